// nccl_runtime.h for builds without CUDA or NCCL.
#include "kv_transfer/nccl/nccl_runtime.h"

namespace pdserve::kv_transfer::nccl {

absl::StatusOr<std::unique_ptr<CommunicatorFactory>> OpenNcclCommunicators(
    int) {
  return absl::FailedPreconditionError(
      "--kv-transport nccl: this pdserve binary was built without CUDA and "
      "NCCL (rebuild where nvcc and NCCL are found, or use --kv-transport "
      "grpc)");
}

}  // namespace pdserve::kv_transfer::nccl
