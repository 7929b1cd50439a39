// The cuda_ipc PeerMemoryBackend's logic over a seam of the CUDA calls it
// makes (CudaIpcDriver), so that CPU tests run it against a fake driver over
// host memory, and the GPU build runs the same code against CUDA
// (cuda_ipc_memory.cc).
//
// Export (decode side): each KvSharedRegion may be a piece of a larger
// allocation (a small cudaMalloc, such as a layer's scale array, can be
// carved from a block the allocator shares with others; CUDA IPC always
// shares the whole block, and the peer's mapping starts at the block's
// base). The exported handle therefore names the allocation that holds the
// region (CudaIpcDriver::AllocationOf, cuMemGetAddressRange) and the
// region's offset in it.
//
// Import (prefill side): each allocation is opened once per process, however
// many regions and peers' mappings share it: CUDA allows one
// cudaIpcOpenMemHandle per handle per process, and a driver that hands back
// the existing mapping would let one mapping's close unmap another's. Opens
// are counted and closed with the last mapping that uses them. The claimed
// region (offset + bytes) is checked against the allocation the driver
// reports for the opened pointer, never trusted from the peer: a region
// larger than the real allocation is FAILED_PRECONDITION and nothing is
// mapped.
//
// Thread-safety: the backend and its mappings are thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kv_transfer/ipc/peer_memory.h"

namespace pdserve::kv_transfer::ipc {

// Device-to-device copies on one stream, waited for with a deadline.
class DeviceCopier {
 public:
  virtual ~DeviceCopier() = default;  // waits for copies still in flight
  // Enqueues every op and waits until all completed, or DEADLINE_EXCEEDED
  // at `deadline` (copies already enqueued may still land).
  virtual absl::Status Copy(std::span<const CopyOp> ops,
                            absl::Time deadline) = 0;
};

// The CUDA calls of the cuda_ipc backend. Implementations are thread-safe.
class CudaIpcDriver {
 public:
  struct Allocation {
    uintptr_t base = 0;  // first byte of the allocation in this process
    uint64_t bytes = 0;
  };
  virtual ~CudaIpcDriver() = default;
  // The allocation holding `p` on `device` (cuMemGetAddressRange).
  virtual absl::StatusOr<Allocation> AllocationOf(int device,
                                                  const void* p) = 0;
  // cudaIpcGetMemHandle of the allocation starting at `base`.
  virtual absl::StatusOr<std::string> GetMemHandle(int device, void* base) = 0;
  // cudaIpcOpenMemHandle: the allocation's base in this process. CUDA fails
  // a second open of a handle that is open in this process.
  virtual absl::StatusOr<void*> OpenMemHandle(int device,
                                              const std::string& handle) = 0;
  virtual void CloseMemHandle(int device, void* base) = 0;
  virtual absl::StatusOr<std::unique_ptr<DeviceCopier>> NewCopier(
      int device) = 0;
};

// The cuda_ipc backend on `device` over `driver` (which must outlive it).
// One backend per process: it counts the process's opens of each handle.
std::unique_ptr<PeerMemoryBackend> NewCudaIpcBackendOver(CudaIpcDriver* driver,
                                                         int device);

// The opaque ExportedRegion::handle: the driver's handle of the allocation
// and the region's byte offset in it. Exposed for tests (a hostile peer).
std::string EncodeCudaIpcHandle(const std::string& driver_handle,
                                uint64_t offset);
absl::Status DecodeCudaIpcHandle(const std::string& handle,
                                 std::string* driver_handle, uint64_t* offset);

}  // namespace pdserve::kv_transfer::ipc
