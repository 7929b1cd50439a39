// The cuda_ipc backend's logic on CPU (kv_transfer/ipc/cuda_ipc_backend.h),
// end to end through IpcKvTransport, over a fake CUDA IPC driver whose
// "device memory" is host memory and which enforces CUDA's rules: one open
// per handle per process, handles of whole allocations, a close only of
// what is open. The decode pool's regions (per layer data and scales) are
// carved from one allocation, as small cudaMallocs can be, so every region
// but the first lies at an offset inside it.
#include "kv_transfer/ipc/cuda_ipc_backend.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kv_transfer/ipc/ipc_transport.h"
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

class FakeCopier final : public DeviceCopier {
 public:
  absl::Status Copy(std::span<const CopyOp> ops, absl::Time) override {
    for (const CopyOp& op : ops) std::memcpy(op.dst, op.src, op.bytes);
    return absl::OkStatus();
  }
};

// CUDA IPC over host memory. Allocations are registered by the test (its
// "cudaMalloc"); a handle names an allocation's base. Opening returns the
// allocation itself (the mapping a driver shares within a process).
class FakeIpcDriver final : public CudaIpcDriver {
 public:
  void AddAllocation(const void* base, uint64_t bytes) {
    absl::MutexLock l(&mu_);
    allocations_[reinterpret_cast<uintptr_t>(base)] = bytes;
  }
  absl::StatusOr<Allocation> AllocationOf(int, const void* p) override {
    absl::MutexLock l(&mu_);
    const auto at = reinterpret_cast<uintptr_t>(p);
    auto it = allocations_.upper_bound(at);
    if (it == allocations_.begin())
      return absl::NotFoundError("not device memory");
    --it;
    if (at >= it->first + it->second)
      return absl::NotFoundError("not device memory");
    return Allocation{it->first, it->second};
  }
  absl::StatusOr<std::string> GetMemHandle(int, void* base) override {
    absl::MutexLock l(&mu_);
    if (!allocations_.contains(reinterpret_cast<uintptr_t>(base)))
      return absl::InvalidArgumentError("cudaErrorInvalidValue");
    return absl::StrCat("fake-ipc:", reinterpret_cast<uintptr_t>(base));
  }
  absl::StatusOr<void*> OpenMemHandle(int, const std::string& handle) override {
    uintptr_t base = 0;
    if (handle.rfind("fake-ipc:", 0) != 0 ||
        !absl::SimpleAtoi(handle.substr(9), &base))
      return absl::InvalidArgumentError("cudaErrorInvalidResourceHandle");
    // Widens the window in which two racing mappings would both open.
    std::this_thread::sleep_for(std::chrono::milliseconds(open_delay_ms));
    absl::MutexLock l(&mu_);
    ++open_calls_;
    if (open_.contains(base)) {
      ++violations_;
      return absl::UnavailableError("cudaErrorAlreadyMapped");
    }
    open_.insert(base);
    return reinterpret_cast<void*>(base);
  }
  void CloseMemHandle(int, void* base) override {
    absl::MutexLock l(&mu_);
    if (open_.erase(reinterpret_cast<uintptr_t>(base)) == 0) ++violations_;
  }
  absl::StatusOr<std::unique_ptr<DeviceCopier>> NewCopier(int) override {
    return std::unique_ptr<DeviceCopier>(new FakeCopier());
  }
  int open_calls() {
    absl::MutexLock l(&mu_);
    return open_calls_;
  }
  int num_open() {
    absl::MutexLock l(&mu_);
    return static_cast<int>(open_.size());
  }
  int violations() {
    absl::MutexLock l(&mu_);
    return violations_;
  }
  int open_delay_ms = 0;

 private:
  absl::Mutex mu_;
  std::map<uintptr_t, uint64_t> allocations_ ABSL_GUARDED_BY(mu_);
  std::set<uintptr_t> open_ ABSL_GUARDED_BY(mu_);
  int open_calls_ ABSL_GUARDED_BY(mu_) = 0;
  int violations_ ABSL_GUARDED_BY(mu_) = 0;
};

