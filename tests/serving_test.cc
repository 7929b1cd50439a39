// End-to-end tests of disaggregated serving: real processes on loopback.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>

#include "nlohmann/json.hpp"
#include "tests/cluster.h"

namespace pdserve::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using ::testing::HasSubstr;
using SteadyTime = std::chrono::steady_clock::time_point;

// Waits until no live worker of `c` holds an active KV block.
class ServingTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = new std::string(std::filesystem::temp_directory_path() /
                             ("pdserve_serving_" + std::to_string(::getpid())));
    RunPdserve("model init --preset tiny --out " + *model_ + " --seed 3");
    ASSERT_TRUE(std::filesystem::exists(*model_ + "/config.json"));
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(*model_, ec);
    delete model_;
    model_ = nullptr;
  }
  static std::string* model_;
};
std::string* ServingTest::model_ = nullptr;

TEST_F(ServingTest, OutputsAreIdenticalAcrossDisaggregatedColocatedAndLocal) {
  Cluster disagg =
      Cluster::Start(*model_, 2, 2, {"--local-prefill-threshold=-1"});
  Cluster coloc = Cluster::Start(*model_, 0, 1);
  const std::string prompt = Family(1) + "Question: what is seven times six?";
  for (auto [temp, seed] : {std::pair{0.0f, 0ull}, {0.9f, 77ull}}) {
    auto a = Generate(disagg.stub.get(), Request(prompt, 24, temp, seed));
    auto b = Generate(coloc.stub.get(), Request(prompt, 24, temp, seed));
    ASSERT_TRUE(a.status.ok()) << a.status.error_message();
    ASSERT_TRUE(b.status.ok()) << b.status.error_message();
    const std::string local = RunPdserve(absl::StrCat(
        "generate --model ", *model_, " --json --ignore-eos --max-tokens 24",
        " --temperature ", temp, " --seed ", seed, " --prompt '", prompt, "'"));
    EXPECT_EQ(a.tokens.size(), 24u);
    EXPECT_EQ(a.tokens, b.tokens) << "temperature " << temp;
    EXPECT_EQ(a.tokens, IdsFromJson(local)) << "temperature " << temp;
    EXPECT_EQ(a.text, b.text);
    EXPECT_THAT(a.last.prefill_worker(),
                HasSubstr("prefill@"));  // really disaggregated
    EXPECT_THAT(a.last.decode_worker(), HasSubstr("decode@"));
    EXPECT_EQ(a.last.finish_reason(), "length");
    EXPECT_EQ(a.last.usage().completion_tokens(), 24u);
  }
  const std::string router_metrics = Scrape(disagg.router.metrics_port);
  EXPECT_GT(MetricValue(router_metrics,
                        "pdserve_prefill_decisions_total{mode=\"remote\"}"),
            0);
  // Every routed request timed (at least one per temperature above).
  EXPECT_GE(MetricValue(router_metrics, "pdserve_router_route_seconds_count"),
            2);
  EXPECT_GT(MetricValue(router_metrics, "pdserve_router_route_seconds_sum"), 0);
  double sent = 0;
  for (auto& p : disagg.prefill)
    sent += MetricValue(Scrape(p.metrics_port),
                        "pdserve_kv_transfer_bytes_total{direction=\"sent\"}");
  EXPECT_GT(sent, 0);
}

TEST_F(ServingTest, PrefixReuseIsReportedAndSaltsIsolateTenants) {
  Cluster c = Cluster::Start(*model_, 1, 2, {"--local-prefill-threshold=0"});
  const std::string shared = Family(2);
  auto first = Generate(c.stub.get(), Request(shared + "first question?", 4));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  auto second = Generate(c.stub.get(),
                         Request(shared + "a different second question?", 4));
  ASSERT_TRUE(second.status.ok());
  const uint32_t shared_tokens =
      static_cast<uint32_t>(shared.size() + 1);  // + BOS
  EXPECT_GE(second.last.usage().cached_prompt_tokens(),
            shared_tokens / 16 * 16);
  auto salted = Generate(
      c.stub.get(),
      Request(shared + "a different second question?", 4, 0, 0, "tenant-b"));
  ASSERT_TRUE(salted.status.ok());
  EXPECT_EQ(salted.last.usage().cached_prompt_tokens(), 0u);
}

