// The cuda_ipc PeerMemoryBackend: decode exports each cudaMalloc region of
// its KV pool with cudaIpcGetMemHandle; prefill opens a peer's handles once
// (cudaIpcOpenMemHandle, cached with the mapping) and copies device to
// device with cudaMemcpyAsync on its own stream, one event per batch.
//
// Never run on a GPU yet (see kv_transfer/README.md).
#include <cuda_runtime_api.h>

#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/cuda_check.h"
#include "kv_transfer/ipc/peer_memory.h"

namespace pdserve::kv_transfer::ipc {
namespace {

class CudaIpcMapping final : public PeerMapping {
 public:
  explicit CudaIpcMapping(int device) : device_(device) {}
  ~CudaIpcMapping() override {
    cudaSetDevice(device_);
    if (event_ != nullptr) {
      // A copy abandoned at its deadline must finish before the handles
      // close; this waits for the stream, never for a peer.
      cudaEventSynchronize(event_);
      cudaEventDestroy(event_);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    for (void* p : bases_) cudaIpcCloseMemHandle(p);
  }
  absl::Status Init() {
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    PDSERVE_CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    PDSERVE_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    return absl::OkStatus();
  }
  absl::Status Add(const ExportedRegion& region) {
    if (region.handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::FailedPreconditionError(
          absl::StrCat("cuda_ipc: a handle of ", region.handle.size(),
                       " bytes is not a cudaIpcMemHandle_t"));
    }
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, region.handle.data(), sizeof handle);
    void* p = nullptr;
    const cudaError_t e =
        cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-less error
      return absl::UnavailableError(absl::StrCat(
          "cuda_ipc: cannot map the decode worker's KV region (", region.bytes,
          " bytes): ", cudaGetErrorName(e),
          " (cuda_ipc needs both workers on one node, a GPU each can reach, "
          "and distinct processes)"));
    }
    bases_.push_back(p);
    return absl::OkStatus();
  }
  uint8_t* base(size_t region) override {
    return static_cast<uint8_t*>(bases_[region]);
  }
  absl::Status Copy(std::span<const CopyOp> ops, absl::Time deadline) override {
    absl::MutexLock l(&mu_);  // one stream and event per mapping
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    for (const CopyOp& op : ops) {
      PDSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
          op.dst, op.src, op.bytes, cudaMemcpyDeviceToDevice, stream_));
    }
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(event_, stream_));
    // Bounded wait: cudaEventSynchronize cannot time out.
    while (true) {
      const cudaError_t q = cudaEventQuery(event_);
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) return PDSERVE_CUDA_STATUS(q);
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(
            "cuda_ipc: device copies into the decode worker's KV did not "
            "complete in time");
      }
      std::this_thread::yield();
    }
  }

 private:
  const int device_;
  absl::Mutex mu_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t event_ = nullptr;
  std::vector<void*> bases_;
};

class CudaIpcBackend final : public PeerMemoryBackend {
 public:
  explicit CudaIpcBackend(int device) : device_(device) {}
  PeerMemoryKind kind() const override { return PeerMemoryKind::kCudaIpc; }
  engine::MemoryKind memory_kind() const override {
    return engine::MemoryKind::kDevice;
  }
  absl::StatusOr<std::string> ExportHandle(
      const engine::KvSharedRegion& region) override {
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    cudaIpcMemHandle_t handle;
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&handle, region.base));
    return std::string(reinterpret_cast<const char*>(&handle), sizeof handle);
  }
  absl::StatusOr<std::unique_ptr<PeerMapping>> Map(
      const KvExport& peer) override {
    if (peer.kind != PeerMemoryKind::kCudaIpc) {
      return absl::FailedPreconditionError(
          absl::StrCat("cuda_ipc: the decode worker exports its KV over ",
                       PeerMemoryName(peer.kind)));
    }
    auto mapping = std::make_unique<CudaIpcMapping>(device_);
    if (auto s = mapping->Init(); !s.ok()) return s;
    for (const ExportedRegion& r : peer.regions) {
      if (auto s = mapping->Add(r); !s.ok()) return s;
    }
    return std::unique_ptr<PeerMapping>(std::move(mapping));
  }

 private:
  const int device_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PeerMemoryBackend>> NewCudaIpcBackend(
    int device) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "--kv-transport cuda_ipc: CUDA device ", device, " is not visible (",
        e == cudaSuccess ? absl::StrCat(count, " devices")
                         : std::string(cudaGetErrorName(e)),
        ")"));
  }
  return std::unique_ptr<PeerMemoryBackend>(new CudaIpcBackend(device));
}

}  // namespace pdserve::kv_transfer::ipc
