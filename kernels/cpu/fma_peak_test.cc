#include "kernels/cpu/fma_peak.h"

#include "gtest/gtest.h"
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

}  // namespace
}  // namespace pdserve::kernels
