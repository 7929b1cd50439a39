// Limits on what a peer can make a KV control stream's ends hold: the
// bounded inbox of the gRPC control channel (a reader that stops reading
// stalls the writer; a flood nobody reads fails the stream with
// RESOURCE_EXHAUSTED instead of queueing without end), and the shm receive
// endpoint's cap on concurrent streams (RESOURCE_EXHAUSTED past it) with
// finished streams' threads reaped at once.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/status_macros.h"
#include "kv_transfer/ipc/ipc_messages.h"
#include "kv_transfer/ipc/ipc_transport.h"
#include "kv_transfer/nccl/fake_control_channel.h"
#include "kv_transfer/nccl/grpc_control_channel.h"
#include "kv_transfer/test_blocks.h"
#include "kv_transfer/test_server.h"
#include "pdserve/v1/internal.grpc.pb.h"

namespace pdserve::kv_transfer::ipc {
namespace {

using ::testing::HasSubstr;
using testing::TestSpec;

// A KvTransfer service whose Control keeps each stream's channel and reads
// it only when the test says so.
class HoldingService : public v1::KvTransfer::Service {
 public:
  explicit HoldingService(nccl::ControlInboxLimits limits) : limits_(limits) {}
  grpc::Status Control(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::KvControlFrame, v1::KvControlFrame>* stream)
      override {
    grpc::Status status = nccl::ServeControlStream(
        context, stream,
        [this](std::unique_ptr<ControlChannel> channel) {
          absl::MutexLock l(&mu_);
          channel_ = std::move(channel);
        },
        limits_);
    absl::MutexLock l(&mu_);
    handler_status_ = status;
    handler_done_ = true;
    return status;
  }
  ControlChannel* WaitForChannel() {
    absl::MutexLock l(&mu_);
    mu_.Await(absl::Condition(
        +[](std::unique_ptr<ControlChannel>* c) { return *c != nullptr; },
        &channel_));
    return channel_.get();
  }
  grpc::Status WaitForHandler() {
    absl::MutexLock l(&mu_);
    mu_.Await(absl::Condition(&handler_done_));
    return handler_status_;
  }

