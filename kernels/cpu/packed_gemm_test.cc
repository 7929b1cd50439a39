#include "kernels/cpu/packed_gemm.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/packed_gemm_internal.h"

namespace pdserve::kernels {
namespace {

// A weight format: the dtype and, for int8, how it is scaled.
struct Format {
  DType dtype;
  Int8Scaling scaling = Int8Scaling::kPerRow;
};
void PrintTo(const Format& f, std::ostream* os) {
  *os << DTypeName(f.dtype)
      << (f.scaling == Int8Scaling::kBlock32 ? "/block32" : "");
}
using Param = std::tuple<GemmIsa, Format>;

class PackedGemmTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    isa_ = std::get<0>(GetParam());
    dtype_ = std::get<1>(GetParam()).dtype;
    scaling_ = std::get<1>(GetParam()).scaling;
    if (!GemmIsaSupported(isa_)) {
      GTEST_SKIP() << "this CPU cannot run the " << GemmIsaName(isa_)
                   << " path (features: " << DetectCpuFeatures().ToString()
                   << ")";
    }
    previous_ = ActiveGemmIsa();
    ASSERT_TRUE(SetGemmIsa(isa_));
  }
  void TearDown() override { SetGemmIsa(previous_); }

  std::vector<float> Random(size_t n, float scale = 1.0f) {
    std::normal_distribution<float> dist(0.0f, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = dist(rng_);
    return v;
  }

  // What every path must return, bit for bit.
  std::vector<float> Expected(const std::vector<float>& x, int64_t m, int64_t k,
                              const WeightMatrix& w) {
    const std::vector<float> widened = w.Widened();
    std::vector<float> y(m * w.rows());
    ReferenceGemmNT(x.data(), m, k, widened.data(), w.rows(), w.scales(),
                    y.data());
    return y;
  }

  GemmIsa isa_ = GemmIsa::kPortable, previous_ = GemmIsa::kPortable;
  WeightMatrix Pack(const std::vector<float>& w, int64_t n, int64_t k) {
    return WeightMatrix::Pack(w.data(), n, k, dtype_, scaling_);
  }

  DType dtype_ = DType::kF32;
  Int8Scaling scaling_ = Int8Scaling::kPerRow;
  std::mt19937 rng_{11};
};

TEST_P(PackedGemmTest, EqualsTheScalarFmaChainAtOddShapes) {
  struct Shape {
    int64_t m, n, k;
  };
  // m > 8 (4 for avx2/portable) widens once per stage for all row tiles,
  // each row tile prefetching its share of the next stage; m = 8 is one full
  // 8-row AVX-512 tile;
  // 130 x 8111 takes two k blocks (partial sums through y) with an odd tail.
  // At m <= 2 int8 and fp16 take tiles of up to 8 panels on AVX-512: 1, 3,
  // 5, 6, 7 and 8 panels in a tile, full and partial.
  for (const Shape s :
       {Shape{1, 1, 1}, Shape{3, 17, 33}, Shape{7, 45, 129}, Shape{8, 61, 257},
        Shape{9, 50, 300}, Shape{33, 97, 515}, Shape{1, 130, 2049},
        Shape{130, 33, 8111}, Shape{2, 250, 67}, Shape{1, 95, 31},
        Shape{2, 80, 129}, Shape{1, 33, 64}, Shape{2, 110, 40}}) {
    const auto x = Random(s.m * s.k), wf = Random(s.n * s.k, 0.05f);
    const WeightMatrix w = Pack(wf, s.n, s.k);
    std::vector<float> y(s.m * s.n, -1.0f);
    GemmNT(x.data(), s.m, s.k, w, y.data());
    const std::vector<float> want = Expected(x, s.m, s.k, w);
    EXPECT_EQ(0, std::memcmp(y.data(), want.data(), y.size() * sizeof(float)))
        << "m=" << s.m << " n=" << s.n << " k=" << s.k;
    // And near the exact product with the unrounded weights: each weight's
    // rounding bound (relative for bf16/fp16, half a step of its row's or
    // block's scale for int8) plus fp32 accumulation is the whole error.
    const bool blocks =
        dtype_ == DType::kI8 && scaling_ == Int8Scaling::kBlock32;
    for (int64_t j = 0; j < s.n; ++j) {
      float amax = 0;
      for (int64_t p = 0; p < s.k; ++p)
        amax = std::max(amax, std::fabs(wf[j * s.k + p]));
      for (int64_t i = 0; i < s.m; ++i) {
        double ref = 0, mag = 0, bound = 0;
        for (int64_t p = 0; p < s.k; ++p) {
          const double xv = x[i * s.k + p], wv = wf[j * s.k + p];
          ref += xv * wv;
          mag += std::fabs(xv * wv);
          const double e =
              dtype_ == DType::kBF16  ? std::fabs(wv) / 256
              : dtype_ == DType::kF16 ? std::fabs(wv) / 1024 + 6e-8
              : blocks ? w.BlockScale(j, p / kInt8Block) / 2.0 * (1 + 1e-5)
              : dtype_ == DType::kI8 ? amax / 254.0 * (1 + 1e-5)
                                     : 0.0;
          bound += std::fabs(xv) * e;
        }
        ASSERT_NEAR(y[i * s.n + j], ref, bound + 1e-5 * mag + 1e-6)
            << "m=" << s.m << " n=" << s.n << " k=" << s.k;
      }
    }
  }
}

TEST_P(PackedGemmTest, RowsDoNotDependOnBatchSizeOrThreads) {
  const int64_t k = 301, n = 83, max_m = 70;
  const auto x = Random(max_m * k), wf = Random(n * k, 0.05f);
  const WeightMatrix w = Pack(wf, n, k);
  std::vector<float> full(max_m * n);
  GemmNT(x.data(), max_m, k, w, full.data());
  for (int64_t m : {1, 2, 3, 5, 8, 9, 16, 17, 33, 64, 69}) {
    for (int64_t off : {int64_t{0}, int64_t{1}, max_m - m}) {
      std::vector<float> y(m * n);
      GemmNT(x.data() + off * k, m, k, w, y.data());
      ASSERT_EQ(0, std::memcmp(y.data(), full.data() + off * n,
                               y.size() * sizeof(float)))
          << "m=" << m << " off=" << off;
    }
  }
  const int before = KernelThreads();
  SetKernelThreads(1);
  std::vector<float> one(max_m * n);
  GemmNT(x.data(), max_m, k, w, one.data());
  SetKernelThreads(before);
  EXPECT_EQ(0,
            std::memcmp(one.data(), full.data(), one.size() * sizeof(float)));
}

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  const Format f = std::get<1>(info.param);
  return std::string(GemmIsaName(std::get<0>(info.param))) + "_" +
         DTypeName(f.dtype) +
         (f.scaling == Int8Scaling::kBlock32 ? "_block32" : "");
}

INSTANTIATE_TEST_SUITE_P(
    AllPathsAndDtypes, PackedGemmTest,
    ::testing::Combine(
        ::testing::Values(GemmIsa::kPortable, GemmIsa::kAvx2, GemmIsa::kAvx512),
        ::testing::Values(Format{DType::kF32}, Format{DType::kBF16},
                          Format{DType::kF16}, Format{DType::kI8},
                          Format{DType::kI8, Int8Scaling::kBlock32})),
    ParamName);

