// DecodeHandler's error paths behind a real gRPC server on loopback port 0,
// over a real EngineLoop (tiny model) and KvReceiver, with a fake prefill
// worker in the same process that pushes KV straight into the receiver (or
// fails, or sends nothing, as each test asks). Cancel, deadline, transfer
// failure and reservation timeout must each end with 0 active blocks.
#include "decode_service/decode_handler.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/grpc_status.h"
#include "common/status_cause.h"
#include "engine/test_util.h"
#include "pdserve/v1/internal.grpc.pb.h"

namespace pdserve::decode {
namespace {

using ::testing::HasSubstr;

// Polls `done` until it holds or `timeout` passes (for state without a
// notification of its own, such as the reservation queue's length).
bool WaitUntil(const std::function<bool()>& done,
               absl::Duration timeout = absl::Seconds(20)) {
  const absl::Time until = absl::Now() + timeout;
  while (!done()) {
    if (absl::Now() >= until) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

// Counts calls into a handler that returned.
class Returned {
 public:
  void Add() {
    absl::MutexLock l(&mu_);
    ++n_;
  }
  bool Await(int n) {
    absl::MutexLock l(&mu_);
    auto done = [this, n]()
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return n_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(30));
  }

 private:
  absl::Mutex mu_;
  int n_ ABSL_GUARDED_BY(mu_) = 0;
};

class DecodeOnlyService : public v1::Worker::Service {
 public:
  explicit DecodeOnlyService(DecodeHandler* handler) : handler_(handler) {}
  grpc::Status Generate(
      grpc::ServerContext* context, const v1::WorkerGenerateRequest* request,
      grpc::ServerWriter<v1::WorkerGenerateResponse>* writer) override {
    grpc::Status s = handler_->Generate(context, *request, writer);
    returned.Add();
    return s;
  }
  Returned returned;

 private:
  DecodeHandler* handler_;
};

// A prefill worker whose behaviour each test picks.
class FakePrefillService : public v1::Worker::Service {
 public:
  enum class Mode { kSendAll, kFail, kSendNothing, kBadChunk };
  explicit FakePrefillService(kv_transfer::KvReceiver* receiver)
      : receiver_(receiver) {}
  grpc::Status Prefill(grpc::ServerContext*, const v1::PrefillRequest* request,
                       v1::PrefillResponse* response) override {
    called.Notify();
    if (hold) release.WaitForNotification();
    v1::PrefillResponse r;
    r.set_first_token(5);
    r.set_worker_id("fake-prefill");
    switch (mode) {
      case Mode::kFail:
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, "prefill crashed");
      case Mode::kSendNothing:
        *response = r;
        return grpc::Status::OK;
      case Mode::kSendAll:
      case Mode::kBadChunk:
        break;
    }
    const kv_transfer::KvLayout& layout = receiver_->layout();
    const uint64_t id = request->reservation_id();
    absl::Status s = receiver_->Begin(id, request->request_id(), layout);
    const int blocks =
        (request->token_ids_size() + layout.block_size - 1) / layout.block_size;
    const std::string span(
        static_cast<size_t>(2 * layout.kv_heads * layout.block_size *
                            layout.head_dim * 4),  // fp32
        '\1');
    for (int l = 0; l < layout.num_layers && s.ok(); ++l) {
      for (int i = static_cast<int>(request->skip_blocks());
           i < blocks && s.ok(); ++i) {
        s = receiver_->Write(
            id, l, i,
            mode == Mode::kBadChunk ? std::string_view(span).substr(1) : span,
            "");
      }
    }
    receiver_->End(id, s.ok());
    if (!s.ok() && mode != Mode::kBadChunk) return ToGrpc(s);
    *response = r;
    return grpc::Status::OK;
  }

  std::atomic<Mode> mode{Mode::kSendAll};
  std::atomic<bool> hold{false};
  absl::Notification called, release;

 private:
  kv_transfer::KvReceiver* receiver_;
};

class DecodeHandlerTest : public ::testing::Test {
 protected:
  // A decode worker with `blocks` KV blocks of 4 tokens (fp32).
  void Start(int64_t blocks = 64,
             absl::Duration admission_timeout = absl::Seconds(30),
             absl::Duration kv_stall_timeout = absl::Seconds(30)) {
    engine::EngineConfig config;
    config.block_size = 4;
    const auto weights = engine::testing::TinyWeights();
    const engine::KvCacheSpec spec{
        static_cast<int32_t>(weights->config.num_layers),
        static_cast<int32_t>(weights->config.num_kv_heads),
        static_cast<int32_t>(weights->config.head_dim), config.block_size,
        config.kv_dtype};
    config.kv_cache_bytes = spec.BytesPerBlock() * blocks;
    auto eng = engine::Engine::Create(weights, config);
    ASSERT_TRUE(eng.ok()) << eng.status();
    loop_ = std::make_unique<engine::EngineLoop>(std::move(*eng));
    receiver_ = std::make_unique<kv_transfer::KvReceiver>(
        &loop_->kv_storage_for_transfer(),
        kv_transfer::KvLayout::FromSpec(loop_->kv_spec(), "test-model"));
    handler_ = std::make_unique<DecodeHandler>(
        loop_.get(), receiver_.get(),
        DecodeOptions{"decode-test", "unused:1", admission_timeout,
                      kv_stall_timeout});
    decode_ = std::make_unique<DecodeOnlyService>(handler_.get());
    prefill_ = std::make_unique<FakePrefillService>(receiver_.get());
    for (auto [service, server, address] :
         {std::tuple<grpc::Service*, std::unique_ptr<grpc::Server>*,
                     std::string*>{decode_.get(), &decode_server_,
                                   &decode_address_},
          {prefill_.get(), &prefill_server_, &prefill_address_}}) {
      grpc::ServerBuilder builder;
      int port = 0;
      builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                               &port);
      builder.RegisterService(service);
      *server = builder.BuildAndStart();
      ASSERT_NE(port, 0);
      *address = "127.0.0.1:" + std::to_string(port);
    }
    stub_ = v1::Worker::NewStub(grpc::CreateChannel(
        decode_address_, grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (prefill_ && !prefill_->release.HasBeenNotified())
      prefill_->release.Notify();
    for (auto* server : {&decode_server_, &prefill_server_}) {
      if (*server) (*server)->Shutdown(std::chrono::system_clock::now());
    }
  }

  v1::WorkerGenerateRequest Request(int prompt_tokens = 20,
                                    uint32_t max_tokens = 8,
                                    bool remote = true) const {
    v1::WorkerGenerateRequest r;
    r.set_request_id("req-1");
    for (int i = 0; i < prompt_tokens; ++i) r.add_token_ids(1 + (i * 13) % 250);
    r.mutable_sampling()->set_max_tokens(max_tokens);
    r.mutable_sampling()->set_ignore_eos(true);
    if (remote) r.set_prefill_address(prefill_address_);
    return r;
  }
  struct Result {
    grpc::Status status;
    int tokens = 0;
  };
  Result Generate(grpc::ClientContext* ctx,
                  const v1::WorkerGenerateRequest& req) {
    auto reader = stub_->Generate(ctx, req);
    Result r;
    v1::WorkerGenerateResponse resp;
    while (reader->Read(&resp)) r.tokens += resp.token_ids_size();
    r.status = reader->Finish();
    return r;
  }
  engine::EngineStats Stats() {
    auto s = loop_->Call([](engine::Engine& e) { return e.Stats(); });
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : engine::EngineStats{};
  }
  // Reserves `blocks` blocks for a request that never completes, the way a
  // transfer in flight holds them.
  void Hold(int blocks) {
    engine::EngineRequest r;
    r.id = "holder";
    for (int i = 0; i < 4 * blocks; ++i) r.prompt.push_back(200 + i % 50);
    r.sampling.max_tokens = 1;
    auto got = loop_->Reserve(std::move(r), absl::InfiniteFuture());
    ASSERT_TRUE(got.ok()) << got.status();
  }
  void ExpectNothingLeft() {
    EXPECT_TRUE(
        WaitUntil([&] { return loop_->num_pending_reservations() == 0; }));
    EXPECT_EQ(Stats().blocks_active, 0);
    EXPECT_EQ(Stats().num_reserved, 0);
    EXPECT_EQ(receiver_->num_reservations(), 0);
    EXPECT_EQ(loop_->num_pending_reservations(), 0);
  }

  std::unique_ptr<engine::EngineLoop> loop_;
  std::unique_ptr<kv_transfer::KvReceiver> receiver_;
  std::unique_ptr<DecodeHandler> handler_;
  std::unique_ptr<DecodeOnlyService> decode_;
  std::unique_ptr<FakePrefillService> prefill_;
  std::unique_ptr<grpc::Server> decode_server_, prefill_server_;
  std::string decode_address_, prefill_address_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

TEST_F(DecodeHandlerTest, DisaggregatedRequestStreamsAndFreesItsBlocks) {
  Start();
  grpc::ClientContext ctx;
  const Result r = Generate(&ctx, Request());
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens, 8);
  ExpectNothingLeft();
}

TEST_F(DecodeHandlerTest, CancelBeforeTheFirstTokenFreesEveryBlock) {
  Start();
  prefill_->hold = true;
  grpc::ClientContext ctx;
  Result r;
  std::thread call([&] { r = Generate(&ctx, Request(20, 200)); });
  ASSERT_TRUE(
      prefill_->called.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_GT(Stats().blocks_active, 0);  // the reservation
  ctx.TryCancel();
  call.join();
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::CANCELLED);
  prefill_->release.Notify();  // the KV arrives for a request nobody wants
  ASSERT_TRUE(decode_->returned.Await(1));
  ExpectNothingLeft();
}

TEST_F(DecodeHandlerTest, CancelWhileQueuedForBlocksLeavesTheQueue) {
  Start(/*blocks=*/8);
  Hold(7);
  grpc::ClientContext ctx;
  Result r;
  std::thread call([&] { r = Generate(&ctx, Request(8, 4)); });
  ASSERT_TRUE(
      WaitUntil([&] { return loop_->num_pending_reservations() == 1; }));
  ctx.TryCancel();
  call.join();
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::CANCELLED);
  ASSERT_TRUE(decode_->returned.Await(1));
  // The waiter leaves the engine-side queue (right after the handler).
  ASSERT_TRUE(
      WaitUntil([&] { return loop_->num_pending_reservations() == 0; }));
  EXPECT_FALSE(prefill_->called.HasBeenNotified());
  loop_->Abort("holder");
  ASSERT_TRUE(WaitUntil([&] { return Stats().blocks_active == 0; }));
  ExpectNothingLeft();
}

TEST_F(DecodeHandlerTest, DeadlineWhileWaitingForKvFreesEveryBlock) {
  Start();
  prefill_->mode = FakePrefillService::Mode::kSendNothing;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(500));
  const Result r = Generate(&ctx, Request());
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  ASSERT_TRUE(decode_->returned.Await(1));
  ExpectNothingLeft();
}

// The client goes away while the KV is still awaited (here it never comes):
// the blocks come back at once, not after the 60 s stall timeout.
TEST_F(DecodeHandlerTest, CancelWhileWaitingForKvFreesEveryBlockAtOnce) {
  Start(64, absl::Seconds(30), /*kv_stall_timeout=*/absl::Seconds(60));
  prefill_->mode = FakePrefillService::Mode::kSendNothing;
  grpc::ClientContext ctx;
  Result r;
  std::thread call([&] { r = Generate(&ctx, Request()); });
  ASSERT_TRUE(
      prefill_->called.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(WaitUntil([&] { return receiver_->num_reservations() == 1; }));
  ctx.TryCancel();
  call.join();
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::CANCELLED);
  ASSERT_TRUE(decode_->returned.Await(1));
  ExpectNothingLeft();
}

TEST_F(DecodeHandlerTest, FailedPrefillWorkerIsNamedAndFreesEveryBlock) {
  Start();
  prefill_->mode = FakePrefillService::Mode::kFail;
  grpc::ClientContext ctx;
  const Result r = Generate(&ctx, Request());
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(CauseOf(r.status), StatusCause::kPrefillFailed);
  ASSERT_TRUE(decode_->returned.Await(1));
  ExpectNothingLeft();
}

TEST_F(DecodeHandlerTest, AGonePrefillWorkersStubIsNotKept) {
  Start();
  grpc::ClientContext ok_ctx;
  ASSERT_TRUE(Generate(&ok_ctx, Request()).status.ok());
  EXPECT_EQ(handler_->cached_prefill_stubs(), 1u);
  v1::WorkerGenerateRequest gone = Request();
  gone.set_prefill_address("127.0.0.1:1");  // nothing listens there
  grpc::ClientContext ctx;
  const Result r = Generate(&ctx, gone);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(handler_->cached_prefill_stubs(), 1u);  // only the live one
  ExpectNothingLeft();
}

TEST_F(DecodeHandlerTest, RejectedKvChunkFailsTheTransferAndFreesEveryBlock) {
  Start();
  prefill_->mode = FakePrefillService::Mode::kBadChunk;
  grpc::ClientContext ctx;
  const Result r = Generate(&ctx, Request());
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(r.status.error_message(), HasSubstr("bytes, expected"));
  ASSERT_TRUE(decode_->returned.Await(1));
  ExpectNothingLeft();
}

TEST_F(DecodeHandlerTest, StalledTransferTimesOutAndFreesEveryBlock) {
  Start(64, absl::Seconds(30), /*kv_stall_timeout=*/absl::Milliseconds(300));
  prefill_->mode = FakePrefillService::Mode::kSendNothing;
  grpc::ClientContext ctx;
  const Result r = Generate(&ctx, Request());
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(r.status.error_message(), HasSubstr("stalled"));
  ASSERT_TRUE(decode_->returned.Await(1));
  ExpectNothingLeft();
}

TEST_F(DecodeHandlerTest,
       ReservationTimeoutIsResourceExhaustedAndTakesNothing) {
  Start(/*blocks=*/8, /*admission_timeout=*/absl::Milliseconds(300));
  Hold(7);
  grpc::ClientContext ctx;
  const Result r = Generate(&ctx, Request(8, 4));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(CauseOf(r.status), StatusCause::kPoolBusy);
  EXPECT_FALSE(prefill_->called.HasBeenNotified());
  EXPECT_EQ(Stats().blocks_active, 7);  // only the holder's
  loop_->Abort("holder");
  ASSERT_TRUE(WaitUntil([&] { return Stats().blocks_active == 0; }));
  ExpectNothingLeft();
}

TEST_F(DecodeHandlerTest, ReservationWokenByReleasedBlocksProceeds) {
  Start(/*blocks=*/8);
  Hold(7);
  grpc::ClientContext ctx;
  Result r;
  std::thread call([&] { r = Generate(&ctx, Request(8, 4)); });
  ASSERT_TRUE(
      WaitUntil([&] { return loop_->num_pending_reservations() == 1; }));
  loop_->Abort("holder");  // the release wakes the waiting reservation
  call.join();
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens, 4);
  ASSERT_TRUE(decode_->returned.Await(1));
  ExpectNothingLeft();
}