 private:
  const nccl::ControlInboxLimits limits_;
  absl::Mutex mu_;
  std::unique_ptr<ControlChannel> channel_ ABSL_GUARDED_BY(mu_);
  grpc::Status handler_status_ ABSL_GUARDED_BY(mu_);
  bool handler_done_ ABSL_GUARDED_BY(mu_) = false;
};

struct Server {
  explicit Server(nccl::ControlInboxLimits limits) : service(limits) {
    server = testing::StartTestServer(&service, &port);
  }
  ~Server() { server->Shutdown(std::chrono::system_clock::now()); }
  std::unique_ptr<v1::KvTransfer::Stub> Stub() {
    return v1::KvTransfer::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  }
  HoldingService service;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

v1::KvControlFrame Frame(int i) {
  v1::KvControlFrame f;
  f.set_payload(absl::StrCat("frame-", i, std::string(1000, 'x')));
  return f;
}

TEST(ControlInboxTest, AFloodNobodyReadsFailsTheStreamWithResourceExhausted) {
  nccl::ControlInboxLimits limits;
  limits.max_messages = 4;
  limits.full_timeout = absl::Milliseconds(200);
  Server server(limits);
  auto stub = server.Stub();
  grpc::ClientContext ctx;
  auto stream = stub->Control(&ctx);
  ControlChannel* held = nullptr;
  int written = 0;
  for (int i = 0; i < 50; ++i) {
    if (!stream->Write(Frame(i))) break;
    ++written;
    if (held == nullptr) held = server.service.WaitForChannel();
  }
  stream->WritesDone();
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << status.error_message() << " after " << written << " frames";
  EXPECT_EQ(server.service.WaitForHandler().error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  // The end that never read learns it too, and holds nothing.
  ASSERT_NE(held, nullptr);
  EXPECT_EQ(held->Receive(absl::Now()).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(ControlInboxTest, ASlowReaderStallsTheWriterAndLosesNothing) {
  nccl::ControlInboxLimits limits;
  limits.max_messages = 2;
  limits.full_timeout = absl::Seconds(30);
  Server server(limits);
  auto stub = server.Stub();
  grpc::ClientContext ctx;
  auto stream = stub->Control(&ctx);
  constexpr int kFrames = 300;
  std::vector<std::string> got;
  std::thread reader([&] {
    ControlChannel* channel = server.service.WaitForChannel();
    for (int i = 0; i < kFrames; ++i) {
      auto m = channel->Receive(absl::Now() + absl::Seconds(30));
      if (!m.ok()) break;
      got.push_back(*std::move(m));
    }
  });
  for (int i = 0; i < kFrames; ++i) ASSERT_TRUE(stream->Write(Frame(i)));
  stream->WritesDone();
  reader.join();
  EXPECT_TRUE(stream->Finish().ok());
  ASSERT_EQ(got.size(), static_cast<size_t>(kFrames));
  for (int i = 0; i < kFrames; ++i) EXPECT_EQ(got[i], Frame(i).payload());
}

class EndpointLimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spec_ = TestSpec(DType::kF16);
    engine::KvCacheSpec shared = spec_;
    shared.host_shared = true;
    decode_pool_ = *engine::KvPool::Create(shared, 16);
    prefill_pool_ = *engine::KvPool::Create(spec_, 16);
    layout_ = KvLayout::FromSpec(spec_, "fp");
    receiver_ = std::make_unique<KvReceiver>(decode_pool_.get(), layout_);
    backend_ = NewShmBackend();
    IpcReceiverConfig config;
    config.max_streams = 2;
    config.timeout = absl::Seconds(30);
    endpoint_ = *IpcKvReceiveEndpoint::Create(
        receiver_.get(), decode_pool_.get(), backend_.get(), config);
    network_.Listen("decode:1", [this](std::unique_ptr<ControlChannel> c) {
      endpoint_->Serve(std::move(c));
    });
    IpcTransportConfig send;
    send.timeout = absl::Seconds(10);
    transport_ = std::make_unique<IpcKvTransport>(&network_, backend_.get(),
                                                  nullptr, send);
  }
  void TearDown() override {
    network_.StopListening("decode:1");
    endpoint_->Shutdown();
  }
  absl::Status Transfer() {
    const uint64_t res = receiver_->Expect("r", {3}, 0);
    SendPlan plan;
    plan.destination = "decode:1";
    plan.request_id = "r";
    plan.reservation_id = res;
    plan.sender_id = "prefill:1";
    plan.layout = layout_;
    plan.blocks = {{0, 0}};
    auto session = transport_->Open(plan, prefill_pool_.get());
    if (!session.ok()) {
      receiver_->Cancel(res);
      return session.status();
    }
    RETURN_IF_ERROR((*session)->SendLayers(0, spec_.num_layers));
    RETURN_IF_ERROR((*session)->Finish().status());
    return receiver_->Wait(res, absl::Seconds(10),
                           absl::Now() + absl::Seconds(10));
  }
  // Waits (bounded) until the endpoint holds `n` stream threads.
  bool HeldBecomes(int n) {
    return Eventually([&] { return endpoint_->held_streams() == n; });
  }
  // Waits (bounded) until at most `n` streams are still running.
  bool ActiveAtMost(int n) {
    return Eventually([&] { return endpoint_->active_streams() <= n; });
  }
  template <typename Pred>
  static bool Eventually(Pred pred) {
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (!pred()) {
      if (absl::Now() > until) return false;
      absl::SleepFor(absl::Milliseconds(1));
    }
    return true;
  }

  engine::KvCacheSpec spec_;
  KvLayout layout_;
  std::unique_ptr<engine::KvPool> decode_pool_, prefill_pool_;
  std::unique_ptr<KvReceiver> receiver_;
  std::unique_ptr<PeerMemoryBackend> backend_;
  std::unique_ptr<IpcKvReceiveEndpoint> endpoint_;
  nccl::FakeControlNetwork network_;
  std::unique_ptr<IpcKvTransport> transport_;
};

TEST_F(EndpointLimitsTest, StreamsPastTheCapAreRefusedWithResourceExhausted) {
  // Two peers open streams and send nothing: each holds a thread.
  auto idle1 = *network_.Connect("decode:1");
  auto idle2 = *network_.Connect("decode:1");
  ASSERT_EQ(endpoint_->active_streams(), 2);
  const absl::Status refused = Transfer();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("2 control streams"));
  EXPECT_EQ(endpoint_->refused_streams(), 1);
  EXPECT_EQ(endpoint_->held_streams(), 2);  // the refused one got no thread
  // Once they go, their threads are reaped without waiting for a new
  // stream, and transfers are served again.
  idle1->Close();
  idle2->Close();
  EXPECT_TRUE(HeldBecomes(0)) << endpoint_->held_streams();
  EXPECT_TRUE(Transfer().ok());
  EXPECT_EQ(receiver_->num_reservations(), 0);
}

TEST_F(EndpointLimitsTest, FinishedStreamsAreReapedPromptly) {
  for (int i = 0; i < 20; ++i) {
    // A stream ends when its thread sees the sender close it, a moment
    // after the transfer returns, and the cap (2) counts it until then: with
    // two such streams still ending, a third would be refused.
    ASSERT_TRUE(ActiveAtMost(1)) << endpoint_->active_streams();
    const absl::Status s = Transfer();
    ASSERT_TRUE(s.ok()) << i << ": " << s;
  }
  // No further Serve call: the reaper alone joins the finished threads.
  EXPECT_TRUE(HeldBecomes(0)) << endpoint_->held_streams();
  EXPECT_EQ(endpoint_->active_streams(), 0);
}

TEST(IpcReceiverConfigTest, MaxStreamsMustBePositive) {
  IpcReceiverConfig config;
  EXPECT_TRUE(config.Validate().ok());
  config.max_streams = 0;
  EXPECT_EQ(config.Validate().code(), absl::StatusCode::kInvalidArgument);
  nccl::ControlInboxLimits limits;
  EXPECT_TRUE(limits.Validate().ok());
  limits.max_messages = 0;
  EXPECT_FALSE(limits.Validate().ok());
}

}  // namespace
}  // namespace pdserve::kv_transfer::ipc