// kBf16Dot: the instruction (where present) and the scalar emulation agree
// bit for bit, rows do not depend on the batch, and the result is close to
// the exact product of the bf16-rounded operands.
class Bf16DotTest : public ::testing::Test {
 protected:
  void TearDown() override { SetGemmIsa(previous_); }
  std::vector<float> Random(size_t n, float scale) {
    std::normal_distribution<float> dist(0.0f, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = dist(rng_);
    return v;
  }
  std::vector<float> Run(GemmIsa isa, const std::vector<float>& x, int64_t m,
                         int64_t k, const WeightMatrix& w) {
    EXPECT_TRUE(SetGemmIsa(isa));
    std::vector<float> y(m * w.rows());
    GemmNT(x.data(), m, k, w, y.data(), GemmNumerics::kBf16Dot);
    return y;
  }
  GemmIsa previous_ = ActiveGemmIsa();
  std::mt19937 rng_{5};
};

TEST_F(Bf16DotTest, InstructionEqualsEmulationAndRowsAreBatchInvariant) {
  const bool hw =
      DetectCpuFeatures().avx512bf16 && GemmIsaSupported(GemmIsa::kAvx512);
  if (!hw) {
    std::printf("no AVX512-BF16 here (%s): checking the emulation only\n",
                DetectCpuFeatures().ToString().c_str());
  }
  struct Shape {
    int64_t m, n, k;
  };
  for (const Shape s : {Shape{1, 5, 1}, Shape{3, 17, 33}, Shape{7, 45, 130},
                        Shape{33, 97, 515}, Shape{70, 50, 301}}) {
    const auto x = Random(s.m * s.k, 1.0f), wf = Random(s.n * s.k, 0.05f);
    const WeightMatrix w =
        WeightMatrix::Pack(wf.data(), s.n, s.k, DType::kBF16);
    const auto emulated = Run(GemmIsa::kPortable, x, s.m, s.k, w);
    if (hw) {
      const auto fast = Run(GemmIsa::kAvx512, x, s.m, s.k, w);
      ASSERT_EQ(0, std::memcmp(fast.data(), emulated.data(),
                               fast.size() * sizeof(float)))
          << "m=" << s.m << " n=" << s.n << " k=" << s.k;
      // Each row alone equals its row in the batch.
      for (int64_t i : {int64_t{0}, s.m / 2, s.m - 1}) {
        std::vector<float> xi(x.begin() + i * s.k, x.begin() + (i + 1) * s.k);
        const auto one = Run(GemmIsa::kAvx512, xi, 1, s.k, w);
        ASSERT_EQ(0, std::memcmp(one.data(), fast.data() + i * s.n,
                                 s.n * sizeof(float)))
            << "row " << i;
      }
    }
    // Close to the exact product of the rounded operands.
    const auto wr = w.ToFloat();
    for (int64_t i = 0; i < s.m; ++i) {
      for (int64_t j = 0; j < s.n; ++j) {
        double ref = 0, mag = 0;
        for (int64_t p = 0; p < s.k; ++p) {
          const double xv = Bf16ToFloat(FloatToBf16(x[i * s.k + p]));
          ref += xv * wr[j * s.k + p];
          mag += std::fabs(xv * wr[j * s.k + p]);
        }
        ASSERT_NEAR(emulated[i * s.n + j], ref, 1e-5 * mag + 1e-6);
      }
    }
  }
}

// The 8-row tiles at the batch sizes that fill them (8, 16, 32) and their
// tails, panel tails of the 3-panel tiles, k tails of the 16-wide rounding
// of the activations, and k blocking (k > 4096 at m = 32), with activations
// whose bf16 rounding is a tie, denormal or large: the
// instruction with the vector rounding equals the emulation with the scalar
// FloatToBf16, and every row equals the row alone.
TEST_F(Bf16DotTest, EightRowTilesAndVectorRoundingEqualTheEmulation) {
  if (!DetectCpuFeatures().avx512bf16 || !GemmIsaSupported(GemmIsa::kAvx512)) {
    GTEST_SKIP() << "no AVX512-BF16 here (" << DetectCpuFeatures().ToString()
                 << "); the emulation is checked by "
                    "InstructionEqualsEmulationAndRowsAreBatchInvariant";
  }
  struct Shape {
    int64_t m, n, k;
  };
  const float specials[] = {
      1.00390625f,      // 0x3f808000: a tie, rounds to even (down)
      1.01171875f,      // 0x3f818000: a tie, rounds up
      -2.0f - 0x1p-8f,  // another tie
      1e-39f,           // fp32 denormal: a bf16 denormal, read as 0
      -1.1754942e-38f,  // rounds up to the smallest normal
      3.3e30f,          // large: rounds in a high binade
      -0.0f,
  };
  for (const Shape s :
       {Shape{8, 48, 16}, Shape{9, 53, 17}, Shape{16, 64, 31}, Shape{24, 35, 1},
        Shape{31, 96, 47}, Shape{32, 53, 4099}, Shape{40, 17, 130},
        Shape{64, 49, 33}}) {
    auto x = Random(s.m * s.k, 1.0f);
    for (size_t i = 0; i < x.size(); i += 7)
      x[i] = specials[(i / 7) % std::size(specials)] * 1e-3f *
                 static_cast<float>(i % 3) +
             (i % 3 == 0 ? specials[(i / 7) % std::size(specials)] : 0.0f);
    const auto wf = Random(s.n * s.k, 0.05f);
    const WeightMatrix w =
        WeightMatrix::Pack(wf.data(), s.n, s.k, DType::kBF16);
    const auto emulated = Run(GemmIsa::kPortable, x, s.m, s.k, w);
    const auto fast = Run(GemmIsa::kAvx512, x, s.m, s.k, w);
    ASSERT_EQ(0, std::memcmp(fast.data(), emulated.data(),
                             fast.size() * sizeof(float)))
        << "m=" << s.m << " n=" << s.n << " k=" << s.k;
    for (int64_t i = 0; i < s.m; ++i) {
      std::vector<float> xi(x.begin() + i * s.k, x.begin() + (i + 1) * s.k);
      const auto one = Run(GemmIsa::kAvx512, xi, 1, s.k, w);
      ASSERT_EQ(0, std::memcmp(one.data(), fast.data() + i * s.n,
                               s.n * sizeof(float)))
          << "row " << i << " of m=" << s.m;
    }
  }
}

// A NaN activation stays a NaN through the vector rounding (a wrong rounding
// would carry into the sign and give -0) and touches only its own row.
TEST_F(Bf16DotTest, NanActivationsStayNanInTheirRowOnly) {
  const int64_t m = 9, n = 20, k = 37;
  auto x = Random(m * k, 1.0f);
  const auto wf = Random(n * k, 0.05f);
  const WeightMatrix w = WeightMatrix::Pack(wf.data(), n, k, DType::kBF16);
  uint32_t nan_bits = 0x7fffffffu;  // all-ones payload: + 0x7fff overflows
  std::memcpy(&x[4 * k + 20], &nan_bits, 4);
  const auto clean_rows = Run(GemmIsa::kPortable, x, m, k, w);
  for (GemmIsa isa : {GemmIsa::kPortable, GemmIsa::kAvx512}) {
    if (!GemmIsaSupported(isa)) continue;
    const auto y = Run(isa, x, m, k, w);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        if (i == 4) {
          EXPECT_TRUE(std::isnan(y[i * n + j])) << GemmIsaName(isa);
        } else {
          EXPECT_EQ(y[i * n + j], clean_rows[i * n + j]) << GemmIsaName(isa);
        }
      }
    }
  }
}

TEST_F(Bf16DotTest, OtherDtypesIgnoreIt) {
  const int64_t m = 3, n = 20, k = 40;
  const auto x = Random(m * k, 1.0f), wf = Random(n * k, 0.05f);
  const WeightMatrix w = WeightMatrix::Pack(wf.data(), n, k, DType::kF16);
  std::vector<float> a(m * n), b(m * n);
  GemmNT(x.data(), m, k, w, a.data(), GemmNumerics::kBf16Dot);
  GemmNT(x.data(), m, k, w, b.data());
  EXPECT_EQ(a, b);
}

