#include "kv_cache/kv_cache.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace pdserve::engine
