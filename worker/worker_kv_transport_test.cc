// Prefill and decode workers in one process, on loopback port 0, moving a
// request's KV with each --kv-transport: grpc, and nccl with its real gRPC
// control plane and the in-process fake communicator in place of NCCL (no
// GPU here). Outputs must match a colocated worker token for token.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "kv_transfer/nccl/fake_communicator.h"
#include "model/model_init.h"
#include "pdserve/v1/internal.grpc.pb.h"
#include "wire/enums.h"
#include "worker/worker_server.h"

namespace pdserve::worker {
namespace {

using ::testing::HasSubstr;

class WorkerKvTransportTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(std::filesystem::temp_directory_path() /
                           ("pdserve_worker_kv_" + std::to_string(::getpid())));
    engine::ModelInitOptions options;
    options.preset = "tiny";
    options.out_dir = *dir_;
    options.seed = 11;
    ASSERT_TRUE(engine::WriteRandomModel(options).ok());
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }

  WorkerConfig Config(const std::string& role, const std::string& transport,
                      DType kv_dtype) {
    WorkerConfig c;
    c.role = *wire::ParseRole(role);
    c.model_dir = *dir_;
    c.kv_transport = *kv_transfer::ParseKvTransport(transport);
    c.kv_communicators = transport == "nccl" ? &comms_ : nullptr;
    c.engine.kv_dtype = kv_dtype;
    c.engine.block_size = 4;
    c.engine.max_num_batched_tokens = 32;  // chunked prefill
    c.engine.kv_cache_bytes = 16 << 20;
    return c;
  }

  struct Result {
    grpc::Status status;
    std::vector<uint32_t> tokens;
  };
  static Result Generate(const std::string& worker, const std::string& prefill,
                         const std::string& id) {
    auto stub = v1::Worker::NewStub(
        grpc::CreateChannel(worker, grpc::InsecureChannelCredentials()));
    v1::WorkerGenerateRequest req;
    req.set_request_id(id);
    for (int i = 0; i < 90; ++i) req.add_token_ids(1 + (i * 13) % 250);
    req.mutable_sampling()->set_max_tokens(8);
    req.mutable_sampling()->set_ignore_eos(true);
    req.set_prefill_address(prefill);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(60));
    auto reader = stub->Generate(&ctx, req);
    Result r;
    v1::WorkerGenerateResponse resp;
    while (reader->Read(&resp)) {
      r.tokens.insert(r.tokens.end(), resp.token_ids().begin(),
                      resp.token_ids().end());
    }
    r.status = reader->Finish();
    return r;
  }

  static v1::WorkerStatus Status(const std::string& worker) {
    auto stub = v1::Worker::NewStub(
        grpc::CreateChannel(worker, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    v1::WorkerStatus status;
    const grpc::Status s =
        stub->GetStatus(&ctx, v1::WorkerInfoRequest(), &status);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return status;
  }
  // The worker's stats trail the engine by one loop iteration: waits (20 s at
  // most) until `free` blocks are free or cached, i.e. none is referenced.
  static bool FreeBlocksReturnTo(const std::string& worker, uint32_t free) {
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (Status(worker).free_blocks() != free) {
      if (absl::Now() >= until) return false;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return true;
  }

  // The tiny preset's KV shape (model/model_init.cc).
  static constexpr int64_t kTinyLayers = 2, kTinyKvHeads = 2, kTinyHeadDim = 16;
  kv_transfer::nccl::FakeCommunicatorFactory comms_;
  static std::string* dir_;
};
std::string* WorkerKvTransportTest::dir_ = nullptr;

TEST_F(WorkerKvTransportTest, EveryTransportAndDtypeMatchesColocated) {
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16, DType::kI8}) {
    metrics::Registry reg;
    auto both = WorkerServer::Start(Config("both", "grpc", dtype), &reg);
    ASSERT_TRUE(both.ok()) << both.status();
    const Result local = Generate((*both)->address(), "", "local");
    ASSERT_TRUE(local.status.ok()) << local.status.error_message();
    ASSERT_EQ(local.tokens.size(), 8u);
    for (const std::string transport : {"grpc", "nccl"}) {
      for (bool layerwise : {true, false}) {
        metrics::Registry r1, r2;
        WorkerConfig pc = Config("prefill", transport, dtype);
        pc.kv_layerwise = layerwise;
        auto prefill = WorkerServer::Start(pc, &r1);
        ASSERT_TRUE(prefill.ok()) << prefill.status();
        auto decode =
            WorkerServer::Start(Config("decode", transport, dtype), &r2);
        ASSERT_TRUE(decode.ok()) << decode.status();
        const std::string what = absl::StrCat(transport, " ", DTypeName(dtype),
                                              layerwise ? " layerwise" : "");
        // Twice: the second request reuses the decode worker's prefix cache,
        // so the prefill skips those blocks.
        for (const char* id : {"a", "b"}) {
          const Result got =
              Generate((*decode)->address(), (*prefill)->address(), id);
          ASSERT_TRUE(got.status.ok())
              << what << ": " << got.status.error_message();
          EXPECT_EQ(got.tokens, local.tokens) << what << " request " << id;
        }
        EXPECT_THAT(r1.Render(), HasSubstr("pdserve_kv_transfer_bytes_total{"
                                           "direction=\"sent\"}"));
      }
    }
  }
}