// kInt8Dot: int8 activations (per row and 32 k) times block-int8 weights,
// exact integer sums per block. VNNI (where present) and the portable loop
// must both equal the contract written plainly, at odd shapes, whatever m.
class Int8DotTest : public ::testing::Test {
 protected:
  void TearDown() override {
    SetGemmIsa(previous_);
    SetInt8DotAmxMinRows(previous_amx_rows_);
  }
  std::vector<float> Random(size_t n, float scale) {
    std::normal_distribution<float> dist(0.0f, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = dist(rng_);
    return v;
  }
  static WeightMatrix Pack(const std::vector<float>& w, int64_t n, int64_t k) {
    return WeightMatrix::Pack(w.data(), n, k, DType::kI8,
                              Int8Scaling::kBlock32);
  }
  // The paths to check: portable always, AVX-512 + VNNI where present.
  static std::vector<GemmIsa> Paths() {
    std::vector<GemmIsa> paths = {GemmIsa::kPortable};
    // The AVX2 path: the plain AVX2 block kernel (with or without AVX-VNNI).
    if (GemmIsaSupported(GemmIsa::kAvx2) && SetGemmIsa(GemmIsa::kAvx2)) {
      EXPECT_NE(Int8DotKernelFor(1), Int8DotKernel::kPortable);
      paths.push_back(GemmIsa::kAvx2);
    }
    if (GemmIsaSupported(GemmIsa::kAvx512)) {
      EXPECT_TRUE(SetGemmIsa(GemmIsa::kAvx512));
      if (Int8DotUsesVnni()) paths.push_back(GemmIsa::kAvx512);
    }
    if (paths.size() == 1) {
      std::printf("no AVX2 or AVX512-VNNI+VBMI here (%s): portable path only\n",
                  DetectCpuFeatures().ToString().c_str());
    }
    return paths;
  }
  std::vector<float> Run(GemmIsa isa, const float* x, int64_t m, int64_t k,
                         const WeightMatrix& w) {
    EXPECT_TRUE(SetGemmIsa(isa));
    std::vector<float> y(m * w.rows(), -1.0f);
    GemmNT(x, m, k, w, y.data(), GemmNumerics::kInt8Dot);
    return y;
  }
  // The contract of packed_gemm.h, from the weights' public values.
  static std::vector<float> Reference(const std::vector<float>& x, int64_t m,
                                      int64_t k, const WeightMatrix& w) {
    const int64_t blocks = (k + kInt8Block - 1) / kInt8Block;
    const std::vector<float> wv = w.Widened();  // q * scale, exact
    std::vector<float> y(m * w.rows());
    for (int64_t i = 0; i < m; ++i) {
      std::vector<int32_t> qx(k);
      std::vector<float> sx(blocks);
      for (int64_t b = 0; b < blocks; ++b) {
        float amax = 0;
        for (int64_t p = b * 32; p < std::min(k, b * 32 + 32); ++p)
          amax = std::max(amax, std::fabs(x[i * k + p]));
        sx[b] = amax / 127.0f;
        for (int64_t p = b * 32; p < std::min(k, b * 32 + 32); ++p) {
          qx[p] =
              sx[b] > 0
                  ? static_cast<int32_t>(std::nearbyint(x[i * k + p] / sx[b]))
                  : 0;
        }
      }
      for (int64_t j = 0; j < w.rows(); ++j) {
        float acc = 0;
        for (int64_t b = 0; b < blocks; ++b) {
          const float sw = w.BlockScale(j, b);
          int32_t isum = 0;
          for (int64_t p = b * 32; p < std::min(k, b * 32 + 32); ++p) {
            const int32_t qw =
                sw > 0
                    ? static_cast<int32_t>(std::nearbyint(wv[j * k + p] / sw))
                    : 0;
            isum += qx[p] * qw;
          }
          acc = std::fma(static_cast<float>(isum), sx[b] * sw, acc);
        }
        y[i * w.rows() + j] = acc;
      }
    }
    return y;
  }
  // Hard cases in x [m, k] and w [n, k]: where k > 40, an outlier in row 1
  // (zero_block: also an all-zero second block in row 0) and
  // an all-zero row 2; where n > 3, an outlier weight and an all-zero row 2.
  static void AddOutliersAndZeros(int64_t m, int64_t n, int64_t k,
                                  bool zero_block, std::vector<float>* x,
                                  std::vector<float>* w) {
    if (k > 40) {
      if (zero_block)
        for (int64_t p = 32; p < 64 && p < k; ++p) (*x)[p] = 0.0f;
      (*x)[k + 3 < m * k ? k + 3 : 0] = 40.0f;
      if (m > 2)
        for (int64_t p = 0; p < k; ++p) (*x)[2 * k + p] = 0.0f;
    }
    if (n > 3) {
      (*w)[3 * k] = 2.0f;
      for (int64_t p = 0; p < k; ++p) (*w)[2 * k + p] = 0.0f;
    }
  }
  // check(m, off, threads) for every m = 1..max_m at offsets 0, 1 and
  // max_m - m, on 1 and 2 threads, until the first fatal failure.
  template <typename Check>
  static void ForEachBatchSlice(int64_t max_m, Check&& check) {
    const int before = KernelThreads();
    for (int threads : {1, 2}) {
      SetKernelThreads(threads);
      for (int64_t m = 1; m <= max_m && !HasFatalFailure(); ++m) {
        for (int64_t off : {int64_t{0}, int64_t{1}, max_m - m}) {
          if (off + m <= max_m && !HasFatalFailure()) check(m, off, threads);
        }
      }
    }
    SetKernelThreads(before);
  }
  GemmIsa previous_ = ActiveGemmIsa();
  int64_t previous_amx_rows_ = Int8DotAmxMinRows();
  std::mt19937 rng_{17};
};

// AMX-INT8 (where the CPU has it and Linux grants the tile state) must give
// the bits of VNNI and of the portable loop, so that the batch sizes that
// take it do not change any row.
class Int8DotAmxTest : public Int8DotTest {
 protected:
  void SetUp() override {
    if (!GemmIsaSupported(GemmIsa::kAvx512) || !SetGemmIsa(GemmIsa::kAvx512) ||
        !Int8DotAmxUsable()) {
      GTEST_SKIP() << "no usable AMX-INT8 here (features: "
                   << DetectCpuFeatures().ToString() << ")";
    }
  }
  // kInt8Dot with AMX for every m (amx), never (VNNI), or on the portable
  // path.
  enum class Kernel { kAmx, kVnni, kPortable };
  std::vector<float> RunWith(Kernel kernel, const float* x, int64_t m,
                             int64_t k, const WeightMatrix& w) {
    SetInt8DotAmxMinRows(kernel == Kernel::kAmx ? 1 : 0);
    const auto y =
        Run(kernel == Kernel::kPortable ? GemmIsa::kPortable : GemmIsa::kAvx512,
            x, m, k, w);
    EXPECT_EQ(Int8DotKernelFor(m), kernel == Kernel::kAmx ? Int8DotKernel::kAmx
                                   : kernel == Kernel::kVnni
                                       ? Int8DotKernel::kVnni
                                       : Int8DotKernel::kPortable);
    return y;
  }
  static bool Same(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() &&
           std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  }
};

TEST_F(Int8DotAmxTest, EqualsVnniPortableAndThePlainContractAtOddShapes) {
  struct Shape {
    int64_t m, n, k;
  };
  // Tails of rows (m % 16), columns (n % 16), k (k % 32 and one block),
  // 1..4 panels per task (n up to 1000), odd and even block counts.
  for (const Shape s :
       {Shape{1, 1, 1}, Shape{2, 17, 33}, Shape{7, 45, 129}, Shape{15, 50, 64},
        Shape{16, 16, 32}, Shape{17, 97, 515}, Shape{31, 33, 300},
        Shape{32, 1000, 96}, Shape{33, 611, 2049}, Shape{70, 130, 160}}) {
    auto x = Random(s.m * s.k, 1.0f), wf = Random(s.n * s.k, 0.05f);
    AddOutliersAndZeros(s.m, s.n, s.k, /*zero_block=*/true, &x, &wf);
    const WeightMatrix w = Pack(wf, s.n, s.k);
    const std::vector<float> want = Reference(x, s.m, s.k, w);
    const auto amx = RunWith(Kernel::kAmx, x.data(), s.m, s.k, w);
    const auto vnni = RunWith(Kernel::kVnni, x.data(), s.m, s.k, w);
    const auto portable = RunWith(Kernel::kPortable, x.data(), s.m, s.k, w);
    EXPECT_TRUE(Same(amx, want))
        << "amx vs contract m=" << s.m << " n=" << s.n << " k=" << s.k;
    EXPECT_TRUE(Same(amx, vnni))
        << "amx vs vnni m=" << s.m << " n=" << s.n << " k=" << s.k;
    EXPECT_TRUE(Same(amx, portable))
        << "amx vs portable m=" << s.m << " n=" << s.n << " k=" << s.k;
  }
}

TEST_F(Int8DotAmxTest, RowsDoNotDependOnBatchSizeOffsetsThreadsOrKernel) {
  const int64_t k = 333, n = 83, max_m = 70;
  const auto x = Random(max_m * k, 1.0f), wf = Random(n * k, 0.05f);
  const WeightMatrix w = Pack(wf, n, k);
  // The rows as the portable loop computes them, all at once.
  const auto full = RunWith(Kernel::kPortable, x.data(), max_m, k, w);
  ForEachBatchSlice(max_m, [&](int64_t m, int64_t off, int threads) {
    // Forced AMX, and the default choice (VNNI below the threshold).
    const auto y = RunWith(Kernel::kAmx, x.data() + off * k, m, k, w);
    SetInt8DotAmxMinRows(kInt8DotAmxDefaultMinRows);
    std::vector<float> d(m * n, -1.0f);
    GemmNT(x.data() + off * k, m, k, w, d.data(), GemmNumerics::kInt8Dot);
    const std::vector<float>* const outs[] = {&y, &d};
    for (const std::vector<float>* got : outs) {
      ASSERT_EQ(0, std::memcmp(got->data(), full.data() + off * n,
                               got->size() * sizeof(float)))
          << (got == &y ? "amx" : "default") << " m=" << m << " off=" << off
          << " threads=" << threads;
    }
  });
}

TEST_F(Int8DotAmxTest, KernelChoiceFollowsTheThreshold) {
  SetInt8DotAmxMinRows(kInt8DotAmxDefaultMinRows);
  EXPECT_EQ(Int8DotKernelFor(1), Int8DotKernel::kVnni);
  EXPECT_EQ(Int8DotKernelFor(kInt8DotAmxDefaultMinRows - 1),
            Int8DotKernel::kVnni);
  EXPECT_EQ(Int8DotKernelFor(kInt8DotAmxDefaultMinRows), Int8DotKernel::kAmx);
  EXPECT_EQ(Int8DotKernelFor(512), Int8DotKernel::kAmx);
  SetInt8DotAmxMinRows(0);
  EXPECT_EQ(Int8DotKernelFor(512), Int8DotKernel::kVnni);
  SetInt8DotAmxMinRows(1);
  EXPECT_EQ(Int8DotKernelFor(1), Int8DotKernel::kAmx);
  ASSERT_TRUE(SetGemmIsa(GemmIsa::kPortable));
  EXPECT_FALSE(Int8DotAmxUsable());
  EXPECT_EQ(Int8DotKernelFor(512), Int8DotKernel::kPortable);
  EXPECT_STREQ(Int8DotKernelName(Int8DotKernel::kAmx), "amx");
}

// A batch on AMX then the same thread on VNNI then AMX again: the tile
// configuration is loaded and released per GEMM, and the results repeat.
TEST_F(Int8DotAmxTest, RepeatsAcrossKernelSwitches) {
  const int64_t m = 20, n = 40, k = 100;
  const auto x = Random(m * k, 1.0f), wf = Random(n * k, 0.05f);
  const WeightMatrix w = Pack(wf, n, k);
  const auto a = RunWith(Kernel::kAmx, x.data(), m, k, w);
  const auto v = RunWith(Kernel::kVnni, x.data(), m, k, w);
  const auto b = RunWith(Kernel::kAmx, x.data(), m, k, w);
  EXPECT_TRUE(Same(a, v));
  EXPECT_TRUE(Same(a, b));
}

TEST_F(Int8DotTest, EveryPathEqualsThePlainContractAtOddShapes) {
  struct Shape {
    int64_t m, n, k;
  };
  for (const Shape s :
       {Shape{1, 1, 1}, Shape{3, 17, 33}, Shape{7, 45, 129}, Shape{8, 61, 257},
        Shape{9, 50, 300}, Shape{33, 97, 515}, Shape{5, 130, 2049}}) {
    auto x = Random(s.m * s.k, 1.0f);
    if (s.k > 40) {  // an all-zero block and a single outlier
      for (int64_t p = 32; p < 64 && p < s.k; ++p) x[p] = 0.0f;
      x[s.k + 3 < s.m * s.k ? s.k + 3 : 0] = 40.0f;
    }
    const auto wf = Random(s.n * s.k, 0.05f);
    const WeightMatrix w = Pack(wf, s.n, s.k);
    const std::vector<float> want = Reference(x, s.m, s.k, w);
    for (GemmIsa isa : Paths()) {
      const auto y = Run(isa, x.data(), s.m, s.k, w);
      ASSERT_EQ(0, std::memcmp(y.data(), want.data(), y.size() * sizeof(float)))
          << GemmIsaName(isa) << " m=" << s.m << " n=" << s.n << " k=" << s.k;
    }
    // Near the exact product of x and the dequantized weights: each x is
    // off by at most half its block's step.
    const std::vector<float> wv = w.Widened();
    for (int64_t i = 0; i < s.m; ++i) {
      for (int64_t j = 0; j < s.n; ++j) {
        double ref = 0, bound = 0;
        for (int64_t b = 0; b * 32 < s.k; ++b) {
          float amax = 0;
          for (int64_t p = b * 32; p < std::min(s.k, b * 32 + 32); ++p)
            amax = std::max(amax, std::fabs(x[i * s.k + p]));
          for (int64_t p = b * 32; p < std::min(s.k, b * 32 + 32); ++p) {
            ref += double(x[i * s.k + p]) * wv[j * s.k + p];
            bound += std::fabs(wv[j * s.k + p]) * amax / 254.0 * (1 + 1e-5) +
                     1e-6 * std::fabs(x[i * s.k + p] * wv[j * s.k + p]);
          }
        }
        ASSERT_NEAR(want[i * s.n + j], ref, bound + 1e-6);
      }
    }
  }
}

TEST_F(Int8DotTest, RowsDoNotDependOnBatchSizeOrThreads) {
  const int64_t k = 301, n = 83, max_m = 70;
  const auto x = Random(max_m * k, 1.0f), wf = Random(n * k, 0.05f);
  const WeightMatrix w = Pack(wf, n, k);
  for (GemmIsa isa : Paths()) {
    const auto full = Run(isa, x.data(), max_m, k, w);
    for (int64_t m : {1, 2, 3, 4, 5, 8, 9, 17, 33, 69}) {
      for (int64_t off : {int64_t{0}, int64_t{1}, max_m - m}) {
        const auto y = Run(isa, x.data() + off * k, m, k, w);
        ASSERT_EQ(0, std::memcmp(y.data(), full.data() + off * n,
                                 y.size() * sizeof(float)))
            << GemmIsaName(isa) << " m=" << m << " off=" << off;
      }
    }
    const int before = KernelThreads();
    SetKernelThreads(1);
    const auto one = Run(isa, x.data(), max_m, k, w);
    SetKernelThreads(before);
    EXPECT_EQ(0,
              std::memcmp(one.data(), full.data(), one.size() * sizeof(float)));
  }
}

TEST_F(Int8DotTest, ActivationQuantizationIsTheSameOnEveryPath) {
  const int64_t m = 3, k = 77, kp = 96, blocks = 3;
  auto x = Random(m * k, 2.0f);
  for (int64_t p = 0; p < 32; ++p) x[k + p] = 0.0f;  // an all-zero block
  x[2 * k] = 127.0f;                                 // exact ties below
  x[2 * k + 1] = 0.5f;
  x[2 * k + 2] = -1.5f;
  x[2 * k + 3] = 2.5f;
  std::vector<std::vector<int8_t>> qs;
  std::vector<std::vector<float>> ss;
  for (GemmIsa isa : Paths()) {
    ASSERT_TRUE(SetGemmIsa(isa));
    std::vector<int8_t> q(m * kp, 99);
    std::vector<float> sc(m * blocks, -1.0f);
    QuantizeActivationsInt8(x.data(), m, k, q.data(), sc.data());
    EXPECT_EQ(sc[1 * blocks], 0.0f);
    EXPECT_EQ(sc[2 * blocks], 1.0f);
    EXPECT_EQ(q[2 * kp + 1], 0);   // 0.5 rounds to even
    EXPECT_EQ(q[2 * kp + 2], -2);  // -1.5 too
    EXPECT_EQ(q[2 * kp + 3], 2);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t p = k; p < kp; ++p) EXPECT_EQ(q[i * kp + p], 0);
    qs.push_back(q);
    ss.push_back(sc);
  }
  for (size_t i = 1; i < qs.size(); ++i) {
    EXPECT_EQ(qs[i], qs[0]);
    EXPECT_EQ(ss[i], ss[0]);
  }
}

