#include "kv_cache/block_manager.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <xxhash.h>

#include <numeric>
#include <string>

namespace pdserve::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

class BlockManagerTest : public ::testing::Test {
 protected:
  std::vector<BlockHash> Hashes(const std::vector<int32_t>& tokens,
                                std::string salt = "") {
    std::vector<BlockHash> out;
    ExtendBlockHashes(fp_, salt, tokens, 4, &out);
    return out;
  }
  ModelFingerprint fp_{1, 2};
  std::vector<KvEvent> events_;
  BlockManager bm_{4, [this](const KvEvent& e) { events_.push_back(e); }};
};

TEST_F(BlockManagerTest, HashesChainOverFullBlocksAndDependOnSaltAndModel) {
  std::vector<int32_t> toks(10);
  std::iota(toks.begin(), toks.end(), 0);
  auto h = Hashes(toks);
  ASSERT_EQ(h.size(), 2u);  // the partial third block is not hashed
  EXPECT_EQ(h[0], HashBlock({}, fp_, "", toks.data(), 4));
  EXPECT_EQ(h[1], HashBlock(h[0], fp_, "", toks.data() + 4, 4));
  EXPECT_EQ(Hashes(toks), h);  // deterministic across calls (and processes)
  EXPECT_NE(Hashes(toks, "tenant-a")[0], h[0]);
  ModelFingerprint other{1, 3};
  EXPECT_NE(HashBlock({}, other, "", toks.data(), 4), h[0]);
  // Same second-block tokens under a different first block: different hash.
  std::vector<int32_t> toks2 = toks;
  toks2[0] = 99;
  EXPECT_NE(Hashes(toks2)[1], h[1]);
}

// The contract's byte layout, hashed independently of HashBlock's fast path:
// XXH3-128 of parent.hi, parent.lo, fingerprint, salt, tokens.
BlockHash ContractHash(const BlockHash& parent, const ModelFingerprint& fp,
                       const std::string& salt,
                       const std::vector<int32_t>& tokens) {
  std::string bytes;
  const uint64_t head[4] = {parent.hi, parent.lo, fp[0], fp[1]};
  bytes.append(reinterpret_cast<const char*>(head), sizeof(head));
  bytes.append(salt);
  bytes.append(reinterpret_cast<const char*>(tokens.data()),
               tokens.size() * sizeof(int32_t));
  const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  return {h.high64, h.low64};
}

