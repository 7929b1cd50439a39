// PrefillHandler's error paths behind a real gRPC server on loopback port 0,
// over a real EngineLoop (tiny model) and a fake KV transport: cancel,
// deadline and transfer failure must each leave no block of this worker
// referenced. A KV event sink can hold the engine inside a step, which is
// how a test makes "the final step is still running" happen on purpose.
#include "prefill_service/prefill_handler.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "engine/test_util.h"
#include "kv_transfer/grpc/grpc_transport.h"
#include "pdserve/v1/internal.grpc.pb.h"

namespace pdserve::prefill {
namespace {

// What the fake sessions saw; shared by every session of one transport.
struct FakeLink {
  std::atomic<int> opens{0};
  std::atomic<int> spans{0};
  absl::Status fail_sends;  // set before the request starts
  absl::Notification cancelled;
};

class FakeSession : public kv_transfer::KvSendSession {
 public:
  explicit FakeSession(FakeLink* link) : link_(link) {}
  absl::Status SendLayers(int32_t, int32_t) override {
    return absl::UnimplementedError("the handler sends blocks");
  }
  absl::Status SendBlocks(
      int32_t first, int32_t last,
      std::span<const kv_transfer::BlockRef> blocks) override {
    if (!link_->fail_sends.ok()) return link_->fail_sends;
    link_->spans += (last - first) * static_cast<int>(blocks.size());
    return absl::OkStatus();
  }
  absl::StatusOr<kv_transfer::SendStats> Finish() override {
    return kv_transfer::SendStats{};
  }
  void Cancel() override {
    if (!link_->cancelled.HasBeenNotified()) link_->cancelled.Notify();
  }

 private:
  FakeLink* link_;
};

class FakeTransport : public kv_transfer::KvTransport {
 public:
  explicit FakeTransport(FakeLink* link) : link_(link) {}
  const char* name() const override { return "fake"; }
  absl::StatusOr<std::unique_ptr<kv_transfer::KvSendSession>> Open(
      const kv_transfer::SendPlan&, engine::KvStorage*) override {
    ++link_->opens;
    return std::make_unique<FakeSession>(link_);
  }

 private:
  FakeLink* link_;
};

// The Worker service with only Prefill, counting calls that returned.
class PrefillOnlyService : public v1::Worker::Service {
 public:
  explicit PrefillOnlyService(PrefillHandler* handler) : handler_(handler) {}
  grpc::Status Prefill(grpc::ServerContext* context,
                       const v1::PrefillRequest* request,
                       v1::PrefillResponse* response) override {
    grpc::Status s = handler_->Prefill(context, *request, response);
    absl::MutexLock l(&mu_);
    ++returned_;
    return s;
  }
  // Waits until `n` handler calls returned.
  bool AwaitReturned(int n) {
    absl::MutexLock l(&mu_);
    auto done = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return returned_ >= n;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(30));
  }

 private:
  PrefillHandler* handler_;
  absl::Mutex mu_;
  int returned_ ABSL_GUARDED_BY(mu_) = 0;
};

class PrefillHandlerTest : public ::testing::Test {
 protected:
  void Start(bool layerwise = true) {
    engine::EngineConfig config;
    config.block_size = 4;
    auto eng =
        engine::Engine::Create(engine::testing::TinyWeights(), config,
                               [this](const engine::KvEvent& e) {
                                 if (e.type != engine::KvEvent::Type::kStored)
                                   return;
                                 if (!hold_step_.exchange(false)) return;
                                 step_held_.Notify();
                                 release_step_.WaitForNotification();
                               });
    ASSERT_TRUE(eng.ok()) << eng.status();
    loop_ = std::make_unique<engine::EngineLoop>(std::move(*eng));
    layout_ = kv_transfer::KvLayout::FromSpec(loop_->kv_spec(), "test-model");
    transport_ = std::make_unique<FakeTransport>(&link_);
    PrefillOptions options;
    options.layerwise = layerwise;
    handler_ = std::make_unique<PrefillHandler>(
        loop_.get(), transport_.get(), layout_, "prefill-test", options);
    service_ = std::make_unique<PrefillOnlyService>(handler_.get());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(port, 0);
    stub_ = v1::Worker::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                            grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (!release_step_.HasBeenNotified()) release_step_.Notify();
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }

  v1::PrefillRequest Request(int tokens = 20) const {
    v1::PrefillRequest r;
    r.set_request_id("req-1");
    for (int i = 0; i < tokens; ++i) r.add_token_ids(1 + (i * 13) % 250);
    r.mutable_sampling()->set_max_tokens(4);
    r.set_kv_destination("nowhere:1");
    r.set_reservation_id(7);
    *r.mutable_layout() = kv_transfer::ToProto(layout_);
    return r;
  }
  int64_t ActiveBlocks() {
    auto s = loop_->Call([](engine::Engine& e) { return e.Stats(); });
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->blocks_active : -1;
  }

