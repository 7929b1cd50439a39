#include "kernels/cpu/ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <numbers>
#include <random>
#include <utility>
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

TEST_F(OpsTest, RmsNormEveryInstructionSetGivesTheSameBits) {
  // Widths with tails for 8 and 16 lanes and one under 8; with the residual
  // fused, without, and in place (out == x, as the per-head norms run).
  for (const int64_t dim :
       {int64_t{5}, int64_t{37}, int64_t{64}, int64_t{2048 + 13}}) {
    const int64_t rows = 19;  // over 16: the rows run on every thread
    const auto x = Random(rows * dim), w = Random(dim),
               res0 = Random(rows * dim);
    struct Result {
      std::vector<float> fused, residual, plain, in_place;
    };
    auto run = [&] {
      Result r;
      r.residual = res0;
      r.fused.resize(rows * dim);
      r.plain.resize(rows * dim);
      RmsNorm(x.data(), r.residual.data(), w.data(), rows, dim, 1e-5f,
              r.fused.data());
      RmsNorm(x.data(), nullptr, w.data(), rows, dim, 1e-5f, r.plain.data());
      r.in_place = x;
      RmsNorm(r.in_place.data(), nullptr, w.data(), rows, dim, 1e-5f,
              r.in_place.data());
      return r;
    };
    ASSERT_TRUE(SetOpsIsa(OpsIsa::kPortable));
    const Result want = run();
    EXPECT_EQ(want.in_place, want.plain);
    for (OpsIsa isa : {OpsIsa::kAvx2, OpsIsa::kAvx512}) {
      if (!SetOpsIsa(isa)) {
        std::printf("[ note ] this CPU lacks %s: not compared\n",
                    isa == OpsIsa::kAvx2 ? "AVX2+FMA" : "AVX-512F");
        continue;
      }
      const Result got = run();
      const char* name = isa == OpsIsa::kAvx2 ? "avx2" : "avx512";
      const std::pair<const std::vector<float>*, const std::vector<float>*>
          pairs[] = {{&got.residual, &want.residual},
                     {&got.fused, &want.fused},
                     {&got.plain, &want.plain},
                     {&got.in_place, &want.in_place}};
      for (size_t p = 0; p < std::size(pairs); ++p) {
        const auto& [a, b] = pairs[p];
        EXPECT_EQ(0, std::memcmp(a->data(), b->data(), b->size() * 4))
            << name << " dim " << dim << " output " << p;
      }
    }
    ASSERT_TRUE(SetOpsIsa(OpsIsa::kBest));
  }
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

TEST_F(OpsTest, RopeOnQueriesAndKeysTogetherMatchesEachAlone) {
  const int64_t rows = 21, q_heads = 4, k_heads = 2, hd = 64;
  const auto q = Random(rows * q_heads * hd), k = Random(rows * k_heads * hd);
  std::vector<int32_t> pos(rows);
  for (int64_t r = 0; r < rows; ++r) pos[r] = static_cast<int32_t>(r * 37 + 3);
  const auto inv = RopeInvFreq(hd, 500000.0, {});
  auto q1 = q, k1 = k, q2 = q, k2 = k;
  ApplyRope(q1.data(), rows, q_heads, hd, pos.data(), inv.data());
  ApplyRope(k1.data(), rows, k_heads, hd, pos.data(), inv.data());
  ApplyRope(q2.data(), q_heads, k2.data(), k_heads, rows, hd, pos.data(),
            inv.data());
  EXPECT_EQ(q1, q2);
  EXPECT_EQ(k1, k2);
  EXPECT_NE(q1, q);
  EXPECT_NE(k1, k);
}

TEST_F(OpsTest, SplitQkvCopiesEachPartAndAddsTheBias) {
  const int64_t rows = 40, q_dim = 8, kv_dim = 4, qkv_dim = q_dim + 2 * kv_dim;
  const auto qkv0 = Random(rows * qkv_dim), bias = Random(qkv_dim);
  for (const bool with_bias : {false, true}) {
    auto qkv = qkv0;
    std::vector<float> q(rows * q_dim), k(rows * kv_dim), v(rows * kv_dim);
    SplitQkv(qkv.data(), with_bias ? bias.data() : nullptr, rows, q_dim, kv_dim,
             q.data(), k.data(), v.data());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < qkv_dim; ++i) {
        const float want = qkv0[r * qkv_dim + i] + (with_bias ? bias[i] : 0.0f);
        ASSERT_EQ(qkv[r * qkv_dim + i], want) << r << " " << i;
        const float got = i < q_dim ? q[r * q_dim + i]
                          : i < q_dim + kv_dim
                              ? k[r * kv_dim + i - q_dim]
                              : v[r * kv_dim + i - q_dim - kv_dim];
        ASSERT_EQ(got, want) << r << " " << i;
      }
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

TEST_F(OpsTest, SiluEveryInstructionSetGivesTheSameBitsNearExactSilu) {
  // Rows of 37 (tails for 16 and 8 lanes) over [-100, 100], plus the edges.
  const int64_t rows = 40, inter = 37;
  std::vector<float> gu(rows * 2 * inter);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> wide(-100.0f, 100.0f);
  std::normal_distribution<float> narrow(0.0f, 3.0f);
  for (size_t i = 0; i < gu.size(); ++i)
    gu[i] = i % 3 ? narrow(rng) : wide(rng);
  const float inf = std::numeric_limits<float>::infinity();
  const float edges[] = {0.0f,  -0.0f,  1e-30f, -1e-30f, 87.5f, -87.5f,
                         88.0f, -88.0f, inf,    -inf,    1e30f, -1e30f};
  for (size_t i = 0; i < std::size(edges); ++i) gu[i] = edges[i];
  gu[20] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_TRUE(SetOpsIsa(OpsIsa::kPortable));
  std::vector<float> portable(rows * inter);
  SiluAndMul(gu.data(), rows, inter, portable.data());
  for (OpsIsa isa : {OpsIsa::kAvx2, OpsIsa::kAvx512}) {
    if (!SetOpsIsa(isa)) {
      std::printf("[ note ] this CPU lacks %s: not compared\n",
                  isa == OpsIsa::kAvx2 ? "AVX2+FMA" : "AVX-512F");
      continue;
    }
    std::vector<float> out(rows * inter);
    SiluAndMul(gu.data(), rows, inter, out.data());
    for (size_t i = 0; i < out.size(); ++i) {
      // Same bits, except that a NaN's sign is not kept.
      if (std::isnan(out[i]) && std::isnan(portable[i])) continue;
      ASSERT_EQ(0, std::memcmp(&out[i], &portable[i], 4))
          << "isa " << static_cast<int>(isa) << " element " << i << ": "
          << out[i] << " vs " << portable[i] << " (gate "
          << gu[i / inter * 2 * inter + i % inter] << ")";
    }
  }
  ASSERT_TRUE(SetOpsIsa(OpsIsa::kBest));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < inter; ++i) {
      const double g = gu[r * 2 * inter + i], u = gu[r * 2 * inter + inter + i];
      const float got = portable[r * inter + i];
      if (std::isnan(g) || std::isinf(g) || std::isinf(u)) continue;
      const double want = g / (1.0 + std::exp(-g)) * u;
      EXPECT_NEAR(got, want, 6e-7 * std::fabs(want) + 1e-32)
          << "g=" << g << " u=" << u;
    }
  }
  // NaN in, NaN out; silu(+inf) * 1 = inf, silu(-inf) = -inf * 0 = NaN, as
  // g / (1 + exp(-g)) gives.
  EXPECT_TRUE(std::isnan(portable[20]));
  const float probe[] = {inf, -inf, 1.0f, 1.0f};
  float two[2];
  SiluAndMul(probe, 1, 2, two);
  EXPECT_EQ(two[0], inf);
  EXPECT_TRUE(std::isnan(two[1]));
}

}  // namespace
}  // namespace pdserve::kernels