TEST_F(BlockManagerTest, HashFollowsTheContractLayoutForShortAndLongInputs) {
  // Short inputs take a one-shot path, long ones (big salt or block) the
  // streaming one; both must give the contract's hash.
  const BlockHash parent{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
  for (int block_size : {1, 16, 64, 200}) {
    for (size_t salt_len : {size_t{0}, size_t{7}, size_t{300}, size_t{2000}}) {
      std::vector<int32_t> toks(block_size);
      std::iota(toks.begin(), toks.end(), 1000);
      const std::string salt(salt_len, 's');
      EXPECT_EQ(HashBlock(parent, fp_, salt, toks.data(), block_size),
                ContractHash(parent, fp_, salt, toks))
          << "block_size " << block_size << ", salt " << salt_len;
    }
  }
}

// ExtendBlockHashes reuses one buffer for the whole chain (and the header's
// inline XXH3): its chain must be the contract's, block by block, whether it
// is computed at once or extended a few tokens at a time (lazy hashing,
// decode), on both the one-shot and the streaming path, and on the loops
// specialised for unsalted 16- and 32-token blocks.
TEST_F(BlockManagerTest, ExtendedChainIsTheContractChainAtOnceOrPiecewise) {
  for (int block_size : {1, 16, 32, 64, 200}) {
    for (size_t salt_len : {size_t{0}, size_t{5}, size_t{300}, size_t{2000}}) {
      std::vector<int32_t> toks(block_size * 9 + block_size / 2);
      std::iota(toks.begin(), toks.end(), 7);
      const std::string salt(salt_len, 'x');
      std::vector<BlockHash> expected;
      BlockHash parent{};
      for (size_t b = 0; b + 1 <= toks.size() / block_size; ++b) {
        parent = ContractHash(
            parent, fp_, salt,
            std::vector<int32_t>(toks.begin() + b * block_size,
                                 toks.begin() + (b + 1) * block_size));
        expected.push_back(parent);
      }
      std::vector<BlockHash> at_once;
      ExtendBlockHashes(fp_, salt, toks, block_size, &at_once);
      EXPECT_EQ(at_once, expected)
          << "block_size " << block_size << ", salt " << salt_len;
      std::vector<BlockHash> piecewise;
      for (size_t n = 0; n <= toks.size(); n += 3) {
        ExtendBlockHashes(fp_, salt, std::span(toks).first(n), block_size,
                          &piecewise);
        ASSERT_EQ(piecewise.size(), n / block_size);
      }
      ExtendBlockHashes(fp_, salt, toks, block_size, &piecewise);
      EXPECT_EQ(piecewise, expected)
          << "block_size " << block_size << ", salt " << salt_len;
    }
  }
}

TEST_F(BlockManagerTest, CachedBlocksSurviveReleaseAndAreFoundAgain) {
  std::vector<int32_t> blocks;
  ASSERT_TRUE(bm_.Allocate(2, &blocks));
  auto h = Hashes({1, 2, 3, 4, 5, 6, 7, 8});
  bm_.Commit({}, blocks, h);
  ASSERT_EQ(events_.size(), 1u);
  EXPECT_EQ(events_[0].type, KvEvent::Type::kStored);
  EXPECT_EQ(events_[0].seq, 1u);
  EXPECT_EQ(events_[0].hashes, h);
  bm_.Release(blocks);
  EXPECT_EQ(bm_.num_free(), 4);
  EXPECT_EQ(bm_.num_cached(), 2);
  EXPECT_EQ(bm_.Lookup(h), blocks);
  bm_.Acquire(bm_.Lookup(h));
  EXPECT_EQ(bm_.num_cached(), 0);
  EXPECT_EQ(bm_.num_active(), 2);
}

TEST_F(BlockManagerTest, UncachedBlocksGoFirstThenLruEvictionPublishesRemoved) {
  std::vector<int32_t> a, b;
  ASSERT_TRUE(bm_.Allocate(2, &a));
  auto h = Hashes({1, 2, 3, 4, 5, 6, 7, 8});
  bm_.Commit({}, a, h);
  const std::vector<int32_t> tail_first{a[1],
                                        a[0]};  // a[1] becomes least recent
  bm_.Release(tail_first);
  ASSERT_TRUE(bm_.Allocate(2, &b));  // the two never-used blocks
  EXPECT_EQ(bm_.num_cached(), 2);
  std::vector<int32_t> c;
  ASSERT_TRUE(bm_.Allocate(1, &c));
  EXPECT_THAT(c, ElementsAre(a[1]));
  EXPECT_EQ(events_.back().type, KvEvent::Type::kRemoved);
  EXPECT_THAT(events_.back().hashes, ElementsAre(h[1]));
  EXPECT_THAT(bm_.Lookup(h), ElementsAre(a[0]));  // prefix still there
  EXPECT_FALSE(bm_.Allocate(2, &c));  // only one left: nothing changes
  EXPECT_EQ(bm_.num_free(), 1);
}

TEST_F(BlockManagerTest, DuplicateContentKeepsFirstBlockAndClearForgetsAll) {
  std::vector<int32_t> a, b;
  ASSERT_TRUE(bm_.Allocate(1, &a));
  ASSERT_TRUE(bm_.Allocate(1, &b));
  auto h = Hashes({1, 2, 3, 4});
  bm_.Commit({}, a, h);
  bm_.Commit({}, b, h);
  EXPECT_FALSE(bm_.IsCached(b[0]));
  EXPECT_EQ(events_.size(), 1u);
  bm_.Release(b);
  EXPECT_EQ(bm_.num_cached(), 0);
  bm_.ClearCache();
  EXPECT_EQ(events_.back().type, KvEvent::Type::kCleared);
  EXPECT_EQ(events_.back().seq, 2u);
  EXPECT_THAT(bm_.Lookup(h), IsEmpty());
  bm_.Release(a);
  EXPECT_EQ(bm_.num_free(), 4);
  EXPECT_EQ(bm_.num_cached(), 0);
}

}  // namespace
}  // namespace pdserve::engine
