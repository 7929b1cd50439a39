#include "kernels/cpu/fma_peak.h"

#include <cstdio>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/idle_cpu_testing.h"

namespace pdserve::kernels {
namespace {

using idle_cpu::ThreadIds;
using idle_cpu::ThreadsStartedSince;

// Benchmarks measure the peak right before timed kernels: the measurement
// must leave no thread behind to poll for work on the cores those kernels
// need.
TEST(FmaPeakTest, PositiveOnEveryThreadCountAndLeavesNoThreadBehind) {
  for (int threads : {1, 2}) {
    const auto before = ThreadIds();
    EXPECT_GT(MeasureFmaPeakGflops(GemmIsa::kPortable, threads, 0.03), 0)
        << threads;
    EXPECT_EQ(ThreadsStartedSince(before), 0) << threads;
  }
}

// Each instruction's peak is measured where the CPU has it, and 0 where it
// does not (benchmarks then print no fraction of it).
TEST(FmaPeakTest, AvxVnniPeakIsMeasuredExactlyWhereTheCpuHasIt) {
  const double gops = MeasureAvxVnniPeakGops(1, 0.03);
  if (DetectCpuFeatures().avxvnni && DetectCpuFeatures().avx2) {
    EXPECT_GT(gops, 0);
  } else {
    EXPECT_EQ(gops, 0);
    std::printf("no AVX-VNNI here (%s): its peak reads 0\n",
                DetectCpuFeatures().ToString().c_str());
  }
}

// The AVX2 int8 dot sequence: 4 instructions per 64 ops, so on a CPU with
// both it runs below the VEX VPDPBUSD's one instruction per 64 ops.
TEST(FmaPeakTest, Avx2DotPeakIsMeasuredWhereTheCpuHasAvx2) {
  if (!DetectCpuFeatures().avx2) {
    EXPECT_EQ(MeasureAvx2DotPeakGops(1, 0.03), 0);
    GTEST_SKIP() << "no AVX2 here: its peak reads 0";
  }
  const double gops = MeasureAvx2DotPeakGops(1, 0.05);
  EXPECT_GT(gops, 0);
  if (DetectCpuFeatures().avxvnni) {
    EXPECT_LT(gops, MeasureAvxVnniPeakGops(1, 0.05));
  }
}

}  // namespace
}  // namespace pdserve::kernels
