// reshape_and_cache on the GPU against the CPU's WriteKv: fp32/fp16/bf16 and
// int8 bytes and scales must be identical (the GPU follows the CPU's
// arithmetic step for step); fp8-e4m3, which has no CPU path, must decode to
// within its precision of the input. Writing a prompt in one call or one
// token per call must give the same cache (prefill == decode).
#include "kernels/cuda/cache.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/paged_attention.h"
#include "kernels/cuda/test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::DeviceArray;
using testing::DeviceKvLayer;

constexpr int kKvHeads = 2;
constexpr int kHeadDim = 64;
constexpr int kBlockSize = 16;
constexpr int kBlocks = 12;
constexpr int kRow = kKvHeads * kHeadDim;

// Three sequences: prompts of 37, 16 and 5 tokens, then 4 decode steps.
// Returns calls of (slots, k, v) in order.
struct Call {
  std::vector<int64_t> slots;
  std::vector<float> k, v;
};

std::vector<Call> MakeCalls(std::mt19937* rng, bool one_token_per_call) {
  const int tables[3][4] = {{7, 2, 9, 4}, {0, 11, 5, 1}, {3, 10, 6, 8}};
  const int prompt[3] = {37, 16, 5};
  // Large magnitudes now and then, so int8/fp8 scales must grow mid-block.
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::uniform_int_distribution<int> spike(0, 9);
  auto token = [&](Call* c, int seq, int pos) {
    c->slots.push_back(int64_t{tables[seq][pos / kBlockSize]} * kBlockSize +
                       pos % kBlockSize);
    for (int i = 0; i < kRow; ++i) {
      const float m = spike(*rng) == 0 ? 8.0f : 1.0f;
      c->k.push_back(dist(*rng) * m);
      c->v.push_back(dist(*rng) * m);
    }
  };
  std::vector<Call> calls;
  Call prefill;
  for (int s = 0; s < 3; ++s) {
    for (int p = 0; p < prompt[s]; ++p) {
      if (one_token_per_call) {
        Call c;
        token(&c, s, p);
        calls.push_back(std::move(c));
      } else {
        token(&prefill, s, p);
      }
    }
  }
  if (!one_token_per_call) calls.push_back(std::move(prefill));
  for (int step = 0; step < 4; ++step) {
    Call c;
    for (int s = 0; s < 3; ++s) token(&c, s, prompt[s] + step);
    calls.push_back(std::move(c));
  }
  return calls;
}

class ReshapeAndCacheTest : public testing::GpuTest {
 protected:
  void RunGpu(const std::vector<Call>& calls, DeviceKvLayer* layer) {
    for (const Call& c : calls) {
      DeviceArray<float> k(c.k), v(c.v);
      DeviceArray<int64_t> slots(c.slots);
      ASSERT_TRUE(InvokeReshapeAndCache(k.get(), v.get(), slots.get(),
                                        static_cast<int64_t>(c.slots.size()),
                                        layer->view, stream_)
                      .ok());
      Sync();
    }
  }
};

TEST_F(ReshapeAndCacheTest, MatchesCpuWriteKvBytesAndScales) {
  const std::vector<Call> calls = MakeCalls(&rng_, false);
  const struct {
    KvDtype gpu;
    DType cpu;
  } cases[] = {{KvDtype::kF32, DType::kF32},
               {KvDtype::kF16, DType::kF16},
               {KvDtype::kBF16, DType::kBF16},
               {KvDtype::kI8, DType::kI8}};
  for (const auto& c : cases) {
    DeviceKvLayer layer(c.gpu, kBlocks, kKvHeads, kBlockSize, kHeadDim);
    RunGpu(calls, &layer);
    std::vector<uint8_t> cpu_data(static_cast<size_t>(layer.view.LayerBytes()));
    std::vector<float> cpu_scales(kBlocks * 2 * kKvHeads, 0.0f);
    kernels::KvLayerView view;
    view.data = cpu_data.data();
    view.scales = c.cpu == DType::kI8 ? cpu_scales.data() : nullptr;
    view.dtype = c.cpu;
    view.num_kv_heads = kKvHeads;
    view.head_dim = kHeadDim;
    view.block_size = kBlockSize;
    for (const Call& call : calls) {
      kernels::WriteKv(call.k.data(), call.v.data(),
                       static_cast<int64_t>(call.slots.size()),
                       call.slots.data(), view);
    }
    EXPECT_EQ(layer.data.Download(), cpu_data) << KvDtypeName(c.gpu);
    if (c.cpu == DType::kI8) {
      EXPECT_EQ(layer.scales.Download(), cpu_scales);
    }
  }
}

