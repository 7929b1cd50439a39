#include "kernels/cpu/ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <random>
#include <vector>

namespace pdserve::kernels {
namespace {

class OpsTest : public ::testing::Test {
 protected:
  std::vector<float> Random(size_t n) {
    std::normal_distribution<float> dist;
    std::vector<float> v(n);
    for (auto& x : v) x = dist(rng_);
    return v;
  }
  std::mt19937 rng_{3};
};

TEST_F(OpsTest, RmsNormNormalisesAndFusesResidual) {
  const int64_t rows = 3, dim = 10;
  auto x = Random(rows * dim), w = Random(dim), res = Random(rows * dim);
  auto res_copy = res;
  std::vector<float> out(rows * dim), out2(rows * dim);
  RmsNorm(x.data(), res.data(), w.data(), rows, dim, 1e-5f, out.data());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < dim; ++i) {
      const double s = double(x[r * dim + i]) + res_copy[r * dim + i];
      EXPECT_FLOAT_EQ(res[r * dim + i], float(s));
      ss += s * s;
    }
    const double inv = 1 / std::sqrt(ss / dim + 1e-5);
    for (int64_t i = 0; i < dim; ++i) {
      EXPECT_NEAR(out[r * dim + i], res[r * dim + i] * inv * w[i], 1e-5);
    }
  }
  RmsNorm(res.data(), nullptr, w.data(), rows, dim, 1e-5f, out2.data());
  EXPECT_EQ(out, out2);
}

TEST_F(OpsTest, RopeRotatesHalvesByPositionAndKeepsNorm) {
  const int64_t heads = 2, hd = 8;
  auto x = Random(2 * heads * hd);
  auto orig = x;
  const int32_t pos[] = {0, 5};
  auto inv = RopeInvFreq(hd, 10000.0, {});
  ApplyRope(x.data(), 2, heads, hd, pos, inv.data());
  for (int64_t i = 0; i < heads * hd; ++i)
    EXPECT_FLOAT_EQ(x[i], orig[i]);  // position 0
  for (int64_t h = 0; h < heads; ++h) {
    const float* a = orig.data() + (heads + h) * hd;
    const float* b = x.data() + (heads + h) * hd;
    for (int64_t i = 0; i < hd / 2; ++i) {
      const double ang = 5.0 * std::pow(10000.0, -2.0 * i / hd);
      EXPECT_NEAR(b[i], a[i] * std::cos(ang) - a[i + hd / 2] * std::sin(ang),
                  1e-5);
      EXPECT_NEAR(b[i + hd / 2],
                  a[i + hd / 2] * std::cos(ang) + a[i] * std::sin(ang), 1e-5);
    }
  }
}

TEST_F(OpsTest, Llama3RopeScalingSlowsOnlyLowFrequencies) {
  RopeScaling s{.factor = 8,
                .low_freq_factor = 1,
                .high_freq_factor = 4,
                .original_max_position_embeddings = 8192};
  auto plain = RopeInvFreq(128, 500000.0, {});
  auto scaled = RopeInvFreq(128, 500000.0, s);
  EXPECT_FLOAT_EQ(scaled[0], plain[0]);  // highest frequency kept
  EXPECT_FLOAT_EQ(scaled.back(),
                  plain.back() / 8.0f);  // lowest slowed by factor
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_LE(scaled[i], plain[i] * 1.000001f);
    EXPECT_GE(scaled[i], plain[i] / 8.0f * 0.999999f);
  }
}

TEST_F(OpsTest, SiluAndMulAndSoftmax) {
  std::vector<float> gu = {1.0f, -2.0f, 3.0f, 4.0f};  // gate {1,-2}, up {3,4}
  std::vector<float> out(2);
  SiluAndMul(gu.data(), 1, 2, out.data());
  EXPECT_NEAR(out[0], 1.0 / (1 + std::exp(-1.0)) * 3, 1e-6);
  EXPECT_NEAR(out[1], -2.0 / (1 + std::exp(2.0)) * 4, 1e-6);
  std::vector<float> p = {1000.0f, 1000.0f, -1e30f};
  SoftmaxInPlace(p.data(), 3);
  EXPECT_FLOAT_EQ(p[0], 0.5f);
  EXPECT_FLOAT_EQ(p[2], 0.0f);
}

}  // namespace
}  // namespace pdserve::kernels
