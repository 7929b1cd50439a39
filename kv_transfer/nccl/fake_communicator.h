// In-process stand-in for NCCL between two ranks, for CPU tests of the
// `nccl` KV transport's protocol. Staging lives in host memory, with host and
// wire staging kept apart so a missing copy shows up as wrong bytes.
//
// It keeps the NCCL semantics the protocol relies on: each rank's operations
// run in enqueue order on its "stream"; a group's sends and receives are
// posted when the stream reaches the group and complete only when the peer
// posted the matching operation (matched in order per direction; differing
// sizes fail both ranks); a Completion is done once the stream passed it.
// Work advances whenever either rank enqueues or polls.
//
// Tests can pause delivery (a stuck peer or network) and read a log of the
// groups each rank issued. Thread-safe; each Communicator it creates has one
// owner, as the interface requires.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kv_transfer/nccl/communicator.h"

namespace pdserve::kv_transfer::nccl {

class FakeCommunicatorFactory : public CommunicatorFactory {
 public:
  FakeCommunicatorFactory();
  ~FakeCommunicatorFactory() override;

  absl::StatusOr<std::string> NewUniqueId() override;
  absl::StatusOr<std::unique_ptr<Communicator>> Create(
      const std::string& unique_id, int rank, absl::Time deadline,
      absl::Duration op_timeout) override;

  // While paused, no send is matched with its receive, so nothing completes.
  void SetDeliveryPaused(bool paused);
  // One line per group a rank enqueued, in order: "r0 send:4096 send:96".
  std::vector<std::string> group_log() const;
  int communicators_created() const;
  int communicators_alive() const;
  uint64_t bytes_delivered() const;

  struct State;  // shared with the communicators it creates

 private:
  std::shared_ptr<State> state_;
};

}  // namespace pdserve::kv_transfer::nccl
