// Applies one worker's KV event stream to the PrefixIndex, enforcing the
// stream's rules: a snapshot replaces everything known about the worker;
// after it, events must arrive with consecutive sequence numbers, and a gap
// means events were lost, so the subscriber must resync from a new snapshot.
// Unknown hashes in `removed` are ignored (PrefixIndex does). Events carry a
// tier (pool, host memory, disk): each tier is its own set in the index, and
// `moved` takes blocks from one set to another. Events of a tier this
// release does not know are skipped (kept in sequence), not a resync. The
// service's subscription loop and the router simulation both go through this
// class. Not thread-safe: one applier per subscription.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "kv_cache/block_manager.h"
#include "pdserve/v1/internal.pb.h"
#include "router/prefix_index.h"

namespace pdserve::router {

// Decodes one wire event; false when it is malformed (a hash or parent that
// is not 16 bytes, an unknown type). A tier number this release does not
// know decodes as kUnknownTier.
bool DecodeKvEvent(const v1::KvEventProto& proto, engine::KvEvent* event);
inline constexpr auto kUnknownTier = static_cast<engine::KvTierKind>(255);

class KvEventApplier {
 public:
  KvEventApplier(PrefixIndex* index, WorkerIndex worker)
      : index_(index), worker_(worker) {}

  // A full snapshot: every hash the worker caches as of sequence `seq`, in
  // its pool only, or in each tier (indexed by KvTierKind).
  void Snapshot(uint64_t seq, const std::vector<engine::BlockHash>& hashes);
  using TierHashes =
      std::array<std::vector<engine::BlockHash>, engine::kNumKvTierKinds>;
  void SnapshotTiers(uint64_t seq, const TierHashes& by_tier);
  // One incremental event. Returns false (and applies nothing) when it is
  // not the next in sequence or no snapshot was read yet: resync needed.
  bool Apply(const engine::KvEvent& event);
  // Decodes and applies one batch of a worker's SubscribeKvEvents stream: a
  // snapshot batch (one STORED event per tier) replaces the worker's entries
  // in every tier (as Snapshot), any other is
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
