// The cuda_ipc PeerMemoryBackend on CUDA: CudaIpcDriver over the CUDA
// runtime (cudaIpcGetMemHandle / cudaIpcOpenMemHandle, copies with
// cudaMemcpyAsync on the mapping's own stream and one event per batch) and
// cuMemGetAddressRange for the allocation that holds a pointer. The logic
// (sub-allocation offsets, one open per handle, region checks) is
// cuda_ipc_backend.cc, tested on CPU against a fake driver.
//
// cuMemGetAddressRange is a driver API call, reached through the runtime's
// cudaGetDriverEntryPointByVersion instead of linking libcuda, so that
// binaries built with CUDA still start on machines without a driver.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.h"
#include "kv_transfer/ipc/cuda_ipc_backend.h"
#include "kv_transfer/ipc/peer_memory.h"

namespace pdserve::kv_transfer::ipc {
namespace {

class CudaCopier final : public DeviceCopier {
 public:
  explicit CudaCopier(int device) : device_(device) {}
  ~CudaCopier() override {
    cudaSetDevice(device_);
    if (event_ != nullptr) {
      // Waits for the stream, never for a peer.
      cudaEventSynchronize(event_);
      cudaEventDestroy(event_);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  absl::Status Init() {
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    PDSERVE_CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    PDSERVE_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    return absl::OkStatus();
  }
  absl::Status Copy(std::span<const CopyOp> ops, absl::Time deadline) override {
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
  cudaStream_t stream_ = nullptr;
  cudaEvent_t event_ = nullptr;
};

class CudaRuntimeIpcDriver final : public CudaIpcDriver {
 public:
  absl::StatusOr<Allocation> AllocationOf(int device, const void* p) override {
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t e = cudaGetDriverEntryPointByVersion(
        "cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found);
    if (e != cudaSuccess || found != cudaDriverEntryPointSuccess ||
        fn == nullptr) {
      cudaGetLastError();
      return absl::FailedPreconditionError(
          "cuda_ipc: the CUDA driver offers no cuMemGetAddressRange");
    }
    CUdeviceptr base = 0;
    size_t bytes = 0;
    const CUresult r = reinterpret_cast<GetAddressRange>(fn)(
        &base, &bytes, reinterpret_cast<CUdeviceptr>(p));
    if (r != CUDA_SUCCESS) {
      return absl::FailedPreconditionError(
          absl::StrCat("cuda_ipc: cuMemGetAddressRange failed (CUresult ",
                       static_cast<int>(r), "): not device memory"));
    }
    return Allocation{static_cast<uintptr_t>(base), bytes};
  }
  absl::StatusOr<std::string> GetMemHandle(int device, void* base) override {
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    cudaIpcMemHandle_t handle;
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&handle, base));
    return std::string(reinterpret_cast<const char*>(&handle), sizeof handle);
  }
  absl::StatusOr<void*> OpenMemHandle(int device,
                                      const std::string& bytes) override {
    if (bytes.size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "a handle of ", bytes.size(), " bytes is not a cudaIpcMemHandle_t"));
    }
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, bytes.data(), sizeof handle);
    void* p = nullptr;
    const cudaError_t e =
        cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-less error
      return absl::UnavailableError(cudaGetErrorName(e));
    }
    return p;
  }
  void CloseMemHandle(int device, void* base) override {
    cudaSetDevice(device);
    cudaIpcCloseMemHandle(base);
  }
  absl::StatusOr<std::unique_ptr<DeviceCopier>> NewCopier(int device) override {
    auto copier = std::make_unique<CudaCopier>(device);
    if (absl::Status s = copier->Init(); !s.ok()) return s;
    return std::unique_ptr<DeviceCopier>(std::move(copier));
  }
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
  // Stateless: one per process, shared by every backend.
  static CudaRuntimeIpcDriver* driver = new CudaRuntimeIpcDriver();
  return NewCudaIpcBackendOver(driver, device);
}

}  // namespace pdserve::kv_transfer::ipc
