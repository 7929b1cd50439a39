// Opens the real NCCL CommunicatorFactory for a worker's GPU, or says why
// this process cannot run the `nccl` KV transport. Workers call it at
// start-up for --kv-transport nccl, so a missing GPU or a binary built
// without CUDA and NCCL fails there with FAILED_PRECONDITION instead of at
// the first transfer.
//
// Two implementations, chosen by the build: nccl_runtime_cuda.cc (CUDA and
// NCCL found) and nccl_runtime_unavailable.cc (otherwise). Thread-safe.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "kv_transfer/nccl/communicator.h"

namespace pdserve::kv_transfer::nccl {

// FAILED_PRECONDITION when the binary has no CUDA/NCCL, no GPU is visible,
// or `device` is not one of the visible GPUs; the message says which.
absl::StatusOr<std::unique_ptr<CommunicatorFactory>> OpenNcclCommunicators(
    int device);

}  // namespace pdserve::kv_transfer::nccl
