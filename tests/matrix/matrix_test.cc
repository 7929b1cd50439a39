// The combination matrix: features that were each tested alone, run together
// the way a user starts them (`pdserve up`). Eight dimensions; a pairwise
// covering set of runs (every pair of values of two dimensions appears in
// some run), generated deterministically here and checked for coverage. Each
// run starts one cluster and sends every prompt to it:
//  - greedy and seeded outputs equal `pdserve generate --model` with the
//    same engine flags;
//  - a repeated prompt reports cached prompt tokens;
//  - afterwards every worker holds 0 active KV blocks.
// Combinations refused on purpose are listed in kRefused with the error a
// user gets, and each is started to check that it gives that error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/cluster.h"
#include "tests/matrix/up_cluster.h"

namespace pdserve::testing {
namespace {

using ::testing::HasSubstr;

// The dimensions and their values, in the order the issue names them.
enum Dim {
  kTransport,
  kTopology,
  kWeights,
  kKvDtype,
  kTier,
  kPeerPull,
  kFront,
  kModel,
  kNumDims
};
const std::vector<std::vector<std::string>>& Values() {
  static const std::vector<std::vector<std::string>> v = {
      {"grpc", "shm"},
      {"colocated", "1P+1D", "2P+1D"},
      {"fp32", "bf16", "int8"},  // int8: --weight-dtype int8 --matmul int8dot
      {"fp32", "int8"},
      {"none", "memory", "disk"},
      {"off", "on"},
      {"grpc", "openai"},
      {"llama3", "qwen3-moe", "deepseek-v3"},  // the presets' tiny shapes
  };
  return v;
}
const char* const kDimNames[kNumDims] = {"transport", "topology", "weights",
                                         "kv_dtype",  "tier",     "peer_pull",
                                         "front",     "model"};

using Row = std::vector<int>;  // one value index per dimension

std::string RowName(const Row& r) {
  std::string s;
  for (int d = 0; d < kNumDims; ++d) {
    if (d > 0) s += "_";
    s += Values()[d][r[d]];
  }
  for (char& c : s)
    if (!isalnum(static_cast<unsigned char>(c))) c = '_';
  return s;
}

// What a run covers: every (dimension, value, dimension, value) pair with
// d1 < d2 (the third pair of values is -1), and the triple transport x
// topology x peer pull (pulls move KV over the transport, and only a second
// prefill worker pulls), which pairs alone would not all reach.
using Pair = std::tuple<int, int, int, int, int>;
std::vector<Pair> PairsOf(const Row& r) {
  std::vector<Pair> out;
  for (int a = 0; a < kNumDims; ++a)
    for (int b = a + 1; b < kNumDims; ++b)
      out.push_back({a * kNumDims + b, r[a], r[b], -1, -1});
  out.push_back({-1, r[kTransport], r[kTopology], r[kPeerPull], -1});
  return out;
}

std::vector<Row> AllRows() {
  std::vector<Row> rows = {Row(kNumDims, 0)};
  for (int d = 0; d < kNumDims; ++d) {
    std::vector<Row> next;
    for (const Row& r : rows) {
      for (int v = 0; v < static_cast<int>(Values()[d].size()); ++v) {
        Row n = r;
        n[d] = v;
        next.push_back(n);
      }
    }
    rows = std::move(next);
  }
  return rows;
}

// Greedy pairwise cover: repeatedly take the first row (in the product's
// order) that covers the most pairs not yet covered. Deterministic: no
// randomness, no hashing.
std::vector<Row> PairwiseRuns() {
  const std::vector<Row> all = AllRows();
  std::set<Pair> uncovered;
  for (const Row& r : all)
    for (const Pair& p : PairsOf(r)) uncovered.insert(p);
  std::vector<Row> runs;
  while (!uncovered.empty()) {
    const Row* best = nullptr;
    int best_gain = 0;
    for (const Row& r : all) {
      int gain = 0;
      for (const Pair& p : PairsOf(r)) gain += uncovered.count(p);
      if (gain > best_gain) {
        best_gain = gain;
        best = &r;
      }
    }
    runs.push_back(*best);
    for (const Pair& p : PairsOf(*best)) uncovered.erase(p);
  }
  return runs;
}

// This process's scratch directory (models, disk tiers), removed at exit.
const std::string& Scratch() {
  static const std::string* root =
      new std::string(std::filesystem::temp_directory_path() /
                      ("pdserve_matrix_" + std::to_string(getpid())));
  return *root;
}
class ScratchCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(Scratch(), ec);
  }
};
const auto* const kCleanup =
    ::testing::AddGlobalTestEnvironment(new ScratchCleanup);

