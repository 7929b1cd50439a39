// GPU prefill and decode workers on one GPU (label gpu): the prefill worker's
// KV leaves device memory through pinned staging and the grpc transport and
// lands in the decode worker's device blocks; with --gpu-reference-math the
// tokens must equal a colocated GPU worker's, greedy and seeded. Skips with
// the reason where no CUDA device is visible. Covers fp32, bf16, int8 and
// fp8 KV (the quantized ones move scale spans too). Prints each disaggregated
// request's time (BENCH lines) for scripts/gpu-check.sh.
#include <cuda_runtime_api.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
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

std::string NoGpuReason() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess)
    return absl::StrCat("no CUDA device: ", cudaGetErrorString(error));
  if (count == 0) return "no CUDA device: cudaGetDeviceCount reports 0";
  return "";
}

struct Result {
  grpc::Status status;
  std::vector<uint32_t> tokens;
};

Result Generate(const std::string& worker, const std::string& prefill,
                const std::string& id, float temperature, uint64_t seed) {
  auto stub = v1::Worker::NewStub(
      grpc::CreateChannel(worker, grpc::InsecureChannelCredentials()));
  v1::WorkerGenerateRequest req;
  req.set_request_id(id);
  for (int i = 0; i < 200; ++i) req.add_token_ids(1 + (i * 13) % 250);
  req.mutable_sampling()->set_max_tokens(16);
  req.mutable_sampling()->set_ignore_eos(true);
  req.mutable_sampling()->set_temperature(temperature);
  req.mutable_sampling()->set_seed(seed);
  req.set_prefill_address(prefill);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::seconds(120));
  auto reader = stub->Generate(&ctx, req);
  Result r;
  v1::WorkerGenerateResponse resp;
  while (reader->Read(&resp))
    r.tokens.insert(r.tokens.end(), resp.token_ids().begin(),
                    resp.token_ids().end());
  r.status = reader->Finish();
  return r;
}

class WorkerGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string reason = NoGpuReason();
    if (!reason.empty()) GTEST_SKIP() << reason;
    engine::RegisterCudaBackend();
    dir_ = std::filesystem::temp_directory_path() /
           ("pdserve_worker_gpu_" + std::to_string(::getpid()));
    engine::ModelInitOptions options;
    options.preset = "small";
    options.out_dir = dir_;
    ASSERT_TRUE(engine::WriteRandomModel(options).ok());
  }
  void TearDown() override {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  WorkerConfig Config(v1::WorkerRole role, DType kv, bool reference_math) {
    WorkerConfig c;
    c.role = role;
    c.model_dir = dir_;
    c.engine.device = engine::Device::kCuda;
    c.engine.gpu_reference_math = reference_math;
    c.engine.gpu_memory_utilization = 0.25;  // three workers on one GPU
    c.engine.kv_dtype = kv;
    c.kv_stall_timeout = absl::Seconds(60);
    return c;
  }
  std::string dir_;
};

// Every KV dtype the GPU stores, int8 and fp8 with their scale spans, and
// for the quantized ones also the serving math (bf16 GEMMs, the tensor-core
// prefill kernel) besides the reference math (fp32 GEMMs, prefill through
// the decode kernel). Exact equality is the bound: both sides run the same
// kernels on the same inputs on one GPU, and the KV bytes (and scales)
// arrive unchanged, so any difference is a transfer or layout fault.
TEST_F(WorkerGpuTest, OneGpuPrefillDecodePairOverGrpcEqualsColocated) {
  struct Case {
    DType kv;
    bool reference_math;
  };
  for (const Case& c :
       {Case{DType::kBF16, true}, Case{DType::kF32, true},
        Case{DType::kI8, true}, Case{DType::kFp8E4M3, true},
        Case{DType::kI8, false}, Case{DType::kFp8E4M3, false}}) {
    const DType kv = c.kv;
    SCOPED_TRACE(absl::StrCat(
        DTypeName(kv), c.reference_math ? " reference math" : " serving math"));
    metrics::Registry r0, r1, r2;
    auto both = WorkerServer::Start(
        Config(v1::WORKER_ROLE_BOTH, kv, c.reference_math), &r0);
    ASSERT_TRUE(both.ok()) << both.status();
    auto prefill = WorkerServer::Start(
        Config(v1::WORKER_ROLE_PREFILL, kv, c.reference_math), &r1);
    ASSERT_TRUE(prefill.ok()) << prefill.status();
    auto decode = WorkerServer::Start(
        Config(v1::WORKER_ROLE_DECODE, kv, c.reference_math), &r2);
    ASSERT_TRUE(decode.ok()) << decode.status();
    for (auto [temperature, seed] :
         {std::pair<float, uint64_t>{0.0f, 0}, {0.8f, 42}}) {
      const Result want =
          Generate((*both)->address(), "", "colocated", temperature, seed);
      ASSERT_TRUE(want.status.ok()) << want.status.error_message();
      const auto t0 = std::chrono::steady_clock::now();
      const Result got =
          Generate((*decode)->address(), (*prefill)->address(),
                   absl::StrCat("disagg-", seed), temperature, seed);
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
              .count();
      ASSERT_TRUE(got.status.ok()) << got.status.error_message();
      EXPECT_EQ(got.tokens, want.tokens)
          << DTypeName(kv) << " temperature " << temperature;
      std::printf("BENCH worker_gpu kv=%s temperature=%.1f request_s=%.4f\n",
                  DTypeName(kv), temperature, s);
    }
  }
}

}  // namespace
}  // namespace pdserve::worker