TEST_F(Int8DotTest, OtherFormatsIgnoreIt) {
  const int64_t m = 3, n = 20, k = 40;
  const auto x = Random(m * k, 1.0f), wf = Random(n * k, 0.05f);
  for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) {
    const WeightMatrix w = WeightMatrix::Pack(wf.data(), n, k, t);
    std::vector<float> a(m * n), b(m * n);
    GemmNT(x.data(), m, k, w, a.data(), GemmNumerics::kInt8Dot);
    GemmNT(x.data(), m, k, w, b.data());
    EXPECT_EQ(a, b) << DTypeName(t);
  }
}

// kInt8Dot on per-row int8 weights: activations rounded per row, one exact
// integer sum over all of k, y = float(isum) * (sx * sw). AMX (where usable),
// VNNI and the portable loop must equal the contract written plainly.
class RowInt8DotTest : public Int8DotTest {
 protected:
  static WeightMatrix PackRow(const std::vector<float>& w, int64_t n,
                              int64_t k) {
    return WeightMatrix::Pack(w.data(), n, k, DType::kI8, Int8Scaling::kPerRow,
                              WeightMatrix::Layout::kPanel16Dot);
  }
  static std::vector<float> RowReference(const std::vector<float>& x, int64_t m,
                                         int64_t k, const WeightMatrix& w) {
    const std::vector<float> qw = w.Widened();  // the integers
    std::vector<float> y(m * w.rows());
    for (int64_t i = 0; i < m; ++i) {
      float amax = 0;
      for (int64_t p = 0; p < k; ++p)
        amax = std::max(amax, std::fabs(x[i * k + p]));
      const float sx = amax / 127.0f;
      for (int64_t j = 0; j < w.rows(); ++j) {
        int64_t isum = 0;
        for (int64_t p = 0; p < k; ++p) {
          const int64_t q =
              sx > 0 ? static_cast<int64_t>(std::nearbyint(x[i * k + p] / sx))
                     : 0;
          isum += q * static_cast<int64_t>(qw[j * k + p]);
        }
        y[i * w.rows() + j] = static_cast<float>(isum) * (sx * w.scales()[j]);
      }
    }
    return y;
  }
  static bool Same(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() &&
           std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  }
  // Every kernel this machine has: portable; AVX-VNNI and plain AVX2 on
  // the AVX2 path; VNNI (AMX off); AMX for every m.
  std::vector<std::pair<std::string, std::vector<float>>> AllKernels(
      const float* x, int64_t m, int64_t k, const WeightMatrix& w) {
    std::vector<std::pair<std::string, std::vector<float>>> out;
    SetInt8DotAmxMinRows(0);
    out.emplace_back("portable", Run(GemmIsa::kPortable, x, m, k, w));
    EXPECT_EQ(Int8DotKernelFor(m), Int8DotKernel::kPortable);
    if (GemmIsaSupported(GemmIsa::kAvx2) && SetGemmIsa(GemmIsa::kAvx2)) {
      // The AVX2 path takes AVX-VNNI exactly where the CPU has it, else
      // the plain AVX2 kernel, which the testing switch reaches on both.
      EXPECT_EQ(Int8DotKernelFor(m), DetectCpuFeatures().avxvnni
                                         ? Int8DotKernel::kAvxVnni
                                         : Int8DotKernel::kAvx2);
      if (Int8DotKernelFor(m) == Int8DotKernel::kAvxVnni)
        out.emplace_back("avxvnni", Run(GemmIsa::kAvx2, x, m, k, w));
      SetInt8DotAvxVnniForTesting(false);
      EXPECT_EQ(Int8DotKernelFor(m), Int8DotKernel::kAvx2);
      out.emplace_back("avx2", Run(GemmIsa::kAvx2, x, m, k, w));
      SetInt8DotAvxVnniForTesting(true);
    }
    if (GemmIsaSupported(GemmIsa::kAvx512) && SetGemmIsa(GemmIsa::kAvx512) &&
        Int8DotUsesVnni()) {
      out.emplace_back("vnni", Run(GemmIsa::kAvx512, x, m, k, w));
      if (Int8DotAmxUsable()) {
        SetInt8DotAmxMinRows(1);
        out.emplace_back("amx", Run(GemmIsa::kAvx512, x, m, k, w));
        EXPECT_EQ(Int8DotKernelFor(m), Int8DotKernel::kAmx);
      }
    }
    SetInt8DotAmxMinRows(kInt8DotAmxDefaultMinRows);
    return out;
  }
};

