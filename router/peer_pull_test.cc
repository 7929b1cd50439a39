#include "router/peer_pull.h"

#include <gtest/gtest.h>

#include "wire/peer_pull_grant.h"

namespace pdserve::router {
namespace {

class PeerPullTest : public ::testing::Test {
 protected:
  PeerPullTest() {
    config_.enabled = true;
    config_.overhead_seconds = 0.001;
    input_.prefill = 0;
    input_.prefill_cached_blocks = 0;
    input_.prompt_blocks = 64;
    input_.block_size = 16;
    input_.bytes_per_block = 1 << 20;         // 1 MiB per block
    input_.prefill_tokens_per_second = 1000;  // 16 ms per block
  }
  PeerPullCandidate Holder(WorkerIndex index, int32_t blocks,
                           double bytes_per_second) {
    PeerPullCandidate c;
    c.index = index;
    c.address = "127.0.0.1:" + std::to_string(9000 + index);
    c.id = "w" + std::to_string(index);
    c.up = true;
    c.same_cache = true;
    c.leading_blocks = blocks;
    c.transfer_bytes_per_second = bytes_per_second;
    return c;
  }
  PeerPullConfig config_;
  PeerPullInput input_;
};

TEST_F(PeerPullTest, PullsWhenTransferIsFasterThanRecompute) {
  // 32 blocks: recompute 512 tokens / 1000 = 0.512 s; transfer 32 MiB at
  // 1 GB/s = 0.034 s.
  input_.candidates = {Holder(1, 32, 1e9)};
  PeerPullDecision d = DecidePeerPull(config_, input_);
  EXPECT_TRUE(d.pull);
  EXPECT_EQ(d.holder, 1);
  EXPECT_EQ(d.holder_address, "127.0.0.1:9001");
  EXPECT_EQ(d.blocks, 32);
  EXPECT_EQ(d.gain_blocks, 32);
  EXPECT_LT(d.transfer_seconds, d.recompute_seconds);
}

TEST_F(PeerPullTest, RecomputesWhenTransferIsSlower) {
  // 10 MB/s: 32 MiB take 3.3 s, recompute 0.512 s.
  input_.candidates = {Holder(1, 32, 1e7)};
  PeerPullDecision d = DecidePeerPull(config_, input_);
  EXPECT_FALSE(d.pull);
  EXPECT_EQ(d.reason, "not_faster");
  EXPECT_GT(d.transfer_seconds, d.recompute_seconds);
}

TEST_F(PeerPullTest, MinSpeedupRaisesTheBar) {
  // Transfer 0.034 s vs recompute 0.512 s: 15x faster, not 20x.
  input_.candidates = {Holder(1, 32, 1e9)};
  config_.min_speedup = 20;
  EXPECT_FALSE(DecidePeerPull(config_, input_).pull);
  config_.min_speedup = 10;
  EXPECT_TRUE(DecidePeerPull(config_, input_).pull);
}

TEST_F(PeerPullTest, NeverWhenPrefillWorkerAlreadyHasIt) {
  input_.prefill_cached_blocks = 32;
  input_.candidates = {Holder(1, 32, 1e9), Holder(2, 20, 1e9)};
  PeerPullDecision d = DecidePeerPull(config_, input_);
  EXPECT_FALSE(d.pull);
  EXPECT_EQ(d.reason, "no_holder");
}

TEST_F(PeerPullTest, NeverFromItself) {
  input_.candidates = {Holder(0, 32, 1e9)};
  EXPECT_FALSE(DecidePeerPull(config_, input_).pull);
}

TEST_F(PeerPullTest, NeverFromADeadOrUnknownWorker) {
  PeerPullCandidate dead = Holder(1, 40, 1e9);
  dead.up = false;
  PeerPullCandidate unknown = Holder(2, 40, 1e9);
  unknown.address.clear();
  input_.candidates = {dead, unknown};
  PeerPullDecision d = DecidePeerPull(config_, input_);
  EXPECT_FALSE(d.pull);
  EXPECT_EQ(d.reason, "no_holder");
  // A live holder with fewer blocks is chosen over them.
  input_.candidates.push_back(Holder(3, 8, 1e9));
  d = DecidePeerPull(config_, input_);
  EXPECT_TRUE(d.pull);
  EXPECT_EQ(d.holder, 3);
}

TEST_F(PeerPullTest, NeverFromAnotherCacheIdentity) {
  PeerPullCandidate other = Holder(1, 32, 1e9);
  other.same_cache = false;
  input_.candidates = {other};
  EXPECT_FALSE(DecidePeerPull(config_, input_).pull);
}

TEST_F(PeerPullTest, DisabledNeverPulls) {
  config_.enabled = false;
  input_.candidates = {Holder(1, 32, 1e9)};
  PeerPullDecision d = DecidePeerPull(config_, input_);
  EXPECT_FALSE(d.pull);
  EXPECT_EQ(d.reason, "disabled");
}

TEST_F(PeerPullTest, PrefersTheHolderWithTheMostMissingBlocks) {
  input_.prefill_cached_blocks = 4;
  input_.candidates = {Holder(1, 10, 1e9), Holder(2, 30, 1e9),
                       Holder(3, 30, 2e9)};
  PeerPullDecision d = DecidePeerPull(config_, input_);
  EXPECT_TRUE(d.pull);
  EXPECT_EQ(d.holder, 3);  // as many blocks as 2, faster
  EXPECT_EQ(d.blocks, 30);
  EXPECT_EQ(d.gain_blocks, 26);
}

TEST_F(PeerPullTest, HolderCountIsCappedAtThePrompt) {
  input_.prompt_blocks = 8;
  input_.candidates = {Holder(1, 100, 1e9)};
  PeerPullDecision d = DecidePeerPull(config_, input_);
  EXPECT_TRUE(d.pull);
  EXPECT_EQ(d.blocks, 8);
}

TEST_F(PeerPullTest, UnmeasuredRatesFallBackToDefaults) {
  input_.prefill_tokens_per_second = 0;
  config_.default_prefill_tokens_per_second = 1e9;  // recompute is ~free
  input_.candidates = {Holder(1, 32, 0)};
  EXPECT_FALSE(DecidePeerPull(config_, input_).pull);
  config_.default_prefill_tokens_per_second = 100;
  EXPECT_TRUE(DecidePeerPull(config_, input_).pull);
}

TEST_F(PeerPullTest, BytesPerBlockFollowsTheLayout) {
  v1::KvLayout layout;
  layout.set_num_layers(2);
  layout.set_kv_heads(4);
  layout.set_head_dim(8);
  layout.set_block_size(16);
  layout.set_dtype(v1::KV_DTYPE_FP32);
  EXPECT_EQ(BytesPerBlock(layout), 2 * (2 * 4 * 16 * 8 * 4));
  layout.set_dtype(v1::KV_DTYPE_INT8);
  EXPECT_EQ(BytesPerBlock(layout), 2 * (2 * 4 * 16 * 8 + 2 * 4 * 4));
  // MLA: one latent row per token (kv_heads 1, head_dim the latent width).
  v1::KvLayout mla;
  mla.set_num_layers(3);
  mla.set_kv_heads(1);
  mla.set_head_dim(512 + 64);
  mla.set_block_size(16);
  mla.set_kv_lora_rank(512);
  mla.set_qk_rope_head_dim(64);
  mla.set_dtype(v1::KV_DTYPE_BF16);
  EXPECT_EQ(BytesPerBlock(mla), 3 * (16 * 576 * 2));
}

// A holder whose blocks are in its KV tier reads them back first.
TEST_F(PeerPullTest, TierHolderIsPricedWithItsTierLoadPlusTheTransfer) {
  // 32 blocks = 512 tokens, all in the holder's tier. Recompute 0.512 s;
  // transfer 0.034 s; tier at 10,000 tokens/s: +0.0512 s.
  PeerPullCandidate c = Holder(1, 32, 1e9);
  c.tier_blocks = 32;
  c.tier_load_tokens_per_second = 10000;
  input_.candidates = {c};
  PeerPullDecision d = DecidePeerPull(config_, input_);
  EXPECT_TRUE(d.pull);
  EXPECT_EQ(d.blocks, 32);
  EXPECT_EQ(d.tier_blocks, 32);
  const double transfer = 0.001 + 32.0 * (1 << 20) / 1e9;
  EXPECT_NEAR(d.transfer_seconds, transfer + 512.0 / 10000, 1e-9);
  EXPECT_NEAR(d.recompute_seconds, 0.512, 1e-9);
  // A tier slower than recomputing (500 tokens/s: 1.02 s) is not worth it.
  input_.candidates[0].tier_load_tokens_per_second = 500;
  d = DecidePeerPull(config_, input_);
  EXPECT_FALSE(d.pull);
  EXPECT_EQ(d.reason, "not_faster");
  // Unmeasured: default_tier_load_cost of a recompute (0.25 x 0.512 s).
  input_.candidates[0].tier_load_tokens_per_second = 0;
  d = DecidePeerPull(config_, input_);
  EXPECT_TRUE(d.pull);
  EXPECT_NEAR(d.transfer_seconds, transfer + 0.25 * 0.512, 1e-9);
}

TEST_F(PeerPullTest, OnlyTheTierPartOfAHoldersRunCostsATierRead) {
  // 40 blocks: 10 in the pool, 30 in the tier; P has the first 4.
  input_.prefill_cached_blocks = 4;
  PeerPullCandidate c = Holder(1, 40, 1e9);
  c.tier_blocks = 30;
  c.tier_load_tokens_per_second = 1e5;
  input_.candidates = {c};
  PeerPullDecision d = DecidePeerPull(config_, input_);
  EXPECT_TRUE(d.pull);
  EXPECT_EQ(d.gain_blocks, 36);
  EXPECT_EQ(d.tier_blocks, 30);
  // Capped at a 20-block prompt: 10 of the tier's blocks are in it.
  input_.prompt_blocks = 20;
  d = DecidePeerPull(config_, input_);
  EXPECT_EQ(d.blocks, 20);
  EXPECT_EQ(d.gain_blocks, 16);
  EXPECT_EQ(d.tier_blocks, 10);
}

TEST_F(PeerPullTest, PoolHolderBeatsATierHolderOfTheSameBlocks) {
  PeerPullCandidate tier = Holder(1, 32, 1e9);
  tier.tier_blocks = 32;
  tier.tier_load_tokens_per_second = 20000;
  input_.candidates = {tier, Holder(2, 32, 1e9)};
  PeerPullDecision d = DecidePeerPull(config_, input_);
  EXPECT_TRUE(d.pull);
  EXPECT_EQ(d.holder, 2);
  EXPECT_EQ(d.tier_blocks, 0);
  // A tier holder with many more blocks saves more and wins.
  input_.candidates[0].leading_blocks = 60;
  input_.candidates[0].tier_blocks = 60;
  d = DecidePeerPull(config_, input_);
  EXPECT_EQ(d.holder, 1);
  EXPECT_EQ(d.gain_blocks, 60);
}

TEST_F(PeerPullTest, PrefillWorkersOwnTierIsTheAlternativeToAPull) {
  // P has 32 blocks in its own fast tier (512 tokens at 1e6/s = 0.5 ms); a
  // peer's pool copy over a slow link (100 MB/s: 0.34 s) is not worth it.
  input_.prefill_tier_blocks = 32;
  input_.prefill_tier_load_tokens_per_second = 1e6;
  input_.candidates = {Holder(1, 32, 1e8)};
  PeerPullDecision d = DecidePeerPull(config_, input_);
  EXPECT_FALSE(d.pull);
  EXPECT_NEAR(d.recompute_seconds, 512.0 / 1e6, 1e-9);
  // Beyond P's tier, P would recompute: with 96 more blocks (1.536 s) and a
  // fast link (128 MiB at 1 GB/s: 0.135 s) the pull wins.
  input_.prompt_blocks = 128;
  input_.candidates[0].leading_blocks = 128;
  input_.candidates[0].transfer_bytes_per_second = 1e9;
  d = DecidePeerPull(config_, input_);
  EXPECT_TRUE(d.pull);
  EXPECT_NEAR(d.recompute_seconds, 512.0 / 1e6 + 96 * 16 / 1000.0, 1e-9);
}

TEST(PeerPullConfigTest, ValidateRefusesBadValues) {
  PeerPullConfig c;
  EXPECT_TRUE(c.Validate().ok());
  c.min_speedup = 0;
  EXPECT_FALSE(c.Validate().ok());
  c = PeerPullConfig();
  c.default_tier_load_cost = 0;
  EXPECT_FALSE(c.Validate().ok());
}

TEST_F(PeerPullTest, SkipsABackedOffHolderForTheNextBest) {
  input_.candidates = {Holder(1, 48, 1e9), Holder(2, 32, 1e9)};
  input_.candidates[0].backed_off = true;
  PeerPullDecision d = DecidePeerPull(config_, input_);
  EXPECT_TRUE(d.pull);
  EXPECT_EQ(d.holder, 2);
}

TEST_F(PeerPullTest, OnlyBackedOffHoldersMeansNoPullWithItsOwnReason) {
  input_.candidates = {Holder(1, 48, 1e9)};
  input_.candidates[0].backed_off = true;
  PeerPullDecision d = DecidePeerPull(config_, input_);
  EXPECT_FALSE(d.pull);
  EXPECT_EQ(d.reason, "backed_off");
}

TEST(PeerPullBackoffTest, FailedHolderIsSkippedUntilItsBackoffEnds) {
  PeerPullBackoffConfig config;
  config.initial = absl::Seconds(5);
  config.max = absl::Seconds(20);
  PeerPullBackoff backoff(config);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_FALSE(backoff.BackedOff("h:1", t0));
  EXPECT_EQ(backoff.Failed("h:1", t0), absl::Seconds(5));
  EXPECT_TRUE(backoff.BackedOff("h:1", t0 + absl::Seconds(4)));
  EXPECT_FALSE(backoff.BackedOff("h:1", t0 + absl::Seconds(5)));
  EXPECT_FALSE(backoff.BackedOff("h:2", t0));
  // Consecutive failures double it, up to max.
  EXPECT_EQ(backoff.Failed("h:1", t0), absl::Seconds(10));
  EXPECT_EQ(backoff.Failed("h:1", t0), absl::Seconds(20));
  EXPECT_EQ(backoff.Failed("h:1", t0), absl::Seconds(20));
  // A pull that worked ends it, and the next failure starts over.
  backoff.Succeeded("h:1");
  EXPECT_FALSE(backoff.BackedOff("h:1", t0));
  EXPECT_EQ(backoff.Failed("h:1", t0), absl::Seconds(5));
}

TEST(PeerPullBackoffTest, ChurnOfHolderAddressesStaysBounded) {
  PeerPullBackoffConfig config;
  config.max_holders = 8;
  PeerPullBackoff backoff(config);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  for (int i = 0; i < 10000; ++i) {
    backoff.Failed("10.0.0." + std::to_string(i) + ":1",
                   t0 + absl::Milliseconds(i));
  }
  EXPECT_LE(backoff.size(), 8u);
  // The newest is still backed off.
  EXPECT_TRUE(backoff.BackedOff("10.0.0.9999:1", t0 + absl::Seconds(10)));
}

class PeerPullGrantTest : public ::testing::Test {
 protected:
  PeerPullGrantTest() : key_(wire::NewPeerPullKey()) {
    keys_.Add(key_);
    grant_.set_holder_address("127.0.0.1:7001");
    grant_.set_holder_id("holder");
    grant_.set_blocks(8);
    grant_.set_puller_kv_address("127.0.0.1:7002");
    grant_.set_request_id("req-1@abc.1");
    grant_.set_expires_unix_ms(absl::ToUnixMillis(now_ + absl::Minutes(1)));
    wire::SignPeerPullGrant(key_, &grant_);
  }
  absl::Status Verify(const v1::PeerPull& g, uint64_t end_block = 8) {
    return keys_.Verify(g, "127.0.0.1:7001", "pull:req-1@abc.1", end_block,
                        now_);
  }
  const absl::Time now_ = absl::FromUnixSeconds(100000);
  std::string key_;
  wire::PeerPullKeys keys_;
  v1::PeerPull grant_;
};

TEST_F(PeerPullGrantTest, TheRoutersGrantVerifies) {
  EXPECT_EQ(key_.size(), wire::kPeerPullKeyBytes);
  EXPECT_TRUE(Verify(grant_).ok()) << Verify(grant_);
}

TEST_F(PeerPullGrantTest, AnotherDestinationBreaksTheSignature) {
  v1::PeerPull g = grant_;
  g.set_puller_kv_address("10.9.9.9:1");
  EXPECT_EQ(Verify(g).code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(PeerPullGrantTest, MoreBlocksOrAnotherRequestBreakTheSignature) {
  v1::PeerPull more = grant_;
  more.set_blocks(1000);
  EXPECT_EQ(Verify(more, 1000).code(), absl::StatusCode::kPermissionDenied);
  v1::PeerPull other = grant_;
  other.set_request_id("req-2@abc.1");
  EXPECT_EQ(
      keys_.Verify(other, "127.0.0.1:7001", "pull:req-2@abc.1", 8, now_).code(),
      absl::StatusCode::kPermissionDenied);
}

TEST_F(PeerPullGrantTest, RefusedForAnotherHolderRequestOrRangeOrWhenExpired) {
  EXPECT_EQ(keys_.Verify(grant_, "127.0.0.1:9999", "pull:req-1@abc.1", 8, now_)
                .code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(
      keys_.Verify(grant_, "127.0.0.1:7001", "pull:req-9", 8, now_).code(),
      absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Verify(grant_, 9).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(keys_
                .Verify(grant_, "127.0.0.1:7001", "pull:req-1@abc.1", 8,
                        now_ + absl::Minutes(2))
                .code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(PeerPullGrantTest, UnknownKeyOrNoKeyIsRefused) {
  v1::PeerPull forged = grant_;
  wire::SignPeerPullGrant(wire::NewPeerPullKey(), &forged);
  EXPECT_EQ(Verify(forged).code(), absl::StatusCode::kPermissionDenied);
  v1::PeerPull unsigned_grant = grant_;
  unsigned_grant.clear_grant_mac();
  EXPECT_EQ(Verify(unsigned_grant).code(), absl::StatusCode::kPermissionDenied);
  wire::PeerPullKeys none;
  EXPECT_EQ(
      none.Verify(grant_, "127.0.0.1:7001", "pull:req-1@abc.1", 8, now_).code(),
      absl::StatusCode::kFailedPrecondition);
  // A key of the wrong size is never taken.
  none.Add("short");
  EXPECT_TRUE(none.empty());
}

TEST_F(PeerPullGrantTest, KeysOfTheLastRoutersAreKept) {
  wire::PeerPullKeys keys;
  keys.Add(key_);
  for (size_t i = 0; i < wire::PeerPullKeys::kMaxKeys - 1; ++i)
    keys.Add(wire::NewPeerPullKey());
  EXPECT_TRUE(
      keys.Verify(grant_, "127.0.0.1:7001", "pull:req-1@abc.1", 8, now_).ok());
  keys.Add(wire::NewPeerPullKey());  // the oldest (key_) goes
  EXPECT_EQ(
      keys.Verify(grant_, "127.0.0.1:7001", "pull:req-1@abc.1", 8, now_).code(),
      absl::StatusCode::kPermissionDenied);
}

}  // namespace
}  // namespace pdserve::router
