#include "kernels/cpu/fma_peak.h"

#include <time.h>
#include <unistd.h>

#include "gtest/gtest.h"

namespace pdserve::kernels {
namespace {

double ProcessCpuMs() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e3 +
         static_cast<double>(t.tv_nsec) / 1e6;
}

// CPU milliseconds this process burns while the calling thread sleeps 30 ms.
double CpuMsDuringASleep() {
  const double cpu0 = ProcessCpuMs();
  ::usleep(30'000);
  return ProcessCpuMs() - cpu0;
}

// Waits (up to 3 s) until nothing in the process runs while this thread
// sleeps: OpenBLAS's threads poll for work for a while after the library
// starts, before any measurement here.
void WaitUntilQuiet() {
  for (int i = 0; i < 100 && CpuMsDuringASleep() >= 1.0; ++i) {
  }
}

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
