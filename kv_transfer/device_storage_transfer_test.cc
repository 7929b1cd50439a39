// The device-memory path of KV transfer, exercised on CPU: a KvStorage that
// reports device memory and whose span pointers are poison (never valid host
// addresses), so the grpc sender and the receiver can only move its bytes
// through CopyToHost / CopyFromHost, as with GPU memory. Bytes must arrive
// identical for every dtype, skipped prefix blocks are never sent, and
// messages span both staging buffers of the sender.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "kv_transfer/grpc/grpc_transport.h"
#include "kv_transfer/receiver.h"
#include "kv_transfer/test_blocks.h"
#include "kv_transfer/test_server.h"

namespace pdserve::kv_transfer {
namespace {

class FakeDeviceStorage : public testing::DeviceFacedStorage {
 public:
  explicit FakeDeviceStorage(engine::KvPool* pool)
      : DeviceFacedStorage(pool, kPoisonPointers) {}
};

class DeviceStorageTransferTest : public ::testing::TestWithParam<DType> {
 protected:
  // A spec whose spans are large enough that one request fills several
  // 1 MiB messages: both staging buffers are used and reused.
  static engine::KvCacheSpec Spec(DType dtype) {
    return {4, 4, 64, 64, dtype};  // 64 KiB (fp32) .. 16 KiB (int8, fp8)
  }
  void Start(bool device_receiver) {
    spec_ = Spec(GetParam());
    receive_pool_ = std::move(*engine::KvPool::Create(spec_, kBlocks));
    receive_device_ = std::make_unique<FakeDeviceStorage>(receive_pool_.get());
    engine::KvStorage* storage =
        device_receiver ? static_cast<engine::KvStorage*>(receive_device_.get())
                        : receive_pool_.get();
    receiver_ = std::make_unique<KvReceiver>(
        storage, KvLayout::FromSpec(spec_, "model"));
    service_ = std::make_unique<KvTransferService>(receiver_.get());
    server_ = testing::StartTestServer(service_.get(), &port_);
    ASSERT_NE(port_, 0);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }

  // Sends logical blocks [skip, n) from `storage` (physical 2i+1 of
  // `send_pool`) into reserved physical blocks n+i of the receiver.
  void Transfer(engine::KvPool* send_pool, engine::KvStorage* storage, int n,
                int skip) {
    std::vector<int32_t> reserved;
    for (int i = 0; i < n; ++i) reserved.push_back(kReceiveBase + i);
    const uint64_t id = receiver_->Expect("req", reserved, skip);
    SendPlan plan;
    plan.destination = "127.0.0.1:" + std::to_string(port_);
    plan.reservation_id = id;
    plan.request_id = "req";
    plan.sender_id = "test";
    plan.layout = KvLayout::FromSpec(spec_, "model");
    for (int i = skip; i < n; ++i) {
      testing::FillBlock(send_pool, 17, i, 2 * i + 1);
      plan.blocks.emplace_back(i, 2 * i + 1);
    }
    GrpcKvTransport transport(nullptr);
    auto session = transport.Open(plan, storage);
    ASSERT_TRUE(session.ok()) << session.status();
    // Layer by layer, as a layer-wise prefill sends.
    for (int l = 0; l < spec_.num_layers; ++l)
      ASSERT_TRUE((*session)->SendLayers(l, l + 1).ok());
    auto stats = (*session)->Finish();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->spans,
              static_cast<uint64_t>((n - skip) * spec_.num_layers));
    ASSERT_TRUE(
        receiver_->Wait(id, absl::Seconds(20), absl::Now() + absl::Seconds(30))
            .ok());
  }

  void ExpectArrived(int n, int skip) {
    const size_t sb = testing::ScaleBytes(spec_);
    for (int l = 0; l < spec_.num_layers; ++l) {
      for (int i = 0; i < n; ++i) {
        const engine::KvSpan got = receive_pool_->Span(l, kReceiveBase + i);
        if (i < skip) {
          // Skipped prefix blocks are never written.
          const std::vector<uint8_t> zero(got.data_bytes, 0);
          EXPECT_EQ(std::memcmp(got.data, zero.data(), zero.size()), 0)
              << "skipped block " << i << " was written";
          continue;
        }
        const auto want =
            testing::ExpectedSpan(spec_, 17, l, i, spec_.LayerBlockBytes());
        EXPECT_EQ(std::memcmp(got.data, want.data(), want.size()), 0)
            << DTypeName(spec_.dtype) << " layer " << l << " block " << i;
        if (sb) {
          const auto scales = testing::ExpectedSpan(spec_, 18, l, i, sb);
          EXPECT_EQ(std::memcmp(got.scales, scales.data(), sb), 0);
        }
      }
    }
  }

  static constexpr int kBlocks = 200;
  static constexpr int kReceiveBase = 120;
  engine::KvCacheSpec spec_;
  std::unique_ptr<engine::KvPool> receive_pool_;
  std::unique_ptr<FakeDeviceStorage> receive_device_;
  std::unique_ptr<KvReceiver> receiver_;
  std::unique_ptr<KvTransferService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_P(DeviceStorageTransferTest, DeviceToDeviceIsByteIdenticalThroughCopies) {
  Start(/*device_receiver=*/true);
  auto send_pool = std::move(*engine::KvPool::Create(spec_, kBlocks));
  FakeDeviceStorage sender(send_pool.get());
  const int n = 40, skip = 3;
  Transfer(send_pool.get(), &sender, n, skip);
  ExpectArrived(n, skip);
  // Every span left and arrived through a device copy, none more than once.
  EXPECT_EQ(sender.to_host, (n - skip) * spec_.num_layers);
  EXPECT_EQ(receive_device_->from_host, (n - skip) * spec_.num_layers);
  EXPECT_EQ(receiver_->num_reservations(), 0);
}

TEST_P(DeviceStorageTransferTest, HostAndDeviceEndsInteroperate) {
  Start(/*device_receiver=*/false);
  auto send_pool = std::move(*engine::KvPool::Create(spec_, kBlocks));
  FakeDeviceStorage sender(send_pool.get());
  Transfer(send_pool.get(), &sender, 12, 0);  // device -> host
  ExpectArrived(12, 0);
  TearDown();
  Start(/*device_receiver=*/true);
  auto host_send = std::move(*engine::KvPool::Create(spec_, kBlocks));
  Transfer(host_send.get(), host_send.get(), 12, 1);  // host -> device
  ExpectArrived(12, 1);
  EXPECT_EQ(receive_device_->from_host, 11 * spec_.num_layers);
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, DeviceStorageTransferTest,
                         ::testing::Values(DType::kF32, DType::kF16,
                                           DType::kBF16, DType::kI8,
                                           DType::kFp8E4M3),
                         [](const auto& info) {
                           return std::string(DTypeName(info.param));
                         });

}  // namespace
}  // namespace pdserve::kv_transfer
