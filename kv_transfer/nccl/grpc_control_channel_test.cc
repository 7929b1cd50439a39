// The `nccl` transport over its production control plane: a real gRPC
// server (loopback, port 0) serving NcclKvTransferService — what a decode
// worker registers — and the sender's GrpcControlChannelFactory, with the
// in-process fake communicator in place of NCCL.
#include "kv_transfer/nccl/grpc_control_channel.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "kv_transfer/nccl/control_messages.h"
#include "kv_transfer/nccl/fake_communicator.h"
#include "kv_transfer/nccl/nccl_receiver.h"
#include "kv_transfer/nccl/nccl_transport.h"
#include "kv_transfer/nccl/test_util.h"

namespace pdserve::kv_transfer::nccl {
namespace {

using ::testing::HasSubstr;
using testing::Holds;
using testing::IsZero;
using testing::kModel;
using testing::Prefill;
using testing::ScaleBytes;
using testing::Spec;

class GrpcControlChannelTest : public ::testing::Test {
 protected:
  void StartDecode(const engine::KvCacheSpec& spec) {
    spec_ = spec;
    pool_ = *engine::KvPool::Create(spec_, 16);
    metrics_ = std::make_unique<TransferMetrics>(registry_);
    receiver_ = std::make_unique<KvReceiver>(pool_.get(),
                                             KvLayout::FromSpec(spec_, kModel),
                                             metrics_->ForReceiver());
    NcclReceiverConfig config;
    config.timeout = absl::Seconds(10);
    endpoint_ = std::make_unique<NcclKvReceiveEndpoint>(receiver_.get(),
                                                        &comms_, config);
    service_ = std::make_unique<NcclKvTransferService>(receiver_.get(),
                                                       endpoint_.get());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_TRUE(server_ != nullptr && port > 0);
    address_ = absl::StrCat("127.0.0.1:", port);
  }
  void StopDecode() {
    if (server_) {
      server_->Shutdown(std::chrono::system_clock::now() +
                        std::chrono::milliseconds(200));
      server_.reset();
    }
    if (endpoint_) endpoint_->Shutdown();
  }
  void TearDown() override { StopDecode(); }

  std::unique_ptr<NcclKvTransport> Transport() {
    NcclTransportConfig config;
    config.timeout = absl::Seconds(10);
    return std::make_unique<NcclKvTransport>(&control_, &comms_, nullptr,
                                             config);
  }
  uint64_t Reserve(const std::string& request, int num_blocks, int skip,
                   std::vector<int32_t>* blocks) {
    blocks->clear();
    for (int i = 0; i < num_blocks; ++i) blocks->push_back(15 - i);
    return receiver_->Expect(request, *blocks, skip);
  }
  absl::Status Wait(uint64_t id) {
    return receiver_->Wait(id, absl::Seconds(20),
                           absl::Now() + absl::Seconds(30));
  }