TEST_F(RowInt8DotTest, EveryKernelEqualsThePlainContractAtOddShapes) {
  struct Shape {
    int64_t m, n, k;
  };
  // Tails of rows (m % 16, odd row-tile counts), columns (n % 16, odd panel
  // counts, 1..4 panels per task), k (k % 4 == 1, 2, 3; k % 64; one and many
  // 64-k steps).
  bool printed = false;
  for (const Shape s :
       {Shape{1, 1, 1}, Shape{2, 17, 2}, Shape{3, 33, 66}, Shape{7, 45, 129},
        Shape{15, 50, 64}, Shape{16, 16, 63}, Shape{17, 97, 515},
        Shape{31, 33, 300}, Shape{32, 1000, 96}, Shape{33, 611, 2049},
        Shape{48, 40, 130}, Shape{70, 130, 161},
        // The VNNI tile's 8 rows and 3 panels: full, and one past.
        Shape{8, 48, 4}, Shape{9, 65, 68}, Shape{24, 49, 255}, Shape{25, 96, 1},
        // The AVX-VNNI tile's 6 rows: full, one past, and 32 in 6 tiles;
        // the AVX2 tile's 4 rows and its 2-row, 2-panel stream tile.
        Shape{6, 16, 64}, Shape{7, 17, 65}, Shape{32, 35, 200},
        Shape{4, 32, 68}, Shape{5, 33, 260}, Shape{2, 64, 1024},
        // Many row tiles (the activations are laid out per row tile, and
        // each row tile prefetches part of the next weight tile) at longer k.
        Shape{64, 48, 512}, Shape{64, 100, 1030}, Shape{77, 49, 2049}}) {
    auto x = Random(s.m * s.k, 1.0f), wf = Random(s.n * s.k, 0.05f);
    AddOutliersAndZeros(s.m, s.n, s.k, /*zero_block=*/false, &x, &wf);
    const WeightMatrix w = PackRow(wf, s.n, s.k);
    const std::vector<float> want = RowReference(x, s.m, s.k, w);
    const auto got = AllKernels(x.data(), s.m, s.k, w);
    if (!printed) {
      std::string names;
      for (const auto& entry : got) names += " " + entry.first;
      std::printf(
          "kernels checked here:%s (of portable, avxvnni, avx2, vnni, amx; "
          "cpu: %s)\n",
          names.c_str(), DetectCpuFeatures().ToString().c_str());
    }
    printed = true;
    for (const auto& [name, y] : got) {
      EXPECT_TRUE(Same(y, want))
          << name << " vs contract m=" << s.m << " n=" << s.n << " k=" << s.k;
    }
    // Near the exact product: each x is off by at most half its row's step.
    const std::vector<float> wv = w.ToFloat();
    for (int64_t i = 0; i < s.m; ++i) {
      float amax = 0;
      for (int64_t p = 0; p < s.k; ++p)
        amax = std::max(amax, std::fabs(x[i * s.k + p]));
      for (int64_t j = 0; j < s.n; ++j) {
        double ref = 0, bound = 0;
        for (int64_t p = 0; p < s.k; ++p) {
          ref += double(x[i * s.k + p]) * wv[j * s.k + p];
          bound += std::fabs(wv[j * s.k + p]) * amax / 254.0 * (1 + 1e-5) +
                   1e-6 * std::fabs(x[i * s.k + p] * wv[j * s.k + p]);
        }
        ASSERT_NEAR(want[i * s.n + j], ref, bound + 1e-6)
            << "m=" << s.m << " n=" << s.n << " k=" << s.k;
      }
    }
  }
}