// A host KvPool behind a device face whose shared regions are one per
// layer's data and one per layer's scales, all inside one allocation.
class SubAllocatedStorage final : public engine::KvStorage {
 public:
  explicit SubAllocatedStorage(engine::KvPool* pool) : pool_(pool) {}
  const engine::KvCacheSpec& spec() const override { return pool_->spec(); }
  int64_t num_blocks() const override { return pool_->num_blocks(); }
  engine::KvMemory memory() const override {
    return {engine::MemoryKind::kDevice, 0};
  }
  engine::KvSpan Span(int32_t layer, int64_t block) override {
    engine::KvSpan s = pool_->Span(layer, block);
    s.memory = memory();
    return s;
  }
  absl::Status CopyToHost(int32_t, int64_t, void*, void*) override {
    return absl::InternalError("cuda_ipc must not copy through the host");
  }
  absl::Status CopyFromHost(int32_t, int64_t, const void*,
                            const void*) override {
    return absl::InternalError("cuda_ipc must not copy through the host");
  }
  std::vector<engine::KvSharedRegion> SharedRegions() override {
    std::vector<engine::KvSharedRegion> out;
    const auto& spec = pool_->spec();
    for (int l = 0; l < spec.num_layers; ++l) {
      out.push_back({pool_->LayerBlockData(l, 0),
                     static_cast<size_t>(spec.LayerBlockBytes() * kBlocks),
                     ""});
      if (ScaleBytes(spec) > 0)
        out.push_back(
            {pool_->LayerBlockScales(l, 0), ScaleBytes(spec) * kBlocks, ""});
    }
    return out;
  }
  // The one allocation every region lies in.
  std::pair<const uint8_t*, uint64_t> Extent() {
    const uint8_t* lo = nullptr;
    const uint8_t* hi = nullptr;
    for (const auto& r : SharedRegions()) {
      const auto* b = static_cast<const uint8_t*>(r.base);
      if (lo == nullptr || b < lo) lo = b;
      if (hi == nullptr || b + r.bytes > hi) hi = b + r.bytes;
    }
    return {lo, static_cast<uint64_t>(hi - lo)};
  }

 private:
  engine::KvPool* pool_;
};

class CudaIpcBackendTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    spec_ = TestSpec(GetParam());
    decode_pool_ = *engine::KvPool::Create(spec_, kBlocks);
    prefill_pool_ = *engine::KvPool::Create(spec_, kBlocks);
    decode_ = std::make_unique<SubAllocatedStorage>(decode_pool_.get());
    prefill_ = std::make_unique<SubAllocatedStorage>(prefill_pool_.get());
    const auto [base, bytes] = decode_->Extent();
    driver_.AddAllocation(base, bytes);
    backend_ = NewCudaIpcBackendOver(&driver_, 0);
    layout_ = KvLayout::FromSpec(spec_, "fp");
    receiver_ = std::make_unique<KvReceiver>(decode_.get(), layout_);
    auto endpoint = IpcKvReceiveEndpoint::Create(receiver_.get(), decode_.get(),
                                                 backend_.get(), {});
    ASSERT_TRUE(endpoint.ok()) << endpoint.status();
    endpoint_ = *std::move(endpoint);
    network_.Listen(kDecode, [this](std::unique_ptr<ControlChannel> c) {
      endpoint_->Serve(std::move(c));
    });
    transport_ =
        std::make_unique<IpcKvTransport>(&network_, backend_.get(), nullptr);
  }
  void TearDown() override {
    network_.StopListening(kDecode);
    if (endpoint_) endpoint_->Shutdown();
    transport_.reset();
    EXPECT_EQ(driver_.num_open(), 0) << "a handle was left open";
    EXPECT_EQ(driver_.violations(), 0)
        << "a handle was opened twice or closed while not open";
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
  // Every span (data and scales) of decode block `block` holds logical
  // `index`'s bytes; names the first that does not.
  std::string CheckHolds(int32_t block, int index, uint64_t seed) {
    for (int l = 0; l < spec_.num_layers; ++l) {
      auto want = ExpectedSpan(spec_, seed, l, index, spec_.LayerBlockBytes());
      if (std::memcmp(decode_pool_->LayerBlockData(l, block), want.data(),
                      want.size()) != 0)
        return absl::StrCat("layer ", l, " block ", block, " data");
      if (ScaleBytes(spec_) > 0) {
        auto ws = ExpectedSpan(spec_, seed + 1, l, index, ScaleBytes(spec_));
        if (std::memcmp(decode_pool_->LayerBlockScales(l, block), ws.data(),
                        ws.size()) != 0)
          return absl::StrCat("layer ", l, " block ", block, " scales");
      }
    }
    return "";
  }

  engine::KvCacheSpec spec_;
  KvLayout layout_;
  FakeIpcDriver driver_;
  std::unique_ptr<engine::KvPool> decode_pool_, prefill_pool_;
  std::unique_ptr<SubAllocatedStorage> decode_, prefill_;
  std::unique_ptr<PeerMemoryBackend> backend_;
  std::unique_ptr<KvReceiver> receiver_;
  std::unique_ptr<IpcKvReceiveEndpoint> endpoint_;
  nccl::FakeControlNetwork network_;
  std::unique_ptr<IpcKvTransport> transport_;
};