  FakeCommunicatorFactory comms_;
  GrpcControlChannelFactory control_;
  engine::KvCacheSpec spec_;
  std::unique_ptr<engine::KvPool> pool_;
  metrics::Registry registry_;
  std::unique_ptr<TransferMetrics> metrics_;
  std::unique_ptr<KvReceiver> receiver_;
  std::unique_ptr<NcclKvReceiveEndpoint> endpoint_;
  std::unique_ptr<NcclKvTransferService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

TEST_F(GrpcControlChannelTest, EveryDtypeArrivesByteIdenticalOverGrpcControl) {
  for (DType dtype :
       {DType::kF32, DType::kF16, DType::kBF16, DType::kI8, DType::kFp8E4M3}) {
    StartDecode(Spec(dtype));
    auto transport = Transport();
    // Two transfers on one link: the first whole, the second layer by layer
    // with two leading blocks already held by the receiver.
    for (int skip : {0, 2}) {
      std::vector<int32_t> reserved;
      const std::string request = absl::StrCat("req-", skip);
      const uint64_t id = Reserve(request, 5, skip, &reserved);
      Prefill prefill(spec_, id, request, 5, skip, 40 + skip);
      prefill.plan.destination = address_;
      auto session = transport->Open(prefill.plan, prefill.pool.get());
      ASSERT_TRUE(session.ok()) << session.status();
      if (skip == 0) {
        ASSERT_TRUE((*session)->SendLayers(0, spec_.num_layers).ok());
      } else {
        for (int l = 0; l < spec_.num_layers; ++l) {
          ASSERT_TRUE((*session)->SendLayers(l, l + 1).ok());
        }
      }
      absl::StatusOr<SendStats> stats = (*session)->Finish();
      ASSERT_TRUE(stats.ok()) << stats.status();
      EXPECT_EQ(stats->bytes,
                static_cast<uint64_t>(spec_.num_layers) * (5 - skip) *
                    (spec_.LayerBlockBytes() + ScaleBytes(spec_)));
      ASSERT_TRUE(Wait(id).ok()) << DTypeName(dtype);
      for (int i = 0; i < 5; ++i) {
        for (int l = 0; l < spec_.num_layers; ++l) {
          if (i < skip) {
            EXPECT_TRUE(IsZero(pool_.get(), l, reserved[i]));
          } else {
            EXPECT_TRUE(Holds(pool_.get(), 40 + skip, l, i, reserved[i]))
                << DTypeName(dtype) << " layer " << l << " block " << i;
          }
        }
      }
      // Clear the receiver's blocks for the next transfer.
      for (int32_t b : reserved) {
        for (int l = 0; l < spec_.num_layers; ++l) {
          std::memset(pool_->LayerBlockData(l, b), 0, spec_.LayerBlockBytes());
          if (ScaleBytes(spec_))
            std::memset(pool_->LayerBlockScales(l, b), 0, ScaleBytes(spec_));
        }
      }
    }
    EXPECT_EQ(transport->num_links(), 1);
    EXPECT_EQ(endpoint_->active_links(), 1);
    EXPECT_EQ(receiver_->num_reservations(), 0);
    transport.reset();
    StopDecode();
  }
}

TEST_F(GrpcControlChannelTest, MismatchedLayoutIsRefusedWithBothValues) {
  StartDecode(Spec(DType::kBF16));
  std::vector<int32_t> reserved;
  const uint64_t id = Reserve("req", 3, 0, &reserved);
  // The sender's pool has another block size.
  Prefill prefill(Spec(DType::kBF16, 8), id, "req", 3, 0, 7);
  prefill.plan.destination = address_;
  auto transport = Transport();
  auto session = transport->Open(prefill.plan, prefill.pool.get());
  ASSERT_FALSE(session.ok());
  EXPECT_EQ(session.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(session.status().message(),
              HasSubstr("block_size: sender 8 vs receiver 4"));
  // The receiver fails the reservation, and Wait frees it.
  EXPECT_FALSE(Wait(id).ok());
  EXPECT_EQ(receiver_->num_reservations(), 0);
}

TEST_F(GrpcControlChannelTest, ReceiverGoneFailsOpenAndTheNextOpenReconnects) {
  StartDecode(Spec(DType::kF32));
  const std::string address = address_;
  auto transport = Transport();
  {
    std::vector<int32_t> reserved;
    const uint64_t id = Reserve("a", 2, 0, &reserved);
    Prefill prefill(spec_, id, "a", 2, 0, 1);
    prefill.plan.destination = address;
    auto session = transport->Open(prefill.plan, prefill.pool.get());
    ASSERT_TRUE(session.ok()) << session.status();
    ASSERT_TRUE((*session)->SendLayers(0, spec_.num_layers).ok());
    ASSERT_TRUE((*session)->Finish().ok());
    ASSERT_TRUE(Wait(id).ok());
  }
  // The decode worker goes away: its server stops, its endpoint closes.
  StopDecode();
  {
    Prefill prefill(spec_, 99, "b", 2, 0, 1);
    prefill.plan.destination = address;
    const absl::Time start = absl::Now();
    auto session = transport->Open(prefill.plan, prefill.pool.get());
    ASSERT_FALSE(session.ok());
    EXPECT_EQ(session.status().code(), absl::StatusCode::kUnavailable)
        << session.status();
    EXPECT_LT(absl::Now() - start, absl::Seconds(9));  // not the timeout
  }
  // Nobody listens at an address at all.
  {
    Prefill prefill(spec_, 1, "c", 2, 0, 1);
    prefill.plan.destination = "127.0.0.1:1";
    auto session = transport->Open(prefill.plan, prefill.pool.get());
    ASSERT_FALSE(session.ok());
    EXPECT_EQ(session.status().code(), absl::StatusCode::kUnavailable);
  }
  EXPECT_EQ(transport->num_links(), 0);  // broken links are not reused
}

TEST_F(GrpcControlChannelTest, SenderGoneMidTransferFreesTheReservation) {
  StartDecode(Spec(DType::kF16));
  std::vector<int32_t> reserved;
  const uint64_t id = Reserve("req", 4, 0, &reserved);
  {
    // A prefill worker speaking the raw protocol: link, begin, then it dies
    // (its gRPC stream is cancelled) without an End.
    absl::StatusOr<std::unique_ptr<ControlChannel>> channel =
        control_.Connect(address_);
    ASSERT_TRUE(channel.ok());
    auto call = [&](const ControlMessage& m) -> absl::StatusOr<ReplyMessage> {
      if (absl::Status s = (*channel)->Send(EncodeMessage(m)); !s.ok())
        return s;
      absl::StatusOr<std::string> bytes =
          (*channel)->Receive(absl::Now() + absl::Seconds(10));
      if (!bytes.ok()) return bytes.status();
      absl::StatusOr<ControlMessage> reply = DecodeMessage(*bytes);
      if (!reply.ok()) return reply.status();
      return std::get<ReplyMessage>(*reply);
    };
    const std::string unique_id = *comms_.NewUniqueId();
    absl::StatusOr<ReplyMessage> hello = call(HelloMessage{unique_id, "p"});
    ASSERT_TRUE(hello.ok() && StatusOf(*hello).ok());
    auto comm =
        comms_.Create(unique_id, Communicator::kSenderRank,
                      absl::Now() + absl::Seconds(10), absl::Seconds(10));
    ASSERT_TRUE(comm.ok());
    absl::StatusOr<ReplyMessage> begin =
        call(BeginMessage{1, id, "req", KvLayout::FromSpec(spec_, kModel)});
    ASSERT_TRUE(begin.ok() && StatusOf(*begin).ok());
  }
  const absl::Time start = absl::Now();
  EXPECT_FALSE(Wait(id).ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // not the stall timeout
  EXPECT_EQ(receiver_->num_reservations(), 0);
}

TEST_F(GrpcControlChannelTest, GrpcOnlyWorkerRefusesTheControlStream) {
  spec_ = Spec(DType::kF32);
  pool_ = *engine::KvPool::Create(spec_, 4);
  receiver_ = std::make_unique<KvReceiver>(pool_.get(),
                                           KvLayout::FromSpec(spec_, kModel));
  KvTransferService plain(receiver_.get());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&plain);
  server_ = builder.BuildAndStart();
  Prefill prefill(spec_, 1, "req", 2, 0, 1);
  prefill.plan.destination = absl::StrCat("127.0.0.1:", port);
  auto transport = Transport();
  auto session = transport->Open(prefill.plan, prefill.pool.get());
  ASSERT_FALSE(session.ok());
  EXPECT_EQ(session.status().code(), absl::StatusCode::kUnavailable);
  server_->Shutdown(std::chrono::system_clock::now());
  server_.reset();
}

}  // namespace
}  // namespace pdserve::kv_transfer::nccl