// The VNNI kernel subtracts the activations' +128 offset with the sums the
// matrix stores: 128 * Σ q per output row, zero in the padding rows, and
// only in the dot-product layout.
TEST_F(RowInt8DotTest, DotOffsetsAre128TimesEachRowsIntegerSum) {
  const int64_t n = 37, k = 131;
  const auto wf = Random(n * k, 0.05f);
  const WeightMatrix w = PackRow(wf, n, k);
  ASSERT_NE(w.dot_offsets(), nullptr);
  const std::vector<float> q = w.Widened();
  for (int64_t j = 0; j < n; ++j) {
    int64_t sum = 0;
    for (int64_t p = 0; p < k; ++p) sum += static_cast<int64_t>(q[j * k + p]);
    EXPECT_EQ(w.dot_offsets()[j], 128 * sum) << "row " << j;
  }
  for (int64_t j = n; j < 48; ++j) EXPECT_EQ(w.dot_offsets()[j], 0);
  EXPECT_EQ(WeightMatrix::Pack(wf.data(), n, k, DType::kI8).dot_offsets(),
            nullptr);
  EXPECT_EQ(WeightMatrix::Pack(wf.data(), n, k, DType::kBF16).dot_offsets(),
            nullptr);
}

TEST_F(RowInt8DotTest, RowsDoNotDependOnBatchSizeOffsetsThreadsOrKernel) {
  const int64_t k = 333, n = 83, max_m = 70;
  const auto x = Random(max_m * k, 1.0f), wf = Random(n * k, 0.05f);
  const WeightMatrix w = PackRow(wf, n, k);
  SetInt8DotAmxMinRows(0);
  const auto full = Run(GemmIsa::kPortable, x.data(), max_m, k, w);
  ForEachBatchSlice(max_m, [&](int64_t m, int64_t off, int threads) {
    for (const auto& [name, y] : AllKernels(x.data() + off * k, m, k, w)) {
      ASSERT_EQ(0, std::memcmp(y.data(), full.data() + off * n,
                               y.size() * sizeof(float)))
          << name << " m=" << m << " off=" << off << " threads=" << threads;
    }
    // The default choice of kernel for this m.
    std::vector<float> d(m * n, -1.0f);
    GemmNT(x.data() + off * k, m, k, w, d.data(), GemmNumerics::kInt8Dot);
    ASSERT_EQ(0, std::memcmp(d.data(), full.data() + off * n,
                             d.size() * sizeof(float)))
        << "default m=" << m << " off=" << off;
  });
}

// kPanel16Dot stores the same integers and scales in another order: no
// value depends on it, with either numerics, at odd shapes.
TEST_F(RowInt8DotTest, LayoutChangesNoValue) {
  for (const auto& [m, n, k] :
       {std::tuple<int64_t, int64_t, int64_t>{3, 20, 37},
        {17, 33, 130},
        {40, 70, 64}}) {
    const auto x = Random(m * k, 1.0f), wf = Random(n * k, 0.05f);
    const WeightMatrix dot = PackRow(wf, n, k);
    const WeightMatrix plain = WeightMatrix::Pack(wf.data(), n, k, DType::kI8);
    ASSERT_EQ(dot.layout(), WeightMatrix::Layout::kPanel16Dot);
    EXPECT_EQ(dot.padded_k() % 64, 0);
    EXPECT_EQ(dot.ToFloat(), plain.ToFloat());
    EXPECT_EQ(dot.Widened(), plain.Widened());
    EXPECT_EQ(dot.bytes(), plain.bytes());
    std::vector<float> row(k), row2(k);
    dot.DequantizeRow(n - 1, row.data());
    plain.DequantizeRow(n - 1, row2.data());
    EXPECT_EQ(row, row2);
    for (GemmNumerics numerics :
         {GemmNumerics::kFp32Chain, GemmNumerics::kInt8Dot}) {
      std::vector<float> a(m * n, -1.0f), b(m * n, -2.0f);
      GemmNT(x.data(), m, k, dot, a.data(), numerics);
      GemmNT(x.data(), m, k, plain, b.data(), numerics);
      EXPECT_TRUE(Same(a, b)) << "m=" << m << " n=" << n << " k=" << k
                              << " numerics " << static_cast<int>(numerics);
    }
  }
  // Other dtypes ignore the layout.
  const auto wf = Random(20 * 30, 0.05f);
  EXPECT_EQ(
      WeightMatrix::Pack(wf.data(), 20, 30, DType::kBF16, Int8Scaling::kPerRow,
                         WeightMatrix::Layout::kPanel16Dot)
          .layout(),
      WeightMatrix::Layout::kPanel16);
  EXPECT_EQ(
      WeightMatrix::Pack(wf.data(), 20, 30, DType::kI8, Int8Scaling::kBlock32,
                         WeightMatrix::Layout::kPanel16Dot)
          .layout(),
      WeightMatrix::Layout::kPanel16);
}

// Not the fp32 chain: activations are rounded, so outputs differ from it
// (and from block int8dot), yet stay close.
TEST_F(RowInt8DotTest, IsItsOwnNumericsCloseToTheFp32Chain) {
  const int64_t m = 5, n = 40, k = 200;
  const auto x = Random(m * k, 1.0f), wf = Random(n * k, 0.05f);
  const WeightMatrix w = PackRow(wf, n, k);
  std::vector<float> dot(m * n), chain(m * n);
  GemmNT(x.data(), m, k, w, dot.data(), GemmNumerics::kInt8Dot);
  GemmNT(x.data(), m, k, w, chain.data());
  EXPECT_NE(dot, chain);
  double num = 0, den = 0;
  for (int64_t i = 0; i < m * n; ++i) {
    num += (dot[i] - chain[i]) * double(dot[i] - chain[i]);
    den += double(chain[i]) * chain[i];
  }
  EXPECT_LT(std::sqrt(num / den), 0.02);
}

