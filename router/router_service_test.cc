#include "router/router_service.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::router {
namespace {

using ::testing::HasSubstr;

// A fake decode worker's status: up, with `max_model_len` and 64 free
// blocks; Generate is each fake's own.
class FakeDecodeWorker : public v1::Worker::Service {
 public:
  explicit FakeDecodeWorker(std::string id, uint32_t max_model_len = 1024)
      : id_(std::move(id)), max_model_len_(max_model_len) {}
  grpc::Status GetStatus(grpc::ServerContext*, const v1::WorkerInfoRequest*,
                         v1::WorkerStatus* status) override {
    status->set_id(id_);
    status->set_role(v1::WORKER_ROLE_DECODE);
    status->set_max_model_len(max_model_len_);
    status->set_free_blocks(64);
    status->set_total_blocks(64);
    return grpc::Status::OK;
  }

 private:
  const std::string id_;
  const uint32_t max_model_len_;
};

// A decode worker that records the request ids it is asked to run and
// answers each with one token.
class RecordingWorker final : public FakeDecodeWorker {
 public:
  RecordingWorker() : FakeDecodeWorker("recording") {}
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

// A router on port 0 in front of one fake decode worker.
class RouterServiceTest : public ::testing::Test {
 protected:
  // Starts a worker of type W (owned by the fixture, so that it outlives
  // the servers that call it) and a router in front of it.
  template <typename W>
  W& StartRouter() {
    auto worker = std::make_unique<W>();
    W& ref = *worker;
    worker_ = std::move(worker);
    StartRouterWith(&ref);
    return ref;
  }
  void StartRouterWith(v1::Worker::Service* worker) {
    // One directory per process: ctest runs these tests in parallel
    // processes, and one must not read a tokenizer another is rewriting.
    const std::string dir =
        absl::StrCat(::testing::TempDir(), "/router_service_test_", getpid());
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/tokenizer.json")
        << engine::ByteTokenizer::TokenizerJson();
    std::ofstream(dir + "/tokenizer_config.json")
        << engine::ByteTokenizer::TokenizerConfigJson();
    int port = 0;
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(worker);
    worker_server_ = builder.BuildAndStart();
    ASSERT_NE(port, 0);

    RouterConfig config;
    config.tls = tls::TlsConfig::Plaintext();
    config.model_dir = dir;
    config.workers.decode = {absl::StrCat("127.0.0.1:", port)};
    config.workers.heartbeat = absl::Milliseconds(50);
    auto router = RouterServer::Create(config, &metrics_);
    ASSERT_TRUE(router.ok()) << router.status();
    router_ = *std::move(router);
    auto router_port = router_->Serve("127.0.0.1", 0);
    ASSERT_TRUE(router_port.ok()) << router_port.status();
    router_port_ = *router_port;
    ASSERT_TRUE(router_->workers().WaitForWorkers(1, absl::Seconds(10)));
    stub_ = v1::Router::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", *router_port),
                            grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (router_) router_->Shutdown();
    if (worker_server_) worker_server_->Shutdown();
  }

  // Runs one Generate; the messages land in `out`.
  grpc::Status Generate(const v1::GenerateRequest& req,
                        std::vector<v1::GenerateResponse>* out = nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(30));
    auto reader = stub_->Generate(&ctx, req);
    v1::GenerateResponse resp;
    while (reader->Read(&resp)) {
      if (out != nullptr) out->push_back(resp);
    }
    return reader->Finish();
  }

  static v1::GenerateRequest Request(uint32_t max_tokens) {
    v1::GenerateRequest req;
    req.set_prompt("hi");
    req.mutable_sampling()->set_max_tokens(max_tokens);
    return req;
  }