// The model directory of a (preset, weights) value pair, written once per
// test process; int8 weights are quantized at load from the fp32 file.
std::string ModelDir(const Row& r) {
  const std::string& root = Scratch();
  const std::string preset = Values()[kModel][r[kModel]];
  const std::string file_dtype = r[kWeights] == 1 ? "bf16" : "fp32";
  const std::string dir = absl::StrCat(root, "/", preset, "-", file_dtype);
  if (!std::filesystem::exists(dir + "/config.json")) {
    RunPdserve(absl::StrCat("model init --preset ", preset, " --dtype ",
                            file_dtype, " --out ", dir, " --seed 3"));
  }
  return dir;
}

// Engine flags that change numbers: the cluster's workers and the local
// reference take the same.
std::string EngineFlags(const Row& r) {
  std::string f = absl::StrCat("--kv-dtype=", Values()[kKvDtype][r[kKvDtype]]);
  if (r[kWeights] == 2) f += " --weight-dtype=int8 --matmul=int8dot";
  return f;
}

// Pool blocks of a tier run: room for two of the prompts below (12 blocks
// each with their output) and no more.
constexpr int kTierPoolBlocks = 24;

// kTierPoolBlocks blocks of the run's model and KV dtype, in bytes, from
// `pdserve kv-budget` over the shape in the model's config.json.
std::string TierPoolBytes(const Row& r) {
  std::ifstream in(ModelDir(r) + "/config.json");
  const nlohmann::json c = nlohmann::json::parse(in, nullptr, false);
  std::string shape =
      absl::StrCat("--layers ", c.value("num_hidden_layers", 0), " --kv-heads ",
                   c.value("num_key_value_heads", 0), " --head-dim ",
                   c.value("head_dim", c.value("qk_nope_head_dim", 0) +
                                           c.value("qk_rope_head_dim", 0)));
  if (c.value("kv_lora_rank", 0) > 0) {
    absl::StrAppend(&shape, " --kv-lora-rank ", c.value("kv_lora_rank", 0),
                    " --qk-rope-head-dim ", c.value("qk_rope_head_dim", 0));
  }
  const nlohmann::json b = nlohmann::json::parse(
      RunPdserve(absl::StrCat("kv-budget ", shape, " --dtype ",
                              Values()[kKvDtype][r[kKvDtype]])),
      nullptr, false);
  return std::to_string(b.value("bytes_per_block", 0) * kTierPoolBlocks);
}

std::vector<std::string> UpArgs(const Row& r, const std::string& model,
                                int http_port) {
  std::vector<std::string> a = {
      "--model=" + model,
      "--port=0",
      "--metrics-port=0",
      absl::StrCat("--http-port=", http_port),
      "--served-model-name=m",
      "--threads=1",
      "--kv-transport=" + Values()[kTransport][r[kTransport]],
  };
  for (absl::string_view f : absl::StrSplit(EngineFlags(r), ' '))
    a.emplace_back(f);
  switch (r[kTopology]) {
    case 0:
      a.insert(a.end(), {"--prefill=0", "--decode=1"});
      break;
    case 1:
      a.insert(a.end(), {"--prefill=1", "--decode=1"});
      break;
    default:
      a.insert(a.end(), {"--prefill=2", "--decode=1"});
      break;
  }
  // A tier run's pool holds kTierPoolBlocks blocks, so that a few other
  // prompts evict a prompt's blocks into the tier.
  if (r[kTier] != 0) a.push_back("--kv-cache-memory=" + TierPoolBytes(r));
  if (r[kTier] == 1) a.push_back("--kv-offload-memory=32MiB");
  if (r[kTier] == 2) {
    a.push_back("--kv-offload-dir=" + model + "-tier-" + RowName(r));
    a.push_back("--kv-offload-bytes=32MiB");
  }
  // Peer pull on: round-robin routing sends a repeated prompt to the other
  // prefill worker, which pulls the prefix from the one that computed it
  // (min speedup 0.01: whatever rates a loaded CI machine measures).
  if (r[kPeerPull] == 1) {
    a.insert(a.end(), {"--peer-pull", "--peer-pull-min-speedup=0.01",
                       "--policy=round_robin", "--local-prefill-threshold=-1"});
  }
  return a;
}

struct Output {
  bool ok = false;
  std::vector<uint32_t> tokens;  // gRPC front
  std::string text;
  int64_t cached = -1;
  std::string error;
};

