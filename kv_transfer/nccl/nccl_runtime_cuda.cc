// nccl_runtime.h for builds with CUDA and NCCL.
#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "kv_transfer/nccl/nccl_communicator.h"
#include "kv_transfer/nccl/nccl_runtime.h"

namespace pdserve::kv_transfer::nccl {

absl::StatusOr<std::unique_ptr<CommunicatorFactory>> OpenNcclCommunicators(
    int device) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--kv-transport nccl: no usable CUDA GPU (cudaGetDeviceCount: ",
        cudaGetErrorName(error), ", ", cudaGetErrorString(error),
        "); use --kv-transport grpc on CPU hosts"));
  }
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("--kv-transport nccl: CUDA device ", device,
                     " is not visible (", count, " GPU(s) visible)"));
  }
  return std::unique_ptr<CommunicatorFactory>(
      new NcclCommunicatorFactory(device));
}

}  // namespace pdserve::kv_transfer::nccl