TEST_F(DecodeHandlerTest, ARequestThatCanNeverFitIsRefusedAtOnce) {
  Start(/*blocks=*/8, /*admission_timeout=*/absl::Seconds(60));
  grpc::ClientContext ctx;
  const absl::Time start = absl::Now();
  const Result r = Generate(&ctx, Request(40, 4));  // 11 blocks of 8
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(CauseOf(r.status), StatusCause::kNeverFits);
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));  // not the 60 s timeout
  ExpectNothingLeft();
}

TEST_F(DecodeHandlerTest, OversizedRequestIdOrSaltIsInvalidArgument) {
  Start();
  v1::WorkerGenerateRequest long_id = Request();
  long_id.set_request_id(std::string(engine::kMaxRequestIdBytes + 1, 'r'));
  v1::WorkerGenerateRequest long_salt = Request(20, 8, /*remote=*/false);
  long_salt.set_cache_salt(std::string(engine::kMaxCacheSaltBytes + 1, 's'));
  for (const auto* req : {&long_id, &long_salt}) {
    grpc::ClientContext ctx;
    const Result r = Generate(&ctx, *req);
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  EXPECT_FALSE(prefill_->called.HasBeenNotified());
  ExpectNothingLeft();
}

}  // namespace
}  // namespace pdserve::decode

