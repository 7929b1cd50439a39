#include "router/policy.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "router/prefix_index.h"

namespace pdserve::router {
namespace {

constexpr int32_t kBlockSize = 16;
const engine::ModelFingerprint kFingerprint = {0x1234, 0x5678};

WorkerView Worker(WorkerIndex index, v1::WorkerRole role) {
  WorkerView w;
  w.index = index;
  w.address = "w" + std::to_string(index);
  w.role = role;
  w.up = true;
  w.fingerprint = kFingerprint;
  w.status.mutable_layout()->set_block_size(kBlockSize);
  w.block_size = kBlockSize;
  w.status.set_total_blocks(100);
  w.status.set_free_blocks(100);
  w.status.set_max_model_len(4096);
  return w;
}

std::vector<int32_t> Tokens(int n, int salt = 0) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(1 + (i * 31 + salt) % 250);
  return t;
}

class PolicyTest : public ::testing::Test {
 protected:
  std::unique_ptr<Policy> Make(const std::string& name) {
    auto p = Policy::Create(name, config_, &index_);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *std::move(p) : nullptr;
  }
  // The index says `worker` holds the first `blocks` blocks of `tokens`.
  void Cache(WorkerIndex worker, const std::vector<int32_t>& tokens,
             size_t blocks) {
    PromptHashes hashes(&tokens, "");
    const auto& all = hashes.For(kFingerprint, kBlockSize);
    index_.Stored(worker, std::span(all).first(blocks));
  }
  absl::StatusOr<RouteDecision> Choose(Policy& p,
                                       const std::vector<int32_t>& tokens,
                                       const std::vector<WorkerView>& workers,
                                       std::vector<WorkerIndex> exclude = {}) {
    RouteRequest r{static_cast<int64_t>(tokens.size()), "", &tokens,
                   std::move(exclude), nullptr};
    return p.Choose(r, workers);
  }

