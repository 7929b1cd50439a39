// The `nccl` KV transport's protocol on CPU: real sender sessions and receive
// endpoint, with the in-process fake communicator and control channel in
// place of NCCL and gRPC. Pools are engine::KvPool in host memory.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/metrics.h"
#include "kv_transfer/nccl/control_messages.h"
#include "kv_transfer/nccl/fake_communicator.h"
#include "kv_transfer/nccl/fake_control_channel.h"
#include "kv_transfer/nccl/nccl_receiver.h"
#include "kv_transfer/nccl/nccl_transport.h"
#include "kv_transfer/nccl/test_util.h"
#include "kv_transfer/test_blocks.h"

namespace pdserve::kv_transfer::nccl {
namespace {

using ::testing::HasSubstr;
using testing::Holds;
using testing::IsZero;
using testing::kDecode;
using testing::kModel;
using testing::Prefill;
using testing::ScaleBytes;
using testing::Spec;

// A speaker of the raw control protocol, for peers that misbehave.
struct RawSender {
  absl::StatusOr<ReplyMessage> Call(const ControlMessage& m) {
    return CallBytes(EncodeMessage(m));
  }
  absl::StatusOr<ReplyMessage> CallBytes(std::string bytes) {
    if (absl::Status s = channel->Send(std::move(bytes)); !s.ok()) return s;
    absl::StatusOr<std::string> reply =
        channel->Receive(absl::Now() + absl::Seconds(10));
    if (!reply.ok()) return reply.status();
    absl::StatusOr<ControlMessage> decoded = DecodeMessage(*reply);
    if (!decoded.ok()) return decoded.status();
    return std::get<ReplyMessage>(*decoded);
  }
  std::unique_ptr<ControlChannel> channel;
  std::unique_ptr<Communicator> comm;
};

class NcclProtocolTest : public ::testing::Test {
 protected:
  static NcclReceiverConfig ReceiverConfig(
      absl::Duration timeout = absl::Seconds(10)) {
    NcclReceiverConfig config;
    config.timeout = timeout;
    return config;
  }
  static NcclTransportConfig SenderConfig(
      absl::Duration timeout = absl::Seconds(10)) {
    NcclTransportConfig config;
    config.timeout = timeout;
    return config;
  }

  void StartReceiver(const engine::KvCacheSpec& spec,
                     NcclReceiverConfig config = ReceiverConfig(),
                     CommunicatorFactory* comms = nullptr) {
    spec_ = spec;
    pool_ = *engine::KvPool::Create(spec_, 16);
    metrics_ = std::make_unique<TransferMetrics>(registry_);
    receiver_ = std::make_unique<KvReceiver>(pool_.get(),
                                             KvLayout::FromSpec(spec_, kModel),
                                             metrics_->ForReceiver());
    endpoint_ = std::make_unique<NcclKvReceiveEndpoint>(
        receiver_.get(), comms ? comms : &comms_, config);
    network_.Listen(kDecode, [this](std::unique_ptr<ControlChannel> channel) {
      endpoint_->Serve(std::move(channel));
    });
  }
  void TearDown() override {
    network_.StopListening(kDecode);
    if (endpoint_) endpoint_->Shutdown();
  }

  std::unique_ptr<NcclKvTransport> Transport(
      NcclTransportConfig config = SenderConfig()) {
    return std::make_unique<NcclKvTransport>(&network_, &comms_, nullptr,
                                             config);
  }

  // Reserves `num_blocks` receiver blocks (in reverse physical order, so it
  // differs from the sender's) of which the first `skip` are already cached.
  uint64_t Reserve(const std::string& request, int num_blocks, int skip,
                   std::vector<int32_t>* blocks) {
    blocks->clear();
    for (int i = 0; i < num_blocks; ++i) blocks->push_back(next_block_ - i);
    next_block_ -= num_blocks;
    return receiver_->Expect(request, *blocks, skip);
  }

  absl::Status Wait(uint64_t id, absl::Duration stall = absl::Seconds(20)) {
    return receiver_->Wait(id, stall, absl::Now() + absl::Seconds(30));
  }

  void ExpectArrived(const std::vector<int32_t>& blocks, int skip,
                     uint64_t seed) {
    for (int i = skip; i < static_cast<int>(blocks.size()); ++i) {
      for (int l = 0; l < spec_.num_layers; ++l) {
        EXPECT_TRUE(Holds(pool_.get(), seed, l, i, blocks[i]))
            << DTypeName(spec_.dtype) << " layer " << l << " block " << i;
      }
    }
    for (int i = 0; i < skip; ++i) {
      for (int l = 0; l < spec_.num_layers; ++l) {
        EXPECT_TRUE(IsZero(pool_.get(), l, blocks[i]));
      }
    }
  }

