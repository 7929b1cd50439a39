// Benchmark (label gpu; runs only with PDSERVE_GPU_BENCH=1, which
// scripts/gpu-check.sh run sets): time to first token and inter-token
// latency of a colocated GPU worker vs a prefill + decode pair on the same
// GPU, over grpc (KV through pinned staging) and over cuda_ipc, on a
// Llama-3.2-1B-shaped random bf16 model. Prints BENCH lines; asserts only
// that every request completed with its tokens. Skips with the reason where
// no CUDA device is visible.
#include <cuda_runtime_api.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "engine/cuda_backend.h"
#include "model/model_init.h"
#include "pdserve/v1/internal.grpc.pb.h"
#include "worker/worker_server.h"

namespace pdserve::worker {
namespace {

using Clock = std::chrono::steady_clock;

std::string SkipReason() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess)
    return absl::StrCat("no CUDA device: ", cudaGetErrorString(error));
  if (count == 0) return "no CUDA device: cudaGetDeviceCount reports 0";
  const char* bench = std::getenv("PDSERVE_GPU_BENCH");
  if (bench == nullptr || std::string(bench) != "1")
    return "benchmark: set PDSERVE_GPU_BENCH=1 to run it";
  return "";
}

// Shared with engine_cuda_test's benchmark: written once under /tmp.
std::string BenchModelDir() {
  if (const char* dir = std::getenv("PDSERVE_BENCH_MODEL_DIR")) return dir;
  const std::string dir = "/tmp/pdserve-bench-llama3.2-1b";
  if (!std::filesystem::exists(dir + "/complete")) {
    std::filesystem::remove_all(dir);
    engine::ModelInitOptions opts;
    opts.preset = "llama3.2-1b";
    opts.out_dir = dir;
    opts.seed = 1;
    const absl::Status s = engine::WriteRandomModel(opts);
    EXPECT_TRUE(s.ok()) << s;
    if (!s.ok()) return "";
    std::FILE* f = std::fopen((dir + "/complete").c_str(), "w");
    if (f) std::fclose(f);
  }
  return dir;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1))];
}

struct Timing {
  grpc::Status status;
  size_t tokens = 0;
  double ttft_ms = 0;
  std::vector<double> itl_ms;  // gaps between later tokens
};

// One greedy request of `prompt_len` tokens for `max_tokens`, streamed.
Timing Request(v1::Worker::Stub* stub, const std::string& prefill,
               const std::string& id, int prompt_len, int max_tokens) {
  v1::WorkerGenerateRequest req;
  req.set_request_id(id);
  for (int i = 0; i < prompt_len; ++i)
    req.add_token_ids(1 + (i * 7919 + id.size() * 31) % 127000);
  req.mutable_sampling()->set_max_tokens(max_tokens);
  req.mutable_sampling()->set_ignore_eos(true);
  req.set_prefill_address(prefill);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::seconds(120));
  Timing t;
  const auto t0 = Clock::now();
  auto last = t0;
  auto reader = stub->Generate(&ctx, req);
  v1::WorkerGenerateResponse resp;
  while (reader->Read(&resp)) {
    if (resp.token_ids_size() == 0) continue;
    const auto now = Clock::now();
    const double ms =
        std::chrono::duration<double, std::milli>(now - last).count();
    if (t.tokens == 0) {
      t.ttft_ms = ms;
    } else {
      // Tokens that arrive together share one gap.
      t.itl_ms.push_back(ms / resp.token_ids_size());
    }
    t.tokens += resp.token_ids_size();
    last = now;
  }
  t.status = reader->Finish();
  return t;
}

class WorkerGpuBenchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string reason = SkipReason();
    if (!reason.empty()) GTEST_SKIP() << reason;
    engine::RegisterCudaBackend();
    dir_ = BenchModelDir();
    ASSERT_FALSE(dir_.empty());
  }
  WorkerConfig Config(v1::WorkerRole role,
                      kv_transfer::KvTransportKind transport) {
    WorkerConfig c;
    c.role = role;
    c.model_dir = dir_;
    c.engine.device = engine::Device::kCuda;
    c.engine.kv_dtype = DType::kBF16;
    c.engine.gpu_memory_utilization = 0.2;  // up to three workers per GPU
    c.engine.max_num_batched_tokens = 2048;
    c.engine.enable_prefix_caching = false;  // every request prefills fully
    c.kv_transport = transport;
    c.kv_stall_timeout = absl::Seconds(60);
    return c;
  }
  // Runs `n` sequential requests (after one warm-up) and prints one line.
  void Measure(const std::string& mode, const std::string& decode_address,
               const std::string& prefill_address) {
    auto stub = v1::Worker::NewStub(grpc::CreateChannel(
        decode_address, grpc::InsecureChannelCredentials()));
    const int kPrompt = 1024, kNew = 64, kRequests = 8;
    Timing warm =
        Request(stub.get(), prefill_address, mode + "-warm", kPrompt, 4);
    ASSERT_TRUE(warm.status.ok())
        << mode << ": " << warm.status.error_message();
    std::vector<double> ttft, itl;
    for (int i = 0; i < kRequests; ++i) {
      Timing t = Request(stub.get(), prefill_address, absl::StrCat(mode, i),
                         kPrompt, kNew);
      ASSERT_TRUE(t.status.ok()) << mode << ": " << t.status.error_message();
      EXPECT_EQ(t.tokens, static_cast<size_t>(kNew)) << mode;
      ttft.push_back(t.ttft_ms);
      itl.insert(itl.end(), t.itl_ms.begin(), t.itl_ms.end());
    }
    std::printf(
        "BENCH worker_gpu_bench model=llama3.2-1b kv=bf16 mode=%s prompt=%d "
        "new=%d requests=%d ttft_ms_p50=%.2f ttft_ms_p99=%.2f itl_ms_p50=%.3f "
        "itl_ms_p99=%.3f\n",
        mode.c_str(), kPrompt, kNew, kRequests, Percentile(ttft, 0.5),
        Percentile(ttft, 0.99), Percentile(itl, 0.5), Percentile(itl, 0.99));
    std::fflush(stdout);
  }
  std::string dir_;
};

TEST_F(WorkerGpuBenchTest, DisaggregatedVsColocatedTtftAndItlOnOneGpu) {
  using kv_transfer::KvTransportKind;
  {
    metrics::Registry r;
    auto both = WorkerServer::Start(
        Config(v1::WORKER_ROLE_BOTH, KvTransportKind::kGrpc), &r);
    ASSERT_TRUE(both.ok()) << both.status();
    Measure("colocated", (*both)->address(), "");
  }
  for (KvTransportKind transport :
       {KvTransportKind::kGrpc, KvTransportKind::kCudaIpc}) {
    const std::string mode =
        absl::StrCat("disaggregated_", kv_transfer::KvTransportName(transport));
    metrics::Registry r1, r2;
    auto decode =
        WorkerServer::Start(Config(v1::WORKER_ROLE_DECODE, transport), &r2);
    auto prefill =
        decode.ok()
            ? WorkerServer::Start(Config(v1::WORKER_ROLE_PREFILL, transport),
                                  &r1)
            : absl::StatusOr<std::unique_ptr<WorkerServer>>(decode.status());
    if (!decode.ok() || !prefill.ok()) {
      // grpc must work; another transport may not be available here.
      const absl::Status s = decode.ok() ? prefill.status() : decode.status();
      if (transport == KvTransportKind::kGrpc) FAIL() << mode << ": " << s;
      std::printf("BENCH worker_gpu_bench mode=%s unavailable: %s\n",
                  mode.c_str(), s.ToString().c_str());
      continue;
    }
    Measure(mode, (*decode)->address(), (*prefill)->address());
  }
}

}  // namespace
}  // namespace pdserve::worker