// `pdserve generate --model` with the run's engine flags (the reference).
Output Local(const Row& r, const std::string& prompt, int max_tokens,
             float temperature, uint64_t seed) {
  const std::string out = RunPdserve(absl::StrCat(
      "generate --model ", ModelDir(r), " ", EngineFlags(r),
      " --json --ignore-eos --max-tokens ", max_tokens, " --temperature ",
      temperature, " --seed ", seed, " --prompt '", prompt, "'"));
  Output o;
  const nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
  if (j.is_discarded() || !j.contains("token_ids")) {
    o.error = out;
    return o;
  }
  o.ok = true;
  o.tokens = j["token_ids"].get<std::vector<uint32_t>>();
  o.text = j["text"].get<std::string>();
  return o;
}

Output ViaGrpc(v1::Router::Stub* stub, const std::string& prompt,
               int max_tokens, float temperature, uint64_t seed) {
  Result res = Generate(stub, Request(prompt, max_tokens, temperature, seed));
  Output o;
  o.ok = res.status.ok();
  o.error = res.status.error_message();
  o.tokens = res.tokens;
  o.text = res.text;
  o.cached = res.last.usage().cached_prompt_tokens();
  return o;
}

Output ViaOpenAi(int port, const std::string& prompt, int max_tokens,
                 float temperature, uint64_t seed) {
  const nlohmann::json req = {{"model", "m"},
                              {"prompt", prompt},
                              {"max_tokens", max_tokens},
                              {"temperature", temperature},
                              {"seed", seed},
                              {"ignore_eos", true}};
  int status = 0;
  const std::string body =
      HttpPost(port, "/v1/completions", req.dump(), &status);
  Output o;
  const nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
  if (status != 200 || j.is_discarded() || !j.contains("choices")) {
    o.error = absl::StrCat("HTTP ", status, ": ", body);
    return o;
  }
  o.ok = true;
  o.text = j["choices"][0]["text"].get<std::string>();
  o.cached =
      j["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
  return o;
}

// Prompts spanning several 16-token blocks (byte tokenizer).
std::string Prompt(int i) {
  std::string s = absl::StrCat("Matrix prompt ", i, ": ");
  for (int k = 0; k < 4; ++k)
    absl::StrAppend(&s, "clause ", i * 10 + k, " keeps every feature honest. ");
  return s;
}

// Confirmed (event-fed) prefix-index entries over the router's workers.
int64_t IndexedBlocks(v1::Router::Stub* stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ListWorkersResponse resp;
  if (!stub->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp).ok()) return -1;
  int64_t n = 0;
  for (const auto& w : resp.workers()) n += w.indexed_blocks();
  return n;
}

class MatrixTest : public ::testing::TestWithParam<Row> {};

