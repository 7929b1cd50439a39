#include "kernels/cpu/step_profile.h"

#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/packed_gemm.h"

namespace pdserve::kernels {
namespace {

TEST(StepProfileTest, TimersCountOnlyWhileACollectorIsInstalled) {
  StepProfile prof;
  { PhaseTimer t(Phase::kRope); }
  {
    ProfileCollector collect(&prof);
    {
      PhaseTimer t(Phase::kRope);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    PhaseTimer stopped(Phase::kNorm);
    stopped.Stop();
    stopped.Stop();
  }
  { PhaseTimer t(Phase::kRope); }
  EXPECT_EQ(prof.calls[static_cast<int>(Phase::kRope)], 1);
  EXPECT_GE(prof.ns[static_cast<int>(Phase::kRope)], 2'000'000);
  EXPECT_EQ(prof.calls[static_cast<int>(Phase::kNorm)], 1);
  EXPECT_EQ(ActiveProfile(), nullptr);
}

TEST(StepProfileTest, CollectorIsPerThread) {
  StepProfile prof;
  ProfileCollector collect(&prof);
  std::thread other([] {
    EXPECT_EQ(ActiveProfile(), nullptr);
    PhaseTimer t(Phase::kRope);
  });
  other.join();
  EXPECT_EQ(prof.calls[static_cast<int>(Phase::kRope)], 0);
}

TEST(StepProfileTest, GemmRecordsCallsRegionsAndKBlockBarriers) {
  SetKernelThreads(2);
  // n = 512: enough column tiles for both threads on every path (a path
  // with wide tiles runs a one-tile GEMM on the calling thread alone, with
  // no parallel region).
  const int64_t m = 256, k = 8192, n = 512;
  std::vector<float> x(m * k, 0.5f), w(n * k, 0.25f), y(m * n);
  const WeightMatrix wm = WeightMatrix::Pack(w.data(), n, k, DType::kBF16);
  StepProfile prof;
  {
    ProfileCollector collect(&prof);
    GemmNT(x.data(), m, k, wm, y.data());
    GemmNT(x.data(), 1, k, wm, y.data());
  }
  EXPECT_EQ(prof.gemm_calls, 2);
  // 256 rows take k blocks of 1M / 256 = 4096: two regions, one barrier
  // between them; one row is one region.
  EXPECT_EQ(prof.parallel_regions, 3);
  EXPECT_EQ(prof.barriers, 1);
  EXPECT_FLOAT_EQ(y[0], 0.5f * 0.25f * k);
  // Packing is timed where the calling thread packs, on its first chunk of a
  // k block; with two threads a helper may claim every chunk (a caller
  // preempted after publishing the job), so the packing time is checked on
  // one thread, where the caller runs every chunk.
  const int threads = KernelThreads();
  SetKernelThreads(1);
  StepProfile solo;
  {
    ProfileCollector collect(&solo);
    GemmNT(x.data(), m, k, wm, y.data());
  }
  SetKernelThreads(threads);
  EXPECT_EQ(solo.gemm_calls, 1);
  EXPECT_GT(solo.pack_ns, 0);
}

}  // namespace
}  // namespace pdserve::kernels
