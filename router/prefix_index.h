// The router's cluster-wide prefix index: which worker holds which KV block
// hashes, fed by the workers' KV event streams, plus short-lived speculative
// entries for requests just routed (so identical prompts arriving back to
// back land together before the worker's `stored` events arrive).
//
// Query cost is O(blocks) hash lookups, each touching a small per-hash list of
// workers, so thousands of blocks take microseconds. Thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/block_manager.h"

namespace pdserve::router {

using WorkerIndex = int32_t;  // dense ids assigned by the registry

class PrefixIndex {
 public:
  // Applies one worker's events. Unknown hashes in `removed` are ignored.
  void Stored(WorkerIndex worker, std::span<const engine::BlockHash> hashes)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Removed(WorkerIndex worker, std::span<const engine::BlockHash> hashes)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets everything about a worker (cleared, resync, or worker gone).
  void ClearWorker(WorkerIndex worker) ABSL_LOCKS_EXCLUDED(mu_);
  // Records that `worker` will hold these blocks soon; expires after `ttl`.
  void Speculate(WorkerIndex worker, std::span<const engine::BlockHash> hashes,
                 absl::Duration ttl) ABSL_LOCKS_EXCLUDED(mu_);
  // For each worker in `workers`, how many leading blocks of `hashes` it holds.
  std::vector<int32_t> LeadingBlocks(std::span<const engine::BlockHash> hashes,
                                     std::span<const WorkerIndex> workers) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Batched LeadingBlocks for every worker at once, for callers that hash a
  // prompt lazily. `counts` is indexed by WorkerIndex and grown as needed (a
  // worker past its end holds nothing). Walks hashes[first..]: a worker whose
  // count is b and that holds hashes[b] moves to b + 1. Start with first = 0
  // and empty counts; while it returns true (some worker holds every hash so
  // far), append more hashes and call again with first = the previous size.
  // Cost is the number of holders of each block visited, not blocks x workers.
  bool ExtendLeadingBlocks(std::span<const engine::BlockHash> hashes,
                           size_t first, std::vector<int32_t>* counts) const
      ABSL_LOCKS_EXCLUDED(mu_);
  size_t num_hashes() const ABSL_LOCKS_EXCLUDED(mu_);

  // What the index holds for one worker, to compare with the worker's own
  // cache: confirmed (non-speculative) hashes and the XOR of them. O(hashes).
  struct WorkerSummary {
    size_t blocks = 0;
    engine::BlockHash digest;
  };
  WorkerSummary Summary(WorkerIndex worker) const ABSL_LOCKS_EXCLUDED(mu_);

  struct MemoryUsage {
    size_t hashes = 0;   // distinct block hashes
    size_t holders = 0;  // (hash, worker) entries
    // Table slots and control bytes, plus holder lists on the heap.
    size_t bytes = 0;
  };
  // O(hashes): for reports, not the routing path.
  MemoryUsage Memory() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Holder {
    WorkerIndex worker;
    absl::Time expires;  // InfiniteFuture for confirmed entries
  };
  static constexpr size_t kInlineHolders = 2;
  using Holders = absl::InlinedVector<Holder, kInlineHolders>;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<engine::BlockHash, Holders, engine::BlockHashHasher>
      index_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::router
