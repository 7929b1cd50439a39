#include "bench/router_sim.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <span>

#include "absl/strings/str_cat.h"
#include "bench/router_sim_internal.h"
#include "bench/trace.h"

namespace pdserve::bench {
namespace {

using ::testing::HasSubstr;

TraceRequest Request(int64_t t_ms, int64_t input, int64_t output,
                     std::vector<int64_t> ids) {
  return {t_ms, input, output, std::move(ids)};
}

const SimRun& RunOf(const SimReport& r, const std::string& policy,
                    int32_t prefill) {
  for (const SimRun& run : r.runs) {
    if (run.policy == policy && run.prefill_workers == prefill) return run;
  }
  ADD_FAILURE() << "no run for " << policy << " at " << prefill;
  return r.runs.front();
}

// Conversations of 1-4 turns, each turn's prompt extending the last, all
// behind one shared system-prompt block: the conversation trace's shape.
std::vector<TraceRequest> Conversations(int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<TraceRequest> out;
  int64_t next_id = 1;
  for (int c = 0; c < n; ++c) {
    std::vector<int64_t> ids = {0};
    const int turns = 1 + static_cast<int>(rng() % 4);
    int64_t t = static_cast<int64_t>(rng() % 60000);
    for (int k = 0; k < turns; ++k) {
      const int add = 1 + static_cast<int>(rng() % 4);
      for (int i = 0; i < add; ++i) ids.push_back(next_id++);
      const int64_t input =
          static_cast<int64_t>(ids.size() - 1) * kTraceBlockTokens + 1 +
          rng() % 511;
      out.push_back(
          Request(t, input, 1 + static_cast<int64_t>(rng() % 200), ids));
      t += 2000 + static_cast<int64_t>(rng() % 8000);
    }
  }
  return out;
}

TEST(TraceTest, ParsesMooncakeLinesAndNamesTheBadLine) {
  const std::string good =
      "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, "
      "\"hash_ids\": [0, 1]}\n"
      "\n"
      "{\"timestamp\": 7, \"input_length\": 512, \"output_length\": 0, "
      "\"hash_ids\": [0], \"extra\": 1}\n";
  auto trace = ParseMooncakeTrace(good, "t.jsonl");
  ASSERT_TRUE(trace.ok()) << trace.status();
  ASSERT_EQ(trace->size(), 2u);
  EXPECT_EQ((*trace)[0].input_length, 600);
  EXPECT_EQ((*trace)[0].hash_ids, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ((*trace)[1].timestamp_ms, 7);

  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{\"timestamp\": 0, \"input_length\": 600", "invalid JSON"},
      {"[1, 2]", "expected a JSON object"},
      {"{\"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}",
       "timestamp"},
      {"{\"timestamp\": -1, \"input_length\": 600, \"output_length\": 5, "
       "\"hash_ids\": [0, 1]}",
       "timestamp"},
      {"{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, "
       "\"hash_ids\": [0]}",
       "want 2"},
      {"{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, "
       "\"hash_ids\": [0, 1.5]}",
       "hash_ids"},
      {"{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 5, "
       "\"hash_ids\": []}",
       "input_length"},
  };
  for (const auto& [line, why] : bad) {
    auto r = ParseMooncakeTrace(absl::StrCat(good, line, "\n"), "t.jsonl");
    ASSERT_FALSE(r.ok()) << line;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("t.jsonl:4")) << line;
    EXPECT_THAT(r.status().message(), HasSubstr(why)) << line;
  }
  EXPECT_EQ(LoadMooncakeTrace("/nonexistent/trace.jsonl").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(TraceTest, SharedLeadingIdsGiveSharedTokensWhateverTheLength) {
  const TraceRequest a = Request(0, 1000, 1, {4, 5});
  const TraceRequest b = Request(0, 700, 1, {4, 5});
  const TraceRequest c = Request(0, 1000, 1, {4, 6});
  const auto ta = SynthesizePrompt(a, 1), tb = SynthesizePrompt(b, 1),
             tc = SynthesizePrompt(c, 1);
  ASSERT_EQ(ta.size(), 1000u);
  ASSERT_EQ(tb.size(), 700u);
  EXPECT_TRUE(std::equal(tb.begin(), tb.end(), ta.begin()));
  EXPECT_TRUE(std::equal(ta.begin(), ta.begin() + 512, tc.begin()));
  EXPECT_FALSE(std::equal(ta.begin() + 512, ta.end(), tc.begin() + 512));
  EXPECT_NE(SynthesizePrompt(a, 2), ta);  // the seed varies the tokens
}

SimConfig SmallConfig() {
  SimConfig c;
  c.prefill_workers = {2};
  c.decode_workers = 1;
  c.prefill_cache_tokens = 1 << 20;
  c.decode_kv_tokens = 1 << 20;
  return c;
}

// Three families of prompts [family block, unique block] over two prefill
// workers, interleaved f0 f1 f2 f0 f1 f2 ..., far enough apart that nothing
// queues. By hand: a policy that keeps each family on one worker hits the
// family block (512 of 1024 tokens) in 9 of 12 requests: 0.375, as the oracle.
// Round robin sends a family's turns to alternating workers (3 is odd), so
// only turns 3 and 4 hit: 0.25. Cache-aware ties rotate, so f0 and f2 share
// worker 0 and f1 has worker 1: computed tokens 2 x 2560 vs 2560, imbalance
// 5120 / 3840 = 4/3; round robin computes 4608 on each.
TEST(RouterSimTest, HandBuiltFamiliesHitAsComputedByHand) {
  std::vector<TraceRequest> trace;
  for (int k = 0; k < 12; ++k)
    trace.push_back(Request(1000 * k, 1024, 2, {k % 3, 100 + k}));
  SimConfig c = SmallConfig();
  c.policies = {"cache_aware", "round_robin", "least_loaded", "oracle"};
  auto r = RunRouterSim(c, trace);
  ASSERT_TRUE(r.ok()) << r.status();
  const SimRun& aware = RunOf(*r, "cache_aware", 2);
  EXPECT_EQ(aware.requests, 12);
  EXPECT_EQ(aware.input_tokens, 12 * 1024);
  EXPECT_EQ(aware.hit_tokens, 9 * 512);
  EXPECT_DOUBLE_EQ(aware.imbalance, 4.0 / 3.0);
  EXPECT_EQ(aware.local_prefills, 0);
  EXPECT_EQ(RunOf(*r, "oracle", 2).hit_tokens, 9 * 512);
  EXPECT_DOUBLE_EQ(r->HitVsOracle(aware), 1.0);
  const SimRun& rr = RunOf(*r, "round_robin", 2);
  EXPECT_EQ(rr.hit_tokens, 6 * 512);
  EXPECT_DOUBLE_EQ(rr.imbalance, 1.0);
  // Nothing queues: TTFT is the prefill time, 5 ms + uncached x 100 us.
  EXPECT_DOUBLE_EQ(aware.prefill_queue_p99_ms, 0);
  EXPECT_NEAR(aware.ttft_p50_ms, 5 + 512 * 0.1, 1e-9);
  EXPECT_NEAR(rr.ttft_p99_ms, 5 + 1024 * 0.1, 1e-9);
  EXPECT_GT(aware.decision_p99_us, 0);
  EXPECT_GE(aware.route_p99_us, aware.decision_p99_us);
  EXPECT_TRUE(std::isnan(RunOf(*r, "oracle", 2).decision_p50_us));
  EXPECT_GT(aware.reference_p50_us, 0);
  EXPECT_GE(aware.reference_p99_us, aware.reference_p50_us);
  EXPECT_TRUE(std::isnan(RunOf(*r, "oracle", 2).reference_p99_us));
  EXPECT_GT(aware.index_bytes_per_block, 0);
}

// Replays repeat the same decisions; each request's fastest decision over
// them is no slower than its time in any one replay, so the percentiles of
// the fastest are at most the first replay's.
TEST(RouterSimTest, DecisionReplaysKeepEachRequestsFastestDecision) {
  std::vector<TraceRequest> trace;
  for (int k = 0; k < 40; ++k)
    trace.push_back(Request(500 * k, 1024, 2, {k % 5, 100 + k}));
  SimConfig c = SmallConfig();
  c.policies = {"cache_aware", "oracle"};
  auto once = RunRouterSim(c, trace);
  ASSERT_TRUE(once.ok()) << once.status();
  const SimRun& one = RunOf(*once, "cache_aware", 2);
  EXPECT_EQ(one.decision_replays, 1);
  EXPECT_EQ(one.decision_min_p99_us, one.decision_p99_us);
  EXPECT_EQ(one.decision_us.size(), 40u);

  c.decision_replays = 3;
  auto thrice = RunRouterSim(c, trace);
  ASSERT_TRUE(thrice.ok()) << thrice.status();
  const SimRun& three = RunOf(*thrice, "cache_aware", 2);
  EXPECT_EQ(three.decision_replays, 3);
  EXPECT_EQ(three.hit_tokens, one.hit_tokens);
  EXPECT_DOUBLE_EQ(three.imbalance, one.imbalance);
  EXPECT_GT(three.decision_min_p50_us, 0);
  EXPECT_LE(three.decision_min_p50_us, three.decision_p50_us);
  EXPECT_LE(three.decision_min_p99_us, three.decision_p99_us);
  EXPECT_LE(three.decision_min_p50_us, three.decision_min_p99_us);
  EXPECT_TRUE(std::isnan(RunOf(*thrice, "oracle", 2).decision_min_p99_us));
  EXPECT_NE(thrice->ToJson().find("\"decision_min_p99_us\""),
            std::string::npos);

  c.decision_replays = 0;
  EXPECT_EQ(RunRouterSim(c, trace).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The reference loop is a chain the compiler cannot fold: its result
// depends on every step, and its time grows with its length.
TEST(RouterSimTest, ReferenceLoopRunsEveryStep) {
  using router_sim_internal::ReferenceLoop;
  EXPECT_EQ(ReferenceLoop(0, 5), 5u);
  EXPECT_EQ(ReferenceLoop(1, 5),
            5 * 6364136223846793005ULL + 1442695040888963407ULL);
  EXPECT_NE(ReferenceLoop(1000, 5), ReferenceLoop(1001, 5));
  EXPECT_GT(router_sim_internal::ReferenceLoopRate(), 0);
  auto best_us = [](int64_t iterations) {
    double best = 1e30;
    for (int i = 0; i < 5; ++i) {
      const double t0 = router_sim_internal::MonotonicMicros();
      volatile uint64_t sink = ReferenceLoop(iterations, i);
      (void)sink;
      best = std::min(best, router_sim_internal::MonotonicMicros() - t0);
    }
    return best;
  };
  EXPECT_GT(best_us(4'000'000), 4 * best_us(200'000));
}

// Peer pull: round robin sends 3 of the 9 repeats of a family's
// 512-token prefix to the prefill worker that lacks it; with "+pull" that
// worker pulls the prefix from the worker holding it instead, so every
// repeat hits, as with cache_aware. TTFT of a pulled prompt: 5 ms + 2 ms
// pull overhead + 512 x 0.5 us transfer + 512 x 100 us compute.
TEST(RouterSimTest, PeerPullTurnsMissesOnTheWrongWorkerIntoHits) {
  std::vector<TraceRequest> trace;
  for (int k = 0; k < 12; ++k)
    trace.push_back(Request(1000 * k, 1024, 2, {k % 3, 100 + k}));
  SimConfig c = SmallConfig();
  c.policies = {"round_robin", "round_robin+pull", "cache_aware+pull", "oracle",
                "unbounded"};
  auto r = RunRouterSim(c, trace);
  ASSERT_TRUE(r.ok()) << r.status();
  const SimRun& rr = RunOf(*r, "round_robin", 2);
  const SimRun& pull = RunOf(*r, "round_robin+pull", 2);
  EXPECT_EQ(rr.hit_tokens, 6 * 512);
  EXPECT_EQ(rr.peer_pulls, 0);
  EXPECT_EQ(pull.hit_tokens, 9 * 512);
  EXPECT_EQ(pull.pulled_tokens, 3 * 512);
  EXPECT_EQ(pull.peer_pulls, 3);
  EXPECT_EQ(pull.peer_pulls_failed, 0);
  EXPECT_NEAR(pull.ttft_p99_ms, 5 + 1024 * 0.1, 1e-9);  // a cold prompt
  // cache_aware already routes each family to its holder: nothing to pull.
  EXPECT_EQ(RunOf(*r, "cache_aware+pull", 2).peer_pulls, 0);
  EXPECT_EQ(RunOf(*r, "unbounded", 2).hit_tokens, 9 * 512);
  EXPECT_DOUBLE_EQ(r->HitVsUnbounded(pull), 1.0);
  c.policies = {"oracle+pull"};
  EXPECT_FALSE(RunRouterSim(c, trace).ok());
}

// "+tier": a prefill worker's pool of 128 blocks (two 1,024-token prompts)
// evicts a family's prefix before it comes back; the worker's own tier still
// has it, so the repeat hits there instead of being recomputed.
TEST(RouterSimTest, TierKeepsWhatTheSmallPoolEvicted) {
  std::vector<TraceRequest> trace;
  // One prefill worker: families 0, 1, 2 (512 tokens each), then 0 again.
  for (int k = 0; k < 4; ++k)
    trace.push_back(Request(1000 * k, 1024, 2, {k % 3, 100 + k}));
  SimConfig c = SmallConfig();
  c.prefill_workers = {1};
  c.prefill_cache_tokens = 2 * 1024;
  c.policies = {"cache_aware", "cache_aware+tier"};
  auto r = RunRouterSim(c, trace);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(RunOf(*r, "cache_aware", 1).hit_tokens, 0);
  const SimRun& tier = RunOf(*r, "cache_aware+tier", 1);
  EXPECT_EQ(tier.hit_tokens, 512);
  EXPECT_EQ(tier.tier_hit_tokens, 512);
}

// A pull served from the holder's tier: two prefill workers with
// pools of two 1,024-token prompts, round robin. f0 goes to worker 0, whose
// pool evicts it into its tier when f4 arrives (f0, f2, f4 there); the
// decode pool (also two prompts) has dropped it too. When f0 comes back it
// lands on worker 1, which lacks it: the index knows worker 0's tier holds
// the family block (the tier's events), so worker 1 pulls it from there.
TEST(RouterSimTest, PullIsServedFromTheHoldersTier) {
  std::vector<TraceRequest> trace;
  for (int k = 0; k < 5; ++k)
    trace.push_back(Request(1000 * k, 1024, 2, {k, 100 + k}));
  trace.push_back(Request(5000, 1024, 2, {0, 200}));
  SimConfig c = SmallConfig();
  c.prefill_cache_tokens = 2 * 1024;
  c.decode_kv_tokens = 2 * 1024 + 64;
  c.policies = {"round_robin+pull", "round_robin+tier",
                "round_robin+tier+pull"};
  auto r = RunRouterSim(c, trace);
  ASSERT_TRUE(r.ok()) << r.status();
  // Pool only: nobody's pool has f0 any more.
  EXPECT_EQ(RunOf(*r, "round_robin+pull", 2).hit_tokens, 0);
  EXPECT_EQ(RunOf(*r, "round_robin+pull", 2).peer_pulls, 0);
  // A tier, no pull: f0's repeat is on the other worker.
  EXPECT_EQ(RunOf(*r, "round_robin+tier", 2).hit_tokens, 0);
  const SimRun& both = RunOf(*r, "round_robin+tier+pull", 2);
  EXPECT_EQ(both.hit_tokens, 512);
  EXPECT_EQ(both.pulled_tokens, 512);
  EXPECT_EQ(both.pulled_tier_tokens, 512);
  EXPECT_EQ(both.peer_pulls, 1);
  EXPECT_EQ(both.peer_pulls_partial, 0);
  EXPECT_EQ(both.peer_pulls_failed, 0);
  // Holders serving pulls from their pool only: nothing to pull.
  c.pull_from_tiers = false;
  c.policies = {"round_robin+tier+pull"};
  auto pool_only = RunRouterSim(c, trace);
  ASSERT_TRUE(pool_only.ok());
  EXPECT_EQ(pool_only->runs[0].peer_pulls, 0);
  EXPECT_EQ(pool_only->runs[0].hit_tokens, 0);
  c.pull_from_tiers = true;
  // "+dtier" only goes with "+tier".
  c.policies = {"round_robin+dtier"};
  EXPECT_FALSE(RunRouterSim(c, trace).ok());
  c.policies = {"round_robin+tier+dtier+pull"};
  EXPECT_TRUE(RunRouterSim(c, trace).ok());
}

// Every prompt starts with one shared 512-token block (a system prompt), then
// 15 blocks of its own; arrivals never overlap. Without the balance slack the
// worker that first cached the shared block is 512 tokens cheaper for every
// later prompt and takes them all (imbalance 4 over 4 workers); with it, new
// prompts go to the worker with the least work routed so far: perfectly even,
// and the shared block hits once each worker holds it (requests 5-8).
TEST(RouterSimTest, CacheAwareSpreadsNewPromptsBehindASharedPrefix) {
  std::vector<TraceRequest> trace;
  for (int k = 0; k < 8; ++k) {
    std::vector<int64_t> ids = {0};
    for (int i = 0; i < 15; ++i) ids.push_back(1000 + 16 * k + i);
    trace.push_back(Request(1000 * k, 16 * 512, 2, ids));
  }
  SimConfig c = SmallConfig();
  c.prefill_workers = {4};
  c.policies = {"cache_aware"};
  auto even = RunRouterSim(c, trace);
  ASSERT_TRUE(even.ok()) << even.status();
  EXPECT_DOUBLE_EQ(even->runs[0].imbalance, 1.0);
  EXPECT_EQ(even->runs[0].hit_tokens, 4 * 512);
  c.policy.balance_slack = 0;
  auto piled = RunRouterSim(c, trace);
  ASSERT_TRUE(piled.ok()) << piled.status();
  EXPECT_DOUBLE_EQ(piled->runs[0].imbalance, 4.0);
  EXPECT_EQ(piled->runs[0].hit_tokens, 7 * 512);
}

// cache_threshold follows the match only when it covers more than the
// threshold: a repeated 1024-token prompt matches 1008 tokens (the last block
// is recomputed), a new one behind a shared block only half.
TEST(RouterSimTest, CacheThresholdFollowsOnlyStrongMatches) {
  std::vector<TraceRequest> trace;
  for (int k = 0; k < 12; ++k)
    trace.push_back(Request(1000 * k, 1024, 2, {k % 3, 100 + k % 3}));
  SimConfig c = SmallConfig();
  c.policies = {"cache_threshold", "round_robin"};
  c.policy.local_prefill_threshold =
      0;  // the decode worker caches the prompts too
  auto r = RunRouterSim(c, trace);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(RunOf(*r, "cache_threshold", 2).hit_tokens, 9 * 1008);
  EXPECT_EQ(RunOf(*r, "round_robin", 2).hit_tokens, 6 * 1008);

  std::vector<TraceRequest> weak;
  for (int k = 0; k < 12; ++k)
    weak.push_back(Request(1000 * k, 1024, 2, {k % 3, 100 + k}));
  c.policies = {"cache_threshold"};
  auto w = RunRouterSim(c, weak);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(RunOf(*w, "cache_threshold", 2).hit_tokens,
            6 * 512);  // least-loaded rotation, like round robin
}

// A decode worker whose KV pool cannot hold a request rejects it; one that
// is merely full makes it wait, and the wait shows in TTFT.
TEST(RouterSimTest, DecodeKvCapacityQueuesAndRejects) {
  std::vector<TraceRequest> trace = {
      Request(0, 1024, 1000, {1, 2}), Request(0, 1024, 10, {3, 4}),
      Request(0, 4096, 1000, {5, 6, 7, 8, 9, 10, 11, 12})};
  SimConfig c = SmallConfig();
  c.policies = {"least_loaded"};
  c.decode_kv_tokens = 3000;
  auto r = RunRouterSim(c, trace);
  ASSERT_TRUE(r.ok()) << r.status();
  const SimRun& run = RunOf(*r, "least_loaded", 2);
  EXPECT_EQ(run.requests, 2);
  EXPECT_EQ(run.rejected, 1);
  // The second waits for the first's 999 decode steps.
  EXPECT_GT(run.decode_admit_p99_ms, 999 * c.decode_step_ms);
  EXPECT_GT(run.ttft_p99_ms, run.decode_admit_p99_ms);
}

TEST(RouterSimTest, SameSeedGivesIdenticalReport) {
  const std::vector<TraceRequest> trace = Conversations(60, 7);
  SimConfig c = SmallConfig();
  c.prefill_workers = {1, 4};  // 1: a single candidate
  c.decode_workers = 2;
  c.prefill_cache_tokens = 40000;  // small enough to evict
  c.time_scale = 0.3;
  c.event_loss = 0.02;
  auto strip = [](SimReport r) {
    for (SimRun& run : r.runs) {  // measured, not simulated
      run.decision_p50_us = run.decision_p99_us = 0;
      run.hash_p50_us = run.hash_p99_us = run.route_p50_us = run.route_p99_us =
          run.reference_p50_us = run.reference_p99_us = 0;
      run.decision_min_p50_us = run.decision_min_p99_us = 0;
    }
    return r.ToJson();
  };
  auto a = RunRouterSim(c, trace), b = RunRouterSim(c, trace);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(strip(*a), strip(*b));
  EXPECT_EQ(a->runs.size(), 10u);
  EXPECT_GT(RunOf(*a, "cache_aware", 4).resyncs, 0);
  EXPECT_EQ(SimReport::SvgPathFor("out/sim.json"), "out/sim.svg");
  EXPECT_EQ(SimReport::SvgPathFor("sim"), "sim.svg");
  // The table, JSON and SVG name every policy.
  for (const std::string& p : c.policies) {
    EXPECT_THAT(a->ToTable(), HasSubstr(p));
    EXPECT_THAT(a->ToJson(), HasSubstr(absl::StrCat("\"", p, "\"")));
    EXPECT_THAT(a->ToSvg(), HasSubstr(absl::StrCat(">", p, "<")));
  }
}

// Losing events costs nothing once the resync catches up: cache-aware
// routing reaches the same hits as with a lossless stream, since the gap is
// found at the next event and a fresh snapshot repairs the index.
TEST(RouterSimTest, LostEventsAreRepairedByResync) {
  std::vector<TraceRequest> trace;
  for (int k = 0; k < 12; ++k)
    trace.push_back(Request(1000 * k, 1024, 2, {k % 3, 100 + k}));
  SimConfig c = SmallConfig();
  c.policies = {"cache_aware"};
  c.resync_delay_ms = 100;
  c.event_loss = 0.3;
  auto r = RunRouterSim(c, trace);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(r->runs[0].events_lost, 0);
  EXPECT_GT(r->runs[0].resyncs, 0);
  EXPECT_EQ(r->runs[0].hit_tokens, 9 * 512);
}

std::vector<engine::BlockHash> Hashes(uint64_t family, int n) {
  std::vector<engine::BlockHash> h;
  for (int i = 0; i < n; ++i) h.push_back({family, static_cast<uint64_t>(i)});
  return h;
}

// The stream applies events in order, stops at a gap (applying nothing
// after it, as the service drops the subscription), and a resync makes the
// index equal to the worker's cache again.
TEST(SimEventStreamTest, GapStopsTheStreamUntilAResnapshot) {
  router::PrefixIndex index;
  SimEventStream* stream_ptr = nullptr;
  bool lose_next = false;
  int64_t now = 0;
  engine::BlockManager cache(6, [&](const engine::KvEvent& e) {
    stream_ptr->Publish(e, now, 10, lose_next);
    lose_next = false;
  });
  SimEventStream stream(&index, 3, &cache);
  stream_ptr = &stream;
  stream.Resync();
  const std::vector<router::WorkerIndex> w = {3};
  auto store = [&](const std::vector<engine::BlockHash>& h) {
    std::vector<int32_t> blocks;
    ASSERT_TRUE(cache.Allocate(static_cast<int64_t>(h.size()), &blocks));
    cache.Commit({}, blocks, h);
    cache.Release(blocks);
  };
  const auto a = Hashes(1, 2), b = Hashes(2, 2), c = Hashes(3, 2),
             d = Hashes(4, 2);
  store(a);  // seq 1
  EXPECT_FALSE(stream.Deliver(9).has_value());
  EXPECT_EQ(index.LeadingBlocks(a, w)[0], 0);  // not arrived yet
  EXPECT_FALSE(stream.Deliver(10).has_value());
  EXPECT_EQ(index.LeadingBlocks(a, w)[0], 2);
  lose_next = true;
  store(b);  // seq 2, lost
  now = 20;
  store(c);  // seq 3: reveals the gap
  now = 30;
  store(d);  // evicts a (seq 4 removed) and stores d (seq 5); both dropped with
             // the stream
  EXPECT_EQ(stream.Deliver(100), std::optional<int64_t>(30));
  EXPECT_TRUE(stream.broken());
  EXPECT_EQ(index.LeadingBlocks(a, w)[0], 2);  // stale until the resync
  EXPECT_EQ(index.LeadingBlocks(c, w)[0], 0);
  stream.Resync();
  EXPECT_FALSE(stream.broken());
  EXPECT_EQ(index.LeadingBlocks(a, w)[0], 0);
  EXPECT_EQ(index.LeadingBlocks(b, w)[0], 2);
  EXPECT_EQ(index.LeadingBlocks(c, w)[0], 2);
  EXPECT_EQ(index.LeadingBlocks(d, w)[0], 2);
  // After the snapshot, events continue from its sequence number.
  now = 40;
  store(a);  // evicts b, stores a
  EXPECT_FALSE(stream.Deliver(100).has_value());
  EXPECT_EQ(index.LeadingBlocks(a, w)[0], 2);
  EXPECT_EQ(index.LeadingBlocks(b, w)[0], 0);
}

TEST(RouterSimTest, ConfigAndCalibrationAreChecked) {
  SimConfig c;
  c.policies = {"cache_aware", "nope"};
  EXPECT_THAT(c.Validate().message(), HasSubstr("nope"));
  c = SimConfig();
  c.event_loss = 1;
  EXPECT_FALSE(c.Validate().ok());
  c = SimConfig();
  ASSERT_TRUE(
      ApplyEngineCalibration(
          "{\"prefill_tokens_per_s\": 2000, \"decode\": [{\"batch\": 1, "
          "\"step_ms\": 12}, "
          "{\"batch\": 8, \"step_ms\": 19}, {\"batch\": 32, \"step_ms\": 43}]}",
          &c)
          .ok());
  EXPECT_DOUBLE_EQ(c.prefill_us_per_token, 500);
  EXPECT_NEAR(c.decode_step_ms, 11, 1e-9);
  EXPECT_NEAR(c.decode_step_per_seq_ms, 1, 1e-9);
  EXPECT_FALSE(ApplyEngineCalibration("{\"decode\": []}", &c).ok());
}

}  // namespace
}  // namespace pdserve::bench
