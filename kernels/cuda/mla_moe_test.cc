// GPU tests of the MLA decode kernel (mla_attention.cuh) and the
// grouped-expert MoE path (moe.cuh) against simple float64 CPU references
// written here (the engine's CPU MLA/MoE in model/mla.h and model/moe.h
// compute the same formulas; kernels never include engine). Label gpu; each
// test skips with a printed reason where no CUDA device is present.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cuda/mla_attention.cuh"
#include "kernels/cuda/moe.cuh"
#include "kernels/cuda/test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::DeviceArray;

class MlaDecodeGpuTest : public testing::GpuTest {};

// Latent rows for `blocks` blocks in `dtype` bytes (+ int8 scales: latent
// part, rope part), and the fp32 values the GPU must read back.
struct LatentCache {
  std::vector<uint8_t> bytes;
  std::vector<float> scales;
  std::vector<float> values;  // [blocks, block_size, width] as stored
};

LatentCache MakeCache(std::mt19937* rng, KvDtype dtype, int blocks, int bs,
                      int rank, int rope) {
  const int width = rank + rope;
  LatentCache c;
  c.values = testing::RandomFloats(rng, size_t(blocks) * bs * width);
  c.bytes.resize(c.values.size() * KvDtypeBytes(dtype));
  c.scales.assign(size_t(blocks) * 2, 1.0f);
  if (dtype == KvDtype::kI8) {
    for (int b = 0; b < blocks; ++b) {
      for (int part = 0; part < 2; ++part) {
        float amax = 0;
        for (int t = 0; t < bs; ++t)
          for (int i = part ? rank : 0; i < (part ? width : rank); ++i)
            amax = std::max(
                amax, std::fabs(c.values[(size_t(b) * bs + t) * width + i]));
        c.scales[b * 2 + part] = amax / 127.0f;
      }
    }
  }
  for (size_t i = 0; i < c.values.size(); ++i) {
    const int64_t b = int64_t(i) / (int64_t(bs) * width);
    const bool rope_part = int64_t(i) % width >= rank;
    float& v = c.values[i];
    switch (dtype) {
      case KvDtype::kF32:
        std::memcpy(&c.bytes[i * 4], &v, 4);
        break;
      case KvDtype::kBF16: {
        const uint16_t h = FloatToBf16(v);
        std::memcpy(&c.bytes[i * 2], &h, 2);
        v = Bf16ToFloat(h);
        break;
      }
      case KvDtype::kF16: {
        const uint16_t h = FloatToF16(v);
        std::memcpy(&c.bytes[i * 2], &h, 2);
        v = F16ToFloat(h);
        break;
      }
      case KvDtype::kI8: {
        const float s = c.scales[b * 2 + (rope_part ? 1 : 0)];
        const float q = std::clamp(std::nearbyint(v / s), -127.0f, 127.0f);
        c.bytes[i] = static_cast<uint8_t>(static_cast<int8_t>(q));
        v = q * s;
        break;
      }
      default:
        break;
    }
  }
  return c;
}

TEST_F(MlaDecodeGpuTest, MatchesTheCpuReferenceForEveryKvDtype) {
  const int heads = 4, rank = 512, rope = 64, width = rank + rope, bs = 16;
  const int blocks = 12, max_blocks = 6;
  const std::vector<int32_t> ctx = {1, 17, 70, 96};  // queries' context lengths
  const int queries = static_cast<int>(ctx.size());
  std::vector<int32_t> tables(queries * max_blocks);
  for (int i = 0; i < queries * max_blocks; ++i)
    tables[i] = (i * 5 + 3) % blocks;  // any mapping, shared blocks allowed
  const float scale = 1.0f / std::sqrt(192.0f);
  for (KvDtype dtype :
       {KvDtype::kF32, KvDtype::kBF16, KvDtype::kF16, KvDtype::kI8}) {
    LatentCache c = MakeCache(&rng_, dtype, blocks, bs, rank, rope);
    std::vector<float> q =
        testing::RandomFloats(&rng_, size_t(queries) * heads * width, 0.05f);
    DeviceArray<uint8_t> d_data(c.bytes);
    DeviceArray<float> d_scales(c.scales), d_q(q);
    DeviceArray<int32_t> d_tables(tables), d_ctx(ctx);
    DeviceArray<float> d_out(size_t(queries) * heads * rank);
    MlaLatentView view{
        d_data.get(), dtype == KvDtype::kI8 ? d_scales.get() : nullptr,
        dtype,        rank,
        rope,         bs};
    ASSERT_TRUE(InvokeMlaDecodeAttention(d_q.get(), view, d_tables.get(),
                                         max_blocks, d_ctx.get(), queries,
                                         heads, scale, d_out.get(), stream_)
                    .ok());
    Sync();
    const std::vector<float> got = d_out.Download();
    double worst = 0;
    for (int r = 0; r < queries; ++r) {
      for (int h = 0; h < heads; ++h) {
        const float* qa = &q[(size_t(r) * heads + h) * width];
        std::vector<double> s(ctx[r]);
        double mx = -INFINITY;
        for (int t = 0; t < ctx[r]; ++t) {
          const int b = tables[r * max_blocks + t / bs];
          const float* row = &c.values[(size_t(b) * bs + t % bs) * width];
          double d = 0;
          for (int i = 0; i < width; ++i) d += double(qa[i]) * row[i];
          s[t] = d * scale;
          mx = std::max(mx, s[t]);
        }
        double z = 0;
        for (double& v : s) z += (v = std::exp(v - mx));
        for (int k = 0; k < rank; ++k) {
          double want = 0;
          for (int t = 0; t < ctx[r]; ++t) {
            const int b = tables[r * max_blocks + t / bs];
            want += s[t] / z * c.values[(size_t(b) * bs + t % bs) * width + k];
          }
          worst = std::max(
              worst, std::fabs(want - got[(size_t(r) * heads + h) * rank + k]));
        }
      }
    }
    EXPECT_LT(worst, 1e-4) << KvDtypeName(dtype);
  }
}