  PolicyConfig config_;
  PrefixIndex index_;
};

const char* const kPolicies[] = {"cache_aware", "round_robin", "least_loaded",
                                 "cache_threshold"};

TEST_F(PolicyTest, UnknownNameIsRefused) {
  auto p = Policy::Create("fastest", config_, &index_);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(PolicyTest, CacheAwareFollowsThePrefixWhenLoadsAreEqual) {
  auto p = Make("cache_aware");
  const auto tokens = Tokens(256);  // 16 blocks
  Cache(2, tokens, 16);
  const std::vector<WorkerView> workers = {Worker(0, v1::WORKER_ROLE_DECODE),
                                           Worker(1, v1::WORKER_ROLE_PREFILL),
                                           Worker(2, v1::WORKER_ROLE_PREFILL)};
  for (int i = 0; i < 4; ++i) {  // not a tie broken by rotation
    auto d = Choose(*p, tokens, workers);
    ASSERT_TRUE(d.ok()) << d.status();
    ASSERT_NE(d->prefill, nullptr);
    EXPECT_EQ(d->prefill->index, 2);
    EXPECT_EQ(d->prefill_cached_tokens, 256);
    EXPECT_EQ(d->reason, "remote");
  }
}

TEST_F(PolicyTest, CacheAwareLeavesTheCachedWorkerWhenItsQueueCostsMore) {
  auto p = Make("cache_aware");
  const auto tokens = Tokens(256);
  Cache(2, tokens, 16);
  std::vector<WorkerView> workers = {Worker(0, v1::WORKER_ROLE_DECODE),
                                     Worker(1, v1::WORKER_ROLE_PREFILL),
                                     Worker(2, v1::WORKER_ROLE_PREFILL)};
  // Cost at 2: w_prefill x (0 uncached + 10000 queued); at 1: 256 uncached.
  workers[2].status.set_queued_prefill_tokens(10000);
  auto d = Choose(*p, tokens, workers);
  ASSERT_TRUE(d.ok());
  ASSERT_NE(d->prefill, nullptr);
  EXPECT_EQ(d->prefill->index, 1);
  EXPECT_EQ(d->prefill_cached_tokens, 0);
}

TEST_F(PolicyTest, CacheAwareDecodesWhereTheLoadIsLowest) {
  auto p = Make("cache_aware");
  std::vector<WorkerView> workers = {Worker(0, v1::WORKER_ROLE_DECODE),
                                     Worker(1, v1::WORKER_ROLE_DECODE)};
  workers[0].status.set_num_running(5);
  for (int i = 0; i < 3; ++i) {
    auto d = Choose(*p, Tokens(64), workers);
    ASSERT_TRUE(d.ok());
    EXPECT_EQ(d->decode->index, 1);
  }
}

TEST_F(PolicyTest, ShortUncachedPromptsPrefillOnTheDecodeWorker) {
  const std::vector<WorkerView> workers = {Worker(0, v1::WORKER_ROLE_DECODE),
                                           Worker(1, v1::WORKER_ROLE_PREFILL)};
  for (const char* name : kPolicies) {
    SCOPED_TRACE(name);
    auto p = Make(name);
    auto at = Choose(*p, Tokens(config_.local_prefill_threshold), workers);
    ASSERT_TRUE(at.ok());
    EXPECT_EQ(at->prefill, nullptr);
    EXPECT_EQ(at->reason, "local:short");
    auto above =
        Choose(*p, Tokens(config_.local_prefill_threshold + 1), workers);
    ASSERT_TRUE(above.ok());
    ASSERT_NE(above->prefill, nullptr);
    EXPECT_EQ(above->prefill->index, 1);
    EXPECT_EQ(above->reason, "remote");
  }
}

TEST_F(PolicyTest, CacheAwareCountsOnlyWhatTheDecodeWorkerLacks) {
  // 256 tokens, 240 of them cached at the decode worker: 16 uncached is
  // under the threshold, so the decode worker prefills the rest itself.
  auto p = Make("cache_aware");
  const auto tokens = Tokens(256);
  Cache(0, tokens, 15);
  const std::vector<WorkerView> workers = {Worker(0, v1::WORKER_ROLE_DECODE),
                                           Worker(1, v1::WORKER_ROLE_PREFILL)};
  auto d = Choose(*p, tokens, workers);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->prefill, nullptr);
  EXPECT_EQ(d->reason, "local:short");
  EXPECT_EQ(d->decode_cached_tokens, 240);
}

TEST_F(PolicyTest, NoPrefillWorkerMeansLocalPrefill) {
  for (const char* name : kPolicies) {
    SCOPED_TRACE(name);
    auto p = Make(name);
    // The decision points into the worker list: keep it alive.
    const std::vector<WorkerView> decode_only = {
        Worker(0, v1::WORKER_ROLE_DECODE)};
    const std::vector<WorkerView> colocated = {Worker(3, v1::WORKER_ROLE_BOTH)};
    auto d = Choose(*p, Tokens(512), decode_only);
    ASSERT_TRUE(d.ok());
    EXPECT_EQ(d->prefill, nullptr);
    EXPECT_EQ(d->reason, "local:no_prefill");
    auto both = Choose(*p, Tokens(512), colocated);
    ASSERT_TRUE(both.ok());
    EXPECT_EQ(both->prefill, nullptr);
    EXPECT_EQ(both->decode->index, 3);
    EXPECT_EQ(both->reason, "colocated");
  }
}

TEST_F(PolicyTest, DrainingAndExcludedWorkersAreNeverChosen) {
  std::vector<WorkerView> workers = {
      Worker(0, v1::WORKER_ROLE_DECODE), Worker(1, v1::WORKER_ROLE_DECODE),
      Worker(2, v1::WORKER_ROLE_PREFILL), Worker(3, v1::WORKER_ROLE_PREFILL)};
  workers[0].status.set_draining(true);
  workers[2].status.set_draining(true);
  // The draining workers look best on every count.
  workers[1].status.set_num_running(50);
  workers[3].status.set_queued_prefill_tokens(50000);
  const auto tokens = Tokens(256);
  Cache(2, tokens, 16);
  for (const char* name : kPolicies) {
    SCOPED_TRACE(name);
    auto p = Make(name);
    for (int i = 0; i < 4; ++i) {
      auto d = Choose(*p, tokens, workers);
      ASSERT_TRUE(d.ok());
      EXPECT_EQ(d->decode->index, 1);
      ASSERT_NE(d->prefill, nullptr);
      EXPECT_EQ(d->prefill->index, 3);
    }
    auto none = Choose(*p, tokens, workers, /*exclude=*/{1});
    EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable);
    auto local = Choose(*p, tokens, workers, /*exclude=*/{3});
    ASSERT_TRUE(local.ok());
    EXPECT_EQ(local->prefill, nullptr);
  }
}