TEST_P(MatrixTest, OutputsEqualTheLocalEngineAndNothingLeaks) {
  const Row& r = GetParam();
  const bool openai = r[kFront] == 1;
  const int http_port = openai ? FreePort() : 0;
  const std::string model = ModelDir(r);
  UpCluster up = UpCluster::Start(UpArgs(r, model, http_port));
  ASSERT_TRUE(up.ok()) << up.output();
  const int n_workers = r[kTopology] == 0 ? 1 : (r[kTopology] == 1 ? 2 : 3);
  ASSERT_EQ(static_cast<int>(up.workers().size()), n_workers) << up.output();
  auto stub = v1::Router::NewStub(grpc::CreateChannel(
      up.router().address, grpc::InsecureChannelCredentials()));
  // The router polls its workers: wait until it lists all of them up.
  ASSERT_TRUE(WaitUntil(
      [&] {
        grpc::ClientContext ctx;
        v1::ListWorkersResponse resp;
        if (!stub->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp).ok())
          return false;
        int n = 0;
        for (const auto& w : resp.workers()) n += w.state() == "up";
        return n == n_workers;
      },
      std::chrono::seconds(30)));
  // Every worker runs with the engine flags of the run (up forwarded them).
  for (const UpChildProc& w : up.workers()) {
    auto info = ConfigInfo(Scrape(w.metrics_port), "pdserve_worker");
    EXPECT_EQ(info["kv_dtype"], Values()[kKvDtype][r[kKvDtype]]) << w.name;
    EXPECT_EQ(info["kv_transport"], Values()[kTransport][r[kTransport]]);
    EXPECT_EQ(info["weight_dtype"], r[kWeights] == 2 ? "int8" : "auto");
  }
  EXPECT_EQ(ConfigInfo(Scrape(up.router().metrics_port),
                       "pdserve_router")["peer_pull"],
            r[kPeerPull] == 1 ? "true" : "false");

  auto send = [&](const std::string& prompt, int max_tokens, float t,
                  uint64_t seed) {
    return openai ? ViaOpenAi(http_port, prompt, max_tokens, t, seed)
                  : ViaGrpc(stub.get(), prompt, max_tokens, t, seed);
  };
  struct Case {
    std::string prompt;
    float temperature;
    uint64_t seed;
    bool repeat;  // sent a second time: its prefix is cached by then
  };
  const std::vector<Case> cases = {
      {Prompt(1), 0.0f, 0, true},
      {Prompt(2), 0.8f, 7, true},
  };
  constexpr int kMaxTokens = 6;
  // Where the combination promises a pull: a second prefill worker.
  const bool pulls = r[kPeerPull] == 1 && r[kTopology] == 2;
  for (const Case& c : cases) {
    const Output want = Local(r, c.prompt, kMaxTokens, c.temperature, c.seed);
    ASSERT_TRUE(want.ok) << want.error;
    for (int pass = 0; pass < (c.repeat ? 2 : 1); ++pass) {
      // The router learns who holds the prompt from the workers' KV events
      // before it can name a holder to pull from.
      if (pass == 1 && pulls) {
        EXPECT_TRUE(WaitUntil([&] { return IndexedBlocks(stub.get()) > 0; },
                              std::chrono::seconds(10)));
      }
      const Output got = send(c.prompt, kMaxTokens, c.temperature, c.seed);
      ASSERT_TRUE(got.ok) << got.error;
      if (!openai) EXPECT_EQ(got.tokens, want.tokens) << "pass " << pass;
      EXPECT_EQ(got.text, want.text) << "pass " << pass;
      // Prefix caching is on in every run: the repeat finds at least one
      // full 16-token block of its prompt cached.
      if (pass == 1) EXPECT_GE(got.cached, 16) << c.prompt;
    }
  }
  // A tier run: other prompts push the first one's blocks out of the pools
  // into the tiers; asked again, it is read back from a tier (cached, and
  // counted as tier hits), with the same output.
  if (r[kTier] != 0) {
    for (const UpChildProc& w : up.workers()) {
      // The pool's blocks: free + cached (none is active between requests).
      const std::string m = Scrape(w.metrics_port);
      const double total =
          MetricValue(m, "pdserve_kv_cache_blocks{state=\"free\"}") +
          MetricValue(m, "pdserve_kv_cache_blocks{state=\"cached\"}");
      EXPECT_LE(total, kTierPoolBlocks + 1) << w.name;
      EXPECT_GE(total, kTierPoolBlocks / 2) << w.name;
    }
    for (int f = 3; f <= 5; ++f) {
      const Output got = send(Prompt(f), kMaxTokens, 0.0f, 0);
      ASSERT_TRUE(got.ok) << got.error;
      EXPECT_EQ(got.text, Local(r, Prompt(f), kMaxTokens, 0.0f, 0).text);
    }
    // Offloads finish in the background: wait until none is in flight.
    EXPECT_TRUE(WaitUntil(
        [&] {
          double writing = 0, stored = 0;
          for (const UpChildProc& w : up.workers()) {
            const std::string m = Scrape(w.metrics_port);
            writing += std::max(
                0.0,
                MetricValue(m, "pdserve_kv_tier_blocks{state=\"writing\"}"));
            stored += std::max(
                0.0,
                MetricValue(m, "pdserve_kv_tier_blocks{state=\"stored\"}"));
          }
          return writing == 0 && stored > 0;
        },
        std::chrono::seconds(10)));
    const Output want = Local(r, cases[0].prompt, kMaxTokens, 0.0f, 0);
    const Output again = send(cases[0].prompt, kMaxTokens, 0.0f, 0);
    ASSERT_TRUE(again.ok) << again.error;
    EXPECT_EQ(again.text, want.text);
    if (!openai) EXPECT_EQ(again.tokens, want.tokens);
    EXPECT_GE(again.cached, 16);
    double tier_hits = 0;
    for (const UpChildProc& w : up.workers()) {
      tier_hits +=
          std::max(0.0, MetricValue(Scrape(w.metrics_port),
                                    "pdserve_kv_tier_hit_tokens_total"));
    }
    EXPECT_GT(tier_hits, 0);
  }
  // Each repeat ran on the other prefill worker and pulled the prefix.
  if (pulls) {
    double pulled = 0;
    for (const UpChildProc& w : up.workers()) {
      pulled += std::max(
          0.0, MetricValue(Scrape(w.metrics_port),
                           "pdserve_kv_peer_pull_total{outcome=\"pulled\"}"));
    }
    EXPECT_GE(pulled, static_cast<double>(cases.size()));
  }
  for (const UpChildProc& w : up.workers()) {
    double active = -1;
    WaitUntil(
        [&] {
          active = MetricValue(Scrape(w.metrics_port),
                               "pdserve_kv_cache_blocks{state=\"active\"}");
          return active == 0;
        },
        std::chrono::seconds(10));
    EXPECT_EQ(active, 0) << w.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Pairwise, MatrixTest,
                         ::testing::ValuesIn(PairwiseRuns()),
                         [](const ::testing::TestParamInfo<Row>& info) {
                           return RowName(info.param);
                         });

