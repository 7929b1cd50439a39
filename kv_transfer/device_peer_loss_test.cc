// A peer lost in the middle of a transfer between device-memory KV storages,
// on CPU: the receiver's reservation is freed (nothing more is written into
// its device blocks), the sender's session fails within its deadline instead
// of hanging (so the prefill side releases its pinned blocks and the router
// retries), and a retried transfer over a rebuilt link arrives intact.
//
// Both transports: `grpc` with DeviceFacedStorage::kPoisonPointers (bytes
// move only through device copies and staging), and `nccl` over the fake
// communicator with kRefuseHostCopies (bytes move only through the span
// pointers, as straight-from-device sends do).
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "kv_transfer/grpc/grpc_transport.h"
#include "kv_transfer/nccl/fake_communicator.h"
#include "kv_transfer/nccl/fake_control_channel.h"
#include "kv_transfer/nccl/nccl_receiver.h"
#include "kv_transfer/nccl/nccl_transport.h"
#include "kv_transfer/nccl/test_util.h"
#include "kv_transfer/receiver.h"
#include "kv_transfer/test_blocks.h"
#include "kv_transfer/test_server.h"

namespace pdserve::kv_transfer {
namespace {

using testing::DeviceFacedStorage;

// ---------------------------------------------------------------- grpc ----

class GrpcDevicePeerLossTest : public ::testing::Test {
 protected:
  void StartReceiver(DType dtype) {
    spec_ = testing::TestSpec(dtype);
    pool_ = std::move(*engine::KvPool::Create(spec_, 16));
    device_ = std::make_unique<DeviceFacedStorage>(
        pool_.get(), DeviceFacedStorage::kPoisonPointers);
    metrics_ = std::make_unique<TransferMetrics>(registry_);
    receiver_ = std::make_unique<KvReceiver>(
        device_.get(), KvLayout::FromSpec(spec_, "test-model"),
        metrics_->ForReceiver());
    service_ = std::make_unique<KvTransferService>(receiver_.get());
    server_ = testing::StartTestServer(service_.get(), &port_);
    ASSERT_NE(port_, 0);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }
  // kv_send_tool in "stall" mode: sends layer 0, prints a line, then hangs
  // until killed. Returns its pid; *stdout_fd reads its output.
  pid_t SpawnStallingSender(uint64_t reservation, int num_blocks,
                            int* stdout_fd) {
    int fds[2];
    EXPECT_EQ(pipe(fds), 0);
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(fds[1], 1);
      close(fds[0]);
      const std::string dest = "127.0.0.1:" + std::to_string(port_);
      const std::string res = std::to_string(reservation),
                        nb = std::to_string(num_blocks);
      execl(KV_SEND_TOOL, KV_SEND_TOOL, dest.c_str(), res.c_str(), "req",
            DTypeName(spec_.dtype), nb.c_str(), "0", "stall", "42",
            static_cast<char*>(nullptr));
      _exit(127);
    }
    close(fds[1]);
    *stdout_fd = fds[0];
    return pid;
  }

  engine::KvCacheSpec spec_;
  std::unique_ptr<engine::KvPool> pool_;
  std::unique_ptr<DeviceFacedStorage> device_;
  metrics::Registry registry_;
  std::unique_ptr<TransferMetrics> metrics_;
  std::unique_ptr<KvReceiver> receiver_;
  std::unique_ptr<KvTransferService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(GrpcDevicePeerLossTest, KilledSenderProcessFreesTheDeviceReservation) {
  StartReceiver(DType::kFp8E4M3);
  const std::vector<int32_t> reserved = {9, 3, 12, 5};
  const uint64_t id = receiver_->Expect("req", reserved, 0);
  int out = -1;
  const pid_t child = SpawnStallingSender(id, 4, &out);
  char buf[64] = {0};
  ASSERT_GT(read(out, buf, sizeof(buf) - 1), 0);  // layer 0 is on the wire
  close(out);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);

