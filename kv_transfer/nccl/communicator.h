// The data plane of the `nccl` KV transport, behind an interface so the
// protocol (nccl_transport.h, nccl_receiver.h) is tested on CPU with an
// in-process fake (fake_communicator.h) and runs on GPUs with NCCL
// (nccl_communicator.h).
//
// A Communicator joins exactly two ranks: 0 is the sender (prefill worker),
// 1 the receiver (decode worker). It owns a staging pair: `host staging`,
// which the CPU reads and writes, and `wire staging`, which Send and Recv move
// (device memory for NCCL). Every operation is enqueued, in call order, on
// the communicator's own stream; nothing has happened until a Completion
// recorded after it reports done. Send and Recv are matched in order per
// direction, as NCCL matches point-to-point operations, and a Send does not
// complete until the peer posted the matching Recv.
//
// Not thread-safe: one owner at a time (the transport serialises each link).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace pdserve::kv_transfer::nccl {

// The end of what was enqueued before it was recorded (a CUDA event).
class Completion {
 public:
  virtual ~Completion() = default;
  // True once everything enqueued before the record has finished; an error
  // if the communicator failed (peer gone, aborted, mismatched sizes).
  virtual absl::StatusOr<bool> Poll() = 0;
};

class Communicator {
 public:
  static constexpr int kSenderRank = 0;
  static constexpr int kReceiverRank = 1;

  virtual ~Communicator() = default;
  virtual int rank() const = 0;

  // Grows both staging buffers to at least `bytes` (never shrinks). Only
  // while idle: FAILED_PRECONDITION if an operation may still be in flight,
  // because growing moves the buffers.
  virtual absl::Status ReserveStaging(size_t bytes) = 0;
  // Host staging: at least the reserved bytes, CPU-visible (pinned for NCCL).
  // Valid until the next ReserveStaging.
  virtual uint8_t* host_staging() = 0;

  // Stream operations; [offset, offset + bytes) must lie in the reservation.
  virtual absl::Status CopyHostToWire(size_t offset, size_t bytes) = 0;
  virtual absl::Status CopyWireToHost(size_t offset, size_t bytes) = 0;
  // Copies between wire staging and memory outside it: a KV span of the
  // worker's storage (a device pointer on this communicator's GPU, or host
  // memory). This is how device-resident KV is gathered into and scattered
  // out of wire staging without a trip through the host.
  virtual absl::Status CopyToWire(size_t offset, const void* src,
                                  size_t bytes) = 0;
  virtual absl::Status CopyFromWire(size_t offset, void* dst, size_t bytes) = 0;
  // Sends and receives between GroupStart and GroupEnd are issued together
  // (ncclGroupStart/End), so several buffers travel as one operation.
  virtual absl::Status GroupStart() = 0;
  virtual absl::Status Send(size_t offset,
                            size_t bytes) = 0;  // wire staging to the peer
  virtual absl::Status Recv(
      size_t offset, size_t bytes) = 0;  // from the peer into wire staging
  virtual absl::Status GroupEnd() = 0;
  virtual absl::StatusOr<std::unique_ptr<Completion>> Record() = 0;

  // Tears the communicator down without waiting for the peer (ncclCommAbort):
  // in-flight operations are abandoned and every later call fails. Used when
  // the peer stopped answering; the link is then rebuilt from scratch.
  virtual void Abort() = 0;
};

// Creates the Communicator of one (prefill, decode) pair. Thread-safe.
class CommunicatorFactory {
 public:
  virtual ~CommunicatorFactory() = default;
  // A fresh rendezvous id (ncclGetUniqueId), created by the sender and passed
  // to the receiver over the control channel. Opaque bytes.
  virtual absl::StatusOr<std::string> NewUniqueId() = 0;
  // Joins the two-rank communicator named by `unique_id` as `rank`. Returns
  // once both ranks joined; DEADLINE_EXCEEDED if the peer did not join by
  // `deadline`. `op_timeout` bounds every later wait inside the communicator.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Create(
      const std::string& unique_id, int rank, absl::Time deadline,
      absl::Duration op_timeout) = 0;
};

// Polls `completion` until it is done, it fails, or `deadline` passes
// (DEADLINE_EXCEEDED naming `what`). Backs off from microseconds to 1 ms.
absl::Status AwaitCompletion(Completion& completion, absl::Time deadline,
                             const char* what);

}  // namespace pdserve::kv_transfer::nccl