  // Every receiver block outside `reserved` is still zero.
  void ExpectUntouchedOutside(const std::vector<int32_t>& reserved) {
    for (int32_t b = 0; b < pool_->num_blocks(); ++b) {
      if (std::find(reserved.begin(), reserved.end(), b) != reserved.end()) {
        continue;
      }
      for (int l = 0; l < spec_.num_layers; ++l) {
        EXPECT_TRUE(IsZero(pool_.get(), l, b)) << "block " << b;
      }
    }
  }

  double Failures(const std::string& reason) {
    const std::string text = registry_.Render();
    const std::string key =
        "pdserve_kv_transfer_failures_total{reason=\"" + reason + "\"} ";
    const size_t at = text.find(key);
    return at == std::string::npos ? -1
                                   : std::stod(text.substr(at + key.size()));
  }

  // Connects a raw sender and completes the Hello, joining the communicator.
  RawSender RawConnect() {
    RawSender raw;
    raw.channel = *network_.Connect(kDecode);
    const std::string id = *comms_.NewUniqueId();
    absl::StatusOr<ReplyMessage> hello = raw.Call(HelloMessage{id, "rogue"});
    EXPECT_TRUE(hello.ok() && StatusOf(*hello).ok());
    raw.comm =
        *comms_.Create(id, Communicator::kSenderRank,
                       absl::Now() + absl::Seconds(10), absl::Seconds(10));
    return raw;
  }

