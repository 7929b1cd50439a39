// cuBLAS linear layers against kernels/cpu/matmul.h. fp32 (no TF32) agrees
// to float rounding: 1e-4 relative to the row's magnitude. bf16 is compared
// with the CPU product of the bf16-rounded inputs: 1e-3 relative (only the
// fp32 accumulation order differs).
#include "kernels/cuda/gemm.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cuda/test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::DeviceArray;

class CudaGemmTest : public testing::GpuTest {};

TEST_F(CudaGemmTest, Fp32AndBf16MatchTheCpuProduct) {
  auto gemm = GemmRunner::Create(stream_);
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  for (auto [m, k, n] : {std::tuple<int64_t, int64_t, int64_t>{1, 64, 160},
                         {7, 512, 1408},
                         {33, 1000, 300}}) {
    const auto x = testing::RandomFloats(&rng_, m * k);
    const auto w = testing::RandomFloats(&rng_, n * k);
    std::vector<float> want(m * n);
    kernels::MatMulNT(x.data(), m, k, w.data(), n, want.data());
    DeviceArray<float> dx(x), dw(w), dy(m * n);
    ASSERT_TRUE(
        (*gemm)
            ->MatMulNT(dx.get(), m, k, dw.get(), n, GemmDtype::kF32, dy.get())
            .ok());
    Sync();
    const float bound = 1e-4f * std::sqrt(static_cast<float>(k));
    auto got = dy.Download();
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_NEAR(got[i], want[i], bound) << "fp32 element " << i;

    std::vector<uint16_t> wb(w.size());
    std::vector<float> xr(x.size()), wr(w.size());
    for (size_t i = 0; i < w.size(); ++i) {
      wb[i] = FloatToBf16(w[i]);
      wr[i] = Bf16ToFloat(wb[i]);
    }
    for (size_t i = 0; i < x.size(); ++i)
      xr[i] = Bf16ToFloat(FloatToBf16(x[i]));
    kernels::MatMulNT(xr.data(), m, k, wr.data(), n, want.data());
    DeviceArray<uint16_t> dwb(wb);
    ASSERT_TRUE(
        (*gemm)
            ->MatMulNT(dx.get(), m, k, dwb.get(), n, GemmDtype::kBf16, dy.get())
            .ok());
    Sync();
    got = dy.Download();
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_NEAR(got[i], want[i], 1e-3f * std::sqrt(static_cast<float>(k)))
          << "bf16 element " << i;
  }
}

}  // namespace
}  // namespace pdserve::kernels::cuda