TEST_F(ReshapeAndCacheTest, Fp8DecodesWithinItsPrecision) {
  const std::vector<Call> calls = MakeCalls(&rng_, false);
  DeviceKvLayer layer(KvDtype::kFp8E4M3, kBlocks, kKvHeads, kBlockSize,
                      kHeadDim);
  RunGpu(calls, &layer);
  const std::vector<float> decoded = layer.DecodeToFloat();
  const std::vector<float> scales = layer.scales.Download();
  const int64_t span = int64_t{kBlockSize} * kHeadDim;
  for (const Call& c : calls) {
    for (size_t t = 0; t < c.slots.size(); ++t) {
      const int64_t block = c.slots[t] / kBlockSize;
      const int64_t off = c.slots[t] % kBlockSize;
      for (int kv = 0; kv < 2; ++kv) {
        for (int h = 0; h < kKvHeads; ++h) {
          const int64_t base = ((block * 2 + kv) * kKvHeads + h) * span;
          const float s = scales[(block * 2 + kv) * kKvHeads + h];
          for (int d = 0; d < kHeadDim; ++d) {
            const float x = (kv == 0 ? c.k : c.v)[t * kRow + h * kHeadDim + d];
            const float got = decoded[base + off * kHeadDim + d];
            // 3 mantissa bits (half-ulp 1/16 relative), rounded again at each
            // of the block's scale growths (a few per block here), plus the
            // subnormal step 2^-9 of the scale's range.
            ASSERT_LE(std::fabs(got - x), 0.35f * std::fabs(x) + s * 0.008f)
                << "block " << block << " offset " << off << " kv " << kv
                << " head " << h << " dim " << d;
          }
        }
      }
    }
  }
}

TEST_F(ReshapeAndCacheTest, OneTokenPerCallEqualsWholePromptAtOnce) {
  for (KvDtype dtype : testing::kAllKvDtypes) {
    std::mt19937 rng_a(7), rng_b(7);
    const std::vector<Call> whole = MakeCalls(&rng_a, false);
    const std::vector<Call> single = MakeCalls(&rng_b, true);
    DeviceKvLayer a(dtype, kBlocks, kKvHeads, kBlockSize, kHeadDim);
    DeviceKvLayer b(dtype, kBlocks, kKvHeads, kBlockSize, kHeadDim);
    RunGpu(whole, &a);
    RunGpu(single, &b);
    EXPECT_EQ(a.data.Download(), b.data.Download()) << KvDtypeName(dtype);
    if (KvDtypeHasScales(dtype)) {
      EXPECT_EQ(a.scales.Download(), b.scales.Download()) << KvDtypeName(dtype);
    }
  }
}

TEST_F(ReshapeAndCacheTest, NegativeSlotsAreSkipped) {
  DeviceKvLayer layer(KvDtype::kBF16, 2, 1, 16, 16);
  DeviceArray<float> k(std::vector<float>(32, 1.0f)),
      v(std::vector<float>(32, 2.0f));
  DeviceArray<int64_t> slots(std::vector<int64_t>{-1, 3});
  ASSERT_TRUE(InvokeReshapeAndCache(k.get(), v.get(), slots.get(), 2,
                                    layer.view, stream_)
                  .ok());
  Sync();
  const std::vector<float> decoded = layer.DecodeToFloat();
  for (int64_t i = 0; i < static_cast<int64_t>(decoded.size()); ++i) {
    const int64_t kv = (i / (16 * 16)) % 2;
    const int64_t slot = (i / 16) % 16;
    const float want =
        slot == 3 && i < 2 * 16 * 16 ? (kv == 0 ? 1.0f : 2.0f) : 0.0f;
    ASSERT_EQ(decoded[i], want) << i;
  }
}

}  // namespace
}  // namespace pdserve::kernels::cuda
