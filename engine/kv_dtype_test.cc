// The fp8 (e4m3) KV dtype on the host side: how it is spelled and sized, that
// the CPU refuses it with a message naming the fix, that its blocks never
// share prefix hashes with other dtypes', and that a host pool of it keeps
// its per-(block, head) scales (the bytes transfers move).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "common/dtype.h"
#include "engine/backend.h"
#include "engine/engine.h"
#include "kv_cache/block_manager.h"
#include "kv_cache/kv_cache.h"

namespace pdserve::engine {
namespace {

using ::testing::HasSubstr;

TEST(KvDtypeTest, Fp8IsSpelledAndSizedAsAOneByteScaledDtype) {
  for (const char* name : {"fp8", "fp8_e4m3", "fp8e4m3", "e4m3"})
    EXPECT_EQ(ParseDType(name), DType::kFp8E4M3) << name;
  EXPECT_STREQ(DTypeName(DType::kFp8E4M3), "fp8");
  EXPECT_EQ(ParseDType(DTypeName(DType::kFp8E4M3)), DType::kFp8E4M3);
  EXPECT_EQ(DTypeBytes(DType::kFp8E4M3), 1u);
  EXPECT_TRUE(DTypeHasScales(DType::kFp8E4M3));
  EXPECT_TRUE(DTypeHasScales(DType::kI8));
  EXPECT_FALSE(DTypeHasScales(DType::kBF16));
  EXPECT_FALSE(ParseDType("fp4").has_value());
}

TEST(KvDtypeTest, Fp8BudgetIsOneBytePerElementPlusScales) {
  // Llama-3.2-1B's KV geometry: 16 layers, 8 KV heads, head_dim 64.
  KvCacheSpec fp8{16, 8, 64, 16, DType::kFp8E4M3};
  EXPECT_EQ(fp8.BytesPerToken(), 2 * 16 * 8 * 64);
  EXPECT_EQ(fp8.LayerBlockBytes(), 2 * 8 * 16 * 64);
  EXPECT_EQ(fp8.ScaleBytesPerBlock(), 2 * 16 * 8 * 4);
  EXPECT_EQ(fp8.BytesPerBlock(), 16 * 2 * 16 * 8 * 64 + 2 * 16 * 8 * 4);
  KvCacheSpec bf16 = fp8;
  bf16.dtype = DType::kBF16;
  // Half of bf16's bytes, plus the scales.
  EXPECT_EQ(2 * (fp8.BytesPerBlock() - fp8.ScaleBytesPerBlock()),
            bf16.BytesPerBlock());
  KvCacheSpec i8 = fp8;
  i8.dtype = DType::kI8;
  EXPECT_EQ(fp8.BytesPerBlock(), i8.BytesPerBlock());
}

TEST(KvDtypeTest, CpuRefusesFp8WithTheFix) {
  const absl::Status s = CheckKvDtypeForDevice(Device::kCpu, DType::kFp8E4M3);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("--device cuda"));
  EXPECT_THAT(s.message(), HasSubstr("--kv-dtype int8"));
  EXPECT_TRUE(CheckKvDtypeForDevice(Device::kCuda, DType::kFp8E4M3).ok());
  EXPECT_TRUE(CheckKvDtypeForDevice(Device::kCpu, DType::kI8).ok());

  EngineConfig config;
  config.kv_dtype = DType::kFp8E4M3;
  EXPECT_EQ(config.Validate().code(), absl::StatusCode::kInvalidArgument);
  config.device = Device::kCuda;
  EXPECT_TRUE(config.Validate().ok()) << config.Validate();

  // A caller that skips EngineConfig still cannot build a CPU fp8 backend.
  BackendConfig backend;
  backend.kv = {2, 2, 16, 16, DType::kFp8E4M3};
  auto created = CreateBackend(nullptr, backend);
  EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(created.status().message(), HasSubstr("--device cuda"));
}

TEST(KvDtypeTest, Fp8BlocksNeverShareHashesWithOtherDtypes) {
  const ModelFingerprint weights = {0x1234, 0x5678};
  std::set<ModelFingerprint> fingerprints;
  for (DType t :
       {DType::kF32, DType::kF16, DType::kBF16, DType::kI8, DType::kFp8E4M3}) {
    fingerprints.insert(Engine::CacheFingerprint(weights, 16, t));
  }
  EXPECT_EQ(fingerprints.size(), 5u);
  // Deterministic: the same parts give the same identity.
  EXPECT_EQ(Engine::CacheFingerprint(weights, 16, DType::kFp8E4M3),
            Engine::CacheFingerprint(weights, 16, DType::kFp8E4M3));

  std::vector<int32_t> tokens(32);
  for (int i = 0; i < 32; ++i) tokens[i] = 7 * i + 1;
  std::vector<BlockHash> fp8, i8;
  ExtendBlockHashes(Engine::CacheFingerprint(weights, 16, DType::kFp8E4M3), "",
                    tokens, 16, &fp8);
  ExtendBlockHashes(Engine::CacheFingerprint(weights, 16, DType::kI8), "",
                    tokens, 16, &i8);
  ASSERT_EQ(fp8.size(), 2u);
  ASSERT_EQ(i8.size(), 2u);
  EXPECT_FALSE(fp8[0] == i8[0]);
  EXPECT_FALSE(fp8[1] == i8[1]);
}

TEST(KvDtypeTest, HostPoolOfFp8KeepsScalesPerBlockAndHead) {
  const KvCacheSpec spec{2, 3, 16, 4, DType::kFp8E4M3};
  auto pool = KvPool::Create(spec, 5);
  ASSERT_TRUE(pool.ok()) << pool.status();
  const KvSpan span = (*pool)->Span(1, 4);
  EXPECT_EQ(span.data_bytes, static_cast<size_t>(spec.LayerBlockBytes()));
  ASSERT_NE(span.scales, nullptr);
  EXPECT_EQ(span.scale_bytes, 2 * 3 * sizeof(float));
  // Bytes and scales round-trip through the host copies unchanged.
  std::vector<uint8_t> data(span.data_bytes);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i);
  const std::vector<float> scales = {0.5f, 1.5f, 2.5f, 3.5f, 4.5f, 5.5f};
  ASSERT_TRUE((*pool)->CopyFromHost(1, 4, data.data(), scales.data()).ok());
  std::vector<uint8_t> data_out(span.data_bytes);
  std::vector<float> scales_out(6);
  ASSERT_TRUE(
      (*pool)->CopyToHost(1, 4, data_out.data(), scales_out.data()).ok());
  EXPECT_EQ(data_out, data);
  EXPECT_EQ(scales_out, scales);
}

}  // namespace
}  // namespace pdserve::engine