TEST_F(WorkerKvTransportTest, NcclWithoutAGpuOrCudaBuildFailsAtStart) {
  metrics::Registry reg;
  WorkerConfig c = Config("decode", "nccl", DType::kF32);
  c.kv_communicators = nullptr;  // the real NCCL
  auto worker = WorkerServer::Start(c, &reg);
  if (worker.ok()) GTEST_SKIP() << "a CUDA GPU is visible here";
  EXPECT_EQ(worker.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(worker.status().message(), HasSubstr("--kv-transport nccl"));
}

TEST_F(WorkerKvTransportTest, UnknownTransportIsInvalidArgument) {
  // The transport is an enum in WorkerConfig; a name is refused where it is
  // parsed (--kv-transport), naming the choices.
  const auto parsed = kv_transfer::ParseKvTransport("rdma");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(parsed.status().message()), HasSubstr("grpc"));
}

TEST_F(WorkerKvTransportTest, NcclPrefillToAGrpcOnlyDecodeWorkerFailsCleanly) {
  metrics::Registry r1, r2;
  auto prefill =
      WorkerServer::Start(Config("prefill", "nccl", DType::kF32), &r1);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  // A pool of 30 blocks, where one request takes 25 (90 + 8 tokens, blocks
  // of 4): a leaked reservation (23 blocks) would starve the next request.
  WorkerConfig dc = Config("decode", "grpc", DType::kF32);
  dc.engine.kv_cache_bytes = 30 * dc.engine.block_size * 2 * kTinyLayers *
                             kTinyKvHeads * kTinyHeadDim *
                             static_cast<int64_t>(sizeof(float));
  dc.admission_timeout = absl::Seconds(2);
  auto decode = WorkerServer::Start(dc, &r2);
  ASSERT_TRUE(decode.ok()) << decode.status();
  const v1::WorkerStatus start = Status((*decode)->address());
  ASSERT_EQ(start.total_blocks(), 30u);
  ASSERT_EQ(start.free_blocks(), start.total_blocks());

  const Result got = Generate((*decode)->address(), (*prefill)->address(), "x");
  EXPECT_FALSE(got.status.ok());
  // Every reserved block came back (free or cached, none active)...
  EXPECT_TRUE(FreeBlocksReturnTo((*decode)->address(), start.total_blocks()));
  // ...so the same request fits and runs locally, and again gives back all.
  const Result again = Generate((*decode)->address(), "", "y");
  EXPECT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_TRUE(FreeBlocksReturnTo((*decode)->address(), start.total_blocks()));
}

}  // namespace
}  // namespace pdserve::worker
