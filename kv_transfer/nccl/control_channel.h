// The control plane of the `nccl` KV transport: an ordered, reliable,
// bidirectional message channel between one prefill worker and one decode
// worker (architecture: the ncclUniqueId and every transfer's header,
// manifests and end travel here; KV bytes travel over the Communicator).
// Production rides on the gRPC control plane; tests use an in-process fake
// (fake_control_channel.h). Messages are opaque bytes; their encoding is in
// control_messages.h.
//
// Thread-safe: Send and Receive may be called from different threads, and
// Close from any thread.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace pdserve::kv_transfer::nccl {

class ControlChannel {
 public:
  virtual ~ControlChannel() = default;
  // UNAVAILABLE once either end closed.
  virtual absl::Status Send(std::string message) = 0;
  // The next message in order. DEADLINE_EXCEEDED at `deadline`; UNAVAILABLE
  // once the peer closed and every message it sent was read, or this end was
  // closed.
  virtual absl::StatusOr<std::string> Receive(absl::Time deadline) = 0;
  // Ends the channel for both sides and wakes a blocked Receive. Idempotent.
  virtual void Close() = 0;
};

// Opens channels to decode workers, by the `destination` of a SendPlan.
// Thread-safe.
class ControlChannelFactory {
 public:
  virtual ~ControlChannelFactory() = default;
  virtual absl::StatusOr<std::unique_ptr<ControlChannel>> Connect(
      const std::string& destination) = 0;
};

}  // namespace pdserve::kv_transfer::nccl
