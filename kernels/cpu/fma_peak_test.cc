#include "kernels/cpu/fma_peak.h"

#include "gtest/gtest.h"
#include "kernels/cpu/idle_cpu_testing.h"

namespace pdserve::kernels {
namespace {

using idle_cpu::CpuMsDuringASleep;
using idle_cpu::WaitUntilQuiet;

// Benchmarks measure the peak right before timed kernels: the measurement
// must leave no thread polling for work on the cores those kernels need.
TEST(FmaPeakTest, PositiveOnEveryThreadCountAndNothingBurnsCpuAfterwards) {
  WaitUntilQuiet();
  for (int threads : {1, 2}) {
    EXPECT_GT(MeasureFmaPeakGflops(GemmIsa::kPortable, threads, 0.03), 0)
        << threads;
    EXPECT_LT(CpuMsDuringASleep(), 1.0) << threads;
  }
}

}  // namespace
}  // namespace pdserve::kernels
