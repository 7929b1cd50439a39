// The `nccl` KV transport, sending side (prefill worker). One link per
// decode worker, created lazily on the first Open to it: a control channel
// (ControlChannelFactory) over which the ncclUniqueId is handed to the
// receiver, and a two-rank Communicator joined by both ends. Transfers to
// the same decode worker share the link.
//
// A SendLayers call is sent as staged batches of at most max_batch_bytes
// (the smaller of ours and the receiver's): the batch's spans are gathered
// from the pool into host staging, named in a manifest over the control
// channel, and only once the receiver has posted the matching grouped
// receive are they copied to wire staging and sent as one group (data, then
// int8 scales) on the communicator's stream. SendLayers returns once the
// batch is enqueued, so the transfer overlaps later layers' compute; the next
// batch on the link, or Finish, waits for its completion. The pool is read
// only inside SendLayers.
//
// A link whose peer stops answering within `timeout` (control reply or data
// completion) is aborted and forgotten; sessions on it fail, and the next
// Open builds a fresh one. The receiver then ends those transfers as
// aborted, so no reserved blocks are left behind.
//
// NcclKvTransport is thread-safe; its sessions are not (KvSendSession).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv_transfer/nccl/communicator.h"
#include "kv_transfer/nccl/control_channel.h"
#include "kv_transfer/transfer_metrics.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv_transfer::nccl {

struct NcclTransportConfig {
  // Largest batch staged at once (data + scales, bytes); the receiver's limit
  // applies too. One (layer, block) span must fit.
  uint64_t max_batch_bytes = uint64_t{256} << 20;
  // Bound on each wait for the receiver: a control reply, joining the
  // communicator, a batch's completion.
  absl::Duration timeout = absl::Seconds(60);
  // Live links (one NCCL communicator each: tens of MB of NCCL buffers plus
  // 2 x max_batch_bytes of staging) kept at most. Opening a link to a new
  // decode worker beyond the cap first drops the least recently used link
  // that no transfer is using (its communicator is destroyed, its control
  // channel closed; the next transfer to that worker rebuilds it). While every
  // link is busy the cap is exceeded rather than a transfer refused.
  int max_links = 8;

  absl::Status Validate() const;
};

class NcclLink;  // one (this prefill, one decode) pair; nccl_transport.cc

class NcclKvTransport : public KvTransport {
 public:
  // `control` and `comms` must outlive the transport; `metrics` may be null.
  // `config` must be valid.
  NcclKvTransport(ControlChannelFactory* control, CommunicatorFactory* comms,
                  TransferMetrics* metrics, NcclTransportConfig config = {});
  ~NcclKvTransport() override;

  const char* name() const override { return "nccl"; }
  // Connects the link if needed and opens the transfer with the receiver
  // (the handshake): FAILED_PRECONDITION on a layout mismatch, NOT_FOUND for
  // an unknown reservation, both before any KV bytes move.
  absl::StatusOr<std::unique_ptr<KvSendSession>> Open(
      const SendPlan& plan, engine::KvStorage* storage) override;

  // Links that are connected or connecting and not broken.
  int num_links() const;
  // Links dropped by the LRU cap so far.
  int64_t num_evicted_links() const;

 private:
  absl::StatusOr<std::shared_ptr<NcclLink>> LinkTo(
      const std::string& destination, const std::string& sender_id);

  ControlChannelFactory* const control_;
  CommunicatorFactory* const comms_;
  TransferMetrics* const metrics_;
  const NcclTransportConfig config_;
  mutable absl::Mutex mu_;
  struct LinkSlot {
    std::shared_ptr<NcclLink> link;
    uint64_t last_used = 0;  // use_clock_ at the last Open
  };
  // Drops least recently used idle links until fewer than max_links remain
  // (or none is idle), keeping `keep`.
  std::vector<std::shared_ptr<NcclLink>> EvictForNewLink(
      const std::string& keep) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::flat_hash_map<std::string, LinkSlot> links_ ABSL_GUARDED_BY(mu_);
  uint64_t use_clock_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t evicted_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pdserve::kv_transfer::nccl
