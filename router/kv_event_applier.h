// Applies one worker's KV event stream to the PrefixIndex, enforcing the
// stream's rules: a snapshot replaces everything known about the worker;
// after it, events must arrive with consecutive sequence numbers, and a gap
// means events were lost, so the subscriber must resync from a new snapshot.
// Unknown hashes in `removed` are ignored (PrefixIndex does). The service's
// subscription loop and the router simulation both go through this class.
// Not thread-safe: one applier per subscription.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/block_manager.h"
#include "pdserve/v1/internal.pb.h"
#include "router/prefix_index.h"

namespace pdserve::router {

// Decodes one wire event; false when it is malformed (a hash or parent that
// is not 16 bytes, an unknown type).
bool DecodeKvEvent(const v1::KvEventProto& proto, engine::KvEvent* event);

class KvEventApplier {
 public:
  KvEventApplier(PrefixIndex* index, WorkerIndex worker)
      : index_(index), worker_(worker) {}

  // A full snapshot: every hash the worker caches as of sequence `seq`.
  void Snapshot(uint64_t seq, const std::vector<engine::BlockHash>& hashes);
  // One incremental event. Returns false (and applies nothing) when it is
  // not the next in sequence or no snapshot was read yet: resync needed.
  bool Apply(const engine::KvEvent& event);
  // Decodes and applies one batch of a worker's SubscribeKvEvents stream: a
  // snapshot batch replaces the worker's entries (as Snapshot), any other is
  // incremental events (as Apply). Returns false when the subscriber must
  // resync: a gap, or an event that does not decode (a hash that is not 16
  // bytes, an unknown type). A rejected event and those after it are not
  // applied.
  bool ApplyBatch(const v1::KvEventBatch& batch);
  bool synced() const { return synced_; }
  uint64_t last_seq() const { return last_seq_; }

 private:
  PrefixIndex* index_;
  WorkerIndex worker_;
  bool synced_ = false;
  uint64_t last_seq_ = 0;
};

}  // namespace pdserve::router
