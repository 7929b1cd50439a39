// Turns CUDA runtime and NCCL failures into absl::Status carrying the failed
// expression, the error name and the file and line (STYLE.md: errors). Only
// host code uses these; kernels report nothing through them.
//
//   PDSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(...));
//   PDSERVE_NCCL_RETURN_IF_ERROR(ncclSend(...));
//
// The NCCL half exists where the build found NCCL (PDSERVE_HAVE_NCCL, set by
// linking pdserve_kernels_cuda). Header-only and stateless, so thread-safe.
#pragma once

#include <cuda_runtime_api.h>
#if defined(PDSERVE_HAVE_NCCL)
#include <nccl.h>
#endif

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pdserve::cuda {

inline absl::StatusCode CudaErrorCode(cudaError_t error) {
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::StatusCode::kResourceExhausted;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidConfiguration:
      return absl::StatusCode::kInvalidArgument;
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
    case cudaErrorInsufficientDriver:
      return absl::StatusCode::kFailedPrecondition;
    default:
      return absl::StatusCode::kInternal;
  }
}

inline absl::Status CudaStatus(cudaError_t error, const char* expr,
                               const char* file, int line) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::Status(CudaErrorCode(error),
                      absl::StrCat(file, ":", line, ": ", expr,
                                   " failed: ", cudaGetErrorName(error), " (",
                                   cudaGetErrorString(error), ")"));
}

#if defined(PDSERVE_HAVE_NCCL)
inline absl::StatusCode NcclErrorCode(ncclResult_t result) {
  switch (result) {
    case ncclInvalidArgument:
      return absl::StatusCode::kInvalidArgument;
    case ncclInvalidUsage:
      return absl::StatusCode::kFailedPrecondition;
    case ncclRemoteError:
    case ncclSystemError:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

// ncclInProgress is not a failure: nonblocking communicators return it while
// an operation is still being set up, and callers poll for completion.
inline absl::Status NcclStatus(ncclResult_t result, const char* expr,
                               const char* file, int line) {
  if (result == ncclSuccess || result == ncclInProgress) {
    return absl::OkStatus();
  }
  return absl::Status(NcclErrorCode(result),
                      absl::StrCat(file, ":", line, ": ", expr,
                                   " failed: ", ncclGetErrorString(result)));
}

#endif  // PDSERVE_HAVE_NCCL

}  // namespace pdserve::cuda

#define PDSERVE_CUDA_STATUS(expr) \
  ::pdserve::cuda::CudaStatus((expr), #expr, __FILE__, __LINE__)
#define PDSERVE_CUDA_RETURN_IF_ERROR(expr)                           \
  do {                                                               \
    ::absl::Status pdserve_cuda_status_ = PDSERVE_CUDA_STATUS(expr); \
    if (!pdserve_cuda_status_.ok()) return pdserve_cuda_status_;     \
  } while (0)

#if defined(PDSERVE_HAVE_NCCL)
#define PDSERVE_NCCL_STATUS(expr) \
  ::pdserve::cuda::NcclStatus((expr), #expr, __FILE__, __LINE__)

#define PDSERVE_NCCL_RETURN_IF_ERROR(expr)                           \
  do {                                                               \
    ::absl::Status pdserve_nccl_status_ = PDSERVE_NCCL_STATUS(expr); \
    if (!pdserve_nccl_status_.ok()) return pdserve_nccl_status_;     \
  } while (0)
#endif  // PDSERVE_HAVE_NCCL