  const absl::Time start = absl::Now();
  EXPECT_FALSE(
      receiver_
          ->Wait(id, absl::Milliseconds(500), absl::Now() + absl::Seconds(30))
          .ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(receiver_->num_reservations(), 0);
  // At most the first layer reached device memory, and nothing more can.
  const int copies = device_->from_host;
  EXPECT_LE(copies, 4);
  const std::string late(spec_.LayerBlockBytes(), '\7');
  const std::string scales(testing::ScaleBytes(spec_), '\1');
  EXPECT_EQ(receiver_->Write(id, 1, 3, late, scales).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(device_->from_host, copies);
}

TEST_F(GrpcDevicePeerLossTest, ReceiverGoneMidTransferFailsTheDeviceSender) {
  StartReceiver(DType::kBF16);
  const std::vector<int32_t> reserved = {2, 7, 11};
  const uint64_t id = receiver_->Expect("req", reserved, 0);
  auto send_pool = std::move(*engine::KvPool::Create(spec_, 8));
  DeviceFacedStorage sender_storage(send_pool.get(),
                                    DeviceFacedStorage::kPoisonPointers);
  SendPlan plan;
  plan.destination = "127.0.0.1:" + std::to_string(port_);
  plan.reservation_id = id;
  plan.request_id = "req";
  plan.sender_id = "test";
  plan.layout = KvLayout::FromSpec(spec_, "test-model");
  for (int i = 0; i < 3; ++i) {
    testing::FillBlock(send_pool.get(), 17, i, 2 * i + 1);
    plan.blocks.emplace_back(i, 2 * i + 1);
  }
  GrpcKvTransport transport(nullptr);
  auto session = transport.Open(plan, &sender_storage);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->SendLayers(0, 1).ok());
  // The decode worker dies: its server goes away with the stream open.
  server_->Shutdown(std::chrono::system_clock::now());

  const absl::Time start = absl::Now();
  absl::Status sent;
  for (int l = 1; l < spec_.num_layers && sent.ok(); ++l)
    sent = (*session)->SendLayers(l, l + 1);
  const absl::Status finished =
      sent.ok() ? (*session)->Finish().status() : sent;
  EXPECT_FALSE(finished.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // The receiver's side of the same stream ended too: no reservation left.
  EXPECT_FALSE(
      receiver_
          ->Wait(id, absl::Milliseconds(500), absl::Now() + absl::Seconds(30))
          .ok());
  EXPECT_EQ(receiver_->num_reservations(), 0);
}

// ---------------------------------------------------------------- nccl ----

namespace nt = nccl::testing;

// Control channels whose prefill end the test can cut, as the death of the
// prefill process does: every channel it opened closes at once.
class KillableNetwork : public nccl::ControlChannelFactory {
 public:
  explicit KillableNetwork(nccl::ControlChannelFactory* inner)
      : inner_(inner) {}
  absl::StatusOr<std::unique_ptr<nccl::ControlChannel>> Connect(
      const std::string& destination) override {
    auto channel = inner_->Connect(destination);
    if (!channel.ok()) return channel.status();
    auto killable = std::make_unique<Channel>(*std::move(channel));
    absl::MutexLock l(&mu_);
    open_.push_back(killable->inner);
    return std::unique_ptr<nccl::ControlChannel>(std::move(killable));
  }
  void KillAll() {
    absl::MutexLock l(&mu_);
    for (const std::weak_ptr<nccl::ControlChannel>& c : open_) {
      if (auto alive = c.lock()) alive->Close();
    }
  }

 private:
  struct Channel : nccl::ControlChannel {
    explicit Channel(std::unique_ptr<nccl::ControlChannel> c)
        : inner(std::move(c)) {}
    absl::Status Send(std::string m) override {
      return inner->Send(std::move(m));
    }
    absl::StatusOr<std::string> Receive(absl::Time deadline) override {
      return inner->Receive(deadline);
    }
    void Close() override { inner->Close(); }
    // KillableNetwork closes it from the test thread (Close is
    // thread-safe) while the channel's owner still holds it.
    std::shared_ptr<nccl::ControlChannel> inner;
  };

  nccl::ControlChannelFactory* const inner_;
  absl::Mutex mu_;
  std::vector<std::weak_ptr<nccl::ControlChannel>> open_ ABSL_GUARDED_BY(mu_);
};

class NcclDevicePeerLossTest : public ::testing::Test {
 protected:
  void StartDecode(DType dtype) {
    spec_ = nt::Spec(dtype);
    pool_ = *engine::KvPool::Create(spec_, 16);
    device_ = std::make_unique<DeviceFacedStorage>(
        pool_.get(), DeviceFacedStorage::kRefuseHostCopies);
    receiver_ = std::make_unique<KvReceiver>(
        device_.get(), KvLayout::FromSpec(spec_, nt::kModel));
    nccl::NcclReceiverConfig config;
    config.timeout = absl::Seconds(10);
    endpoint_ = std::make_unique<nccl::NcclKvReceiveEndpoint>(receiver_.get(),
                                                              &comms_, config);
    network_.Listen(nt::kDecode,
                    [this](std::unique_ptr<nccl::ControlChannel> channel) {
                      endpoint_->Serve(std::move(channel));
                    });
  }
  void StopDecode() {
    network_.StopListening(nt::kDecode);
    if (endpoint_) endpoint_->Shutdown();
  }
  void TearDown() override { StopDecode(); }

  std::unique_ptr<nccl::NcclKvTransport> Transport() {
    nccl::NcclTransportConfig config;
    config.timeout = absl::Seconds(10);
    return std::make_unique<nccl::NcclKvTransport>(&killable_, &comms_, nullptr,
                                                   config);
  }
  absl::Status Wait(uint64_t id) {
    return receiver_->Wait(id, absl::Seconds(20),
                           absl::Now() + absl::Seconds(30));
  }
  // Blocks outside `reserved` are still zero: nothing strayed.
  void ExpectUntouchedOutside(const std::vector<int32_t>& reserved) {
    for (int32_t b = 0; b < pool_->num_blocks(); ++b) {
      if (std::find(reserved.begin(), reserved.end(), b) != reserved.end())
        continue;
      for (int l = 0; l < spec_.num_layers; ++l)
        EXPECT_TRUE(nt::IsZero(pool_.get(), l, b)) << "block " << b;
    }
  }
  // A transfer of `n` blocks into `reserved` that must arrive intact.
  void ExpectRetrySucceeds(nccl::NcclKvTransport* transport,
                           const std::vector<int32_t>& reserved,
                           uint64_t seed) {
    const int n = static_cast<int>(reserved.size());
    const uint64_t id = receiver_->Expect("retry", reserved, 0);
    nt::Prefill prefill(spec_, id, "retry", n, 0, seed);
    DeviceFacedStorage storage(prefill.pool.get(),
                               DeviceFacedStorage::kRefuseHostCopies);
    auto session = transport->Open(prefill.plan, &storage);
    ASSERT_TRUE(session.ok()) << session.status();
    for (int l = 0; l < spec_.num_layers; ++l)
      ASSERT_TRUE((*session)->SendLayers(l, l + 1).ok());
    ASSERT_TRUE((*session)->Finish().ok());
    ASSERT_TRUE(Wait(id).ok());
    for (int i = 0; i < n; ++i) {
      for (int l = 0; l < spec_.num_layers; ++l) {
        EXPECT_TRUE(nt::Holds(pool_.get(), seed, l, i, reserved[i]))
            << "retry layer " << l << " block " << i;
      }
    }
    EXPECT_EQ(receiver_->num_reservations(), 0);
  }

  nccl::FakeCommunicatorFactory comms_;
  nccl::FakeControlNetwork network_;
  KillableNetwork killable_{&network_};
  engine::KvCacheSpec spec_;
  std::unique_ptr<engine::KvPool> pool_;
  std::unique_ptr<DeviceFacedStorage> device_;
  std::unique_ptr<KvReceiver> receiver_;
  std::unique_ptr<nccl::NcclKvReceiveEndpoint> endpoint_;
};

TEST_F(NcclDevicePeerLossTest, SenderKilledMidTransferFreesBothSides) {
  StartDecode(DType::kFp8E4M3);
  const std::vector<int32_t> reserved = {14, 12, 10};
  const uint64_t id = receiver_->Expect("req", reserved, 0);
  nt::Prefill prefill(spec_, id, "req", 3, 0, 5);
  DeviceFacedStorage prefill_storage(prefill.pool.get(),
                                     DeviceFacedStorage::kRefuseHostCopies);
  auto transport = Transport();
  auto session = transport->Open(prefill.plan, &prefill_storage);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->SendLayers(0, 1).ok());
  killable_.KillAll();  // the prefill process is gone

  const absl::Time start = absl::Now();
  EXPECT_FALSE(Wait(id).ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(receiver_->num_reservations(), 0);
  ExpectUntouchedOutside(reserved);
  // What is left of the sender sees its link gone within its deadline.
  absl::Status rest = (*session)->SendLayers(1, spec_.num_layers);
  if (rest.ok()) rest = (*session)->Finish().status();
  EXPECT_FALSE(rest.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  session->reset();
  EXPECT_EQ(transport->num_links(), 0);
  // A retried request over a fresh link arrives intact.
  ExpectRetrySucceeds(transport.get(), {1, 4, 7}, 9);
  EXPECT_EQ(transport->num_links(), 1);
}

TEST_F(NcclDevicePeerLossTest, ReceiverKilledMidTransferFreesBothSides) {
  StartDecode(DType::kI8);
  const std::vector<int32_t> reserved = {3, 8};
  const uint64_t id = receiver_->Expect("req", reserved, 0);
  nt::Prefill prefill(spec_, id, "req", 2, 0, 4);
  DeviceFacedStorage prefill_storage(prefill.pool.get(),
                                     DeviceFacedStorage::kRefuseHostCopies);
  auto transport = Transport();
  auto session = transport->Open(prefill.plan, &prefill_storage);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->SendLayers(0, 1).ok());
  StopDecode();  // the decode process is gone

  EXPECT_FALSE(Wait(id).ok());
  EXPECT_EQ(receiver_->num_reservations(), 0);
  const absl::Time start = absl::Now();
  absl::Status rest = (*session)->SendLayers(1, spec_.num_layers);
  if (rest.ok()) rest = (*session)->Finish().status();
  EXPECT_FALSE(rest.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  session->reset();
  EXPECT_EQ(transport->num_links(), 0);
  // A new decode worker at the same address: the next transfer links anew.
  StartDecode(DType::kI8);
  ExpectRetrySucceeds(transport.get(), {5, 6}, 11);
}

}  // namespace
}  // namespace pdserve::kv_transfer