// A small-batch tile prefetches kStreamAheadBytes ahead in each panel; in a
// panel's last stretch that moves on to the same panel of the tile the thread
// runs next, next_tile bytes on.
TEST(StreamAheadTest, MovesOnToTheNextTilesPanelPastAPanelsEnd) {
  using packed_gemm_internal::kStreamAheadBytes;
  using packed_gemm_internal::StreamAheadOffset;
  constexpr int64_t pb = 8192;  // one panel's bytes
  EXPECT_EQ(StreamAheadOffset(0, pb, 8 * pb), kStreamAheadBytes);
  EXPECT_EQ(StreamAheadOffset(pb - kStreamAheadBytes - 64, pb, 8 * pb),
            pb - 64);
  // The first line past this panel's end: the next tile's panel, 8 on.
  EXPECT_EQ(StreamAheadOffset(pb - kStreamAheadBytes, pb, 8 * pb), 8 * pb);
  EXPECT_EQ(StreamAheadOffset(pb - 64, pb, 3 * pb),
            3 * pb + kStreamAheadBytes - 64);
  // Two tiles of 8 panels on (the other thread runs the tile between).
  EXPECT_EQ(StreamAheadOffset(pb - kStreamAheadBytes, pb, 16 * pb), 16 * pb);
}

// Claims of one tile by two threads go out in turn (0, 1, 2, ...), so the
// thread that ran tile 0 runs tile 2 next; inside a claim, the next tile.
TEST(StreamAheadTest, ExpectsTheTileAfterTheOtherThreadsClaims) {
  using packed_gemm_internal::ExpectedNextTile;
  // tile, end of its claim, tiles, chunk, threads
  EXPECT_EQ(ExpectedNextTile(0, 1, 6, 1, 2), 2);
  EXPECT_EQ(ExpectedNextTile(3, 4, 6, 1, 2), 5);
  EXPECT_EQ(ExpectedNextTile(0, 5, 22, 5, 2), 1);
  EXPECT_EQ(ExpectedNextTile(4, 5, 22, 5, 2), 10);
  EXPECT_EQ(ExpectedNextTile(4, 5, 22, 5, 3), 15);
  // One thread runs the claims back to back.
  EXPECT_EQ(ExpectedNextTile(4, 5, 22, 5, 1), 5);
  // Nothing left to claim: the next tile.
  EXPECT_EQ(ExpectedNextTile(4, 5, 6, 1, 2), 5);
  EXPECT_EQ(ExpectedNextTile(5, 6, 6, 1, 2), 6);
}

// A helper claiming from the back runs its claim up, then the claim below.
TEST(StreamAheadTest, FromTheBackExpectsTheClaimBelow) {
  using packed_gemm_internal::ExpectedNextTileFromBack;
  // tile, begin and end of its claim, chunk
  EXPECT_EQ(ExpectedNextTileFromBack(17, 15, 20, 5), 18);
  EXPECT_EQ(ExpectedNextTileFromBack(19, 15, 20, 5), 10);
  EXPECT_EQ(ExpectedNextTileFromBack(5, 5, 6, 1), 4);
  // At the front: the next tile.
  EXPECT_EQ(ExpectedNextTileFromBack(4, 2, 5, 5), 5);
}

TEST(WeightMatrixTest, Int8RoundTripIsWithinHalfAStepPerRow) {
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  const int64_t n = 37, k = 129;
  std::vector<float> w(n * k);
  for (auto& v : w) v = dist(rng);
  for (int64_t q = 0; q < k; ++q) w[5 * k + q] = 0.0f;  // an all-zero row
  w[7 * k + 3] = 1.5f;                                  // an outlier
  const WeightMatrix m = WeightMatrix::Pack(w.data(), n, k, DType::kI8);
  EXPECT_EQ(m.bytes(), n * k + n * 4);
  const std::vector<float> back = m.ToFloat();
  double sum_err = 0, sum_mag = 0;
  for (int64_t r = 0; r < n; ++r) {
    float amax = 0;
    for (int64_t q = 0; q < k; ++q)
      amax = std::max(amax, std::fabs(w[r * k + q]));
    EXPECT_FLOAT_EQ(m.scales()[r], amax / 127.0f) << "row " << r;
    for (int64_t q = 0; q < k; ++q) {
      const float err = std::fabs(back[r * k + q] - w[r * k + q]);
      ASSERT_LE(err, amax / 254.0f * (1 + 1e-5f)) << "row " << r << " k " << q;
      sum_err += err;
      sum_mag += std::fabs(w[r * k + q]);
    }
  }
  for (int64_t q = 0; q < k; ++q) EXPECT_EQ(back[5 * k + q], 0.0f);
  // The outlier's row keeps only coarse steps; the rest stays within ~1%.
  EXPECT_LT(sum_err / sum_mag, 0.05);
}

TEST(WeightMatrixTest, Int8Block32RoundTripIsWithinHalfAStepPerBlock) {
  std::mt19937 rng(4);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  const int64_t n = 37, k = 129;  // 5 blocks, the last one of a single k
  std::vector<float> w(n * k);
  for (auto& v : w) v = dist(rng);
  for (int64_t q = 0; q < k; ++q) w[5 * k + q] = 0.0f;  // an all-zero row
  w[7 * k + 3] = 1.5f;                                  // an outlier
  w[9 * k + 40] = 3e-9f;  // a block of tiny weights: subnormal fp16 scale
  for (int64_t q = 32; q < 64; ++q)
    if (q != 40) w[9 * k + q] = 0.0f;
  const WeightMatrix m =
      WeightMatrix::Pack(w.data(), n, k, DType::kI8, Int8Scaling::kBlock32);
  EXPECT_EQ(m.int8_scaling(), Int8Scaling::kBlock32);
  EXPECT_EQ(m.bytes(), n * k + n * 5 * 2);  // one fp16 per block of 32
  EXPECT_EQ(m.scales(), nullptr);
  const std::vector<float> back = m.ToFloat();
  EXPECT_EQ(back, m.Widened());  // q * scale is exact: nothing left to apply
  double row7_err = 0, row7_mag = 0;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t b = 0; b * kInt8Block < k; ++b) {
      const int64_t q0 = b * kInt8Block, q1 = std::min(k, q0 + kInt8Block);
      float amax = 0;
      for (int64_t q = q0; q < q1; ++q)
        amax = std::max(amax, std::fabs(w[r * k + q]));
      const float s = m.BlockScale(r, b);
      // Rounded up to fp16: never below max/127 (so nothing is clipped),
      // at most one fp16 step above it (2^-24 for subnormal scales).
      EXPECT_GE(s, amax / 127.0f) << "row " << r << " block " << b;
      EXPECT_LE(s, std::max(amax / 127.0f * (1 + 1.0f / 1024),
                            amax / 127.0f + 5.97e-8f))
          << "row " << r << " block " << b;
      EXPECT_EQ(s, F16ToFloat(FloatToF16(s)));
      for (int64_t q = q0; q < q1; ++q) {
        const float err = std::fabs(back[r * k + q] - w[r * k + q]);
        ASSERT_LE(err, s / 2) << "row " << r << " k " << q;
        if (r == 7) {
          row7_err += err;
          row7_mag += std::fabs(w[r * k + q]);
        }
      }
    }
  }
  for (int64_t q = 0; q < k; ++q) EXPECT_EQ(back[5 * k + q], 0.0f);
  // The outlier only coarsens its own block: its row stays within a few %,
  // where per-row scaling loses most of the row (below).
  const WeightMatrix per_row = WeightMatrix::Pack(w.data(), n, k, DType::kI8);
  const std::vector<float> back_row = per_row.ToFloat();
  double row7_err_per_row = 0;
  for (int64_t q = 0; q < k; ++q)
    row7_err_per_row += std::fabs(back_row[7 * k + q] - w[7 * k + q]);
  EXPECT_LT(row7_err / row7_mag, 0.05);
  EXPECT_LT(row7_err * 4, row7_err_per_row);
}