  FakeCommunicatorFactory comms_;
  FakeControlNetwork network_;
  engine::KvCacheSpec spec_;
  std::unique_ptr<engine::KvPool> pool_;
  metrics::Registry registry_;
  std::unique_ptr<TransferMetrics> metrics_;
  std::unique_ptr<KvReceiver> receiver_;
  std::unique_ptr<NcclKvReceiveEndpoint> endpoint_;
  int32_t next_block_ = 15;
};

TEST_F(NcclProtocolTest, EveryDtypeArrivesByteIdenticalWholeAndLayerwise) {
  for (DType dtype :
       {DType::kF32, DType::kF16, DType::kBF16, DType::kI8, DType::kFp8E4M3}) {
    for (bool layerwise : {false, true}) {
      StartReceiver(Spec(dtype));
      next_block_ = 15;
      std::vector<int32_t> reserved;
      const uint64_t id = Reserve("req-1", 5, 2, &reserved);
      Prefill prefill(spec_, id, "req-1", 5, 2, 42);
      auto transport = Transport();
      auto session = transport->Open(prefill.plan, prefill.pool.get());
      ASSERT_TRUE(session.ok()) << session.status();
      if (layerwise) {
        for (int l = 0; l < spec_.num_layers; ++l) {
          ASSERT_TRUE((*session)->SendLayers(l, l + 1).ok());
        }
      } else {
        ASSERT_TRUE((*session)->SendLayers(0, spec_.num_layers).ok());
      }
      absl::StatusOr<SendStats> stats = (*session)->Finish();
      ASSERT_TRUE(stats.ok()) << stats.status();
      EXPECT_EQ(stats->spans, 3u * 3u);
      EXPECT_EQ(stats->bytes,
                9u * (spec_.LayerBlockBytes() + ScaleBytes(spec_)));
      ASSERT_TRUE(Wait(id).ok())
          << DTypeName(dtype) << (layerwise ? " layerwise" : " whole");
      ExpectArrived(reserved, 2, 42);
      ExpectUntouchedOutside(reserved);
      EXPECT_EQ(receiver_->num_reservations(), 0);
      endpoint_->Shutdown();
    }
  }
}

TEST_F(NcclProtocolTest,
       EachBatchTravelsAsOneGroupWithInt8ScalesBehindTheData) {
  StartReceiver(Spec(DType::kI8));
  std::vector<int32_t> reserved;
  const uint64_t id = Reserve("req-1", 4, 0, &reserved);
  Prefill prefill(spec_, id, "req-1", 4, 0, 7);
  auto transport = Transport();
  auto session = *transport->Open(prefill.plan, prefill.pool.get());
  ASSERT_TRUE(session->SendLayers(0, 3).ok());
  ASSERT_TRUE(session->Finish().ok());
  ASSERT_TRUE(Wait(id).ok());
  const size_t data = 12 * spec_.LayerBlockBytes(),
               scales = 12 * ScaleBytes(spec_);
  EXPECT_THAT(comms_.group_log(),
              ::testing::UnorderedElementsAre(
                  absl::StrCat("r0 send:", data, " send:", scales),
                  absl::StrCat("r1 recv:", data, " recv:", scales)));
  EXPECT_EQ(comms_.bytes_delivered(), data + scales);
}

TEST_F(NcclProtocolTest, BatchesStayWithinTheSmallerOfBothStagingLimits) {
  const engine::KvCacheSpec spec = Spec(DType::kF16);
  const size_t span = spec.LayerBlockBytes();
  NcclReceiverConfig config = ReceiverConfig();
  config.max_batch_bytes =
      5 * span + 1;  // the receiver's limit is the smaller one
  StartReceiver(spec, config);
  std::vector<int32_t> reserved;
  const uint64_t id = Reserve("req-1", 4, 0, &reserved);
  Prefill prefill(spec_, id, "req-1", 4, 0, 9);
  auto transport = Transport();
  auto session = *transport->Open(prefill.plan, prefill.pool.get());
  ASSERT_TRUE(session->SendLayers(0, 3).ok());  // 12 spans: batches of 5, 5, 2
  ASSERT_TRUE(session->Finish().ok());
  ASSERT_TRUE(Wait(id).ok());
  ExpectArrived(reserved, 0, 9);
  std::vector<std::string> sends;
  for (const std::string& g : comms_.group_log()) {
    if (g.rfind("r0", 0) == 0) sends.push_back(g);
  }
  EXPECT_THAT(sends,
              ::testing::ElementsAre(absl::StrCat("r0 send:", 5 * span),
                                     absl::StrCat("r0 send:", 5 * span),
                                     absl::StrCat("r0 send:", 2 * span)));
}

TEST_F(NcclProtocolTest, OneLinkPerDecodeWorkerIsCreatedOnFirstUseAndShared) {
  StartReceiver(Spec(DType::kF16));
  auto transport = Transport();
  EXPECT_EQ(comms_.communicators_created(), 0);
  EXPECT_EQ(network_.connections(), 0);
  for (int r = 0; r < 3; ++r) {
    std::vector<int32_t> reserved;
    const std::string request = absl::StrCat("req-", r);
    const uint64_t id = Reserve(request, 2, 0, &reserved);
    Prefill prefill(spec_, id, request, 2, 0, r);
    auto session = *transport->Open(prefill.plan, prefill.pool.get());
    ASSERT_TRUE(session->SendLayers(0, 3).ok());
    ASSERT_TRUE(session->Finish().ok());
    ASSERT_TRUE(Wait(id).ok());
    ExpectArrived(reserved, 0, r);
  }
  EXPECT_EQ(network_.connections(), 1);
  EXPECT_EQ(comms_.communicators_created(), 2);  // one per rank of the one pair
  EXPECT_EQ(transport->num_links(), 1);
  EXPECT_EQ(endpoint_->active_links(), 1);
}

TEST_F(NcclProtocolTest, ConcurrentTransfersOnOneLinkBothArriveIntact) {
  StartReceiver(Spec(DType::kI8));
  auto transport = Transport();
  constexpr int kSenders = 4;
  std::vector<std::vector<int32_t>> reserved(kSenders);
  std::vector<uint64_t> ids;
  for (int s = 0; s < kSenders; ++s) {
    ids.push_back(Reserve(absl::StrCat("req-", s), 3, 1, &reserved[s]));
  }
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(kSenders);
  for (int s = 0; s < kSenders; ++s) {
    threads.emplace_back([&, s] {
      Prefill prefill(spec_, ids[s], absl::StrCat("req-", s), 3, 1, 100 + s);
      auto session = transport->Open(prefill.plan, prefill.pool.get());
      if (!session.ok()) {
        results[s] = session.status();
        return;
      }
      for (int l = 0; l < 3 && results[s].ok(); ++l) {
        results[s] = (*session)->SendLayers(l, l + 1);
      }
      if (results[s].ok()) results[s] = (*session)->Finish().status();
    });
  }
  for (auto& t : threads) t.join();
  for (int s = 0; s < kSenders; ++s) {
    ASSERT_TRUE(results[s].ok()) << s << ": " << results[s];
    ASSERT_TRUE(Wait(ids[s]).ok());
    ExpectArrived(reserved[s], 1, 100 + s);
  }
  EXPECT_EQ(comms_.communicators_created(), 2);
}

TEST_F(NcclProtocolTest,
       LayoutMismatchFailsOpenWithBothValuesAndEndsTheReservation) {
  StartReceiver(Spec(DType::kF16, /*block_size=*/4));
  std::vector<int32_t> reserved;
  const uint64_t id = Reserve("req-1", 2, 0, &reserved);
  Prefill prefill(Spec(DType::kF16, /*block_size=*/8), id, "req-1", 2, 0, 1);
  auto transport = Transport();
  auto session = transport->Open(prefill.plan, prefill.pool.get());
  ASSERT_EQ(session.status().code(), absl::StatusCode::kFailedPrecondition)
      << session.status();
  EXPECT_THAT(session.status().message(),
              HasSubstr("block_size: sender 8 vs receiver 4"));
  EXPECT_EQ(comms_.bytes_delivered(), 0u);
  const absl::Status waited = Wait(id);
  EXPECT_EQ(waited.code(), absl::StatusCode::kAborted) << waited;
  EXPECT_EQ(Failures("handshake"), 1);
  EXPECT_EQ(receiver_->num_reservations(), 0);
}

TEST_F(NcclProtocolTest, UnknownReservationIsNotFound) {
  StartReceiver(Spec(DType::kF16));
  Prefill prefill(spec_, /*reservation=*/999, "req-1", 2, 0, 1);
  auto transport = Transport();
  auto session = transport->Open(prefill.plan, prefill.pool.get());
  EXPECT_EQ(session.status().code(), absl::StatusCode::kNotFound)
      << session.status();
  EXPECT_EQ(Failures("unknown_reservation"), 1);
  EXPECT_EQ(transport->num_links(), 1);  // a refusal leaves the link usable
}

TEST_F(NcclProtocolTest,
       SpansOutsideTheReservationAreRejectedAndNothingOutsideIsWritten) {
  StartReceiver(Spec(DType::kF16));
  for (int bad_index :
       {5 /* past the end */, 0 /* an already cached block */}) {
    std::vector<int32_t> reserved;
    const uint64_t id = Reserve("req-1", 5, 2, &reserved);
    Prefill prefill(spec_, id, "req-1", 5, 2, 3);
    prefill.plan.blocks.emplace_back(bad_index, 0);
    auto transport = Transport();
    auto session = *transport->Open(prefill.plan, prefill.pool.get());
    // The bytes are accepted into staging; KvReceiver rejects the span.
    EXPECT_TRUE(session->SendLayers(0, 3).ok());
    const absl::StatusOr<SendStats> finished = session->Finish();
    EXPECT_EQ(finished.status().code(), absl::StatusCode::kInvalidArgument)
        << finished.status();
    EXPECT_THAT(finished.status().message(), HasSubstr("outside reservation"));
    const absl::Status waited = Wait(id);
    EXPECT_EQ(waited.code(), absl::StatusCode::kAborted);
    EXPECT_THAT(waited.message(), HasSubstr("outside reservation"));
    ExpectUntouchedOutside(reserved);
    for (int i = 0; i < 2; ++i) {
      for (int l = 0; l < 3; ++l) {
        EXPECT_TRUE(IsZero(pool_.get(), l, reserved[i]))
            << "cached block " << i;
      }
    }
    EXPECT_EQ(receiver_->num_reservations(), 0);
    for (int32_t b : reserved) {
      for (int l = 0; l < 3; ++l) {
        std::memset(pool_->LayerBlockData(l, b), 0, spec_.LayerBlockBytes());
      }
    }
  }
  EXPECT_EQ(Failures("out_of_range"), 2);
}

TEST_F(NcclProtocolTest, ReservationCancelledByDecodeStopsFurtherWrites) {
  StartReceiver(Spec(DType::kF16));
  std::vector<int32_t> reserved;
  const uint64_t id = Reserve("req-1", 3, 0, &reserved);
  Prefill prefill(spec_, id, "req-1", 3, 0, 5);
  auto transport = Transport();
  auto session = *transport->Open(prefill.plan, prefill.pool.get());
  receiver_->Cancel(id);
  EXPECT_TRUE(session->SendLayers(0, 2).ok());
  const absl::Status refused =
      session->SendLayers(2, 3);  // the receiver knows by now
  EXPECT_EQ(refused.code(), absl::StatusCode::kNotFound) << refused;
  EXPECT_FALSE(session->Finish().ok());
  for (int32_t b : reserved) {
    for (int l = 0; l < 3; ++l) EXPECT_TRUE(IsZero(pool_.get(), l, b));
  }
  EXPECT_EQ(receiver_->num_reservations(), 0);
  // A refused batch sent nothing, so the link carries the next transfer intact.
  EXPECT_EQ(transport->num_links(), 1);
  const uint64_t next = Reserve("req-2", 3, 0, &reserved);
  Prefill second(spec_, next, "req-2", 3, 0, 6);
  auto again = *transport->Open(second.plan, second.pool.get());
  ASSERT_TRUE(again->SendLayers(0, 3).ok());
  ASSERT_TRUE(again->Finish().ok());
  ASSERT_TRUE(Wait(next).ok());
  ExpectArrived(reserved, 0, 6);
}

TEST_F(NcclProtocolTest, SenderCancelEndsTheReservationAtOnce) {
  StartReceiver(Spec(DType::kF16));
  for (bool destroy : {false, true}) {
    std::vector<int32_t> reserved;
    const uint64_t id = Reserve("req-1", 3, 0, &reserved);
    Prefill prefill(spec_, id, "req-1", 3, 0, 5);
    auto transport = Transport();
    auto session = *transport->Open(prefill.plan, prefill.pool.get());
    ASSERT_TRUE(session->SendLayers(0, 1).ok());
    if (destroy) {
      session.reset();  // an abandoned session cancels itself
    } else {
      session->Cancel();
      session->Cancel();  // idempotent
      EXPECT_EQ(session->Finish().status().code(),
                absl::StatusCode::kFailedPrecondition);
    }
    const absl::Time start = absl::Now();
    const absl::Status waited = Wait(id, /*stall=*/absl::Seconds(20));
    EXPECT_EQ(waited.code(), absl::StatusCode::kAborted) << waited;
    EXPECT_THAT(waited.message(), HasSubstr("aborted"));
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));  // not the stall timeout
    EXPECT_EQ(receiver_->num_reservations(), 0);
  }
  EXPECT_EQ(Failures("sender_aborted"), 2);
}