TEST_F(MlaDecodeGpuTest, RefusesFp8AndOversizedRanks) {
  MlaLatentView view{nullptr, nullptr, KvDtype::kFp8E4M3, 512, 64, 16};
  EXPECT_EQ(InvokeMlaDecodeAttention(nullptr, view, nullptr, 1, nullptr, 1, 1,
                                     1.0f, nullptr, stream_)
                .code(),
            absl::StatusCode::kInvalidArgument);
  view.dtype = KvDtype::kBF16;
  view.kv_lora_rank = 4096;
  EXPECT_EQ(InvokeMlaDecodeAttention(nullptr, view, nullptr, 1, nullptr, 1, 1,
                                     1.0f, nullptr, stream_)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

class GroupedMoeGpuTest : public testing::GpuTest {};

TEST_F(GroupedMoeGpuTest, MatchesPerTokenMathAndIsBatchInvariant) {
  const int m = 37, k = 2, hidden = 64, inter = 48, experts = 8;
  std::vector<float> x = testing::RandomFloats(&rng_, size_t(m) * hidden);
  std::vector<float> gate_up = testing::RandomFloats(
      &rng_, size_t(experts) * 2 * inter * hidden, 1.0f / 8);
  std::vector<float> down =
      testing::RandomFloats(&rng_, size_t(experts) * hidden * inter, 1.0f / 7);
  std::vector<int32_t> route(m * k);
  std::vector<float> weights(m * k);
  for (int t = 0; t < m; ++t) {
    route[t * k] = (t * 3) % experts;
    route[t * k + 1] = (t * 5 + 1) % experts == route[t * k]
                           ? (t * 5 + 2) % experts
                           : (t * 5 + 1) % experts;
    weights[t * k] = 0.7f;
    weights[t * k + 1] = 0.3f;
  }
  auto run = [&](int rows, const float* xs, const int32_t* rs,
                 const float* ws) {
    DeviceArray<float> d_x(std::vector<float>(xs, xs + size_t(rows) * hidden));
    DeviceArray<int32_t> d_r(std::vector<int32_t>(rs, rs + rows * k));
    DeviceArray<float> d_w(std::vector<float>(ws, ws + rows * k));
    DeviceArray<float> d_gu(gate_up), d_dn(down), d_y(size_t(rows) * hidden);
    const int64_t bytes =
        GroupedMoeWorkspaceBytes(rows, k, hidden, inter, experts);
    DeviceArray<uint8_t> d_ws(bytes);
    EXPECT_TRUE(InvokeGroupedMoe(d_x.get(), d_r.get(), d_w.get(), d_gu.get(),
                                 d_dn.get(), rows, k, hidden, inter, experts,
                                 d_ws.get(), bytes, d_y.get(), stream_)
                    .ok());
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    return d_y.Download();
  };
  const std::vector<float> batched =
      run(m, x.data(), route.data(), weights.data());
  double worst = 0;
  for (int t = 0; t < m; ++t) {
    // Alone: the same bits as in the batch.
    const std::vector<float> alone =
        run(1, &x[size_t(t) * hidden], &route[t * k], &weights[t * k]);
    for (int h = 0; h < hidden; ++h)
      ASSERT_EQ(alone[h], batched[size_t(t) * hidden + h]) << t << " " << h;
    for (int h = 0; h < hidden; ++h) {
      double want = 0;
      for (int r = 0; r < k; ++r) {
        const int e = route[t * k + r];
        double out = 0;
        for (int j = 0; j < inter; ++j) {
          double g = 0, u = 0;
          for (int c = 0; c < hidden; ++c) {
            const double xv = x[size_t(t) * hidden + c];
            g += xv * gate_up[(size_t(e) * 2 * inter + j) * hidden + c];
            u += xv * gate_up[(size_t(e) * 2 * inter + inter + j) * hidden + c];
          }
          out += g / (1 + std::exp(-g)) * u *
                 down[(size_t(e) * hidden + h) * inter + j];
        }
        want += weights[t * k + r] * out;
      }
      worst =
          std::max(worst, std::fabs(want - batched[size_t(t) * hidden + h]));
    }
  }
  EXPECT_LT(worst, 1e-3);
}

}  // namespace
}  // namespace pdserve::kernels::cuda
