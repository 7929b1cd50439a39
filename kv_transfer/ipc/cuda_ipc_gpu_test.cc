// cuda_ipc on one GPU (label gpu; each test skips with the reason where no
// GPU is visible):
// - the cuda_ipc backend writing into another process's device memory: each
//   span carries its own pattern and lands at a shuffled destination, and
//   every span of the 256 MiB region is read back and checked (a wrong,
//   duplicated or dropped offset fails); a region at an offset inside the
//   allocation maps to that offset; a region claiming more than the
//   allocation holds is refused (cuMemGetAddressRange on the imported
//   pointer); then the copy rate against cudaMemcpy device to device of the
//   same bytes within one process, printed as a `BENCH` line (goal: ratio
//   >= 0.8);
// - a prefill and a decode worker (real processes) on the GPU moving KV over
//   cuda_ipc, fp32, int8 and fp8 KV (the quantized dtypes add the scale
//   regions): tokens equal a colocated GPU worker's, greedy and seeded.
//
// CUDA IPC handles cannot be opened by the process that made them, so the
// rate test forks an exporter before this process touches CUDA; it is
// therefore the first test of the binary.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kv_transfer/ipc/cuda_ipc_backend.h"
#include "kv_transfer/ipc/peer_memory.h"
#include "tests/cluster.h"

