#include "kernels/cpu/matmul.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace pdserve::kernels {
namespace {

class MatMulTest : public ::testing::Test {
 protected:
  std::vector<float> Random(size_t n) {
    std::normal_distribution<float> dist;
    std::vector<float> v(n);
    for (auto& x : v) x = dist(rng_);
    return v;
  }
  std::mt19937 rng_{7};
};

TEST_F(MatMulTest, MatchesDoublePrecisionReference) {
  for (int64_t k : {1, 7, 8, 64, 129}) {
    const int64_t m = 5, n = 11;
    auto x = Random(m * k), w = Random(n * k);
    std::vector<float> y(m * n);
    MatMulNT(x.data(), m, k, w.data(), n, y.data());
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double ref = 0;
        for (int64_t p = 0; p < k; ++p)
          ref += double(x[i * k + p]) * w[j * k + p];
        EXPECT_NEAR(y[i * n + j], ref, 1e-4 * (1 + std::fabs(ref)))
            << "k=" << k;
      }
    }
  }
}

TEST_F(MatMulTest, DeterministicRowsDoNotDependOnBatchSize) {
  const int64_t k = 200, n = 97, max_m = 70;
  auto x = Random(max_m * k), w = Random(n * k);
  std::vector<float> full(max_m * n);
  MatMulNT(x.data(), max_m, k, w.data(), n, full.data());
  for (int64_t m : {1, 2, 3, 4, 5, 17, 64, 69}) {
    for (int64_t off : {int64_t{0}, max_m - m}) {
      std::vector<float> y(m * n);
      MatMulNT(x.data() + off * k, m, k, w.data(), n, y.data());
      EXPECT_EQ(0, std::memcmp(y.data(), full.data() + off * n,
                               y.size() * sizeof(float)))
          << "m=" << m << " off=" << off;
    }
  }
  // The shared dot product agrees with the tiled kernel bit for bit.
  EXPECT_EQ(DotFixedOrder(x.data(), w.data(), k), full[0]);
}

TEST_F(MatMulTest, BlasModeAgreesWithinRounding) {
  const int64_t m = 9, k = 300, n = 40;
  auto x = Random(m * k), w = Random(n * k);
  std::vector<float> a(m * n), b(m * n), c(n);
  MatMulNT(x.data(), m, k, w.data(), n, a.data(), MatMulMode::kDeterministic);
  MatMulNT(x.data(), m, k, w.data(), n, b.data(), MatMulMode::kBlas);
  MatMulNT(x.data(), 1, k, w.data(), n, c.data(), MatMulMode::kBlas);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-3);
  for (int64_t j = 0; j < n; ++j) EXPECT_NEAR(a[j], c[j], 1e-3);
}

}  // namespace
}  // namespace pdserve::kernels