namespace pdserve::decode {
namespace {

// Prefill addresses change with pod-IP churn: the stub cache stays bounded
// (it used to keep a channel for every address ever named).
TEST(PrefillStubCacheTest, StaysBoundedUnderAddressChurn) {
  PrefillStubCache cache(8);
  for (int i = 0; i < 10000; ++i) {
    cache.Get("10." + std::to_string(i / 65536) + "." +
              std::to_string(i / 256 % 256) + "." + std::to_string(i % 256) +
              ":50052");
    ASSERT_LE(cache.size(), 8u);
  }
  const auto a = cache.Get("10.9.9.9:1");
  EXPECT_EQ(cache.Get("10.9.9.9:1"), a);  // reused while cached
  // The most recently used survive eviction.
  for (int i = 0; i < 7; ++i) {
    cache.Get("10.8.8." + std::to_string(i) + ":1");
    EXPECT_EQ(cache.Get("10.9.9.9:1"), a);
  }
  cache.Forget("10.9.9.9:1", nullptr);  // not its stub: kept
  EXPECT_EQ(cache.Get("10.9.9.9:1"), a);
  const size_t before = cache.size();
  cache.Forget("10.9.9.9:1", a);
  EXPECT_EQ(cache.size(), before - 1);
  EXPECT_NE(cache.Get("10.9.9.9:1"), a);
}

}  // namespace
}  // namespace pdserve::decode
