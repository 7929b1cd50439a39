// The same-node KV transport end to end over shm, in one process: a decode
// side (KvReceiver over a memfd-backed KvPool, IpcKvReceiveEndpoint) and a
// prefill side (IpcKvTransport) joined by the in-process control channel.
// The decode pool is mapped a second time by the sender, exactly as another
// process maps it, so every byte crosses the shared mapping. This is the
// logic cuda_ipc runs on a GPU (only PeerMemoryBackend differs).
#include "kv_transfer/ipc/ipc_transport.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "kv_transfer/ipc/ipc_messages.h"
#include "kv_transfer/nccl/fake_control_channel.h"
#include "kv_transfer/test_blocks.h"

namespace pdserve::kv_transfer::ipc {
namespace {

using testing::ExpectedSpan;
using testing::FillBlock;
using ::testing::HasSubstr;
using testing::ScaleBytes;
using testing::TestSpec;

constexpr char kDecode[] = "decode:1";
constexpr int kBlocks = 16;

class IpcTransportTest : public ::testing::TestWithParam<DType> {
 protected:
  void Start(DType dtype, absl::Duration receive_timeout = absl::Seconds(30),
             IpcTransportConfig send = {}) {
    spec_ = TestSpec(dtype);
    engine::KvCacheSpec shared = spec_;
    shared.host_shared = true;
    decode_pool_ = *engine::KvPool::Create(shared, kBlocks);
    prefill_pool_ = *engine::KvPool::Create(spec_, kBlocks);
    layout_ = KvLayout::FromSpec(spec_, "fp");
    receiver_ = std::make_unique<KvReceiver>(decode_pool_.get(), layout_);
    backend_ = NewShmBackend();
    IpcReceiverConfig rc;
    rc.timeout = receive_timeout;
    auto endpoint = IpcKvReceiveEndpoint::Create(
        receiver_.get(), decode_pool_.get(), backend_.get(), rc);
    ASSERT_TRUE(endpoint.ok()) << endpoint.status();
    endpoint_ = *std::move(endpoint);
    network_.Listen(kDecode, [this](std::unique_ptr<ControlChannel> c) {
      endpoint_->Serve(std::move(c));
    });
    if (send.timeout == absl::Seconds(60)) send.timeout = absl::Seconds(30);
    transport_ = std::make_unique<IpcKvTransport>(&network_, backend_.get(),
                                                  nullptr, send);
  }
  void TearDown() override {
    network_.StopListening(kDecode);
    if (endpoint_) endpoint_->Shutdown();
  }

  SendPlan Plan(uint64_t reservation, std::vector<BlockRef> blocks) {
    SendPlan p;
    p.destination = kDecode;
    p.request_id = "r";
    p.reservation_id = reservation;
    p.sender_id = "prefill:1";
    p.layout = layout_;
    p.blocks = std::move(blocks);
    return p;
  }

  absl::Status WaitFor(uint64_t reservation,
                       absl::Duration d = absl::Seconds(20)) {
    return receiver_->Wait(reservation, d, absl::Now() + d);
  }

