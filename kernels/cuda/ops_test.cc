// RMSNorm (plain, fused residual, in place), RoPE (plain and Llama-3
// scaled frequencies) and SiLU-and-mul on the GPU against kernels/cpu/ops.h.
// The GPU mirrors the CPU's operations without fused multiply-adds, so the
// only differences are libm vs CUDA cos/sin/exp (<= 2 ulp) and the order of
// RMSNorm's double sum: tolerance 1e-5 relative + 1e-6 absolute.
#include "kernels/cuda/ops.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cuda/test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::DeviceArray;

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                 const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-6f + 1e-5f * std::fabs(want[i]))
        << what << " element " << i;
  }
}

class CudaOpsTest : public testing::GpuTest {};

TEST_F(CudaOpsTest, RmsNormMatchesCpuWithAndWithoutResidual) {
  for (int64_t dim : {16, 64, 4096, 5000}) {
    const int64_t rows = 7;
    const auto x = testing::RandomFloats(&rng_, rows * dim, 3.0f);
    const auto res = testing::RandomFloats(&rng_, rows * dim);
    const auto w = testing::RandomFloats(&rng_, dim);
    std::vector<float> want(rows * dim), want_res = res;
    kernels::RmsNorm(x.data(), nullptr, w.data(), rows, dim, 1e-5f,
                     want.data());
    DeviceArray<float> dx(x), dres(res), dw(w), dout(rows * dim);
    ASSERT_TRUE(InvokeRmsNorm(dx.get(), nullptr, dw.get(), rows, dim, 1e-5f,
                              dout.get(), stream_)
                    .ok());
    Sync();
    ExpectClose(dout.Download(), want, "rms_norm");

    kernels::RmsNorm(x.data(), want_res.data(), w.data(), rows, dim, 1e-6f,
                     want.data());
    ASSERT_TRUE(InvokeRmsNorm(dx.get(), dres.get(), dw.get(), rows, dim, 1e-6f,
                              dout.get(), stream_)
                    .ok());
    Sync();
    ExpectClose(dout.Download(), want, "rms_norm fused");
    ExpectClose(dres.Download(), want_res, "rms_norm residual");

    // In place (Qwen3's per-head q/k norm).
    kernels::RmsNorm(x.data(), nullptr, w.data(), rows, dim, 1e-5f,
                     want.data());
    dx.Upload(x);
    ASSERT_TRUE(InvokeRmsNorm(dx.get(), nullptr, dw.get(), rows, dim, 1e-5f,
                              dx.get(), stream_)
                    .ok());
    Sync();
    ExpectClose(dx.Download(), want, "rms_norm in place");
  }
}

TEST_F(CudaOpsTest, RopeMatchesCpuForPlainAndLlama3Scaling) {
  kernels::RopeScaling llama3;
  llama3.factor = 8;
  llama3.low_freq_factor = 1;
  llama3.high_freq_factor = 4;
  llama3.original_max_position_embeddings = 8192;
  for (const kernels::RopeScaling& scaling : {kernels::RopeScaling{}, llama3}) {
    for (int64_t hd : {16, 64, 128}) {
      const int64_t rows = 9, heads = 3;
      const std::vector<float> inv =
          kernels::RopeInvFreq(hd, 500000.0, scaling);
      std::vector<int32_t> pos = {0, 1, 2, 17, 255, 1000, 4096, 32767, 131071};
      auto x = testing::RandomFloats(&rng_, rows * heads * hd);
      DeviceArray<float> dx(x), dinv(inv);
      DeviceArray<int32_t> dpos(pos);
      kernels::ApplyRope(x.data(), rows, heads, hd, pos.data(), inv.data());
      ASSERT_TRUE(
          InvokeRope(dx.get(), rows, heads, hd, dpos.get(), dinv.get(), stream_)
              .ok());
      Sync();
      // cos/sin of large angles amplify 1-ulp argument differences; the
      // angle itself is computed identically, so 1e-5 still holds.
      ExpectClose(dx.Download(), x, "rope");
    }
  }
}

TEST_F(CudaOpsTest, SiluAndMulMatchesCpu) {
  const int64_t rows = 5, inter = 1000;
  const auto gu = testing::RandomFloats(&rng_, rows * 2 * inter, 4.0f);
  std::vector<float> want(rows * inter);
  kernels::SiluAndMul(gu.data(), rows, inter, want.data());
  DeviceArray<float> dgu(gu), dout(rows * inter);
  ASSERT_TRUE(
      InvokeSiluAndMul(dgu.get(), rows, inter, dout.get(), stream_).ok());
  Sync();
  ExpectClose(dout.Download(), want, "silu_and_mul");
}

TEST_F(CudaOpsTest, SplitQkvAddsBiasAndGatherRowsLooksUp) {
  const int64_t rows = 3, qd = 8, kvd = 4, width = qd + 2 * kvd;
  const auto qkv = testing::RandomFloats(&rng_, rows * width);
  const auto bias = testing::RandomFloats(&rng_, width);
  DeviceArray<float> dqkv(qkv), dbias(bias), dq(rows * qd), dk(rows * kvd),
      dv(rows * kvd);
  ASSERT_TRUE(InvokeSplitQkv(dqkv.get(), dbias.get(), rows, qd, kvd, dq.get(),
                             dk.get(), dv.get(), stream_)
                  .ok());
  Sync();
  const auto q = dq.Download(), k = dk.Download(), v = dv.Download();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < width; ++c) {
      const float want = qkv[r * width + c] + bias[c];
      const float got = c < qd         ? q[r * qd + c]
                        : c < qd + kvd ? k[r * kvd + c - qd]
                                       : v[r * kvd + c - qd - kvd];
      ASSERT_EQ(got, want) << r << "," << c;
    }
  }
  const auto table = testing::RandomFloats(&rng_, 10 * 6);
  DeviceArray<float> dt(table), dout(3 * 6);
  DeviceArray<int32_t> ids(std::vector<int32_t>{4, 0, 9});
  ASSERT_TRUE(
      InvokeGatherRows(dt.get(), 10, 6, ids.get(), 3, dout.get(), stream_)
          .ok());
  Sync();
  const auto out = dout.Download();
  const int want_rows[] = {4, 0, 9};
  for (int r = 0; r < 3; ++r) {
    for (int i = 0; i < 6; ++i)
      ASSERT_EQ(out[r * 6 + i], table[want_rows[r] * 6 + i]);
  }
}

}  // namespace
}  // namespace pdserve::kernels::cuda
