// WorkerServer start-up and configuration: the server listens before its
// port (and so its address and id) is known, so RPCs in that window must be
// refused cleanly, never served by half-built handlers.
#include "worker/worker_server.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "model/model_init.h"
#include "pdserve/v1/internal.grpc.pb.h"

namespace pdserve::worker {
namespace {

using ::testing::HasSubstr;

class WorkerServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(
        std::filesystem::temp_directory_path() /
        ("pdserve_worker_server_" + std::to_string(::getpid())));
    engine::ModelInitOptions options;
    options.preset = "tiny";
    options.out_dir = *dir_;
    ASSERT_TRUE(engine::WriteRandomModel(options).ok());
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }
  static WorkerConfig Config(v1::WorkerRole role) {
    WorkerConfig c;
    c.role = role;
    c.model_dir = *dir_;
    c.engine.block_size = 4;
    c.engine.kv_cache_bytes = 4 << 20;
    return c;
  }
  static std::string* dir_;
};
std::string* WorkerServerTest::dir_ = nullptr;

TEST_F(WorkerServerTest, RpcsDuringStartUpAreRefusedWithUnavailable) {
  for (v1::WorkerRole role : {v1::WORKER_ROLE_PREFILL, v1::WORKER_ROLE_DECODE,
                              v1::WORKER_ROLE_BOTH}) {
    metrics::Registry registry;
    WorkerConfig c = Config(role);
    int calls = 0;
    c.after_listen_for_test = [&](int port) {
      auto stub = v1::Worker::NewStub(
          grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                              grpc::InsecureChannelCredentials()));
      auto deadline =
          std::chrono::system_clock::now() + std::chrono::seconds(10);
      {
        grpc::ClientContext ctx;
        ctx.set_deadline(deadline);
        v1::WorkerStatus status;
        grpc::Status st =
            stub->GetStatus(&ctx, v1::WorkerInfoRequest(), &status);
        EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE);
        EXPECT_THAT(st.error_message(), HasSubstr("starting"));
        ++calls;
      }
      {
        grpc::ClientContext ctx;
        ctx.set_deadline(deadline);
        v1::WorkerGenerateRequest req;
        req.add_token_ids(1);
        req.mutable_sampling()->set_max_tokens(1);
        auto reader = stub->Generate(&ctx, req);
        v1::WorkerGenerateResponse resp;
        EXPECT_FALSE(reader->Read(&resp));
        grpc::Status st = reader->Finish();
        EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE);
        ++calls;
      }
      {
        grpc::ClientContext ctx;
        ctx.set_deadline(deadline);
        v1::PrefillRequest req;
        req.add_token_ids(1);
        v1::PrefillResponse resp;
        grpc::Status st = stub->Prefill(&ctx, req, &resp);
        EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE);
        ++calls;
      }
    };
    auto server = WorkerServer::Start(c, &registry);
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_EQ(calls, 3);
    // Once Start returned, the same RPC is served with the final identity.
    auto stub = v1::Worker::NewStub(grpc::CreateChannel(
        (*server)->address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    v1::WorkerStatus status;
    ASSERT_TRUE(stub->GetStatus(&ctx, v1::WorkerInfoRequest(), &status).ok());
    EXPECT_EQ(status.role(), role);
    EXPECT_EQ(status.address(), (*server)->address());
    EXPECT_EQ(status.id(), (*server)->id());
    EXPECT_FALSE(status.id().empty());
    (*server)->Shutdown();
  }
}

TEST_F(WorkerServerTest, UnknownRoleIsRejected) {
  metrics::Registry registry;
  for (auto role :
       {v1::WORKER_ROLE_UNSPECIFIED, static_cast<v1::WorkerRole>(9)}) {
    auto server = WorkerServer::Start(Config(role), &registry);
    ASSERT_FALSE(server.ok());
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(server.status().message()), HasSubstr("--role"));
  }
}

TEST_F(WorkerServerTest, GpuEngineIsAcceptedForEveryRoleAndFailsCleanlyHere) {
  // KV transfer reads and writes backend storage spans, so a GPU engine is a
  // valid configuration for prefill and decode roles too. This test binary
  // registers no CUDA backend, so Start must fail with a clear status (as it
  // does on a machine without a GPU), never crash.
  metrics::Registry registry;
  for (auto role : {v1::WORKER_ROLE_PREFILL, v1::WORKER_ROLE_DECODE,
                    v1::WORKER_ROLE_BOTH}) {
    WorkerConfig c = Config(role);
    c.engine.device = engine::Device::kCuda;
    EXPECT_TRUE(c.Validate().ok()) << c.Validate();
    auto server = WorkerServer::Start(c, &registry);
    ASSERT_FALSE(server.ok());
    EXPECT_EQ(server.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(server.status().message()), HasSubstr("cuda"));
  }
}

}  // namespace
}  // namespace pdserve::worker