namespace pdserve::kv_transfer::ipc {
namespace {

constexpr size_t kBytes = size_t{256} << 20;
constexpr size_t kSpan = size_t{32} << 10;  // a 1B-shaped (layer, block) span

bool ReadAll(int fd, void* p, size_t n) {
  auto* at = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t got = read(fd, at, n);
    if (got <= 0) return false;
    at += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

// Span i's pattern: 32-bit words (i << 16) + word index, so any two spans,
// and any two words of one span, differ.
std::vector<uint32_t> Pattern(size_t spans) {
  std::vector<uint32_t> out(spans * kSpan / 4);
  for (size_t i = 0; i < spans; ++i)
    for (size_t w = 0; w < kSpan / 4; ++w)
      out[i * kSpan / 4 + w] = static_cast<uint32_t>((i << 16) + w);
  return out;
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
      .count();
}

TEST(CudaIpcGpuTest, CopyRateAgainstCudaMemcpyDeviceToDevice) {
  int to_parent[2], to_child[2];
  ASSERT_EQ(pipe(to_parent), 0);
  ASSERT_EQ(pipe(to_child), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The exporter: reports the device count, then exports kBytes of device
    // memory and keeps it alive until the parent is done.
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
    (void)!write(to_parent[1], &count, sizeof count);
    if (count == 0) _exit(0);
    void* p = nullptr;
    cudaIpcMemHandle_t handle{};
    const bool ok = cudaMalloc(&p, kBytes) == cudaSuccess &&
                    cudaIpcGetMemHandle(&handle, p) == cudaSuccess;
    const char flag = ok ? 1 : 0;
    (void)!write(to_parent[1], &flag, 1);
    (void)!write(to_parent[1], &handle, sizeof handle);
    char done = 0;
    (void)!read(to_child[0], &done, 1);
    _exit(0);
  }
  close(to_parent[1]);
  close(to_child[0]);
  auto finish = [&] {
    const char done = 1;
    (void)!write(to_child[1], &done, 1);
    waitpid(child, nullptr, 0);
  };
  int count = 0;
  ASSERT_TRUE(ReadAll(to_parent[0], &count, sizeof count));
  if (count == 0) {
    finish();
    GTEST_SKIP() << "no CUDA device visible: cuda_ipc not measured";
  }
  char flag = 0;
  cudaIpcMemHandle_t handle{};
  ASSERT_TRUE(ReadAll(to_parent[0], &flag, 1));
  ASSERT_TRUE(ReadAll(to_parent[0], &handle, sizeof handle));
  if (flag != 1) {
    finish();
    FAIL() << "the exporter could not allocate or export device memory";
  }

  auto backend = NewCudaIpcBackend(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const std::string raw(reinterpret_cast<const char*>(&handle), sizeof handle);
  KvExport peer;
  peer.kind = PeerMemoryKind::kCudaIpc;
  peer.device = 0;
  peer.regions.push_back({kBytes, EncodeCudaIpcHandle(raw, 0)});
  // A region that claims one byte more than the exporter allocated: the
  // importer's own cuMemGetAddressRange of the mapping must refuse it.
  KvExport lie = peer;
  lie.regions[0].bytes = kBytes + 1;
  auto refused = (*backend)->Map(lie);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition)
      << refused.status();
  auto mapping = (*backend)->Map(peer);
  ASSERT_TRUE(mapping.ok()) << mapping.status();
  // The same allocation as a region at an offset (a sub-allocation), mapped
  // while the first mapping is open: one open of the handle serves both.
  constexpr uint64_t kOffset = uint64_t{1} << 20;
  KvExport inner = peer;
  inner.regions[0] = {kBytes - kOffset, EncodeCudaIpcHandle(raw, kOffset)};
  auto inner_mapping = (*backend)->Map(inner);
  ASSERT_TRUE(inner_mapping.ok()) << inner_mapping.status();
  EXPECT_EQ((*inner_mapping)->base(0), (*mapping)->base(0) + kOffset);
  inner_mapping->reset();  // must not unmap the first mapping's memory

  const size_t spans = kBytes / kSpan;
  const std::vector<uint32_t> pattern = Pattern(spans);
  void *src = nullptr, *local = nullptr;
  ASSERT_EQ(cudaMalloc(&src, kBytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&local, kBytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(src, pattern.data(), kBytes, cudaMemcpyHostToDevice),
            cudaSuccess);
  // As the transport issues them, one cudaMemcpyAsync per span, with span
  // i of the source going to destination span perm[i].
  std::vector<size_t> perm(spans);
  for (size_t i = 0; i < spans; ++i) perm[i] = (i * 2654435761u) % spans;
  std::sort(perm.begin(), perm.end());
  perm.erase(std::unique(perm.begin(), perm.end()), perm.end());
  ASSERT_EQ(perm.size(), spans) << "2654435761 must be coprime with spans";
  for (size_t i = 0; i < spans; ++i) perm[i] = (i * 2654435761u) % spans;
  std::vector<CopyOp> ops;
  for (size_t i = 0; i < spans; ++i) {
    ops.push_back({(*mapping)->base(0) + perm[i] * kSpan,
                   static_cast<const uint8_t*>(src) + i * kSpan, kSpan});
  }
  ASSERT_TRUE((*mapping)->Copy(ops, absl::Now() + absl::Seconds(30)).ok());
  std::vector<uint32_t> back(kBytes / 4);
  ASSERT_EQ(cudaMemcpy(back.data(), (*mapping)->base(0), kBytes,
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  size_t wrong = 0;
  for (size_t i = 0; i < spans && wrong < 5; ++i) {
    if (std::memcmp(&back[perm[i] * kSpan / 4], &pattern[i * kSpan / 4],
                    kSpan) != 0) {
      ADD_FAILURE() << "destination span " << perm[i]
                    << " does not hold source span " << i << " (first word "
                    << back[perm[i] * kSpan / 4] << ")";
      ++wrong;
    }
  }
  EXPECT_EQ(wrong, 0u);
  double ipc_best = 1e9, d2d_best = 1e9;
  for (int rep = 0; rep < 4; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE((*mapping)->Copy(ops, absl::Now() + absl::Seconds(30)).ok());
    if (rep > 0) ipc_best = std::min(ipc_best, Seconds(t0));
    t0 = std::chrono::steady_clock::now();
    ASSERT_EQ(cudaMemcpy(local, src, kBytes, cudaMemcpyDeviceToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (rep > 0) d2d_best = std::min(d2d_best, Seconds(t0));
  }
  const double gb = static_cast<double>(kBytes) / 1e9;
  std::printf(
      "BENCH cuda_ipc %zu MiB in %zu KiB spans: %.1f GB/s; cudaMemcpy D2D "
      "(one process, one copy): %.1f GB/s; ratio %.2f (goal >= 0.8)\n",
      kBytes >> 20, kSpan >> 10, gb / ipc_best, gb / d2d_best,
      d2d_best / ipc_best);
  cudaFree(src);
  cudaFree(local);
  mapping->reset();
  finish();
}

class CudaIpcServingTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
      GTEST_SKIP() << "no CUDA device visible: cuda_ipc serving not run";
    // The workers are real processes of the build tree's binary; a bundle
    // that carries only this test cannot start them.
    const std::string bin = pdserve::testing::PdserveBin();
    if (access(bin.c_str(), X_OK) != 0)
      GTEST_SKIP() << bin << " is missing: cuda_ipc serving not run";
    model_ = std::filesystem::temp_directory_path() /
             ("pdserve_cuda_ipc_" + std::to_string(::getpid()));
    pdserve::testing::RunCli(bin, "model init --preset tiny --out " + model_);
    ASSERT_TRUE(std::filesystem::exists(model_ + "/config.json"));
  }
  void TearDown() override {
    if (!model_.empty()) std::filesystem::remove_all(model_);
  }
  std::string model_;
};

// fp32 KV moves one data region per layer; int8 and fp8 add a scale region
// per layer, so a scale span dropped, misplaced or read from the wrong
// offset changes the decode worker's attention and its tokens. Exact token
// equality is the right bound: both sides run the same kernels on the same
// bytes, so any difference is a transfer fault, not rounding.
TEST_P(CudaIpcServingTest, PrefillDecodePairOnOneGpuEqualsColocated) {
  using pdserve::testing::Cluster;
  const std::vector<std::string> gpu = {"--device=cuda", "--gpu-reference-math",
                                        "--gpu-memory-utilization=0.2",
                                        "--kv-dtype=" + GetParam()};
  std::vector<std::string> pd = gpu;
  pd.push_back("--kv-transport=cuda_ipc");
  Cluster disagg =
      Cluster::Start(model_, 1, 1, {"--local-prefill-threshold=-1"}, pd);
  Cluster coloc = Cluster::Start(model_, 0, 1, {}, gpu);
  std::string prompt = "CUDA IPC moves this prompt's KV between processes: ";
  for (int i = 0; i < 8; ++i) absl::StrAppend(&prompt, "part ", i, ". ");
  for (auto [temp, seed] : {std::pair{0.0f, 0ull}, {0.8f, 99ull}}) {
    auto a = pdserve::testing::Generate(
        disagg.stub.get(), pdserve::testing::Request(prompt, 16, temp, seed));
    auto b = pdserve::testing::Generate(
        coloc.stub.get(), pdserve::testing::Request(prompt, 16, temp, seed));
    ASSERT_TRUE(a.status.ok()) << a.status.error_message();
    ASSERT_TRUE(b.status.ok()) << b.status.error_message();
    EXPECT_EQ(a.tokens, b.tokens) << "temperature " << temp;
    EXPECT_THAT(a.last.prefill_worker(), ::testing::HasSubstr("prefill@"));
  }
  const double sent = pdserve::testing::MetricValue(
      pdserve::testing::Scrape(disagg.prefill[0].metrics_port),
      "pdserve_kv_transfer_bytes_total{direction=\"sent\"}");
  EXPECT_GT(sent, 0);
}

INSTANTIATE_TEST_SUITE_P(KvDtypes, CudaIpcServingTest,
                         ::testing::Values("fp32", "int8", "fp8"));

}  // namespace
}  // namespace pdserve::kv_transfer::ipc