  metrics::Registry metrics_;
  std::unique_ptr<v1::Worker::Service> worker_;
  std::unique_ptr<grpc::Server> worker_server_;
  std::unique_ptr<RouterServer> router_;
  std::unique_ptr<v1::Router::Stub> stub_;
  int router_port_ = 0;
};

// Found by the fault soak (tests/soak): request ids restart at req-1 with
// the router, and workers abort by id, so a worker's stale handler from
// before a router restart cancelled a new request that reused its id (which
// then "finished" with reason cancelled and no tokens). Client-chosen ids
// collide the same way.
TEST_F(RouterServiceTest, WorkersSeeADistinctIdForEveryRequest) {
  auto& worker = StartRouter<RecordingWorker>();
  for (int i = 0; i < 2; ++i) {
    v1::GenerateRequest req = Request(1);
    req.set_request_id("same");
    std::vector<v1::GenerateResponse> out;
    ASSERT_TRUE(Generate(req, &out).ok());
    for (const auto& resp : out) EXPECT_EQ(resp.request_id(), "same");
  }
  absl::MutexLock l(&worker.mu);
  ASSERT_EQ(worker.ids.size(), 2u);
  EXPECT_NE(worker.ids[0], worker.ids[1]);
  EXPECT_TRUE(absl::StartsWith(worker.ids[0], "same"));  // readable in logs
}

// cache_salt is hashed into every block and request_id rides on every
// message and log line: both are bounded.
TEST_F(RouterServiceTest, OverlongCacheSaltAndRequestIdAreRefused) {
  auto& worker = StartRouter<RecordingWorker>();
  v1::GenerateRequest req = Request(1);
  req.set_cache_salt(std::string(256, 's'));
  req.set_request_id(std::string(128, 'r'));
  EXPECT_TRUE(Generate(req).ok());

  req.set_cache_salt(std::string(257, 's'));
  grpc::Status st = Generate(req);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(st.error_message(), "cache_salt"))
      << st.error_message();

  req.set_cache_salt("");
  req.set_request_id(std::string(129, 'r'));
  st = Generate(req);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(st.error_message(), "request_id"))
      << st.error_message();
  absl::MutexLock l(&worker.mu);
  EXPECT_EQ(worker.ids.size(), 1u) << "refused requests reached a worker";
}

// A worker that streams more tokens than asked for and then fails. The
// router used to pass them all on, then migrate with max_tokens =
// max_tokens - generated, which wrapped around to ~4 billion.
class OverrunningWorker final : public FakeDecodeWorker {
 public:
  OverrunningWorker() : FakeDecodeWorker("overrunning") {}
  grpc::Status Generate(
      grpc::ServerContext*, const v1::WorkerGenerateRequest* req,
      grpc::ServerWriter<v1::WorkerGenerateResponse>* writer) override {
    {
      absl::MutexLock l(&mu);
      max_tokens.push_back(req->sampling().max_tokens());
    }
    v1::WorkerGenerateResponse resp;
    for (int i = 0; i < 5; ++i) resp.add_token_ids('a' + i);
    writer->Write(resp);
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "died");
  }
  absl::Mutex mu;
  std::vector<uint32_t> max_tokens ABSL_GUARDED_BY(mu);
};

TEST_F(RouterServiceTest, AWorkerThatOverrunsMaxTokensIsCutOff) {
  auto& worker = StartRouter<OverrunningWorker>();
  std::vector<v1::GenerateResponse> out;
  ASSERT_TRUE(Generate(Request(2), &out).ok());
  size_t tokens = 0;
  for (const auto& resp : out) tokens += resp.token_ids_size();
  EXPECT_EQ(tokens, 2u);
  ASSERT_FALSE(out.empty());
  EXPECT_EQ(out.back().finish_reason(), "length");
  EXPECT_EQ(out.back().usage().completion_tokens(), 2u);
  absl::MutexLock l(&worker.mu);
  for (uint32_t asked : worker.max_tokens) EXPECT_LE(asked, 2u);
}

// The finish reason comes from the worker; a number this router does not
// know ends the request as "error" and is counted under that label, never as
// a new label (nor a failed lookup: metric lookups used to abort).
class UnknownFinishWorker final : public FakeDecodeWorker {
 public:
  UnknownFinishWorker() : FakeDecodeWorker("unknown-finish") {}
  grpc::Status Generate(
      grpc::ServerContext*, const v1::WorkerGenerateRequest*,
      grpc::ServerWriter<v1::WorkerGenerateResponse>* writer) override {
    v1::WorkerGenerateResponse resp;
    resp.add_token_ids('a');
    resp.set_finish_reason(static_cast<v1::FinishReason>(97));
    writer->Write(resp);
    return grpc::Status::OK;
  }
};

TEST_F(RouterServiceTest, AnUnknownFinishReasonIsCountedAsError) {
  StartRouter<UnknownFinishWorker>();
  std::vector<v1::GenerateResponse> out;
  ASSERT_TRUE(Generate(Request(4), &out).ok());
  ASSERT_FALSE(out.empty());
  EXPECT_EQ(out.back().finish_reason(), "error");
  const std::string text = metrics_.Render();
  EXPECT_TRUE(absl::StrContains(
      text, "pdserve_requests_total{finish_reason=\"error\"} 1"))
      << text;
  EXPECT_FALSE(absl::StrContains(text, "finish_reason=\"97\""));
}