double FamilyStickiness(Cluster& c, int families, int rounds) {
  std::map<int, std::string> home;
  int hits = 0, total = 0;
  for (int r = 0; r < rounds; ++r) {
    for (int i = 0; i < families; ++i) {
      const int f = (i + r) % families;  // vary the arrival order per round
      auto res = Generate(
          c.stub.get(),
          Request(Family(10 + f) + absl::StrCat(" user ", r, " asks."), 2));
      EXPECT_TRUE(res.status.ok()) << res.status.error_message();
      if (r == 0) {
        home[f] = res.last.prefill_worker();
      } else {
        hits += res.last.prefill_worker() == home[f];
        ++total;
      }
    }
  }
  return static_cast<double>(hits) / total;
}

TEST_F(ServingTest, CacheAwareRoutingKeepsPromptFamiliesOnTheirWorker) {
  Cluster aware =
      Cluster::Start(*model_, 2, 1, {"--local-prefill-threshold=0"});
  const double aware_rate = FamilyStickiness(aware, 4, 4);
  Cluster rr = Cluster::Start(
      *model_, 2, 1, {"--local-prefill-threshold=0", "--policy=round_robin"});
  const double rr_rate = FamilyStickiness(rr, 4, 4);
  std::printf("family stickiness: cache_aware %.2f, round_robin %.2f\n",
              aware_rate, rr_rate);
  EXPECT_GE(aware_rate, 0.9);
  EXPECT_LT(rr_rate, 0.9);
}

TEST_F(ServingTest, KilledDecodeWorkerMidStreamMigratesWithoutLosingTokens) {
  Cluster c = Cluster::Start(*model_, 1, 2, {"--local-prefill-threshold=0"});
  const std::string prompt = Family(3) + "Tell a long story.";
  const uint32_t n = 600;
  const std::string local = RunPdserve(absl::StrCat(
      "generate --model ", *model_, " --json --ignore-eos --max-tokens ", n,
      " --prompt '", prompt, "'"));
  const auto expected = IdsFromJson(local);
  ASSERT_EQ(expected.size(), n);
  bool killed = false;
  auto res = Generate(c.stub.get(), Request(prompt, n),
                      [&](const v1::GenerateResponse&) {
                        if (killed) return;
                        // Find the decode worker running our request and kill
                        // it hard.
                        for (auto& d : c.decode) {
                          if (MetricValue(Scrape(d.metrics_port),
                                          "pdserve_num_requests_running") > 0) {
                            Kill(&d);
                            killed = true;
                            return;
                          }
                        }
                      });
  ASSERT_TRUE(killed) << "the request finished before a worker could be killed";
  ASSERT_TRUE(res.status.ok()) << res.status.error_message();
  EXPECT_EQ(res.tokens, expected);  // no duplicate, no missing token
  EXPECT_GE(MetricValue(Scrape(c.router.metrics_port),
                        "pdserve_request_retries_total"),
            1);
  // Every surviving worker holds no active blocks afterwards.
  ExpectNoActiveBlocks(c);
}

