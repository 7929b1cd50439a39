// NewCudaIpcBackend where this pdserve was built without CUDA.
#include "kv_transfer/ipc/peer_memory.h"

namespace pdserve::kv_transfer::ipc {

absl::StatusOr<std::unique_ptr<PeerMemoryBackend>> NewCudaIpcBackend(int) {
  return absl::FailedPreconditionError(
      "--kv-transport cuda_ipc: this pdserve was built without CUDA");
}

}  // namespace pdserve::kv_transfer::ipc