// The property the run list promises: every pair of values of two
// dimensions is in some run, and so is every transport x topology x peer pull
// triple.
TEST(MatrixCoverageTest, EveryPairOfValuesIsInSomeRun) {
  const std::vector<Row> runs = PairwiseRuns();
  std::set<Pair> covered;
  for (const Row& r : runs)
    for (const Pair& p : PairsOf(r)) covered.insert(p);
  int pairs = 0;
  for (int a = 0; a < kNumDims; ++a) {
    for (int b = a + 1; b < kNumDims; ++b) {
      for (size_t va = 0; va < Values()[a].size(); ++va) {
        for (size_t vb = 0; vb < Values()[b].size(); ++vb) {
          ++pairs;
          EXPECT_TRUE(covered.count({a * kNumDims + b, static_cast<int>(va),
                                     static_cast<int>(vb), -1, -1}))
              << kDimNames[a] << "=" << Values()[a][va] << " with "
              << kDimNames[b] << "=" << Values()[b][vb] << " is in no run";
        }
      }
    }
  }
  EXPECT_EQ(pairs, 174);  // (20^2 - 52) / 2 for value counts 2,3,3,2,3,2,2,3
  for (int t = 0; t < 2; ++t)
    for (int topo = 0; topo < 3; ++topo)
      for (int pull = 0; pull < 2; ++pull)
        EXPECT_TRUE(covered.count({-1, t, topo, pull, -1}))
            << Values()[kTransport][t] << " " << Values()[kTopology][topo]
            << " peer pull " << Values()[kPeerPull][pull];
  // Far fewer runs than the 1296 combinations.
  EXPECT_LE(runs.size(), 16u);
  std::string list;
  for (const Row& r : runs) absl::StrAppend(&list, "\n  ", RowName(r));
  std::printf("%zu runs:%s\n", runs.size(), list.c_str());
}

// Combinations refused on purpose, with the error `pdserve up` prints
// (docs/combinations.md lists the same).
struct Refused {
  const char* name;
  std::vector<std::string> flags;  // beside the model and ports
  const char* error;
};
const std::vector<Refused>& RefusedCombinations() {
  static const std::vector<Refused> r = {
      {"int8dot_without_int8_weights",
       {"--matmul=int8dot"},
       "--matmul int8dot needs int8 weights (--weight-dtype int8 or "
       "int8-b32), not bf16"},
      {"blas_with_int8_weights",
       {"--matmul=blas", "--weight-dtype=int8"},
       "--matmul blas needs --weight-dtype fp32 or auto, got int8"},
      {"memory_and_disk_tier",
       {"--kv-offload-memory=16MiB", "--kv-offload-dir=" + Scratch() + "/t"},
       "--kv-offload-dir and --kv-offload-memory: one KV tier per worker"},
      {"fp8_kv_on_cpu",
       {"--kv-dtype=fp8"},
       "--kv-dtype fp8 (e4m3) needs --device cuda"},
      {"cuda_ipc_on_cpu",
       {"--kv-transport=cuda_ipc"},
       "--kv-transport cuda_ipc moves GPU KV pools and needs --device cuda"},
  };
  return r;
}

class RefusedTest : public ::testing::TestWithParam<Refused> {};

TEST_P(RefusedTest, UpStopsWithTheError) {
  // A bf16 checkpoint: the weights a user gets from --dtype bf16.
  const Row bf16 = {0, 1, 1, 0, 0, 0, 0, 0};
  std::vector<std::string> args = {"--model=" + ModelDir(bf16), "--port=0",
                                   "--metrics-port=0", "--http-port=0",
                                   "--threads=1"};
  args.insert(args.end(), GetParam().flags.begin(), GetParam().flags.end());
  UpCluster up = UpCluster::Start(args);
  EXPECT_FALSE(up.ok());
  EXPECT_THAT(up.output(),
              HasSubstr(std::string("pdserve: error: ") + GetParam().error));
}

INSTANTIATE_TEST_SUITE_P(Combinations, RefusedTest,
                         ::testing::ValuesIn(RefusedCombinations()),
                         [](const ::testing::TestParamInfo<Refused>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace pdserve::testing