TEST_F(PolicyTest, NoDecodeWorkerIsUnavailable) {
  for (const char* name : kPolicies) {
    SCOPED_TRACE(name);
    auto p = Make(name);
    auto d = Choose(*p, Tokens(64), {Worker(0, v1::WORKER_ROLE_PREFILL)});
    EXPECT_EQ(d.status().code(), absl::StatusCode::kUnavailable);
  }
}

TEST_F(PolicyTest, RoundRobinRotatesOverDecodeWorkers) {
  auto p = Make("round_robin");
  const std::vector<WorkerView> workers = {Worker(0, v1::WORKER_ROLE_DECODE),
                                           Worker(1, v1::WORKER_ROLE_DECODE),
                                           Worker(2, v1::WORKER_ROLE_DECODE)};
  std::vector<int> seen(3, 0);
  for (int i = 0; i < 9; ++i) {
    auto d = Choose(*p, Tokens(8), workers);
    ASSERT_TRUE(d.ok());
    ++seen[d->decode->index];
  }
  EXPECT_EQ(seen, (std::vector<int>{3, 3, 3}));
}

TEST_F(PolicyTest, LeastLoadedIgnoresTheCache) {
  auto p = Make("least_loaded");
  const auto tokens = Tokens(256);
  Cache(1, tokens, 16);
  std::vector<WorkerView> workers = {Worker(0, v1::WORKER_ROLE_DECODE),
                                     Worker(1, v1::WORKER_ROLE_PREFILL),
                                     Worker(2, v1::WORKER_ROLE_PREFILL)};
  workers[1].status.set_queued_prefill_tokens(100);
  // Router-side in-flight tokens count too (the larger of the two figures).
  workers[2].routed_prefill_tokens = 50;
  auto d = Choose(*p, tokens, workers);
  ASSERT_TRUE(d.ok());
  ASSERT_NE(d->prefill, nullptr);
  EXPECT_EQ(d->prefill->index, 2);
}

TEST_F(PolicyTest, CacheThresholdFollowsAMatchOnlyAboveTheThreshold) {
  const auto tokens = Tokens(320);  // 20 blocks
  std::vector<WorkerView> workers = {Worker(0, v1::WORKER_ROLE_DECODE),
                                     Worker(1, v1::WORKER_ROLE_PREFILL),
                                     Worker(2, v1::WORKER_ROLE_PREFILL)};
  workers[1].status.set_queued_prefill_tokens(1000);  // busier, but cached
  {
    Cache(1, tokens, 11);  // 55% > 50%: follow the match
    auto p = Make("cache_threshold");
    auto d = Choose(*p, tokens, workers);
    ASSERT_TRUE(d.ok());
    ASSERT_NE(d->prefill, nullptr);
    EXPECT_EQ(d->prefill->index, 1);
    EXPECT_EQ(d->prefill_cached_tokens, 176);
  }
  {
    index_.ClearWorker(1);
    Cache(1, tokens, 9);  // 45%: the least loaded instead
    auto p = Make("cache_threshold");
    auto d = Choose(*p, tokens, workers);
    ASSERT_TRUE(d.ok());
    ASSERT_NE(d->prefill, nullptr);
    EXPECT_EQ(d->prefill->index, 2);
  }
}

// --- KV tiers: a tier hit costs its load, less than recompute, more than a
// pool hit.

