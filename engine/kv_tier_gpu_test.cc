// The host-memory KV tier (--kv-offload-memory) over the CUDA backend's
// device KV storage: its arena comes from KvStorage::AllocateStaging (pinned
// memory there) and blocks move device -> pinned host -> device through
// CopyToHost / CopyFromHost. A block offered, overwritten in the pool and
// loaded back into another pool block has the bytes it had, for every KV
// dtype the device stores (scales included), and a scaled span copied with
// no scale buffer is refused. Needs a CUDA device; skips
// with the reason when none is found.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/cuda_backend.h"
#include "engine/test_util.h"
#include "kv_cache/kv_cache.h"
#include "kv_cache/kv_tier.h"

namespace pdserve::engine {
namespace {

std::string NoGpuReason() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess)
    return std::string("no CUDA device: ") + cudaGetErrorString(error);
  if (count == 0) return "no CUDA device: cudaGetDeviceCount reports 0";
  return "";
}

// Every layer of pool block `block`: data then scales.
std::vector<unsigned char> BlockBytes(KvStorage& s, int64_t block) {
  const KvCacheSpec& spec = s.spec();
  const int64_t data = spec.LayerBlockBytes();
  const int64_t scales = spec.ScaleBytesPerBlock() / spec.num_layers;
  std::vector<unsigned char> out((data + scales) * spec.num_layers);
  for (int32_t l = 0; l < spec.num_layers; ++l) {
    unsigned char* p = out.data() + l * (data + scales);
    EXPECT_TRUE(s.CopyToHost(l, block, p, scales ? p + data : nullptr).ok());
  }
  return out;
}

void FillBlock(KvStorage& s, int64_t block, uint64_t seed) {
  const KvCacheSpec& spec = s.spec();
  const int64_t data = spec.LayerBlockBytes();
  const int64_t scales = spec.ScaleBytesPerBlock() / spec.num_layers;
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> d(data);
  std::vector<float> sc(scales / sizeof(float));
  for (int32_t l = 0; l < spec.num_layers; ++l) {
    for (auto& b : d) b = static_cast<unsigned char>(rng());
    // Finite, positive scales: the device may validate nothing, but keep
    // them plausible.
    for (auto& f : sc) f = 0.5f + static_cast<float>(rng() % 1000) / 1000.0f;
    ASSERT_TRUE(
        s.CopyFromHost(l, block, d.data(), scales ? sc.data() : nullptr).ok());
  }
}

class KvTierGpuTest : public ::testing::TestWithParam<DType> {};

TEST_P(KvTierGpuTest, PinnedMemoryTierRoundTripsDeviceBlocks) {
  if (const std::string reason = NoGpuReason(); !reason.empty())
    GTEST_SKIP() << reason;
  RegisterCudaBackend();
  auto weights = testing::TinyWeights();
  BackendConfig c;
  c.device = Device::kCuda;
  c.kv = {static_cast<int32_t>(weights->config.num_layers),
          static_cast<int32_t>(weights->config.num_kv_heads),
          static_cast<int32_t>(weights->config.head_dim), 16, GetParam()};
  c.gpu_memory_utilization = 0.05;
  c.max_num_batched_tokens = 64;
  auto backend = CreateBackend(weights, c);
  ASSERT_TRUE(backend.ok()) << backend.status();
  KvStorage& storage = *(*backend)->kv_storage();
  ASSERT_EQ(storage.memory().kind, MemoryKind::kDevice);
  ASSERT_GE(storage.num_blocks(), 4);

  KvTierConfig tier;
  tier.memory_bytes = 64 << 20;
  auto t = KvTier::Create(tier, {11, 22}, storage);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ((*t)->kind(), KvTierKind::kHostMemory);
  const BlockHash h0{1, 2}, h1{3, 4};
  FillBlock(storage, 0, 7);
  FillBlock(storage, 1, 8);
  const std::vector<unsigned char> want0 = BlockBytes(storage, 0);
  const std::vector<unsigned char> want1 = BlockBytes(storage, 1);
  EXPECT_TRUE((*t)->Offer(h0, storage, 0));  // stored at once: a move
  EXPECT_TRUE((*t)->Offer(h1, storage, 1));
  // The pool reuses both blocks for something else.
  FillBlock(storage, 0, 9);
  FillBlock(storage, 1, 10);
  const BlockHash chain[] = {h0, h1};
  ASSERT_EQ((*t)->MatchAndPin(chain), 2);
  ASSERT_TRUE((*t)->Load(h0, storage, 2).ok());
  ASSERT_TRUE((*t)->Load(h1, storage, 3).ok());
  EXPECT_EQ(BlockBytes(storage, 2), want0);
  EXPECT_EQ(BlockBytes(storage, 3), want1);
  // A scaled span copied without its scale buffer is refused, both ways,
  // and nothing lands (never int8/fp8 data with stale scales).
  if (DTypeHasScales(GetParam())) {
    std::vector<unsigned char> data(storage.spec().LayerBlockBytes(), 0x5a);
    EXPECT_EQ(storage.CopyFromHost(0, 2, data.data(), nullptr).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(BlockBytes(storage, 2), want0) << "data copied without scales";
    EXPECT_EQ(storage.CopyToHost(0, 2, data.data(), nullptr).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(data[0], 0x5a);
  }
  const KvTierStats s = (*t)->Stats();
  EXPECT_EQ(s.blocks_loaded, 2);
  EXPECT_GT(s.LoadTokensPerSecond(), 0);
  for (int f = 0; f < kNumKvTierFailures; ++f)
    EXPECT_EQ(s.failures[f], 0) << KvTierFailureName(KvTierFailure(f));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, KvTierGpuTest,
                         ::testing::Values(DType::kF32, DType::kBF16,
                                           DType::kI8, DType::kFp8E4M3),
                         [](const auto& info) {
                           return std::to_string(static_cast<int>(info.param));
                         });

}  // namespace
}  // namespace pdserve::engine
