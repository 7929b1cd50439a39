#include "bench/kv_tier_sim.h"

#include <gtest/gtest.h>

namespace pdserve::bench {
namespace {

TraceRequest Req(std::vector<int64_t> ids) {
  TraceRequest r;
  r.input_length = static_cast<int64_t>(ids.size()) * kTraceBlockTokens;
  r.hash_ids = std::move(ids);
  return r;
}

// Two conversations of 2 blocks each, alternating, then each again: a pool of
// 2 blocks (half the working set) loses every reuse; a tier of 4x the pool
// holds them all.
std::vector<TraceRequest> Alternating() {
  return {Req({1, 2}), Req({3, 4}), Req({1, 2}), Req({3, 4})};
}

TEST(KvTierSimTest, TierWinsBackWhatASmallPoolLoses) {
  TierSimConfig c;
  c.pool_fractions = {0.5};
  auto r = RunTierSim(c, Alternating());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->working_set_blocks, 4);
  ASSERT_EQ(r->cases.size(), 3u);
  const TierSimCase& unbounded = r->cases[0];
  const TierSimCase& pool = r->cases[1];
  const TierSimCase& tiered = r->cases[2];
  EXPECT_EQ(unbounded.name, "unbounded");
  EXPECT_DOUBLE_EQ(unbounded.hit_ratio, 0.5);  // the second half is reuse
  EXPECT_EQ(pool.name, "pool");
  EXPECT_EQ(pool.pool_blocks, 2);
  EXPECT_DOUBLE_EQ(pool.hit_ratio, 0);
  EXPECT_EQ(tiered.name, "pool+tier");
  EXPECT_EQ(tiered.tier_blocks, 8);
  EXPECT_DOUBLE_EQ(tiered.hit_ratio, 0.5);
  EXPECT_EQ(tiered.tier_hit_tokens, 4 * kTraceBlockTokens);
  EXPECT_DOUBLE_EQ(tiered.vs_unbounded, 1.0);
  // Reading the tier is cheaper than recomputing at these rates.
  EXPECT_LT(tiered.prefill_seconds, pool.prefill_seconds);
}

TEST(KvTierSimTest, PrefixStopsAtTheFirstMissAndPartialBlocksCountTheirTokens) {
  std::vector<TraceRequest> t = {Req({1, 2, 3}), Req({1, 9, 3})};
  t[1].input_length = 2 * kTraceBlockTokens + 100;  // last block partial
  TierSimConfig c;
  c.pool_fractions = {1.0};
  auto r = RunTierSim(c, t);
  ASSERT_TRUE(r.ok());
  // Block 3 of the second request is cached but follows a miss: no hit.
  EXPECT_EQ(r->cases[0].pool_hit_tokens, kTraceBlockTokens);
  EXPECT_EQ(r->cases[0].input_tokens, 5 * kTraceBlockTokens + 100);
}

TEST(KvTierSimTest, RejectsBadConfig) {
  TierSimConfig c;
  c.pool_fractions = {0};
  EXPECT_FALSE(RunTierSim(c, Alternating()).ok());
  c.pool_fractions = {0.5};
  c.tier_read_gbps = 0;
  EXPECT_FALSE(RunTierSim(c, Alternating()).ok());
}

}  // namespace
}  // namespace pdserve::bench