class PolicyTierTest : public PolicyTest {
 protected:
  void SetUp() override { config_.balance_slack = 0; }
  void CacheIn(WorkerIndex worker, const std::vector<int32_t>& tokens,
               size_t blocks, engine::KvTierKind tier) {
    PromptHashes hashes(&tokens, "");
    const auto& all = hashes.For(kFingerprint, kBlockSize);
    index_.Stored(worker, std::span(all).first(blocks), tier);
  }
  static WorkerView Tiered(WorkerIndex i, v1::KvTier tier) {
    WorkerView w = Worker(i, v1::WORKER_ROLE_PREFILL);
    w.status.set_kv_tier(tier);
    return w;
  }
};

TEST_F(PolicyTierTest, ATierHitBeatsACold) {
  auto p = Make("cache_aware");
  const auto tokens = Tokens(256);
  CacheIn(2, tokens, 16, engine::KvTierKind::kDisk);
  const std::vector<WorkerView> workers = {Worker(0, v1::WORKER_ROLE_DECODE),
                                           Tiered(1, v1::KV_TIER_DISK),
                                           Tiered(2, v1::KV_TIER_DISK)};
  for (int i = 0; i < 4; ++i) {
    auto d = Choose(*p, tokens, workers);
    ASSERT_TRUE(d.ok()) << d.status();
    ASSERT_NE(d->prefill, nullptr);
    EXPECT_EQ(d->prefill->index, 2);
    EXPECT_EQ(d->prefill_cached_tokens, 256);
    EXPECT_EQ(d->prefill_tier_tokens, 256);
  }
}

TEST_F(PolicyTierTest, APoolHitBeatsATierHitAtEqualLoad) {
  auto p = Make("cache_aware");
  const auto tokens = Tokens(256);
  CacheIn(1, tokens, 16, engine::KvTierKind::kHostMemory);
  Cache(2, tokens, 16);
  const std::vector<WorkerView> workers = {Worker(0, v1::WORKER_ROLE_DECODE),
                                           Tiered(1, v1::KV_TIER_HOST_MEMORY),
                                           Tiered(2, v1::KV_TIER_HOST_MEMORY)};
  for (int i = 0; i < 4; ++i) {
    auto d = Choose(*p, tokens, workers);
    ASSERT_TRUE(d.ok());
    ASSERT_NE(d->prefill, nullptr);
    EXPECT_EQ(d->prefill->index, 2);
    EXPECT_EQ(d->prefill_tier_tokens, 0);
  }
}

TEST_F(PolicyTierTest, MeasuredRatesPriceTheTier) {
  WorkerView w = Tiered(1, v1::KV_TIER_DISK);
  EXPECT_DOUBLE_EQ(TierLoadCost(w, config_), config_.tier_load_cost);
  w.status.set_prefill_tokens_per_second(1000);
  w.status.set_kv_tier_load_tokens_per_second(10000);
  EXPECT_DOUBLE_EQ(TierLoadCost(w, config_), 0.1);
  // Never priced as free or as dearer than recompute.
  w.status.set_kv_tier_load_tokens_per_second(1e9);
  EXPECT_DOUBLE_EQ(TierLoadCost(w, config_), kMinTierLoadCost);
  w.status.set_kv_tier_load_tokens_per_second(10);
  EXPECT_DOUBLE_EQ(TierLoadCost(w, config_), kMaxTierLoadCost);
  // A slow tier (cost 0.95 per token) on an idle worker against a pool hit
  // on a worker with 200 queued tokens: 0.95 x 256 > 200, the queue wins.
  auto p = Make("cache_aware");
  const auto tokens = Tokens(256);
  CacheIn(1, tokens, 16, engine::KvTierKind::kDisk);
  Cache(2, tokens, 16);
  std::vector<WorkerView> workers = {Worker(0, v1::WORKER_ROLE_DECODE), w,
                                     Tiered(2, v1::KV_TIER_POOL)};
  workers[2].status.set_queued_prefill_tokens(200);
  auto d = Choose(*p, tokens, workers);
  ASSERT_TRUE(d.ok());
  ASSERT_NE(d->prefill, nullptr);
  EXPECT_EQ(d->prefill->index, 2);
  // A fast one (0.1 per token): 25.6 < 200, the tier wins.
  workers[1].status.set_kv_tier_load_tokens_per_second(10000);
  d = Choose(*p, tokens, workers);
  ASSERT_TRUE(d.ok());
  ASSERT_NE(d->prefill, nullptr);
  EXPECT_EQ(d->prefill->index, 1);
  EXPECT_EQ(d->prefill_tier_tokens, 256);
}