TEST_F(NcclProtocolTest, SenderThatVanishesMidTransferLeavesNoReservation) {
  StartReceiver(Spec(DType::kF16));
  std::vector<int32_t> reserved;
  const uint64_t id = Reserve("req-1", 2, 0, &reserved);
  {
    RawSender raw = RawConnect();
    auto begun = raw.Call(
        BeginMessage{1, id, "req-1", KvLayout::FromSpec(spec_, kModel)});
    ASSERT_TRUE(begun.ok() && StatusOf(*begun).ok());
    raw.channel->Close();  // the prefill process died
  }
  const absl::Time start = absl::Now();
  EXPECT_EQ(Wait(id).code(), absl::StatusCode::kAborted);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(receiver_->num_reservations(), 0);
}

TEST_F(NcclProtocolTest,
       StalledDataPlaneTimesOutAndTheNextOpenBuildsAFreshLink) {
  // Generous enough for a loaded CI machine to connect within, short enough
  // to keep the test quick; the receiver gives up first.
  StartReceiver(Spec(DType::kF16), ReceiverConfig(absl::Seconds(1)));
  auto transport = Transport(SenderConfig(absl::Milliseconds(1500)));
  std::vector<int32_t> reserved;
  const uint64_t id = Reserve("req-1", 2, 0, &reserved);
  {
    Prefill prefill(spec_, id, "req-1", 2, 0, 8);
    auto session = *transport->Open(prefill.plan, prefill.pool.get());
    comms_.SetDeliveryPaused(true);
    ASSERT_TRUE(session->SendLayers(0, 3).ok());  // enqueued, never delivered
    const absl::Time start = absl::Now();
    const absl::StatusOr<SendStats> finished = session->Finish();
    EXPECT_FALSE(finished.ok());
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
    EXPECT_EQ(Wait(id).code(),
              absl::StatusCode::kAborted);  // the receiver gave up too
    EXPECT_EQ(receiver_->num_reservations(), 0);
    for (int32_t b : reserved) {
      for (int l = 0; l < 3; ++l) EXPECT_TRUE(IsZero(pool_.get(), l, b));
    }
  }
  EXPECT_EQ(transport->num_links(), 0);
  comms_.SetDeliveryPaused(false);
  const uint64_t again = Reserve("req-2", 2, 0, &reserved);
  Prefill prefill(spec_, again, "req-2", 2, 0, 8);
  auto session = transport->Open(prefill.plan, prefill.pool.get());
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->SendLayers(0, 3).ok());
  ASSERT_TRUE((*session)->Finish().ok());
  ASSERT_TRUE(Wait(again).ok());
  ExpectArrived(reserved, 0, 8);
  EXPECT_EQ(network_.connections(), 2);
  EXPECT_EQ(comms_.communicators_created(), 4);
  EXPECT_EQ(comms_.communicators_alive(), 2);  // the stalled pair was torn down
}