TEST(WeightMatrixTest, HalfPrecisionPackingRoundsToNearestEven) {
  const std::vector<float> w = {1.0f,     1.00390625f, 1.01171875f, -3.14159f,
                                65504.0f, 1e-8f,       0.0f};
  const int64_t n = 1, k = static_cast<int64_t>(w.size());
  const auto bf = WeightMatrix::Pack(w.data(), n, k, DType::kBF16).ToFloat();
  const auto fp = WeightMatrix::Pack(w.data(), n, k, DType::kF16).ToFloat();
  for (int64_t q = 0; q < k; ++q) {
    EXPECT_EQ(bf[q], Bf16ToFloat(FloatToBf16(w[q])));
    EXPECT_EQ(fp[q], F16ToFloat(FloatToF16(w[q])));
  }
  EXPECT_EQ(WeightMatrix::Pack(w.data(), n, k, DType::kBF16).bytes(), 2 * k);
}

TEST(CpuFeaturesTest, BestPathIsSupportedAndPortableAlwaysIs) {
  std::printf("cpu features: %s; GEMM path: %s\n",
              DetectCpuFeatures().ToString().c_str(),
              GemmIsaName(ActiveGemmIsa()));
  EXPECT_TRUE(GemmIsaSupported(GemmIsa::kPortable));
  EXPECT_TRUE(GemmIsaSupported(ActiveGemmIsa()));
  EXPECT_EQ(GemmIsaSupported(GemmIsa::kAvx512),
            DetectCpuFeatures().avx512f && DetectCpuFeatures().fma);
}

TEST(CpuFeaturesTest, Avx2CapClearsEveryAvx512AndAmxBit) {
  CpuFeatures all;
  all.avx2 = all.fma = all.f16c = all.avxvnni = all.avx512f = all.avx512bw =
      all.avx512vl = all.avx512bf16 = all.avx512vnni = all.avx512vbmi =
          all.avx512fp16 = all.amx_bf16 = all.amx_int8 = all.amx_usable = true;
  // AVX-VNNI is a 256-bit VEX extension, which AVX2-only CPUs may have.
  const CpuFeatures avx2 = CapCpuFeatures(all, CpuFeatures::Cap::kAvx2);
  EXPECT_EQ(avx2.ToString(), "avx2 fma f16c avxvnni cap=avx2");
  const CpuFeatures avx512 = CapCpuFeatures(all, CpuFeatures::Cap::kAvx512);
  EXPECT_EQ(avx512.ToString(),
            "avx2 fma f16c avxvnni avx512f avx512bw avx512vl avx512bf16 "
            "avx512vnni avx512vbmi avx512fp16 cap=avx512");
  const CpuFeatures native = CapCpuFeatures(all, CpuFeatures::Cap::kNative);
  EXPECT_EQ(native.ToString(), all.ToString());
  EXPECT_EQ(ParseCpuIsaCap("avx2"), CpuFeatures::Cap::kAvx2);
  EXPECT_EQ(ParseCpuIsaCap("avx512"), CpuFeatures::Cap::kAvx512);
  EXPECT_EQ(ParseCpuIsaCap("native"), CpuFeatures::Cap::kNative);
  EXPECT_FALSE(ParseCpuIsaCap("AVX2").has_value());
  EXPECT_FALSE(ParseCpuIsaCap("").has_value());
}

// FNV-1a over the output bits of GEMMs on every weight format and numerics
// that the engine runs, batch 1, 7 and 32: equal hashes, equal bits.
uint64_t GemmBitsHash() {
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  constexpr int64_t kN = 100, kK = 300, kMaxM = 32;
  std::vector<float> x(kMaxM * kK), wf(kN * kK);
  for (float& v : x) v = dist(rng);
  for (float& v : wf) v = 0.05f * dist(rng);
  struct Case {
    DType dtype;
    Int8Scaling scaling;
    WeightMatrix::Layout layout;
    GemmNumerics numerics;
  };
  const WeightMatrix::Layout kPanel = WeightMatrix::Layout::kPanel16;
  const WeightMatrix::Layout kDot = WeightMatrix::Layout::kPanel16Dot;
  uint64_t h = 1469598103934665603ull;
  for (const Case c :
       {Case{DType::kF32, Int8Scaling::kPerRow, kPanel,
             GemmNumerics::kFp32Chain},
        Case{DType::kBF16, Int8Scaling::kPerRow, kPanel,
             GemmNumerics::kFp32Chain},
        Case{DType::kBF16, Int8Scaling::kPerRow, kPanel,
             GemmNumerics::kBf16Dot},
        Case{DType::kI8, Int8Scaling::kPerRow, kPanel,
             GemmNumerics::kFp32Chain},
        Case{DType::kI8, Int8Scaling::kPerRow, kDot, GemmNumerics::kInt8Dot},
        Case{DType::kI8, Int8Scaling::kBlock32, kPanel,
             GemmNumerics::kInt8Dot}}) {
    const WeightMatrix w =
        WeightMatrix::Pack(wf.data(), kN, kK, c.dtype, c.scaling, c.layout);
    for (const int64_t m : {1, 7, 32}) {
      std::vector<float> y(m * kN);
      GemmNT(x.data(), m, kK, w, y.data(), c.numerics);
      std::vector<unsigned char> bytes(y.size() * sizeof(float));
      std::memcpy(bytes.data(), y.data(), bytes.size());
      for (const unsigned char b : bytes) h = (h ^ b) * 1099511628211ull;
    }
  }
  return h;
}

// Run by CpuIsaCapTest in a child process with PDSERVE_CPU_ISA set (the cap
// is read once per process); skipped otherwise.
TEST(CpuIsaCapChild, PrintsFeaturesPathAndGemmBits) {
  if (std::getenv("PDSERVE_CPU_ISA_CHILD") == nullptr)
    GTEST_SKIP() << "run by CpuIsaCapTest";
  std::printf("child: features=[%s] path=%s hash=%016llx\n",
              DetectCpuFeatures().ToString().c_str(),
              GemmIsaName(ActiveGemmIsa()),
              static_cast<unsigned long long>(GemmBitsHash()));
}

TEST(CpuIsaCapTest, Avx2CapRunsTheAvx2PathWithTheSameBits) {
  // This process's path as it is; whichever it is, the bits must be the same.
  const uint64_t here = GemmBitsHash();
  // This test binary (the shell popen starts would read its own).
  char exe[4096];
  const ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  ASSERT_GT(len, 0);
  exe[len] = '\0';
  const std::string command =
      std::string("PDSERVE_CPU_ISA=avx2 PDSERVE_CPU_ISA_CHILD=1 '") + exe +
      "' --gtest_filter='CpuIsaCapChild.*' 2>&1";
  FILE* child = popen(command.c_str(), "r");
  ASSERT_NE(child, nullptr);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, child) != nullptr) out += buf;
  ASSERT_EQ(pclose(child), 0) << out;
  const size_t at = out.find("child: features=[");
  ASSERT_NE(at, std::string::npos) << out;
  const std::string line = out.substr(at, out.find('\n', at) - at);
  std::printf("%s (this process: %s, hash=%016llx)\n", line.c_str(),
              GemmIsaName(ActiveGemmIsa()),
              static_cast<unsigned long long>(here));
  EXPECT_EQ(line.find("avx512"), std::string::npos) << line;
  EXPECT_EQ(line.find("amx"), std::string::npos) << line;
  EXPECT_NE(line.find("cap=avx2"), std::string::npos) << line;
  const CpuFeatures& f = DetectCpuFeatures();
  if (f.avx2 && f.fma && f.f16c) {
    EXPECT_NE(line.find("path=avx2 "), std::string::npos) << line;
  }
  char want[32];
  std::snprintf(want, sizeof want, "hash=%016llx",
                static_cast<unsigned long long>(here));
  EXPECT_NE(line.find(want), std::string::npos) << line;
}

}  // namespace
}  // namespace pdserve::kernels