TEST_F(RouterServiceTest, AWorkerWithAnUnknownRoleIsRejectedAtRegistration) {
  // Before roles were enums such a worker registered and was never routed to.
  StartRouter<RecordingWorker>();
  auto control = v1::RouterControl::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", router_port_),
                          grpc::InsecureChannelCredentials()));
  auto register_as = [&](v1::WorkerRole role) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    v1::RegisterWorkerRequest req;
    req.set_address("127.0.0.1:1");
    req.set_role(role);
    v1::RegisterWorkerResponse resp;
    return control->RegisterWorker(&ctx, req, &resp);
  };
  for (auto role :
       {v1::WORKER_ROLE_UNSPECIFIED, static_cast<v1::WorkerRole>(42)}) {
    const grpc::Status st = register_as(role);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr("unknown worker role"));
  }
  EXPECT_TRUE(register_as(v1::WORKER_ROLE_PREFILL).ok());
}

// A decode worker that streams one token a millisecond until its call is
// cancelled, counting the calls it was given.
class EndlessWorker final : public FakeDecodeWorker {
 public:
  EndlessWorker() : FakeDecodeWorker("endless", 100000) {}
  grpc::Status Generate(
      grpc::ServerContext* ctx, const v1::WorkerGenerateRequest*,
      grpc::ServerWriter<v1::WorkerGenerateResponse>* writer) override {
    calls.fetch_add(1);
    v1::WorkerGenerateResponse resp;
    resp.add_token_ids('a');
    while (!ctx->IsCancelled() && writer->Write(resp))
      absl::SleepFor(absl::Milliseconds(1));
    return grpc::Status(grpc::StatusCode::CANCELLED, "request cancelled");
  }
  std::atomic<int> calls{0};
};

// A client that goes away mid-stream ends its request. The worker did
// nothing wrong: it is neither retried on (another call to it, or to any
// worker) nor marked down, even when the router's write to the gone client
// fails, or the worker's CANCELLED arrives, a moment before the router's
// call reads as cancelled. A worker marked down would refuse every request
// until the next heartbeat with "no decode worker is up".
TEST_F(RouterServiceTest, AClientThatGoesAwayMidStreamLeavesTheWorkerUp) {
  auto& worker = StartRouter<EndlessWorker>();
  constexpr int kRequests = 30;
  for (int i = 0; i < kRequests; ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(30));
    auto reader = stub_->Generate(&ctx, Request(50000));
    v1::GenerateResponse resp;
    for (int read = 0; read < 3; ++read)
      ASSERT_TRUE(reader->Read(&resp)) << reader->Finish().error_message();
    ctx.TryCancel();
    while (reader->Read(&resp)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
    // Every request so far found the worker up.
    EXPECT_EQ(router_->workers().UpWorkers().size(), 1u) << "request " << i;
  }
  // Each request's call has ended at the worker within a moment.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (worker.calls.load() < kRequests && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(10));
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(worker.calls.load(), kRequests)
      << "a cancelled request was retried";
  const std::string text = metrics_.Render();
  EXPECT_TRUE(absl::StrContains(text, "\npdserve_request_retries_total 0\n"))
      << text;
}

// A decode worker that ends every call as cancelled, as one shutting down
// does.
class CancellingWorker final : public FakeDecodeWorker {
 public:
  CancellingWorker() : FakeDecodeWorker("cancelling") {}
  grpc::Status Generate(
      grpc::ServerContext*, const v1::WorkerGenerateRequest*,
      grpc::ServerWriter<v1::WorkerGenerateResponse>*) override {
    return grpc::Status(grpc::StatusCode::CANCELLED, "request cancelled");
  }
};

// A worker's CANCELLED answer ends that attempt (here there is nowhere else
// to go, so the client gets it), but only heartbeats mark a worker down: the
// next request still finds it up.
TEST_F(RouterServiceTest, AWorkerThatCancelsACallIsNotMarkedDown) {
  StartRouter<CancellingWorker>();
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(Generate(Request(4)).error_code(), grpc::StatusCode::CANCELLED);
    EXPECT_EQ(router_->workers().UpWorkers().size(), 1u) << "request " << i;
  }
}

TEST(RouterConfigTest, DefaultTlsIsNotPlaintext) {
  RouterConfig config;
  config.model_dir = "/nonexistent";
  EXPECT_FALSE(config.tls.insecure);
  EXPECT_FALSE(config.Validate().ok());
}

}  // namespace
}  // namespace pdserve::router
