// MLA latent blocks over the grpc transport: a (layer, block) span of an MLA
// KvCacheSpec is [block_size][kv_lora_rank + qk_rope_head_dim] (no separate
// V), and the transport moves it as any other span, byte for byte; the
// handshake refuses to pair an MLA cache with an MHA/GQA one.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/metrics.h"
#include "kv_cache/block_manager.h"
#include "kv_transfer/grpc/grpc_transport.h"
#include "kv_transfer/test_blocks.h"

namespace pdserve::kv_transfer {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// 3 layers of latent rows 32 + 8 wide, blocks of 16 tokens.
engine::KvCacheSpec MlaSpec(DType dtype) {
  return {3, 1, 40, 16, dtype, 32, 8};
}
// A GQA cache whose (kv_heads, head_dim) happen to equal the MLA row's.
engine::KvCacheSpec GqaSpec(DType dtype) { return {3, 1, 40, 16, dtype}; }

class MlaTransferTest : public ::testing::Test {
 protected:
  void StartReceiver(const engine::KvCacheSpec& spec) {
    spec_ = spec;
    pool_ = std::move(*engine::KvPool::Create(spec_, 16));
    blocks_ = std::make_unique<engine::BlockManager>(16);
    metrics_ = std::make_unique<TransferMetrics>(registry_);
    receiver_ = std::make_unique<KvReceiver>(pool_.get(),
                                             KvLayout::FromSpec(spec_, "model"),
                                             metrics_->ForReceiver());
    service_ = std::make_unique<KvTransferService>(receiver_.get());
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port_);
    builder.RegisterService(service_.get());
    ConfigureInternalServer(&builder);
    server_ = builder.BuildAndStart();
    ASSERT_NE(port_, 0);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }
  // Sends logical blocks [0, n) from `sender` layer by layer; returns the
  // sender's status (and stats in *stats).
  absl::Status Send(engine::KvPool* sender, uint64_t reservation, int n,
                    SendStats* stats = nullptr) {
    SendPlan plan;
    plan.destination = "127.0.0.1:" + std::to_string(port_);
    plan.request_id = "mla-req";
    plan.reservation_id = reservation;
    plan.sender_id = "test";
    plan.layout = KvLayout::FromSpec(sender->spec(), "model");
    for (int i = 0; i < n; ++i) plan.blocks.emplace_back(i, 2 * i + 1);
    GrpcKvTransport transport(nullptr);
    auto session = transport.Open(plan, sender);
    if (!session.ok()) return session.status();
    for (int l = 0; l < sender->spec().num_layers; ++l) {
      if (auto s = (*session)->SendLayers(l, l + 1); !s.ok()) return s;
    }
    auto done = (*session)->Finish();
    if (done.ok() && stats != nullptr) *stats = *done;
    return done.status();
  }

