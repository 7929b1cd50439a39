// The NCCL Communicator (communicator.h) of one (prefill, decode) pair: a
// two-rank ncclComm_t created nonblocking (so joining and every wait are
// bounded by a deadline and a stuck peer can be aborted), a dedicated
// non-blocking CUDA stream, pinned host staging and device wire staging,
// and completions as CUDA events.
//
// Only built with CUDA (PDSERVE_HAVE_CUDA). Not run in this repository's CI:
// it needs two GPUs (see README.md).
//
// Thread-safety: as Communicator (one owner at a time); the factory is
// thread-safe.
#pragma once

#include <memory>
#include <string>

#include "kv_transfer/nccl/communicator.h"

namespace pdserve::kv_transfer::nccl {

class NcclCommunicatorFactory : public CommunicatorFactory {
 public:
  // Communicators live on CUDA device `device` (the worker's GPU).
  explicit NcclCommunicatorFactory(int device) : device_(device) {}

  absl::StatusOr<std::string> NewUniqueId() override;
  // INVALID_ARGUMENT if `unique_id` is not an ncclUniqueId, before any CUDA
  // call.
  absl::StatusOr<std::unique_ptr<Communicator>> Create(
      const std::string& unique_id, int rank, absl::Time deadline,
      absl::Duration op_timeout) override;

 private:
  const int device_;
};

}  // namespace pdserve::kv_transfer::nccl