  FakeLink link_;
  std::atomic<bool> hold_step_{false};
  absl::Notification step_held_, release_step_;
  std::unique_ptr<engine::EngineLoop> loop_;
  kv_transfer::KvLayout layout_;
  std::unique_ptr<FakeTransport> transport_;
  std::unique_ptr<PrefillHandler> handler_;
  std::unique_ptr<PrefillOnlyService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

TEST_F(PrefillHandlerTest, SuccessSendsTheMissingBlocksAndUnpinsThem) {
  Start();
  v1::PrefillRequest req = Request();
  req.set_skip_blocks(2);
  grpc::ClientContext ctx;
  v1::PrefillResponse resp;
  const grpc::Status s = stub_->Prefill(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(link_.spans, layout_.num_layers * (5 - 2));
  EXPECT_EQ(resp.worker_id(), "prefill-test");
  EXPECT_EQ(ActiveBlocks(), 0);
}

TEST_F(PrefillHandlerTest, CancelWhileTheFinalStepRunsLongLeavesNoBlocks) {
  Start();
  hold_step_ = true;  // the prefill's only (final) step stops in the sink
  grpc::ClientContext ctx;
  grpc::Status status;
  std::thread call([&] {
    v1::PrefillResponse resp;
    status = stub_->Prefill(&ctx, Request(), &resp);
  });
  ASSERT_TRUE(step_held_.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ctx.TryCancel();
  // The handler gave up (it cancels the transfer first)...
  ASSERT_TRUE(
      link_.cancelled.WaitForNotificationWithTimeout(absl::Seconds(30)));
  // ...while the final step still runs, for longer than the one second an
  // earlier handler waited for it before leaving its held blocks behind.
  // This models a slow step; nothing here waits on it to synchronise.
  absl::SleepFor(absl::Milliseconds(1500));
  release_step_.Notify();
  call.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED);
  ASSERT_TRUE(service_->AwaitReturned(1));
  EXPECT_EQ(ActiveBlocks(), 0);
}

TEST_F(PrefillHandlerTest, DeadlineDuringThePrefillLeavesNoBlocks) {
  Start();
  hold_step_ = true;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(300));
  grpc::Status status;
  std::thread call([&] {
    v1::PrefillResponse resp;
    status = stub_->Prefill(&ctx, Request(), &resp);
  });
  ASSERT_TRUE(step_held_.WaitForNotificationWithTimeout(absl::Seconds(30)));
  call.join();  // the client gives up at its deadline, step still held
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // The handler sees the deadline too and gives up while the step runs.
  ASSERT_TRUE(
      link_.cancelled.WaitForNotificationWithTimeout(absl::Seconds(30)));
  release_step_.Notify();
  ASSERT_TRUE(service_->AwaitReturned(1));
  EXPECT_EQ(ActiveBlocks(), 0);
}

class PrefillHandlerTransferTest : public PrefillHandlerTest,
                                   public ::testing::WithParamInterface<bool> {
};

TEST_P(PrefillHandlerTransferTest, TransferFailureLeavesNoBlocks) {
  Start(/*layerwise=*/GetParam());
  link_.fail_sends = absl::UnavailableError("the decode worker went away");
  grpc::ClientContext ctx;
  v1::PrefillResponse resp;
  const grpc::Status s = stub_->Prefill(&ctx, Request(), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("went away"));
  ASSERT_TRUE(service_->AwaitReturned(1));
  EXPECT_TRUE(link_.cancelled.HasBeenNotified());
  EXPECT_EQ(ActiveBlocks(), 0);
}

INSTANTIATE_TEST_SUITE_P(LayerwiseOrNot, PrefillHandlerTransferTest,
                         ::testing::Bool());

TEST_F(PrefillHandlerTest, OversizedRequestIdOrSaltIsRefusedBeforeAnyWork) {
  Start();
  v1::PrefillRequest long_id = Request();
  long_id.set_request_id(std::string(engine::kMaxRequestIdBytes + 1, 'r'));
  v1::PrefillRequest long_salt = Request();
  long_salt.set_cache_salt(std::string(engine::kMaxCacheSaltBytes + 1, 's'));
  for (const v1::PrefillRequest* req : {&long_id, &long_salt}) {
    grpc::ClientContext ctx;
    v1::PrefillResponse resp;
    const grpc::Status s = stub_->Prefill(&ctx, *req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  EXPECT_EQ(link_.opens, 0);
  // At the caps exactly, the request is served.
  v1::PrefillRequest at_cap = Request();
  at_cap.set_request_id(std::string(engine::kMaxRequestIdBytes, 'r'));
  at_cap.set_cache_salt(std::string(engine::kMaxCacheSaltBytes, 's'));
  grpc::ClientContext ctx;
  v1::PrefillResponse resp;
  const grpc::Status s = stub_->Prefill(&ctx, at_cap, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(ActiveBlocks(), 0);
}

}  // namespace
}  // namespace pdserve::prefill