  engine::KvCacheSpec spec_;
  std::unique_ptr<engine::KvPool> pool_;
  std::unique_ptr<engine::BlockManager> blocks_;
  metrics::Registry registry_;
  std::unique_ptr<TransferMetrics> metrics_;
  std::unique_ptr<KvReceiver> receiver_;
  std::unique_ptr<KvTransferService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(MlaTransferTest, LatentBlocksArriveByteIdenticalLayerByLayer) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kI8}) {
    StartReceiver(MlaSpec(dtype));
    auto sender = std::move(*engine::KvPool::Create(spec_, 16));
    const int n = 4;
    for (int i = 0; i < n; ++i)
      testing::FillBlock(sender.get(), 7, i, 2 * i + 1);
    std::vector<int32_t> reserved;
    ASSERT_TRUE(blocks_->Allocate(n, &reserved));
    const uint64_t id = receiver_->Expect("mla-req", reserved, 0);
    SendStats stats;
    ASSERT_TRUE(Send(sender.get(), id, n, &stats).ok()) << DTypeName(dtype);
    ASSERT_TRUE(
        receiver_->Wait(id, absl::Seconds(20), absl::Now() + absl::Seconds(30))
            .ok());
    for (int i = 0; i < n; ++i) {
      for (int l = 0; l < spec_.num_layers; ++l) {
        const engine::KvSpan got = pool_->Span(l, reserved[i]);
        const engine::KvSpan want = sender->Span(l, 2 * i + 1);
        ASSERT_EQ(got.data_bytes, want.data_bytes);
        EXPECT_EQ(0, std::memcmp(got.data, want.data, got.data_bytes))
            << DTypeName(dtype) << " layer " << l << " block " << i;
        ASSERT_EQ(got.scale_bytes, want.scale_bytes);
        if (got.scale_bytes > 0) {
          EXPECT_EQ(0, std::memcmp(got.scales, want.scales, got.scale_bytes));
        }
      }
    }
    // One latent row per token: 16 x 40 elements per span, nothing for V;
    // int8 adds the two scales of each span.
    const size_t span =
        16 * 40 * DTypeBytes(dtype) + (dtype == DType::kI8 ? 8 : 0);
    EXPECT_EQ(stats.bytes, n * 3 * span) << DTypeName(dtype);
    server_->Shutdown(std::chrono::system_clock::now());
    server_.reset();
  }
}

TEST_F(MlaTransferTest, MlaSenderAndGqaReceiverFailThePreconditionByName) {
  StartReceiver(GqaSpec(DType::kBF16));
  auto sender = std::move(*engine::KvPool::Create(MlaSpec(DType::kBF16), 16));
  std::vector<int32_t> reserved;
  ASSERT_TRUE(blocks_->Allocate(2, &reserved));
  const uint64_t id = receiver_->Expect("mla-req", reserved, 0);
  // The sender is told why, with both values; the receiver's reservation
  // ends (not ok) and is freed.
  const absl::Status sent = Send(sender.get(), id, 2);
  EXPECT_EQ(sent.code(), absl::StatusCode::kFailedPrecondition) << sent;
  EXPECT_THAT(
      std::string(sent.message()),
      HasSubstr("kv cache kind: sender MLA latent vs receiver MHA/GQA"));
  EXPECT_THAT(std::string(sent.message()),
              HasSubstr("kv_lora_rank: sender 32 vs receiver 0"));
  const absl::Status s =
      receiver_->Wait(id, absl::Seconds(20), absl::Now() + absl::Seconds(30));
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("kv_lora_rank"));
  EXPECT_EQ(receiver_->num_reservations(), 0);
}

TEST(MlaLayoutTest, CheckLayoutsNamesTheMlaGeometry) {
  const KvLayout mla = KvLayout::FromSpec(MlaSpec(DType::kBF16), "m");
  EXPECT_EQ(mla.kv_lora_rank, 32);
  EXPECT_EQ(mla.qk_rope_head_dim, 8);
  EXPECT_TRUE(CheckLayouts(mla, mla).ok());
  // Both MLA, different rope width.
  engine::KvCacheSpec other = MlaSpec(DType::kBF16);
  other.qk_rope_head_dim = 16;
  other.head_dim = 48;
  const absl::Status s = CheckLayouts(mla, KvLayout::FromSpec(other, "m"));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("qk_rope_head_dim: sender 8 vs receiver 16"));
  EXPECT_THAT(std::string(s.message()), Not(HasSubstr("kv cache kind")));
  // A GQA receiver: the kind and the rank are named.
  const absl::Status g =
      CheckLayouts(KvLayout::FromSpec(GqaSpec(DType::kBF16), "m"), mla);
  EXPECT_THAT(
      std::string(g.message()),
      HasSubstr("kv cache kind: sender MHA/GQA vs receiver MLA latent"));
  // The proto round trip keeps the geometry.
  const KvLayout back = FromProto(ToProto(mla));
  EXPECT_EQ(back, mla);
}

}  // namespace
}  // namespace pdserve::kv_transfer
