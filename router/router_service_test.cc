#include "router/router_service.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "engine/tokenizer.h"

namespace pdserve::router {
namespace {

// A decode worker that records the request ids it is asked to run and
// answers each with one token.
class RecordingWorker final : public v1::Worker::Service {
 public:
  grpc::Status GetStatus(grpc::ServerContext*, const v1::WorkerInfoRequest*,
                         v1::WorkerStatus* status) override {
    status->set_id("recording");
    status->set_role(v1::WORKER_ROLE_DECODE);
    status->set_max_model_len(1024);
    status->set_free_blocks(64);
    status->set_total_blocks(64);
    return grpc::Status::OK;
  }
  grpc::Status Generate(
      grpc::ServerContext*, const v1::WorkerGenerateRequest* req,
      grpc::ServerWriter<v1::WorkerGenerateResponse>* writer) override {
    {
      absl::MutexLock l(&mu);
      ids.push_back(req->request_id());
    }
    v1::WorkerGenerateResponse resp;
    resp.add_token_ids('a');
    resp.set_finish_reason(v1::FINISH_REASON_LENGTH);
    writer->Write(resp);
    return grpc::Status::OK;
  }
  grpc::Status SubscribeKvEvents(
      grpc::ServerContext* ctx, const v1::SubscribeKvEventsRequest*,
      grpc::ServerWriter<v1::KvEventBatch>* writer) override {
    v1::KvEventBatch snapshot;
    snapshot.set_snapshot(true);
    writer->Write(snapshot);
    while (!ctx->IsCancelled() && writer->Write(v1::KvEventBatch()))
      absl::SleepFor(absl::Milliseconds(100));
    return grpc::Status::OK;
  }

  absl::Mutex mu;
  std::vector<std::string> ids ABSL_GUARDED_BY(mu);
};

// Found by the fault soak (tests/soak): request ids restart at req-1 with
// the router, and workers abort by id, so a worker's stale handler from
// before a router restart cancelled a new request that reused its id (which
// then "finished" with reason cancelled and no tokens). Client-chosen ids
// collide the same way.
TEST(RouterServiceTest, WorkersSeeADistinctIdForEveryRequest) {
  const std::string dir = ::testing::TempDir() + "/router_service_test";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/tokenizer.json")
      << engine::ByteTokenizer::TokenizerJson();
  std::ofstream(dir + "/tokenizer_config.json")
      << engine::ByteTokenizer::TokenizerConfigJson();

  RecordingWorker worker;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&worker);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();

  metrics::Registry metrics;
  RouterConfig config;
  config.model_dir = dir;
  config.workers.decode = {absl::StrCat("127.0.0.1:", port)};
  config.workers.heartbeat = absl::Milliseconds(50);
  auto router = RouterServer::Create(config, &metrics);
  ASSERT_TRUE(router.ok()) << router.status();
  auto router_port = (*router)->Serve("127.0.0.1", 0);
  ASSERT_TRUE(router_port.ok()) << router_port.status();
  ASSERT_TRUE((*router)->workers().WaitForWorkers(1, absl::Seconds(10)));
  auto stub = v1::Router::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", *router_port),
                          grpc::InsecureChannelCredentials()));
  for (int i = 0; i < 2; ++i) {
    v1::GenerateRequest req;
    req.set_request_id("same");
    req.set_prompt("hi");
    req.mutable_sampling()->set_max_tokens(1);
    grpc::ClientContext ctx;
    auto reader = stub->Generate(&ctx, req);
    v1::GenerateResponse resp;
    while (reader->Read(&resp)) EXPECT_EQ(resp.request_id(), "same");
    ASSERT_TRUE(reader->Finish().ok());
  }
  absl::MutexLock l(&worker.mu);
  ASSERT_EQ(worker.ids.size(), 2u);
  EXPECT_NE(worker.ids[0], worker.ids[1]);
  EXPECT_TRUE(absl::StartsWith(worker.ids[0], "same"));  // readable in logs
  (*router)->Shutdown();
  server->Shutdown();
}

}  // namespace
}  // namespace pdserve::router