TEST_F(NcclProtocolTest,
       PeerThatNeverJoinsTheCommunicatorFailsOpenWithinTheTimeout) {
  // The receiver joins on a different fake "network", so its rank never pairs.
  FakeCommunicatorFactory elsewhere;
  StartReceiver(Spec(DType::kF16), ReceiverConfig(absl::Milliseconds(300)),
                &elsewhere);
  auto transport = Transport(SenderConfig(absl::Milliseconds(300)));
  std::vector<int32_t> reserved;
  const uint64_t id = Reserve("req-1", 2, 0, &reserved);
  Prefill prefill(spec_, id, "req-1", 2, 0, 1);
  const absl::Time start = absl::Now();
  auto session = transport->Open(prefill.plan, prefill.pool.get());
  EXPECT_EQ(session.status().code(), absl::StatusCode::kDeadlineExceeded)
      << session.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(transport->num_links(), 0);
  receiver_->Cancel(id);
  // `elsewhere` must outlive the endpoint, whose link may still be joining.
  endpoint_->Shutdown();
}

TEST_F(NcclProtocolTest, NoReceiverListeningIsUnavailable) {
  StartReceiver(Spec(DType::kF16));
  Prefill prefill(spec_, 1, "req-1", 2, 0, 1);
  prefill.plan.destination = "decode-9";
  auto transport = Transport();
  EXPECT_EQ(transport->Open(prefill.plan, prefill.pool.get()).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(NcclProtocolTest,
       PlanThatDoesNotDescribeThePoolIsRejectedBeforeConnecting) {
  StartReceiver(Spec(DType::kF16));
  auto transport = Transport();
  Prefill lying(spec_, 1, "req-1", 2, 0, 1);
  lying.plan.layout.head_dim = 16;
  auto session = transport->Open(lying.plan, lying.pool.get());
  EXPECT_EQ(session.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(session.status().message(), HasSubstr("head_dim"));
  Prefill outside(spec_, 1, "req-1", 2, 0, 1);
  outside.plan.blocks.emplace_back(2, 99);
  EXPECT_EQ(transport->Open(outside.plan, outside.pool.get()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(network_.connections(), 0);
}

TEST_F(NcclProtocolTest,
       MalformedOrOutOfOrderMessagesEndTheLinkWithoutCrashing) {
  StartReceiver(Spec(DType::kF16));
  {
    RawSender raw{*network_.Connect(kDecode), nullptr};
    auto reply = raw.CallBytes("\x07garbage");
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ(reply->code, absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(
        raw.channel->Receive(absl::Now() + absl::Seconds(5)).status().code(),
        absl::StatusCode::kUnavailable);  // the receiver hung up
  }
  {
    RawSender raw{*network_.Connect(kDecode), nullptr};
    auto reply = raw.Call(
        BeginMessage{1, 1, "req-1", KvLayout::FromSpec(spec_, kModel)});
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ(reply->code,
              absl::StatusCode::kFailedPrecondition);  // no Hello first
  }
  {
    RawSender raw = RawConnect();
    auto reply = raw.Call(ReplyMessage{});
    ASSERT_TRUE(reply.ok());
    EXPECT_EQ(reply->code,
              absl::StatusCode::kInvalidArgument);  // a sender does not reply
  }
  // The endpoint still serves well-behaved senders.
  std::vector<int32_t> reserved;
  const uint64_t id = Reserve("req-1", 2, 0, &reserved);
  Prefill prefill(spec_, id, "req-1", 2, 0, 4);
  auto transport = Transport();
  auto session = *transport->Open(prefill.plan, prefill.pool.get());
  ASSERT_TRUE(session->SendLayers(0, 3).ok());
  ASSERT_TRUE(session->Finish().ok());
  ASSERT_TRUE(Wait(id).ok());
  ExpectArrived(reserved, 0, 4);
}

TEST_F(NcclProtocolTest,
       ManifestsThatCannotBeReceivedAreRefusedBeforeAnyBytesMove) {
  NcclReceiverConfig config = ReceiverConfig();
  config.max_batch_bytes = 4 * Spec(DType::kF16).LayerBlockBytes();
  StartReceiver(Spec(DType::kF16), config);
  std::vector<int32_t> reserved;
  const uint64_t id = Reserve("req-1", 3, 0, &reserved);
  RawSender raw = RawConnect();
  auto reply = raw.Call(ManifestMessage{77, {{0, 0}}});
  EXPECT_EQ(reply->code,
            absl::StatusCode::kNotFound);  // no such transfer on the link
  ASSERT_TRUE(StatusOf(*raw.Call(BeginMessage{
                           1, id, "req-1", KvLayout::FromSpec(spec_, kModel)}))
                  .ok());
  reply = raw.Call(ManifestMessage{1, {}});
  EXPECT_EQ(reply->code, absl::StatusCode::kResourceExhausted);  // empty
  reply = raw.Call(ManifestMessage{1, {{0, 0}, {0, 1}}});
  EXPECT_EQ(
      reply->code,
      absl::StatusCode::kResourceExhausted);  // the transfer already failed
  EXPECT_EQ(comms_.bytes_delivered(), 0u);
  EXPECT_EQ(Wait(id).code(), absl::StatusCode::kAborted);
  const uint64_t big = Reserve("req-2", 3, 0, &reserved);
  ASSERT_TRUE(StatusOf(*raw.Call(BeginMessage{
                           2, big, "req-2", KvLayout::FromSpec(spec_, kModel)}))
                  .ok());
  reply =
      raw.Call(ManifestMessage{2, {{0, 0}, {0, 1}, {0, 2}, {1, 0}, {1, 1}}});
  EXPECT_EQ(reply->code,
            absl::StatusCode::kResourceExhausted);  // over the staging limit
  EXPECT_THAT(reply->message, HasSubstr("staging limit"));
  EXPECT_EQ(Wait(big).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(comms_.group_log().size(), 0u);
  EXPECT_EQ(receiver_->num_reservations(), 0);
}

TEST_F(NcclProtocolTest, ShutdownEndsOpenTransfersAndSendersSeeTheLinkGo) {
  StartReceiver(Spec(DType::kF16));
  std::vector<int32_t> reserved;
  const uint64_t id = Reserve("req-1", 2, 0, &reserved);
  Prefill prefill(spec_, id, "req-1", 2, 0, 4);
  auto transport = Transport();
  auto session = *transport->Open(prefill.plan, prefill.pool.get());
  ASSERT_TRUE(session->SendLayers(0, 1).ok());
  endpoint_->Shutdown();
  EXPECT_EQ(Wait(id).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(receiver_->num_reservations(), 0);
  EXPECT_EQ(session->Finish().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(transport->num_links(), 0);
}

TEST(ControlMessagesTest, EveryMessageRoundTripsAndEveryTruncationIsRejected) {
  const KvLayout layout{"fp", 3, 2, 8, 4, DType::kI8};
  const std::vector<ControlMessage> messages = {
      HelloMessage{std::string(128, '\x01'), "prefill-0"},
      BeginMessage{7, 9, "req-1", layout},
      // An MLA latent layout: its geometry travels so the receiver's
      // CheckLayouts can compare it (it used to be dropped on this path).
      BeginMessage{8, 10, "req-2",
                   KvLayout{"fp", 3, 1, 576, 4, DType::kBF16, 512, 64}},
      ManifestMessage{7, {{0, 3}, {2, -1}}},
      EndMessage{7, true},
      ReplyMessage{absl::StatusCode::kNotFound, "no such", 1 << 20},
  };
  for (const ControlMessage& m : messages) {
    const std::string bytes = EncodeMessage(m);
    absl::StatusOr<ControlMessage> back = DecodeMessage(bytes);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(*back == m) << "kind " << m.index();
    for (size_t n = 0; n < bytes.size(); ++n) {
      EXPECT_EQ(DecodeMessage(bytes.substr(0, n)).status().code(),
                absl::StatusCode::kInvalidArgument)
          << "kind " << m.index() << " truncated to " << n;
    }
    EXPECT_FALSE(DecodeMessage(bytes + "x").ok()) << "trailing bytes";
  }
}

TEST(ControlMessagesTest, RandomBytesNeverCrashOrAllocateWildly) {
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> byte(0, 255), length(0, 64);
  int decoded = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string bytes(length(rng), '\0');
    for (char& c : bytes) c = static_cast<char>(byte(rng));
    if (!bytes.empty()) {
      bytes[0] = static_cast<char>(1 + i % 5);  // a known kind, then noise
      decoded += DecodeMessage(bytes).ok() ? 1 : 0;
    }
  }
  // A manifest claiming 2^32 - 1 spans in a few bytes is refused, not
  // allocated.
  std::string huge = EncodeMessage(ManifestMessage{1, {}});
  std::memset(huge.data() + 9, 0xFF, 4);
  EXPECT_FALSE(DecodeMessage(huge).ok());
  EXPECT_LT(decoded, 20000);
}

TEST(NcclConfigTest, RejectsZeroLimitsAndTimeouts) {
  EXPECT_TRUE(NcclTransportConfig{}.Validate().ok());
  EXPECT_TRUE(NcclReceiverConfig{}.Validate().ok());
  EXPECT_FALSE((NcclTransportConfig{0, absl::Seconds(1)}.Validate().ok()));
  EXPECT_FALSE((NcclTransportConfig{1, absl::ZeroDuration()}.Validate().ok()));
  EXPECT_FALSE((NcclReceiverConfig{0, absl::Seconds(1)}.Validate().ok()));
  EXPECT_FALSE((NcclReceiverConfig{1, absl::Seconds(-1)}.Validate().ok()));
}

// One decode worker of the LRU test: its own pool, receiver and endpoint,
// listening on `name` of the shared fake network.
struct DecodeEnd {
  DecodeEnd(const std::string& name, const engine::KvCacheSpec& spec,
            FakeControlNetwork* network, CommunicatorFactory* comms)
      : name(name), network(network) {
    pool = *engine::KvPool::Create(spec, 16);
    receiver = std::make_unique<KvReceiver>(pool.get(),
                                            KvLayout::FromSpec(spec, kModel));
    NcclReceiverConfig config;
    config.timeout = absl::Seconds(10);
    endpoint =
        std::make_unique<NcclKvReceiveEndpoint>(receiver.get(), comms, config);
    network->Listen(name, [this](std::unique_ptr<ControlChannel> channel) {
      endpoint->Serve(std::move(channel));
    });
  }
  ~DecodeEnd() {
    network->StopListening(name);
    endpoint->Shutdown();
  }
  // Sends a 4-block request (1 cached) from a fresh prefill pool and checks
  // every byte arrived.
  void Transfer(NcclKvTransport* transport, const engine::KvCacheSpec& spec,
                uint64_t seed) {
    std::vector<int32_t> reserved = {next, next - 1, next - 2, next - 3};
    next -= 4;
    const uint64_t id = receiver->Expect("req", reserved, 1);
    Prefill prefill(spec, id, "req", 4, 1, seed);
    prefill.plan.destination = name;
    auto session = transport->Open(prefill.plan, prefill.pool.get());
    ASSERT_TRUE(session.ok()) << name << ": " << session.status();
    ASSERT_TRUE((*session)->SendLayers(0, spec.num_layers).ok());
    ASSERT_TRUE((*session)->Finish().ok());
    ASSERT_TRUE(
        receiver->Wait(id, absl::Seconds(20), absl::Now() + absl::Seconds(30))
            .ok());
    for (int i = 1; i < 4; ++i) {
      for (int l = 0; l < spec.num_layers; ++l)
        EXPECT_TRUE(Holds(pool.get(), seed, l, i, reserved[i])) << name;
    }
  }
  std::string name;
  FakeControlNetwork* network;
  std::unique_ptr<engine::KvPool> pool;
  std::unique_ptr<KvReceiver> receiver;
  std::unique_ptr<NcclKvReceiveEndpoint> endpoint;
  int32_t next = 15;
};

TEST(NcclLinkCacheTest, LeastRecentlyUsedIdleLinkIsDroppedAndRebuiltOnUse) {
  FakeCommunicatorFactory comms;
  FakeControlNetwork network;
  const engine::KvCacheSpec spec = Spec(DType::kBF16);
  DecodeEnd a("decode-a", spec, &network, &comms),
      b("decode-b", spec, &network, &comms),
      c("decode-c", spec, &network, &comms);
  NcclTransportConfig config;
  config.timeout = absl::Seconds(10);
  config.max_links = 2;
  NcclKvTransport transport(&network, &comms, nullptr, config);

  a.Transfer(&transport, spec, 1);
  b.Transfer(&transport, spec, 2);
  a.Transfer(&transport, spec, 3);  // a is now the most recently used
  EXPECT_EQ(transport.num_links(), 2);
  EXPECT_EQ(network.connections(), 2);  // reused, not reconnected
  EXPECT_EQ(transport.num_evicted_links(), 0);

  c.Transfer(&transport, spec, 4);  // over the cap: b (LRU) goes
  EXPECT_EQ(transport.num_links(), 2);
  EXPECT_EQ(transport.num_evicted_links(), 1);
  EXPECT_EQ(network.connections(), 3);

  a.Transfer(&transport, spec, 5);  // a survived: no new connection
  EXPECT_EQ(network.connections(), 3);
  b.Transfer(&transport, spec, 6);  // b is rebuilt; c (LRU) goes
  EXPECT_EQ(network.connections(), 4);
  EXPECT_EQ(transport.num_links(), 2);
  EXPECT_EQ(transport.num_evicted_links(), 2);
  EXPECT_EQ(a.receiver->num_reservations(), 0);
  EXPECT_EQ(b.receiver->num_reservations(), 0);
  EXPECT_EQ(c.receiver->num_reservations(), 0);
}

TEST(NcclLinkCacheTest, InvalidCapIsRefused) {
  NcclTransportConfig config;
  config.max_links = 0;
  EXPECT_FALSE(config.Validate().ok());
}

TEST(NcclDevicePathTest, DeviceSpansGoStraightThroughWireStaging) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kI8, DType::kFp8E4M3}) {
    FakeCommunicatorFactory comms;
    FakeControlNetwork network;
    const engine::KvCacheSpec spec = Spec(dtype);
    auto decode_pool = *engine::KvPool::Create(spec, 16);
    kv_transfer::testing::DeviceFacedStorage decode_storage(
        decode_pool.get(),
        kv_transfer::testing::DeviceFacedStorage::kRefuseHostCopies);
    KvReceiver receiver(&decode_storage, KvLayout::FromSpec(spec, kModel));
    NcclReceiverConfig rc;
    rc.timeout = absl::Seconds(10);
    NcclKvReceiveEndpoint endpoint(&receiver, &comms, rc);
    network.Listen(kDecode, [&](std::unique_ptr<ControlChannel> channel) {
      endpoint.Serve(std::move(channel));
    });
    NcclTransportConfig sc;
    sc.timeout = absl::Seconds(10);
    // Small batches: several manifests, wire staging reused between them.
    sc.max_batch_bytes = 3 * (spec.LayerBlockBytes() + ScaleBytes(spec));
    NcclKvTransport transport(&network, &comms, nullptr, sc);

    const std::vector<int32_t> reserved = {14, 12, 10, 8, 6};
    const uint64_t id = receiver.Expect("req", reserved, 1);
    Prefill prefill(spec, id, "req", 5, 1, 77);
    kv_transfer::testing::DeviceFacedStorage prefill_storage(
        prefill.pool.get(),
        kv_transfer::testing::DeviceFacedStorage::kRefuseHostCopies);
    auto session = transport.Open(prefill.plan, &prefill_storage);
    ASSERT_TRUE(session.ok()) << session.status();
    for (int l = 0; l < spec.num_layers; ++l)
      ASSERT_TRUE((*session)->SendLayers(l, l + 1).ok()) << DTypeName(dtype);
    ASSERT_TRUE((*session)->Finish().ok()) << DTypeName(dtype);
    ASSERT_TRUE(
        receiver.Wait(id, absl::Seconds(20), absl::Now() + absl::Seconds(30))
            .ok())
        << DTypeName(dtype);
    for (int i = 0; i < 5; ++i) {
      for (int l = 0; l < spec.num_layers; ++l) {
        if (i == 0) {
          EXPECT_TRUE(IsZero(decode_pool.get(), l, reserved[i]));
        } else {
          EXPECT_TRUE(Holds(decode_pool.get(), 77, l, i, reserved[i]))
              << DTypeName(dtype) << " layer " << l << " block " << i;
        }
      }
    }
    EXPECT_EQ(receiver.num_reservations(), 0);
    network.StopListening(kDecode);
    endpoint.Shutdown();
  }
}

}  // namespace
}  // namespace pdserve::kv_transfer::nccl