TEST_F(ServingTest, MigratedStreamResumesItsConstraint) {
  // Structured output across a migration: the new decode worker resumes the
  // match after the tokens already streamed (StructuredOutput.resume_tokens)
  // and the stream equals the local run. The regex has no accepting state
  // before 750 bytes, so 600 tokens all stay under the constraint.
  Cluster c = Cluster::Start(*model_, 1, 2, {"--local-prefill-threshold=0"});
  const std::string prompt = Family(4) + "Words: ";
  const std::string regex = "([a-z]{4} ){150}";
  const uint32_t n = 600;
  const auto expected = IdsFromJson(RunPdserve(absl::StrCat(
      "generate --model ", *model_, " --json --temperature 0.8 --seed 5 ",
      "--max-tokens ", n, " --regex '", regex, "' --prompt '", prompt, "'")));
  ASSERT_EQ(expected.size(), n);
  v1::GenerateRequest req = Request(prompt, n, 0.8f, 5);
  req.mutable_sampling()->mutable_structured()->set_regex(regex);
  bool killed = false;
  std::string text;
  auto res = Generate(c.stub.get(), req, [&](const v1::GenerateResponse& r) {
    text += r.text();
    if (killed) return;
    for (auto& d : c.decode) {
      if (MetricValue(Scrape(d.metrics_port), "pdserve_num_requests_running") >
          0) {
        Kill(&d);
        killed = true;
        return;
      }
    }
  });
  ASSERT_TRUE(killed) << "the request finished before a worker could be killed";
  ASSERT_TRUE(res.status.ok()) << res.status.error_message();
  EXPECT_EQ(res.tokens, expected);
  EXPECT_EQ(res.last.finish_reason(), "length");
  // Every byte is a prefix of a match: groups of 4 letters and a space.
  for (size_t i = 0; i < text.size(); ++i) {
    if (i % 5 == 4) {
      EXPECT_EQ(text[i], ' ') << text;
    } else {
      EXPECT_TRUE(text[i] >= 'a' && text[i] <= 'z') << text;
    }
  }
  ExpectNoActiveBlocks(c);
}

TEST_F(ServingTest, KilledPrefillWorkerIsRetriedOnAnother) {
  Cluster c = Cluster::Start(*model_, 2, 1, {"--local-prefill-threshold=0"});
  const std::string prompt = Family(4) + "Question after a failure.";
  auto warm = Generate(c.stub.get(), Request(prompt, 3));
  ASSERT_TRUE(warm.status.ok());
  // Kill the prefill worker that holds this family; the router still believes
  // it is up for a moment, so the next request is routed to it and must retry.
  for (auto& p : c.prefill) {
    if (warm.last.prefill_worker() == "prefill@" + p.address) Kill(&p);
  }
  auto res = Generate(c.stub.get(), Request(prompt, 8));
  ASSERT_TRUE(res.status.ok()) << res.status.error_message();
  EXPECT_EQ(res.tokens.size(), 8u);
  const std::string local = RunPdserve(absl::StrCat(
      "generate --model ", *model_, " --json --ignore-eos --max-tokens 8",
      " --prompt '", prompt, "'"));
  EXPECT_EQ(res.tokens, IdsFromJson(local));
  ExpectNoActiveBlocks(c);
}

