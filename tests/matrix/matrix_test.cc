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

// Combinations refused on purpose: a predicate on a row, and the error text
// a user sees from `pdserve up`.
struct Refusal {
  const char* what;
  bool (*matches)(const Row& r);
  const char* error;
};
const std::vector<Refusal>& Refusals() {
  static const std::vector<Refusal> r = {};
  return r;
}
const Refusal* RefusalOf(const Row& r) {
  for (const Refusal& f : Refusals())
    if (f.matches(r)) return &f;
  return nullptr;
}

// Every (dimension, value, dimension, value) pair, d1 < d2.
using Pair = std::tuple<int, int, int, int>;
std::vector<Pair> PairsOf(const Row& r) {
  std::vector<Pair> out;
  for (int a = 0; a < kNumDims; ++a)
    for (int b = a + 1; b < kNumDims; ++b) out.push_back({a, r[a], b, r[b]});
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
// order) that covers the most pairs not yet covered, among rows that are not
// refused. Deterministic: no randomness, no hashing.
std::vector<Row> PairwiseRuns() {
  const std::vector<Row> all = AllRows();
  std::set<Pair> uncovered;
  for (const Row& r : all) {
    if (RefusalOf(r) != nullptr) continue;
    for (const Pair& p : PairsOf(r)) uncovered.insert(p);
  }
  std::vector<Row> runs;
  while (!uncovered.empty()) {
    const Row* best = nullptr;
    int best_gain = 0;
    for (const Row& r : all) {
      if (RefusalOf(r) != nullptr) continue;
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

// The model directory of a (preset, weights) value pair, written once per
// test process; int8 weights are quantized at load from the fp32 file.
std::string ModelDir(const Row& r) {
  static const std::string root =
      std::filesystem::temp_directory_path() /
      ("pdserve_matrix_" + std::to_string(getpid()));
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
  if (r[kTier] == 1) a.push_back("--kv-offload-memory=32MiB");
  if (r[kTier] == 2) {
    a.push_back("--kv-offload-dir=" + model + "-tier-" + RowName(r));
    a.push_back("--kv-offload-bytes=32MiB");
  }
  if (r[kPeerPull] == 1) a.push_back("--peer-pull");
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
  for (const Case& c : cases) {
    const Output want = Local(r, c.prompt, kMaxTokens, c.temperature, c.seed);
    ASSERT_TRUE(want.ok) << want.error;
    for (int pass = 0; pass < (c.repeat ? 2 : 1); ++pass) {
      const Output got = send(c.prompt, kMaxTokens, c.temperature, c.seed);
      ASSERT_TRUE(got.ok) << got.error;
      if (!openai) EXPECT_EQ(got.tokens, want.tokens) << "pass " << pass;
      EXPECT_EQ(got.text, want.text) << "pass " << pass;
      // Prefix caching is on in every run: the repeat finds at least one
      // full 16-token block of its prompt cached.
      if (pass == 1) EXPECT_GE(got.cached, 16) << c.prompt;
    }
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
// dimensions is in some run, unless every combination holding it is refused
// on purpose (then RefusedCombinations covers it).
TEST(MatrixCoverageTest, EveryPairOfValuesIsInSomeRun) {
  const std::vector<Row> runs = PairwiseRuns();
  std::set<Pair> covered;
  for (const Row& r : runs) {
    EXPECT_EQ(RefusalOf(r), nullptr) << RowName(r);
    for (const Pair& p : PairsOf(r)) covered.insert(p);
  }
  for (int a = 0; a < kNumDims; ++a) {
    for (int b = a + 1; b < kNumDims; ++b) {
      for (size_t va = 0; va < Values()[a].size(); ++va) {
        for (size_t vb = 0; vb < Values()[b].size(); ++vb) {
          const Pair p{a, static_cast<int>(va), b, static_cast<int>(vb)};
          if (covered.count(p)) continue;
          bool all_refused = true;
          for (const Row& r : AllRows()) {
            if (r[a] == static_cast<int>(va) && r[b] == static_cast<int>(vb) &&
                RefusalOf(r) == nullptr)
              all_refused = false;
          }
          EXPECT_TRUE(all_refused)
              << kDimNames[a] << "=" << Values()[a][va] << " with "
              << kDimNames[b] << "=" << Values()[b][vb] << " is in no run";
        }
      }
    }
  }
  // Far fewer runs than the 1296 combinations.
  EXPECT_LE(runs.size(), 16u);
  std::string list;
  for (const Row& r : runs) absl::StrAppend(&list, "\n  ", RowName(r));
  std::printf("%zu runs:%s\n", runs.size(), list.c_str());
}

}  // namespace
}  // namespace pdserve::testing