  // Whether decode block `block` holds logical `index`'s expected bytes.
  bool Holds(int32_t block, int index, uint64_t seed) {
    for (int l = 0; l < spec_.num_layers; ++l) {
      auto want = ExpectedSpan(spec_, seed, l, index, spec_.LayerBlockBytes());
      if (std::memcmp(decode_pool_->LayerBlockData(l, block), want.data(),
                      want.size()) != 0)
        return false;
      if (ScaleBytes(spec_) > 0) {
        auto ws = ExpectedSpan(spec_, seed + 1, l, index, ScaleBytes(spec_));
        if (std::memcmp(decode_pool_->LayerBlockScales(l, block), ws.data(),
                        ws.size()) != 0)
          return false;
      }
    }
    return true;
  }
  bool IsZero(int32_t block) {
    for (int l = 0; l < spec_.num_layers; ++l) {
      const uint8_t* p = decode_pool_->LayerBlockData(l, block);
      for (int64_t i = 0; i < spec_.LayerBlockBytes(); ++i)
        if (p[i] != 0) return false;
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

TEST_P(IpcTransportTest, EveryDtypeArrivesByteIdenticalAndSkippedBlocksStay) {
  Start(GetParam());
  // Decode has logical block 0 cached (skip 1); it reserved 5, 2, 7, 1.
  const uint64_t res = receiver_->Expect("r", {5, 2, 7, 1}, 1);
  for (int i = 1; i < 4; ++i) FillBlock(prefill_pool_.get(), 9, i, 10 + i);
  auto session = transport_->Open(Plan(res, {{1, 11}, {2, 12}, {3, 13}}),
                                  prefill_pool_.get());
  ASSERT_TRUE(session.ok()) << session.status();
  // Layer-wise: layer 0 of all blocks, then the rest.
  ASSERT_TRUE((*session)->SendLayers(0, 1).ok());
  ASSERT_TRUE((*session)->SendLayers(1, spec_.num_layers).ok());
  auto stats = (*session)->Finish();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->spans, 3u * spec_.num_layers);
  EXPECT_EQ(stats->bytes, 3u * spec_.num_layers *
                              (spec_.LayerBlockBytes() + ScaleBytes(spec_)));
  ASSERT_TRUE(WaitFor(res).ok());
  EXPECT_TRUE(Holds(2, 1, 9));
  EXPECT_TRUE(Holds(7, 2, 9));
  EXPECT_TRUE(Holds(1, 3, 9));
  EXPECT_TRUE(IsZero(5)) << "the skipped prefix block was written";
  for (int b : {0, 3, 4, 6, 8}) EXPECT_TRUE(IsZero(b)) << b;
  EXPECT_EQ(receiver_->num_reservations(), 0);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, IpcTransportTest,
                         ::testing::Values(DType::kF32, DType::kF16,
                                           DType::kBF16, DType::kI8,
                                           DType::kFp8E4M3),
                         [](const auto& info) {
                           std::string name = DTypeName(info.param);
                           for (char& c : name)
                             if (!std::isalnum(static_cast<unsigned char>(c)))
                               c = '_';
                           return name;
                         });

class IpcTransportSafetyTest : public IpcTransportTest {};

TEST_F(IpcTransportSafetyTest, LayoutMismatchFailsTheHandshakeNamingIt) {
  Start(DType::kF16);
  const uint64_t res = receiver_->Expect("r", {1, 2}, 0);
  SendPlan plan = Plan(res, {{0, 0}, {1, 1}});
  plan.layout.block_size = 32;
  plan.layout.dtype = DType::kBF16;
  auto session = transport_->Open(plan, prefill_pool_.get());
  ASSERT_EQ(session.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(session.status().message(), HasSubstr("block_size: sender 32"));
  EXPECT_THAT(session.status().message(), HasSubstr("kv dtype"));
  EXPECT_EQ(transport_->num_maps(), 0) << "mapped before the handshake";
}

TEST_F(IpcTransportSafetyTest, UnknownReservationIsNotFound) {
  Start(DType::kF16);
  auto session = transport_->Open(Plan(777, {{0, 0}}), prefill_pool_.get());
  EXPECT_EQ(session.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(IpcTransportSafetyTest, WritesOutsideTheReservationAreRefused) {
  Start(DType::kF32);
  for (int i = 0; i < 4; ++i) FillBlock(prefill_pool_.get(), 3, i, i);
  // Logical 9 was never reserved; logical 0 is a skipped prefix block.
  for (int32_t bad : {9, 0}) {
    const uint64_t res = receiver_->Expect("r", {4, 6}, 1);
    auto session = transport_->Open(Plan(res, {}), prefill_pool_.get());
    ASSERT_TRUE(session.ok()) << session.status();
    const BlockRef refs[] = {{bad, 2}};
    const absl::Status s = (*session)->SendBlocks(0, 1, refs);
    EXPECT_FALSE(s.ok()) << bad;
    EXPECT_FALSE(WaitFor(res).ok());
    EXPECT_TRUE(IsZero(4));
    EXPECT_TRUE(IsZero(6));
  }
  // A layer the layout does not have is refused by the sender already.
  const uint64_t res = receiver_->Expect("r", {4, 6}, 0);
  auto session = transport_->Open(Plan(res, {{0, 0}}), prefill_pool_.get());
  ASSERT_TRUE(session.ok());
  EXPECT_EQ((*session)->SendLayers(0, spec_.num_layers + 1).code(),
            absl::StatusCode::kInvalidArgument);
  (*session)->Cancel();
  EXPECT_FALSE(WaitFor(res).ok());
  EXPECT_EQ(receiver_->num_reservations(), 0);
}

// A fake decode worker that answers the handshake with a real export but
// names a block outside its pool: the sender must refuse to write.
TEST_F(IpcTransportSafetyTest, SenderRefusesABlockOutsideTheExportedPool) {
  Start(DType::kF16);
  const KvExport exported = endpoint_->exported();
  nccl::FakeControlNetwork liar;
  std::thread server;
  liar.Listen("liar", [&](std::unique_ptr<ControlChannel> c) {
    server = std::thread([c = std::move(c), exported]() mutable {
      auto deadline = [] { return absl::Now() + absl::Seconds(10); };
      if (!c->Receive(deadline()).ok()) return;  // Open
      ReplyMessage hello;
      hello.exported = exported;
      (void)c->Send(EncodeMessage(hello));
      if (!c->Receive(deadline()).ok()) return;  // Manifest
      ReplyMessage where;
      where.blocks = {kBlocks + 5};
      (void)c->Send(EncodeMessage(where));
      (void)c->Receive(deadline());  // whatever comes next, then close
      c->Close();
    });
  });
  IpcKvTransport sender(&liar, backend_.get(), nullptr);
  SendPlan plan = Plan(1, {{0, 0}});
  plan.destination = "liar";
  FillBlock(prefill_pool_.get(), 1, 0, 0);
  auto session = sender.Open(plan, prefill_pool_.get());
  ASSERT_TRUE(session.ok()) << session.status();
  const absl::Status s = (*session)->SendLayers(0, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("outside its pool"));
  session->reset();
  server.join();
  for (int b = 0; b < kBlocks; ++b) EXPECT_TRUE(IsZero(b)) << b;
}

TEST_F(IpcTransportSafetyTest, DeadlineMidTransferAbortsFreesAndNextSucceeds) {
  // Both ends time out a batch after 300 ms; the first batch's copy is held
  // back until the receiver gave up on it.
  std::atomic<bool> stall{true};
  IpcTransportConfig send;
  send.timeout = absl::Milliseconds(300);
  KvReceiver* receiver = nullptr;
  send.before_copy_for_test = [&] {
    if (!stall.exchange(false)) return;
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (receiver->num_reservations() > 0 && absl::Now() < until)
      std::this_thread::yield();
  };
  Start(DType::kF16, absl::Milliseconds(300), send);
  receiver = receiver_.get();
  FillBlock(prefill_pool_.get(), 5, 0, 0);
  FillBlock(prefill_pool_.get(), 5, 1, 1);
  const uint64_t res = receiver_->Expect("r", {3, 8}, 0);
  auto session =
      transport_->Open(Plan(res, {{0, 0}, {1, 1}}), prefill_pool_.get());
  ASSERT_TRUE(session.ok());
  absl::Status sent;
  std::thread t([&] { sent = (*session)->SendLayers(0, spec_.num_layers); });
  // The decode side's wait fails and frees the reservation.
  const absl::Status waited =
      receiver_->Wait(res, absl::Seconds(20), absl::Now() + absl::Seconds(20));
  t.join();
  EXPECT_FALSE(waited.ok());
  EXPECT_EQ(sent.code(), absl::StatusCode::kDeadlineExceeded) << sent;
  EXPECT_EQ(receiver_->num_reservations(), 0);
  EXPECT_TRUE(IsZero(3)) << "written after the reservation lapsed";
  EXPECT_TRUE(IsZero(8));
  EXPECT_EQ(transport_->num_mappings(), 0) << "a timed-out peer is forgotten";
  session->reset();
  // The next transfer remaps and succeeds.
  const uint64_t again = receiver_->Expect("r", {3, 8}, 0);
  auto next =
      transport_->Open(Plan(again, {{0, 0}, {1, 1}}), prefill_pool_.get());
  ASSERT_TRUE(next.ok()) << next.status();
  ASSERT_TRUE((*next)->SendLayers(0, spec_.num_layers).ok());
  ASSERT_TRUE((*next)->Finish().ok());
  ASSERT_TRUE(WaitFor(again).ok());
  EXPECT_TRUE(Holds(3, 0, 5));
  EXPECT_TRUE(Holds(8, 1, 5));
}

TEST_F(IpcTransportSafetyTest, SenderThatVanishesFreesTheReservationAtOnce) {
  Start(DType::kBF16);
  FillBlock(prefill_pool_.get(), 2, 0, 0);
  const uint64_t res = receiver_->Expect("r", {3, 8}, 0);
  auto session =
      transport_->Open(Plan(res, {{0, 0}, {1, 1}}), prefill_pool_.get());
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)->SendLayers(0, 1).ok());
  session->reset();  // dies mid-transfer: the stream ends without Finish
  // Far below the 20 s stall timeout: the receiver noticed the stream end.
  const absl::Time start = absl::Now();
  EXPECT_FALSE(WaitFor(res).ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(receiver_->num_reservations(), 0);
}

TEST_F(IpcTransportSafetyTest, ReceiverThatDiesFailsTheSenderAndDropsTheMap) {
  Start(DType::kF32);
  const uint64_t res = receiver_->Expect("r", {3, 8}, 0);
  auto session =
      transport_->Open(Plan(res, {{0, 0}, {1, 1}}), prefill_pool_.get());
  ASSERT_TRUE(session.ok());
  ASSERT_EQ(transport_->num_mappings(), 1);
  endpoint_->Shutdown();  // the decode worker goes away mid-transfer
  EXPECT_FALSE(WaitFor(res).ok());
  EXPECT_EQ(receiver_->num_reservations(), 0);
  const absl::Status s = (*session)->SendLayers(0, spec_.num_layers);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ(transport_->num_mappings(), 0);
}

TEST_F(IpcTransportSafetyTest, APeerIsMappedOnceAndRemappedAfterRestart) {
  Start(DType::kF16);
  for (int round = 0; round < 3; ++round) {
    const uint64_t res = receiver_->Expect("r", {1}, 0);
    auto session = transport_->Open(Plan(res, {{0, 0}}), prefill_pool_.get());
    ASSERT_TRUE(session.ok());
    ASSERT_TRUE((*session)->SendLayers(0, spec_.num_layers).ok());
    ASSERT_TRUE((*session)->Finish().ok());
    ASSERT_TRUE(WaitFor(res).ok());
  }
  EXPECT_EQ(transport_->num_maps(), 1);
  // A restarted decode worker on the same address exports anew.
  network_.StopListening(kDecode);
  endpoint_->Shutdown();
  endpoint_ = *IpcKvReceiveEndpoint::Create(receiver_.get(), decode_pool_.get(),
                                            backend_.get());
  network_.Listen(kDecode, [this](std::unique_ptr<ControlChannel> c) {
    endpoint_->Serve(std::move(c));
  });
  const uint64_t res = receiver_->Expect("r", {1}, 0);
  auto session = transport_->Open(Plan(res, {{0, 0}}), prefill_pool_.get());
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)->SendLayers(0, spec_.num_layers).ok());
  ASSERT_TRUE((*session)->Finish().ok());
  EXPECT_EQ(transport_->num_maps(), 2);
  EXPECT_EQ(transport_->num_mappings(), 1);
}

TEST_F(IpcTransportSafetyTest, AGonePeerIsUnmappedWhenANewOneIsMapped) {
  Start(DType::kF16);
  const uint64_t res = receiver_->Expect("r", {1}, 0);
  auto session = transport_->Open(Plan(res, {{0, 0}}), prefill_pool_.get());
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)->SendLayers(0, spec_.num_layers).ok());
  ASSERT_TRUE((*session)->Finish().ok());
  session->reset();
  ASSERT_EQ(transport_->num_mappings(), 1);
  // The decode worker goes away for good: its pool (and memfd) is gone.
  network_.StopListening(kDecode);
  endpoint_->Shutdown();
  endpoint_.reset();
  receiver_.reset();
  decode_pool_.reset();
  // A second decode worker elsewhere: mapping it unmaps the dead one.
  engine::KvCacheSpec shared = spec_;
  shared.host_shared = true;
  auto pool2 = *engine::KvPool::Create(shared, kBlocks);
  KvReceiver receiver2(pool2.get(), layout_);
  auto endpoint2 =
      *IpcKvReceiveEndpoint::Create(&receiver2, pool2.get(), backend_.get());
  network_.Listen("decode:2", [&](std::unique_ptr<ControlChannel> c) {
    endpoint2->Serve(std::move(c));
  });
  const uint64_t res2 = receiver2.Expect("r", {1}, 0);
  SendPlan plan = Plan(res2, {{0, 0}});
  plan.destination = "decode:2";
  auto next = transport_->Open(plan, prefill_pool_.get());
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(transport_->num_mappings(), 1);
  (*next)->Cancel();
  network_.StopListening("decode:2");
  endpoint2->Shutdown();
}

TEST(IpcExportTest, PrivateHostPoolsAndWrongKindsCannotBeExported) {
  auto backend = NewShmBackend();
  auto pool = *engine::KvPool::Create(TestSpec(DType::kF16), 4);
  auto exported = ExportStorage(pool.get(), backend.get());
  EXPECT_EQ(exported.status().code(), absl::StatusCode::kFailedPrecondition);
  engine::KvPool* raw = pool.get();
  testing::DeviceFacedStorage device(
      raw, testing::DeviceFacedStorage::kPoisonPointers);
  exported = ExportStorage(&device, backend.get());
  EXPECT_EQ(exported.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(exported.status().message(), HasSubstr("cuda:3"));
}

TEST(IpcExportTest, ExportsOutsideTheirRegionsAreRejectedBeforeMapping) {
  engine::KvCacheSpec spec = TestSpec(DType::kI8);
  spec.host_shared = true;
  auto pool = *engine::KvPool::Create(spec, 4);
  auto backend = NewShmBackend();
  KvExport e = *ExportStorage(pool.get(), backend.get());
  const engine::KvCacheSpec& layout = spec;
  ASSERT_TRUE(e.Validate(layout).ok());
  KvExport big = e;
  big.num_blocks = 1 << 20;
  EXPECT_EQ(big.Validate(layout).code(), absl::StatusCode::kFailedPrecondition);
  KvExport far = e;
  far.layers.back().scale_offset = e.regions[0].bytes - 1;
  EXPECT_EQ(far.Validate(layout).code(), absl::StatusCode::kFailedPrecondition);
  KvExport other = e;
  other.data_bytes += 4;
  EXPECT_EQ(other.Validate(layout).code(),
            absl::StatusCode::kFailedPrecondition);
  // A handle whose socket is gone (the exporter exited): UNAVAILABLE.
  KvExport missing = e;
  missing.regions[0].handle =
      "shm-fd:pdserve-kv-gone:00000000000000000000000000000000:1:2";
  EXPECT_EQ(backend->Map(missing).status().code(),
            absl::StatusCode::kUnavailable);
  // Paths are not handles: a peer cannot name a file (or any process's
  // /proc/<pid>/fd/<n>) for the sender to open (shm_trust_test covers the
  // fds a hostile peer can pass).
  const std::string file = ::testing::TempDir() + "ipc_not_a_pool";
  std::FILE* f = std::fopen(file.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  const int fd = open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  KvExport other_file = e;
  other_file.regions[0].handle = absl::StrCat("/proc/", getpid(), "/fd/", fd);
  EXPECT_EQ(backend->Map(other_file).status().code(),
            absl::StatusCode::kFailedPrecondition);
  other_file.regions[0].handle = file;
  EXPECT_EQ(backend->Map(other_file).status().code(),
            absl::StatusCode::kFailedPrecondition);
  close(fd);
  std::remove(file.c_str());
}

TEST(IpcCudaTest, CudaIpcWithoutADeviceIsAClearError) {
  auto backend = NewCudaIpcBackend(0);
  if (backend.ok()) GTEST_SKIP() << "a CUDA device is visible";
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(backend.status().message(), HasSubstr("cuda_ipc"));
}

TEST(IpcMessagesTest, RoundTripAndTruncationsNeverCrash) {
  OpenMessage open{PeerMemoryKind::kCudaIpc, "p", 7, "req",
                   KvLayout::FromSpec(TestSpec(DType::kBF16), "abc")};
  ReplyMessage reply;
  reply.code = absl::StatusCode::kNotFound;
  reply.message = "no";
  reply.exported = KvExport{42,
                            PeerMemoryKind::kShm,
                            -1,
                            8,
                            128,
                            0,
                            {{4096, "/proc/1/fd/3"}},
                            {{0, 0, 0, 0}}};
  reply.blocks = {1, 2, 3};
  const std::vector<IpcMessage> messages = {
      open, ManifestMessage{{{0, 1}, {2, 3}}}, CopiedMessage{true},
      EndMessage{false}, reply};
  for (const IpcMessage& m : messages) {
    const std::string bytes = EncodeMessage(m);
    auto back = DecodeMessage(bytes);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(*back == m);
    for (size_t n = 0; n < bytes.size(); ++n) {
      EXPECT_FALSE(DecodeMessage(bytes.substr(0, n)).ok()) << n;
    }
    EXPECT_FALSE(DecodeMessage(bytes + "x").ok());
  }
  // A count far beyond the bytes present is refused without allocating.
  std::string huge = EncodeMessage(ManifestMessage{});
  huge[1] = huge[2] = huge[3] = huge[4] = '\xff';
  EXPECT_FALSE(DecodeMessage(huge).ok());
}

}  // namespace
}  // namespace pdserve::kv_transfer::ipc