TEST_P(CudaIpcBackendTest, SubAllocatedRegionsLandAtTheirOffsetsSpanBySpan) {
  // Every region after the first starts inside the one allocation.
  const KvExport& exported = endpoint_->exported();
  ASSERT_GE(exported.regions.size(), 3u);
  // Decode reserved physical blocks in a scrambled order; each logical
  // block has its own pattern, so a wrong or duplicated offset shows.
  const std::vector<int32_t> physical = {9, 2, 14, 0, 7, 11, 3, 5};
  const uint64_t res = receiver_->Expect("r", physical, 0);
  std::vector<BlockRef> refs;
  for (int i = 0; i < static_cast<int>(physical.size()); ++i) {
    FillBlock(prefill_pool_.get(), 42, i, 15 - i);
    refs.push_back({i, 15 - i});
  }
  auto session = transport_->Open(Plan(res, refs), prefill_.get());
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->SendLayers(0, spec_.num_layers).ok());
  ASSERT_TRUE((*session)->Finish().ok());
  ASSERT_TRUE(
      receiver_->Wait(res, absl::Seconds(10), absl::Now() + absl::Seconds(10))
          .ok());
  for (int i = 0; i < static_cast<int>(physical.size()); ++i)
    EXPECT_EQ(CheckHolds(physical[i], i, 42), "") << "logical block " << i;
  for (int32_t b : {1, 4, 6, 8, 10, 12, 13, 15}) {
    for (int l = 0; l < spec_.num_layers; ++l) {
      const uint8_t* p = decode_pool_->LayerBlockData(l, b);
      EXPECT_TRUE(std::all_of(p, p + spec_.LayerBlockBytes(),
                              [](uint8_t v) { return v == 0; }))
          << "unreserved block " << b << " layer " << l << " was written";
    }
  }
  // One allocation: opened once for all of its regions.
  EXPECT_EQ(driver_.open_calls(), 1);
}

