#include "kv_cache/kv_cache.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cstdint>
#include <vector>

namespace pdserve::engine {
namespace {

TEST(KvCacheSpecTest, BytesPerTokenFollowsTheFormula) {
  KvCacheSpec small{2, 4, 8, 16, DType::kF16};
  EXPECT_EQ(small.BytesPerToken(), 256);
  KvCacheSpec llama{32, 8, 128, 16, DType::kF16};
  EXPECT_EQ(llama.BytesPerToken(), 131072);
  EXPECT_EQ(llama.BytesPerToken() * 8192, int64_t{1} << 30);
  EXPECT_EQ(llama.BytesPerBlock(), 131072 * 16);
  EXPECT_EQ(llama.BlocksForMemory(int64_t{1} << 30), 512);
  KvCacheSpec q = llama;
  q.dtype = DType::kI8;
  EXPECT_EQ(q.BytesPerToken(), 65536);  // int8 halves fp16
  EXPECT_EQ(q.ScaleBytesPerBlock(), 2 * 32 * 8 * 4);
}

TEST(KvCacheSpecTest, RejectsBadGeometry) {
  EXPECT_FALSE((KvCacheSpec{0, 1, 1, 16, DType::kF32}).Validate().ok());
  EXPECT_FALSE((KvCacheSpec{1, 1, 1, 0, DType::kF32}).Validate().ok());
  EXPECT_FALSE((KvCacheSpec{1, 1, 1, 1000, DType::kF32}).Validate().ok());
}

TEST(KvPoolTest, LayerBlockSpansAreContiguousAndDisjoint) {
  KvCacheSpec spec{2, 2, 4, 4, DType::kI8};
  auto pool = KvPool::Create(spec, 3);
  ASSERT_TRUE(pool.ok());
  EXPECT_EQ((*pool)->LayerBlockData(0, 1) - (*pool)->LayerBlockData(0, 0),
            spec.LayerBlockBytes());
  EXPECT_NE((*pool)->LayerBlockScales(1, 2), nullptr);
  EXPECT_EQ(KvPool::Create(spec, 0).status().code(),
            absl::StatusCode::kResourceExhausted);
}

// int8 data without its scales is garbage on arrival: a copy given no scale
// buffer for a scaled span fails and copies nothing (the CUDA storage has
// the same rule, engine/kv_tier_gpu_test.cc).
TEST(KvPoolTest, CopiesOfScaledSpansWithoutAScaleBufferAreRefused) {
  KvCacheSpec spec{2, 2, 4, 4, DType::kI8};
  auto pool = KvPool::Create(spec, 3);
  ASSERT_TRUE(pool.ok());
  std::vector<uint8_t> data(spec.LayerBlockBytes(), 7);
  std::vector<float> scales(2 * spec.num_kv_heads, 0.5f);
  EXPECT_EQ((*pool)->CopyFromHost(1, 2, data.data(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*pool)->LayerBlockData(1, 2)[0], 0) << "data copied anyway";
  EXPECT_EQ((*pool)->CopyToHost(1, 2, data.data(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(data[0], 7) << "data copied anyway";
  ASSERT_TRUE((*pool)->CopyFromHost(1, 2, data.data(), scales.data()).ok());
  EXPECT_EQ((*pool)->LayerBlockScales(1, 2)[3], 0.5f);
  // fp32 has no scales: null is fine.
  KvCacheSpec f32{2, 2, 4, 4, DType::kF32};
  auto plain = KvPool::Create(f32, 3);
  std::vector<uint8_t> f32_data(f32.LayerBlockBytes(), 1);
  EXPECT_TRUE((*plain)->CopyFromHost(0, 0, f32_data.data(), nullptr).ok());
}

int64_t MinorFaults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// A pool's pages are backed as blocks are written, not at creation: a
// 1 GiB budget costs a worker nothing until it is used, every slot reads
// zero, and writing one (layer, block) touches about its own pages.
TEST(KvPoolTest, PagesAreBackedOnlyWhereBlocksAreWritten) {
  KvCacheSpec spec{4, 8, 128, 16, DType::kF32};  // 256 KiB a block
  const int64_t blocks = spec.BlocksForMemory(int64_t{1} << 30);
  const int64_t before = MinorFaults();
  auto pool = KvPool::Create(spec, blocks);
  ASSERT_TRUE(pool.ok());
  const int64_t after_create = MinorFaults();
  // 1 GiB would be 262,144 pages of 4 KiB.
  EXPECT_LT(after_create - before, 64) << "the pool was touched at creation";
  const int64_t block = blocks / 2;
  const uint8_t* data = (*pool)->LayerBlockData(3, block);
  for (int64_t i = 0; i < spec.LayerBlockBytes(); i += 4096)
    ASSERT_EQ(data[i], 0) << "byte " << i << " of a fresh block";
  std::vector<uint8_t> ones(spec.LayerBlockBytes(), 1);
  const int64_t before_write = MinorFaults();
  ASSERT_TRUE((*pool)->CopyFromHost(3, block, ones.data(), nullptr).ok());
  EXPECT_LT(MinorFaults() - before_write,
            2 * spec.LayerBlockBytes() / 4096 + 16);
  EXPECT_EQ((*pool)->LayerBlockData(3, block)[spec.LayerBlockBytes() - 1], 1);
  EXPECT_EQ((*pool)->LayerBlockData(3, block + 1)[0], 0);
}

}  // namespace
}  // namespace pdserve::engine