TEST_F(PolicyTierTest, TierEntriesOfAWorkerWithoutATierAreNotCounted) {
  // Stale tier entries of a worker that now reports no tier: cold.
  auto p = Make("cache_aware");
  const auto tokens = Tokens(256);
  CacheIn(1, tokens, 16, engine::KvTierKind::kDisk);
  const std::vector<WorkerView> workers = {Worker(0, v1::WORKER_ROLE_DECODE),
                                           Worker(1, v1::WORKER_ROLE_PREFILL)};
  auto d = Choose(*p, tokens, workers);
  ASSERT_TRUE(d.ok());
  ASSERT_NE(d->prefill, nullptr);
  EXPECT_EQ(d->prefill_cached_tokens, 0);
}

}  // namespace
}  // namespace pdserve::router

namespace pdserve::router {
namespace {

TEST_F(PolicyTest, CacheAwareDecidesTheSameWithTheChainHashedOrHashedLazily) {
  // The service hashes the prompt at intake (PromptHashes), and the index
  // walk then prefetches; without hashes the policy hashes lazily. Both
  // must decide alike, request after request (the decisions reuse
  // per-thread buffers), at more workers than one 64-bit word covers.
  auto hashed = Make("cache_aware");
  auto lazy = Make("cache_aware");
  std::vector<WorkerView> workers;
  for (WorkerIndex w = 0; w < 70; ++w)
    workers.push_back(Worker(w, v1::WORKER_ROLE_PREFILL));
  for (WorkerIndex w = 70; w < 80; ++w)
    workers.push_back(Worker(w, v1::WORKER_ROLE_DECODE));
  std::vector<std::vector<int32_t>> prompts;
  for (int c = 0; c < 12; ++c) prompts.push_back(Tokens(16 * (20 + 9 * c), c));
  for (WorkerIndex w = 0; w < 80; ++w) {
    Cache(w, prompts[w % prompts.size()],
          static_cast<size_t>(w * 7 % 19));  // prefixes of several lengths
    workers[w].status.set_queued_prefill_tokens(static_cast<uint64_t>(w % 5) *
                                                100);
    workers[w].status.set_num_running(static_cast<uint32_t>(w % 3));
  }
  for (int i = 0; i < 60; ++i) {
    const std::vector<int32_t>& tokens = prompts[(i * 5) % prompts.size()];
    PromptHashes hashes(&tokens, "");
    const RouteRequest with{
        static_cast<int64_t>(tokens.size()), "", &tokens, {}, &hashes};
    const RouteRequest without{
        static_cast<int64_t>(tokens.size()), "", &tokens, {}, nullptr};
    auto a = hashed->Choose(with, workers);
    auto b = lazy->Choose(without, workers);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(a->prefill, b->prefill) << "request " << i;
    ASSERT_EQ(a->decode, b->decode) << "request " << i;
    EXPECT_EQ(a->prefill_cached_tokens, b->prefill_cached_tokens);
    EXPECT_EQ(a->decode_cached_tokens, b->decode_cached_tokens);
    EXPECT_EQ(a->reason, b->reason);
    // What the service does after routing: the chosen workers count it.
    if (a->prefill != nullptr) {
      const auto index = static_cast<size_t>(a->prefill->index);
      workers[index].routed_prefill_tokens +=
          static_cast<int64_t>(tokens.size()) - a->prefill_cached_tokens;
    }
    workers[static_cast<size_t>(a->decode->index)].routed_requests += 1;
  }
}

}  // namespace
}  // namespace pdserve::router