TEST_P(CudaIpcBackendTest, ConcurrentSendsToANewPeerOpenEachHandleOnce) {
  driver_.open_delay_ms = 30;
  constexpr int kSenders = 4;
  std::vector<uint64_t> reservations;
  for (int s = 0; s < kSenders; ++s) {
    reservations.push_back(
        receiver_->Expect(absl::StrCat("r", s), {2 * s, 2 * s + 1}, 0));
    FillBlock(prefill_pool_.get(), 100 + s, 0, 2 * s);
    FillBlock(prefill_pool_.get(), 100 + s, 1, 2 * s + 1);
  }
  std::vector<absl::Status> results(kSenders);
  std::vector<std::thread> threads;
  for (int s = 0; s < kSenders; ++s) {
    threads.emplace_back([&, s] {
      SendPlan plan = Plan(reservations[s], {{0, 2 * s}, {1, 2 * s + 1}});
      plan.request_id = absl::StrCat("r", s);
      auto session = transport_->Open(plan, prefill_.get());
      if (!session.ok()) {
        results[s] = session.status();
        return;
      }
      results[s] = (*session)->SendLayers(0, spec_.num_layers);
      if (results[s].ok()) results[s] = (*session)->Finish().status();
    });
  }
  for (auto& t : threads) t.join();
  for (int s = 0; s < kSenders; ++s) {
    ASSERT_TRUE(results[s].ok()) << "sender " << s << ": " << results[s];
    ASSERT_TRUE(receiver_
                    ->Wait(reservations[s], absl::Seconds(10),
                           absl::Now() + absl::Seconds(10))
                    .ok());
    EXPECT_EQ(CheckHolds(2 * s, 0, 100 + s), "") << s;
    EXPECT_EQ(CheckHolds(2 * s + 1, 1, 100 + s), "") << s;
  }
  EXPECT_EQ(driver_.open_calls(), 1) << "a racing mapping opened it again";
  EXPECT_EQ(driver_.num_open(), 1) << "a losing mapping closed the winner's";
  // The mapping the transport kept still writes.
  const uint64_t res = receiver_->Expect("again", {12}, 0);
  FillBlock(prefill_pool_.get(), 7, 0, 12);
  SendPlan plan = Plan(res, {{0, 12}});
  plan.request_id = "again";
  auto session = transport_->Open(plan, prefill_.get());
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->SendLayers(0, spec_.num_layers).ok());
  ASSERT_TRUE((*session)->Finish().ok());
  ASSERT_TRUE(
      receiver_->Wait(res, absl::Seconds(10), absl::Now() + absl::Seconds(10))
          .ok());
  EXPECT_EQ(CheckHolds(12, 0, 7), "");
}

TEST_P(CudaIpcBackendTest, ARegionLargerThanItsAllocationIsRefused) {
  // A confused or hostile peer claims more bytes than it allocated: the
  // geometry check alone (KvExport::Validate) would accept the larger
  // region, so only the allocation the driver reports can catch it.
  KvExport lie = endpoint_->exported();
  lie.regions.back().bytes += 4096;
  auto mapped = backend_->Map(lie);
  ASSERT_EQ(mapped.status().code(), absl::StatusCode::kFailedPrecondition)
      << mapped.status();
  EXPECT_THAT(mapped.status().message(), HasSubstr("claims"));
  EXPECT_EQ(driver_.num_open(), 0) << "the refused mapping left a handle open";
  // An offset past the allocation's end, same verdict.
  KvExport far = endpoint_->exported();
  std::string handle;
  uint64_t offset = 0;
  ASSERT_TRUE(
      DecodeCudaIpcHandle(far.regions[0].handle, &handle, &offset).ok());
  far.regions[0].handle = EncodeCudaIpcHandle(handle, uint64_t{1} << 40);
  EXPECT_EQ(backend_->Map(far).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // A handle too short to hold an offset.
  KvExport shortened = endpoint_->exported();
  shortened.regions[0].handle = "x";
  EXPECT_EQ(backend_->Map(shortened).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(driver_.num_open(), 0);
  // The true export still maps.
  EXPECT_TRUE(backend_->Map(endpoint_->exported()).ok());
}

TEST_P(CudaIpcBackendTest, ExportingMemoryOutsideAnyAllocationFails) {
  std::vector<uint8_t> stray(64);
  EXPECT_FALSE(backend_->ExportHandle({stray.data(), stray.size(), ""}).ok());
  // A region that runs past the end of its allocation.
  const auto [base, bytes] = decode_->Extent();
  engine::KvSharedRegion past{const_cast<uint8_t*>(base) + bytes - 8, 64, ""};
  EXPECT_EQ(backend_->ExportHandle(past).status().code(),
            absl::StatusCode::kInternal);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaIpcBackendTest,
                         ::testing::Values(DType::kF32, DType::kI8,
                                           DType::kFp8E4M3),
                         [](const auto& info) {
                           return info.param == DType::kF32  ? "f32"
                                  : info.param == DType::kI8 ? "int8"
                                                             : "fp8";
                         });

}  // namespace
}  // namespace pdserve::kv_transfer::ipc
