#include "kv_transfer/ipc/cuda_ipc_backend.h"

#include <cstring>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace pdserve::kv_transfer::ipc {

std::string EncodeCudaIpcHandle(const std::string& driver_handle,
                                uint64_t offset) {
  std::string out = driver_handle;
  for (int i = 0; i < 8; ++i)
    out.push_back(static_cast<char>((offset >> (8 * i)) & 0xff));
  return out;
}

absl::Status DecodeCudaIpcHandle(const std::string& handle,
                                 std::string* driver_handle, uint64_t* offset) {
  if (handle.size() <= 8) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda_ipc: a region handle of ", handle.size(),
                     " bytes is too short (a CUDA IPC handle and an offset)"));
  }
  *driver_handle = handle.substr(0, handle.size() - 8);
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i)
    v |= uint64_t{static_cast<uint8_t>(handle[handle.size() - 8 + i])}
         << (8 * i);
  *offset = v;
  return absl::OkStatus();
}

namespace {

class CudaIpcBackendImpl;

class CudaIpcMapping final : public PeerMapping {
 public:
  CudaIpcMapping(CudaIpcBackendImpl* backend,
                 std::unique_ptr<DeviceCopier> copier)
      : backend_(backend), copier_(std::move(copier)) {}
  ~CudaIpcMapping() override;
  void AddRegion(std::string driver_handle, uint8_t* base) {
    handles_.push_back(std::move(driver_handle));
    bases_.push_back(base);
  }
  uint8_t* base(size_t region) override { return bases_[region]; }
  absl::Status Copy(std::span<const CopyOp> ops, absl::Time deadline) override {
    absl::MutexLock l(&mu_);  // one stream and event per mapping
    return copier_->Copy(ops, deadline);
  }

 private:
  CudaIpcBackendImpl* const backend_;
  absl::Mutex mu_;
  std::unique_ptr<DeviceCopier> copier_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> handles_;  // one open reference per region
  std::vector<uint8_t*> bases_;
};

class CudaIpcBackendImpl final : public PeerMemoryBackend {
 public:
  CudaIpcBackendImpl(CudaIpcDriver* driver, int device)
      : driver_(driver), device_(device) {}
  PeerMemoryKind kind() const override { return PeerMemoryKind::kCudaIpc; }
  engine::MemoryKind memory_kind() const override {
    return engine::MemoryKind::kDevice;
  }

  absl::StatusOr<std::string> ExportHandle(
      const engine::KvSharedRegion& region) override {
    absl::StatusOr<CudaIpcDriver::Allocation> a =
        driver_->AllocationOf(device_, region.base);
    if (!a.ok()) return a.status();
    const auto at = reinterpret_cast<uintptr_t>(region.base);
    if (at < a->base || at - a->base > a->bytes ||
        region.bytes > a->bytes - (at - a->base)) {
      return absl::InternalError(absl::StrCat(
          "cuda_ipc: a KV region of ", region.bytes,
          " bytes does not lie inside its allocation of ", a->bytes, " bytes"));
    }
    absl::StatusOr<std::string> h =
        driver_->GetMemHandle(device_, reinterpret_cast<void*>(a->base));
    if (!h.ok()) return h.status();
    return EncodeCudaIpcHandle(*h, at - a->base);
  }

  absl::StatusOr<std::unique_ptr<PeerMapping>> Map(
      const KvExport& peer) override {
    if (peer.kind != PeerMemoryKind::kCudaIpc) {
      return absl::FailedPreconditionError(
          absl::StrCat("cuda_ipc: the decode worker exports its KV over ",
                       PeerMemoryName(peer.kind)));
    }
    absl::StatusOr<std::unique_ptr<DeviceCopier>> copier =
        driver_->NewCopier(device_);
    if (!copier.ok()) return copier.status();
    auto mapping = std::make_unique<CudaIpcMapping>(this, *std::move(copier));
    for (size_t i = 0; i < peer.regions.size(); ++i) {
      const ExportedRegion& r = peer.regions[i];
      std::string handle;
      uint64_t offset = 0;
      if (auto s = DecodeCudaIpcHandle(r.handle, &handle, &offset); !s.ok())
        return s;
      absl::StatusOr<uint8_t*> base = Acquire(handle, i, r.bytes);
      if (!base.ok()) return base.status();  // `mapping` releases the others
      // The real allocation, as this process's driver sees the mapping.
      absl::StatusOr<CudaIpcDriver::Allocation> a =
          driver_->AllocationOf(device_, *base);
      absl::Status fits = a.status();
      if (fits.ok() && (a->base != reinterpret_cast<uintptr_t>(*base) ||
                        offset > a->bytes || r.bytes > a->bytes - offset)) {
        fits = absl::FailedPreconditionError(absl::StrCat(
            "cuda_ipc: the decode worker's KV region ", i, " claims ", r.bytes,
            " bytes at offset ", offset, ", but the allocation it names holds ",
            a->bytes, " bytes; refusing to map it"));
      }
      mapping->AddRegion(handle, *base + offset);
      if (!fits.ok()) return fits;
    }
    return std::unique_ptr<PeerMapping>(std::move(mapping));
  }

  // One open reference to `handle`'s allocation (opened on first use).
  absl::StatusOr<uint8_t*> Acquire(const std::string& handle, size_t region,
                                   uint64_t bytes) {
    // Held across the open: two mappings racing for a new peer must not
    // both open one handle (the second open fails in CUDA).
    absl::MutexLock l(&mu_);
    auto it = opens_.find(handle);
    if (it != opens_.end()) {
      ++it->second.refs;
      return it->second.base;
    }
    absl::StatusOr<void*> p = driver_->OpenMemHandle(device_, handle);
    if (!p.ok()) {
      return absl::UnavailableError(absl::StrCat(
          "cuda_ipc: cannot map the decode worker's KV region ", region, " (",
          bytes, " bytes): ", p.status().message(),
          " (cuda_ipc needs both workers on one node, a GPU each can reach, "
          "and distinct processes)"));
    }
    opens_[handle] = Open{static_cast<uint8_t*>(*p), 1};
    return static_cast<uint8_t*>(*p);
  }
  void Release(const std::string& handle) {
    absl::MutexLock l(&mu_);
    auto it = opens_.find(handle);
    if (it == opens_.end() || --it->second.refs > 0) return;
    driver_->CloseMemHandle(device_, it->second.base);
    opens_.erase(it);
  }

 private:
  struct Open {
    uint8_t* base = nullptr;
    int refs = 0;
  };
  CudaIpcDriver* const driver_;
  const int device_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Open> opens_ ABSL_GUARDED_BY(mu_);
};

CudaIpcMapping::~CudaIpcMapping() {
  // A copy abandoned at its deadline finishes before the handles close.
  {
    absl::MutexLock l(&mu_);
    copier_.reset();
  }
  for (const std::string& h : handles_) backend_->Release(h);
}

}  // namespace

std::unique_ptr<PeerMemoryBackend> NewCudaIpcBackendOver(CudaIpcDriver* driver,
                                                         int device) {
  return std::make_unique<CudaIpcBackendImpl>(driver, device);
}

}  // namespace pdserve::kv_transfer::ipc