TEST_F(ServingTest, BadRequestsGetTheirStatusCodes) {
  Cluster c = Cluster::Start(*model_, 1, 1);
  auto code = [&](v1::GenerateRequest req, int timeout_ms = 60000) {
    return Generate(c.stub.get(), req, nullptr, timeout_ms).status.error_code();
  };
  EXPECT_EQ(code(Request("", 4)), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(code(Request("hi", 0)), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(code(Request("hi", 4000)),
            grpc::StatusCode::INVALID_ARGUMENT);  // over max_model_len 2048
  EXPECT_EQ(code(Request("hi", 4, -1)), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(code(Request("hi", 4, 101)), grpc::StatusCode::INVALID_ARGUMENT);
  auto bad_top_p = Request("hi", 4, 1);
  bad_top_p.mutable_sampling()->set_top_p(1.5f);
  EXPECT_EQ(code(bad_top_p), grpc::StatusCode::INVALID_ARGUMENT);
  v1::GenerateRequest no_input;
  no_input.mutable_sampling()->set_max_tokens(3);
  EXPECT_EQ(code(no_input), grpc::StatusCode::INVALID_ARGUMENT);
  // A client deadline shorter than the answer ends it with DEADLINE_EXCEEDED.
  // The deadline is a tenth of the time the whole answer takes on this
  // machine: a fixed 300 ms let a fast machine stream all 2,000 tokens of
  // the tiny model in time (CI, session 5).
  const auto full_start = std::chrono::steady_clock::now();
  ASSERT_TRUE(Generate(c.stub.get(), Request("a long answer please", 2000))
                  .status.ok());
  const int full_ms =
      static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                           std::chrono::steady_clock::now() - full_start)
                           .count());
  EXPECT_EQ(
      code(Request("a long answer please", 2000), std::max(1, full_ms / 10)),
      grpc::StatusCode::DEADLINE_EXCEEDED)
      << "the whole answer took " << full_ms << " ms";
  // Stop strings end the stream with "stop".
  auto plain = Generate(c.stub.get(), Request("stop test", 40));
  ASSERT_TRUE(plain.status.ok());
  ASSERT_GE(plain.text.size(), 8u);
  auto stop_req = Request("stop test", 40);
  stop_req.mutable_sampling()->add_stop(plain.text.substr(4, 2));
  auto stopped = Generate(c.stub.get(), stop_req);
  EXPECT_EQ(stopped.last.finish_reason(), "stop");
  EXPECT_EQ(stopped.text,
            plain.text.substr(0, plain.text.find(plain.text.substr(4, 2))));
  // A cancelled client frees every block on every worker.
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(60));
    auto reader = c.stub->Generate(&ctx, Request(Family(5), 1500));
    v1::GenerateResponse resp;
    ASSERT_TRUE(reader->Read(&resp));
    ctx.TryCancel();
    while (reader->Read(&resp)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  ExpectNoActiveBlocks(c);
  // No worker at all: UNAVAILABLE, once the router has seen them go.
  for (Proc* p : c.All()) {
    if (p->role != "router") Kill(p);
  }
  ASSERT_TRUE(WaitUntil([&] { return c.UpWorkers() == 0; }, seconds(10)))
      << "the router still lists a killed worker as up after 10 s";
  EXPECT_EQ(code(Request("anyone?", 4)), grpc::StatusCode::UNAVAILABLE);
}

// The decode worker's pool is full: a request holds all but one block while
// its prefill worker is SIGSTOPped (the decode worker reserves the prompt's
// blocks, then waits for the KV). tiny model, fp32 KV: 8 KiB per 16-token
// block, so 1008 KiB = 126 blocks per worker. The holder's 2000-token prompt
// reserves 125 (and 2000 + 16 tokens fill all 126); the second request's
// 61-token prompt needs 4; a 462-token prompt + 1580 tokens needs 128 of the
// 126, so it never fits.
constexpr char kPoolMemory[] = "--kv-cache-memory=1008KiB";
constexpr uint32_t kHolderTokens = 16;
constexpr uint32_t kSecondTokens = 60;
constexpr uint32_t kNeverFitsTokens = 1580;
std::string HolderPrompt() {
  std::string s;
  while (s.size() < 1999) s += Family(6);
  return s.substr(0, 1999);  // + BOS = 2000 tokens
}
std::string SecondPrompt() { return Family(7).substr(0, 60); }

class PoolHolder {
 public:
  // Stops the prefill worker, sends the holding request and waits until the
  // decode worker has reserved its blocks.
  explicit PoolHolder(Cluster& c) : c_(c) {
    kill(c_.prefill[0].pid, SIGSTOP);
    thread_ = std::thread([this] {
      result_ = Generate(c_.stub.get(), Request(HolderPrompt(), kHolderTokens));
    });
    holding_ = WaitUntil(
        [&] {
          return MetricValue(Scrape(c_.decode[0].metrics_port),
                             "pdserve_kv_cache_blocks{state=\"active\"}") >=
                 125;
        },
        seconds(30));
  }
  ~PoolHolder() { Finish(); }
  bool holding() const { return holding_; }
  void ContinuePrefill() { kill(c_.prefill[0].pid, SIGCONT); }
  // Lets the holder finish; its result.
  const Result& Finish() {
    ContinuePrefill();
    if (thread_.joinable()) thread_.join();
    return result_;
  }

 private:
  Cluster& c_;
  std::thread thread_;
  Result result_;
  bool holding_ = false;
};

TEST_F(ServingTest, FullKvCacheMakesARequestWaitForFreedBlocksThenRun) {
  // An admission wait far longer than the test.
  Cluster c = Cluster::Start(*model_, 1, 1, {"--local-prefill-threshold=-1"},
                             {kPoolMemory, "--admission-timeout-ms=60000"});
  PoolHolder holder(c);
  ASSERT_TRUE(holder.holding()) << "the decode worker never reserved the pool";
  SteadyTime second_first_token;
  std::atomic<bool> seen{false};
  Result second;
  std::thread waiting([&] {
    second = Generate(c.stub.get(), Request(SecondPrompt(), kSecondTokens),
                      [&](const v1::GenerateResponse&) {
                        if (!seen)
                          second_first_token = std::chrono::steady_clock::now();
                        seen = true;
                      });
  });
  // Once the router has routed the second request (and so is calling the
  // decode worker), let the holder go on.
  const bool routed = WaitUntil(
      [&] {
        return MetricValue(
                   Scrape(c.router.metrics_port),
                   "pdserve_prefill_decisions_total{mode=\"remote\"}") >= 2;
      },
      seconds(30));
  EXPECT_TRUE(routed) << "the router never routed the second request";
  // The pool is still full: the second request has no token yet.
  EXPECT_FALSE(seen.load()) << "the second request ran while the pool was full";
  const SteadyTime released = std::chrono::steady_clock::now();
  const Result& first = holder.Finish();
  waiting.join();
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(first.tokens.size(), kHolderTokens);
  // It ran only once the holder was let go. (Not compared with when the
  // holder's client saw its tokens: the tiny model decodes the holder's 16
  // tokens in about a millisecond, and the freed blocks can give the second
  // request its first token before the holder's messages reach their client.)
  EXPECT_GT(second_first_token, released);
  EXPECT_EQ(second.tokens, LocalTokens(*model_, SecondPrompt(), kSecondTokens));
  // A request that can never fit is refused at once, without the wait.
  ASSERT_GT(Family(8).size() + 1 + kNeverFitsTokens, 126u * 16);
  ASSERT_LE(Family(8).size() + 1 + kNeverFitsTokens, 2048u);  // max_model_len
  const auto sent = std::chrono::steady_clock::now();
  auto huge = Generate(c.stub.get(), Request(Family(8), kNeverFitsTokens));
  EXPECT_EQ(huge.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << huge.status.error_message();
  EXPECT_EQ(huge.messages, 0);
  EXPECT_LT(std::chrono::steady_clock::now() - sent, seconds(10));
  ExpectNoActiveBlocks(c);
}

TEST_F(ServingTest, FullKvCacheEverywhereIsResourceExhaustedAfterABoundedWait) {
  constexpr int kAdmissionMs = 500;
  Cluster c = Cluster::Start(
      *model_, 1, 1, {"--local-prefill-threshold=-1"},
      {kPoolMemory, absl::StrCat("--admission-timeout-ms=", kAdmissionMs)});
  PoolHolder holder(c);
  ASSERT_TRUE(holder.holding()) << "the decode worker never reserved the pool";
  // The holder cannot finish while its prefill worker is stopped, so the
  // second request waits out the admission timeout and is refused.
  const auto sent = std::chrono::steady_clock::now();
  auto second = Generate(c.stub.get(), Request(SecondPrompt(), kSecondTokens));
  const auto waited = std::chrono::steady_clock::now() - sent;
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << second.status.error_message();
  EXPECT_EQ(second.messages, 0);
  EXPECT_GE(waited, milliseconds(kAdmissionMs * 9 / 10));
  EXPECT_LT(waited, seconds(30));
  // The holder itself is unharmed (stalled well under the KV stall timeout).
  const Result& first = holder.Finish();
  EXPECT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(first.tokens.size(), kHolderTokens);
  // A request that can never fit is refused.
  auto huge = Generate(c.stub.get(), Request(Family(8), kNeverFitsTokens));
  EXPECT_EQ(huge.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  ExpectNoActiveBlocks(c);
}

// Metric families declared by "# TYPE name kind" lines.
std::set<std::string> Families(const std::string& exposition) {
  std::set<std::string> out;
  for (absl::string_view line : absl::StrSplit(exposition, '\n')) {
    if (!absl::ConsumePrefix(&line, "# TYPE ")) continue;
    out.insert(std::string(line.substr(0, line.find(' '))));
  }
  return out;
}

// Sum of every series of `family` (all label sets), or -1 if none.
double FamilySum(const std::string& exposition, const std::string& family) {
  double sum = -1;
  for (absl::string_view line : absl::StrSplit(exposition, '\n')) {
    if (!absl::ConsumePrefix(&line, family)) continue;
    if (line.empty() || (line[0] != '{' && line[0] != ' ')) continue;
    const size_t space = line.rfind(' ');
    double v;
    if (space == absl::string_view::npos ||
        !absl::SimpleAtod(line.substr(space + 1), &v))
      continue;
    sum = (sum < 0 ? 0 : sum) + v;
  }
  return sum;
}

TEST_F(ServingTest, EveryProcessExpositionPassesPromtool) {
  Cluster c = Cluster::Start(*model_, 1, 1, {"--local-prefill-threshold=0"});
  ASSERT_TRUE(Generate(c.stub.get(), Request(Family(9), 5)).status.ok());
  const std::string file = std::filesystem::temp_directory_path() /
                           ("pdserve_metrics_" + std::to_string(::getpid()));
  const std::vector<std::string> router_families = {
      "pdserve_requests_total",
      "pdserve_time_to_first_token_seconds",
      "pdserve_inter_token_latency_seconds",
      "pdserve_request_duration_seconds",
      "pdserve_prompt_tokens_total",
      "pdserve_generation_tokens_total",
      "pdserve_prefill_decisions_total",
      "pdserve_request_retries_total",
      "pdserve_workers"};
  const std::vector<std::string> worker_families = {
      "pdserve_num_requests_running",
      "pdserve_num_requests_waiting",
      "pdserve_kv_cache_blocks",
      "pdserve_prefix_cache_queried_tokens_total",
      "pdserve_prefix_cache_hit_tokens_total",
      "pdserve_kv_transfer_bytes_total",
      "pdserve_kv_transfer_duration_seconds",
      "pdserve_kv_transfer_failures_total",
      "pdserve_engine_steps_total",
      "pdserve_engine_step_seconds_total",
      "pdserve_engine_tokens_total"};
  for (Proc* p : c.All()) {
    const std::string text = Scrape(p->metrics_port);
    ASSERT_FALSE(text.empty()) << p->role;
    std::ofstream(file) << text;
    // Each process declares its role's families, and only pdserve_ ones.
    const std::set<std::string> families = Families(text);
    for (const std::string& f :
         p->role == "router" ? router_families : worker_families)
      EXPECT_TRUE(families.count(f)) << p->role << " lacks " << f;
    for (const std::string& f : families)
      EXPECT_THAT(f, ::testing::StartsWith("pdserve_")) << p->role;
    const int rc =
        std::system((std::string(PDSERVE_PROMTOOL) + " check metrics < " +
                     file + " > " + file + ".out 2>&1")
                        .c_str());
    std::ifstream out(file + ".out");
    EXPECT_EQ(rc, 0) << p->role << ": "
                     << std::string(std::istreambuf_iterator<char>(out), {});
  }
  std::filesystem::remove(file);
  std::filesystem::remove(file + ".out");
  // The one request shows in the counts: 5 tokens generated, a remote
  // prefill (threshold 0) whose KV went from the prefill to the decode worker.
  const std::string router = Scrape(c.router.metrics_port);
  EXPECT_EQ(FamilySum(router, "pdserve_requests_total"), 1) << router;
  EXPECT_EQ(FamilySum(router, "pdserve_generation_tokens_total"), 5);
  EXPECT_EQ(
      MetricValue(router, "pdserve_prefill_decisions_total{mode=\"remote\"}"),
      1);
  EXPECT_GT(MetricValue(Scrape(c.prefill[0].metrics_port),
                        "pdserve_kv_transfer_bytes_total{direction=\"sent\"}"),
            0);
  EXPECT_GT(
      MetricValue(Scrape(c.decode[0].metrics_port),
                  "pdserve_kv_transfer_bytes_total{direction=\"received\"}"),
      0);
  // The engines' work: the prefill worker computed the whole prompt in
  // prompt passes and decoded nothing; the decode worker computed the
  // tokens after the first in one-token steps.
  const std::string prefill = Scrape(c.prefill[0].metrics_port);
  const std::string decode = Scrape(c.decode[0].metrics_port);
  EXPECT_EQ(
      MetricValue(prefill, "pdserve_engine_tokens_total{kind=\"prefill\"}"),
      FamilySum(router, "pdserve_prompt_tokens_total"));
  EXPECT_EQ(
      MetricValue(prefill, "pdserve_engine_tokens_total{kind=\"decode\"}"), 0);
  EXPECT_EQ(MetricValue(decode, "pdserve_engine_tokens_total{kind=\"decode\"}"),
            4);
  for (const std::string* text : {&prefill, &decode}) {
    EXPECT_GE(MetricValue(*text, "pdserve_engine_steps_total"), 1) << *text;
    EXPECT_GT(MetricValue(*text, "pdserve_engine_step_seconds_total"), 0);
  }
}

}  // namespace
}  // namespace pdserve::testing

namespace pdserve::testing {
namespace {

TEST_F(ServingTest, SigtermDrainsADecodeWorkerWithoutClientErrors) {
  Cluster c = Cluster::Start(*model_, 1, 2, {"--local-prefill-threshold=-1"});
  constexpr int kClients = 6;
  std::vector<std::thread> clients;
  std::vector<Result> results(kClients);
  std::atomic<int> streaming{0};
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      bool counted = false;
      results[i] = Generate(c.stub.get(), Request(Family(20 + i), 150),
                            [&](const v1::GenerateResponse&) {
                              if (!counted) ++streaming;
                              counted = true;
                            });
    });
  }
  const bool half_streaming =
      WaitUntil([&] { return streaming >= kClients / 2; }, seconds(60));
  EXPECT_TRUE(half_streaming) << "only " << streaming << " clients streaming";
  if (!half_streaming) {
    for (auto& t : clients) t.join();
    return;
  }
  // Drain then exit, within the default --drain-timeout-ms and some slack.
  EXPECT_TRUE(Kill(&c.decode[0], SIGTERM, seconds(60)))
      << "the decode worker did not exit within 60 s of SIGTERM";
  // New work keeps flowing to the remaining worker meanwhile.
  auto after = Generate(c.stub.get(), Request(Family(30), 10));
  for (auto& t : clients) t.join();
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
  for (int i = 0; i < kClients; ++i) {
    EXPECT_TRUE(results[i].status.ok())
        << i << ": " << results[i].status.error_message();
    EXPECT_EQ(results[i].tokens.size(), 150u) << i;
  }
}

}  // namespace
}  // namespace pdserve::testing
