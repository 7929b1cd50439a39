// The router's cluster-wide prefix index: which worker holds which KV block
// hashes, fed by the workers' KV event streams, plus short-lived speculative
// entries for requests just routed (so identical prompts arriving back to
// back land together before the worker's `stored` events arrive).
//
// LeadingBlocks costs O(blocks) hash lookups, each touching a small per-hash
// list of workers; LeadingBlocksOfPrompt, the routing path, bisects and costs
// O(distinct match lengths x log blocks), reading per-hash counts and worker
// bit sets kept in the table's slots rather than the lists. Thread-safe:
// queries share a reader lock, event updates take it exclusively.
//
// Tiers: each (hash, worker) entry says which of the worker's
// tiers hold the block, the pool (confirmed or speculative) and the tiers
// below it (host memory, disk), each set fed by its own stored / removed /
// moved events. Queries take a TierMask: pool only (the default) counts
// what the worker can use at once, pool + lower tiers what it can use after
// reading the tier back.
//
// Speculative entries that expire unconfirmed (the request was refused, or
// the worker never stored the blocks) are purged, a bounded number per
// Speculate call, oldest expiry first, so the index stays within the entries
// speculated during one TTL plus what confirmed events hold.
//
// Per worker, a reverse index (the hashes it has entries for) and running
// summaries (block count and XOR digest per tier) are kept with every update,
// so Summary is O(1) and ClearWorker touches only that worker's entries. It
// also never holds the lock for long: it takes the worker's set in O(1), after
// which queries ignore the worker's old entries, and erases them in batches,
// releasing the lock between batches so routing goes on meanwhile.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv_cache/block_manager.h"
#include "router/huge_page_allocator.h"

namespace pdserve::router {

using WorkerIndex = int32_t;  // dense ids assigned by the registry

// A set of tiers: bit (1 << KvTierKind).
using TierMask = uint8_t;
inline constexpr TierMask TierBit(engine::KvTierKind t) {
  return static_cast<TierMask>(1u << static_cast<unsigned>(t));
}
inline constexpr TierMask kPoolTier = TierBit(engine::KvTierKind::kPool);
inline constexpr TierMask kLowerTiers =
    TierBit(engine::KvTierKind::kHostMemory) |
    TierBit(engine::KvTierKind::kDisk);
inline constexpr TierMask kAllTiers = kPoolTier | kLowerTiers;

class PrefixIndex {
 public:
  // The time source for speculative TTLs; tests pass a fake.
  using Clock = std::function<absl::Time()>;
  explicit PrefixIndex(Clock clock = &absl::Now) : clock_(std::move(clock)) {}

  // Applies one worker's events to one tier's set. Unknown hashes in
  // `removed` (and `moved`) are ignored.
  void Stored(WorkerIndex worker, std::span<const engine::BlockHash> hashes,
              engine::KvTierKind tier = engine::KvTierKind::kPool)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Removed(WorkerIndex worker, std::span<const engine::BlockHash> hashes,
               engine::KvTierKind tier = engine::KvTierKind::kPool)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Removed from `from` and stored in `to`, at once. A hash the index does
  // not know for `from` is still stored in `to` (the worker says it is
  // there).
  void Moved(WorkerIndex worker, std::span<const engine::BlockHash> hashes,
             engine::KvTierKind from, engine::KvTierKind to)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets everything about a worker, every tier (cleared, resync, or
  // worker gone). Its entries stop counting at once; erasing them costs
  // O(its entries), in batches of kClearBatch under the lock, and returns
  // when they are all gone. Events for the worker may arrive meanwhile (a
  // resync's snapshot): they count, and the erasing leaves them alone.
  void ClearWorker(WorkerIndex worker) ABSL_LOCKS_EXCLUDED(mu_);
  // Entries ClearWorker erases per lock hold: a few hundred microseconds.
  static constexpr size_t kClearBatch = 1024;
  // Records that `worker` will hold these blocks soon; expires after `ttl`
  // unless Stored confirms it. Also purges up to 2 x hashes.size() + 16
  // expired speculative entries, more than it adds, so refused requests
  // cannot grow the index without bound.
  void Speculate(WorkerIndex worker, std::span<const engine::BlockHash> hashes,
                 absl::Duration ttl) ABSL_LOCKS_EXCLUDED(mu_);
  // For each worker in `workers`, how many leading blocks of `hashes` it
  // holds in any of the tiers of `tiers`.
  std::vector<int32_t> LeadingBlocks(std::span<const engine::BlockHash> hashes,
                                     std::span<const WorkerIndex> workers,
                                     TierMask tiers = kPoolTier) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // LeadingBlocks for every worker at once, by bisection over block
  // positions. It relies on each worker's cached set being prefix-closed
  // (holding block i means holding blocks 0..i-1), which workers maintain:
  // they release a sequence's blocks tail first, so LRU evicts a chain's
  // suffix before its prefix, and speculation covers whole prompts. Then the
  // live holders of block i shrink as i grows, and equal holder counts at two
  // positions mean equal sets: the walk probes O(distinct counts x
  // log(blocks)) blocks instead of every block, which keeps a 5,000-block
  // prompt within microseconds. (Were the set not closed, a worker's count
  // could be overstated; routing would then be less good, never wrong.)
  //
  // `num_blocks` is the prompt's full-block count; `hash_at(i)` returns block
  // i's hash and may compute hashes lazily: positions past the longest match
  // are probed at most up to twice that length. `counts` is indexed by
  // WorkerIndex and grown as needed (a worker past its end holds nothing).
  // A block counts when it is in any tier of `tiers`. Lower tiers drop a
  // chain's tail first (kv_cache/kv_tier.h), so pool + tier sets stay close to
  // prefix-closed too.
  void LeadingBlocksOfPrompt(
      size_t num_blocks, absl::FunctionRef<engine::BlockHash(size_t)> hash_at,
      std::vector<int32_t>* counts, TierMask tiers = kPoolTier) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The same, given the whole chain already hashed (as the router does at
  // intake): then the walk can also prefetch the index slots of the blocks
  // it will probe next, so that its lookups overlap instead of waiting on
  // memory one after the other. Same result as the lazy form.
  void LeadingBlocksOfPrompt(std::span<const engine::BlockHash> hashes,
                             std::vector<int32_t>* counts,
                             TierMask tiers = kPoolTier) const
      ABSL_LOCKS_EXCLUDED(mu_);
  size_t num_hashes() const ABSL_LOCKS_EXCLUDED(mu_);

  // What the index holds for one worker in one tier, to compare with the
  // worker's own cache: confirmed (non-speculative) hashes and the XOR of
  // them. O(1): kept up to date by every update.
  struct WorkerSummary {
    size_t blocks = 0;
    engine::BlockHash digest;
  };
  WorkerSummary Summary(WorkerIndex worker, engine::KvTierKind tier =
                                                engine::KvTierKind::kPool) const
      ABSL_LOCKS_EXCLUDED(mu_);

  struct MemoryUsage {
    size_t hashes = 0;   // distinct block hashes
    size_t holders = 0;  // (hash, worker) entries
    // Worker slots (the highest WorkerIndex seen, plus one) and the entries
    // of their reverse indexes (equal to `holders` once clears finish).
    size_t workers = 0;
    size_t reverse_entries = 0;
    // Speculative entries waiting for their expiry to be checked (some may
    // have been confirmed or renewed since).
    size_t pending_expiries = 0;
    // Table slots and control bytes, holder lists on the heap, the
    // reverse indexes and the expiry queue.
    size_t bytes = 0;
  };
  // O(hashes): for reports, not the routing path.
  MemoryUsage Memory() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Holder;
  static constexpr size_t kInlineHolders = 2;
  // Workers whose pool states each entry also keeps as bits (WorkerSet).
  static constexpr size_t kSetWorkers = 128;
  using WorkerSet = std::array<uint64_t, kSetWorkers / 64>;
  using Holders = absl::InlinedVector<Holder, kInlineHolders>;
  struct Holder {
    WorkerIndex worker;
    TierMask lower = 0;  // the lower tiers (kLowerTiers bits) that hold it
    // In the pool: InfiniteFuture when confirmed, the expiry when
    // speculative, InfinitePast when not in the pool.
    absl::Time expires;
    bool Holds(TierMask tiers, absl::Time now) const {
      return (lower & tiers) != 0 || ((tiers & kPoolTier) && expires > now);
    }
    // Nothing left: neither in the pool (nor expecting it) nor below.
    bool Empty() const { return lower == 0 && expires == absl::InfinitePast(); }
  };
  // One block hash's holders, with counts of their pool states kept by every
  // update (over all holders, stale ones included), so that the routing
  // walk's count-only probes read this slot and not the holder list, which
  // for a prefix every prompt shares has one holder per worker on the heap.
  struct Entry {
    uint32_t confirmed = 0;    // holders confirmed in the pool
    uint32_t speculative = 0;  // speculative pool expiry, passed or not
    // Bounds on the speculative holders' expiries, in Unix nanoseconds
    // (rounded down; 16 bytes where two absl::Time take 32): every one set
    // since `speculative` was last 0 lies within them. All later than now:
    // all live; none later: none live. Either way the list need not be read.
    int64_t speculative_min_ns = std::numeric_limits<int64_t>::max();
    int64_t speculative_max_ns = std::numeric_limits<int64_t>::min();
    // The same pool states as sets of workers, for workers below
    // kSetWorkers (a worker has one holder per hash): the walk reads which
    // workers' matches end at a block from these, not from the lists.
    // A set with fewer members than its count means a holder past the sets:
    // then the lists are read.
    WorkerSet confirmed_set{};
    WorkerSet speculative_set{};
    Holders holders;
    // Adds `d` to the count of `x`'s pool state (none when not in the pool).
    void Count(const Holder& x, int d) {
      if (x.expires == absl::InfiniteFuture()) {
        confirmed += d;
        Mark(confirmed_set, x.worker, d);
      } else if (x.expires != absl::InfinitePast()) {
        speculative += d;
        Mark(speculative_set, x.worker, d);
        if (d > 0) {
          const int64_t ns = absl::ToUnixNanos(x.expires);
          speculative_min_ns = std::min(speculative_min_ns, ns);
          speculative_max_ns = std::max(speculative_max_ns, ns);
        } else if (speculative == 0) {
          speculative_min_ns = std::numeric_limits<int64_t>::max();
          speculative_max_ns = std::numeric_limits<int64_t>::min();
        }
      }
    }
    static uint32_t Members(const WorkerSet& set) {
      uint32_t n = 0;
      for (uint64_t word : set) n += static_cast<uint32_t>(std::popcount(word));
      return n;
    }
    void Mark(WorkerSet& set, WorkerIndex w, int d) {
      if (w < 0 || static_cast<size_t>(w) >= kSetWorkers) return;
      const uint64_t bit = uint64_t{1} << (w % 64);
      if (d > 0) {
        set[static_cast<size_t>(w) / 64] |= bit;
      } else {
        set[static_cast<size_t>(w) / 64] &= ~bit;
      }
    }
    // The live pool holders as a set, when the sets and the expiry bounds
    // tell (no holder stale, none past the sets); else false.
    bool PoolSet(int64_t now_ns, WorkerSet* out) const {
      if (Members(confirmed_set) != confirmed) return false;
      *out = confirmed_set;
      if (speculative == 0 || speculative_max_ns < now_ns) return true;
      if (speculative_min_ns <= now_ns ||
          Members(speculative_set) != speculative)
        return false;
      for (size_t i = 0; i < out->size(); ++i) (*out)[i] |= speculative_set[i];
      return true;
    }
    // Live pool holders if the counts alone tell (no holder stale), else -1.
    // `now_ns` is now in Unix nanoseconds, rounded down: the comparisons are
    // strict so that rounding never counts a holder wrongly (a tie reads the
    // list).
    int64_t PoolHolders(int64_t now_ns) const {
      if (speculative == 0 || speculative_max_ns < now_ns) return confirmed;
      if (speculative_min_ns > now_ns) return int64_t{confirmed} + speculative;
      return -1;
    }
    // Every change of a holder's `expires` goes through here.
    void SetExpires(Holder& x, absl::Time t) {
      Count(x, -1);
      x.expires = t;
      Count(x, 1);
    }
    // Drops holder `x` (one of `holders`).
    void Erase(Holder* x) {
      Count(*x, -1);
      holders.erase(holders.begin() + (x - holders.data()));
    }
  };
  // One worker's reverse index and running summaries.
  struct WorkerState {
    // Hashes this worker has a live holder for.
    absl::flat_hash_set<engine::BlockHash, engine::BlockHashHasher> hashes;
    std::array<WorkerSummary, engine::kNumKvTierKinds> summary{};
    // ClearWorker calls still erasing this worker's old holders: while any
    // runs, a holder whose hash is not in `hashes` is stale and ignored.
    int clearing = 0;
  };
  WorkerState* State(WorkerIndex worker) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A holder left over from before a ClearWorker that is still erasing.
  bool Stale(const Holder& x, const engine::BlockHash& h) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // `worker`'s live holder of `h` in `holders`, or null.
  Holder* FindLive(Holders& holders, WorkerIndex worker,
                   const engine::BlockHash& h)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `worker`'s live holder of `h`, created (holding nothing) if there is
  // none; a stale one is reset and reused.
  Holder& Touch(Entry& entry, WorkerIndex worker, const engine::BlockHash& h)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Updates the worker's summaries for a holder that went from `before` to
  // `after`, and drops it from the reverse index when it holds nothing.
  void Account(WorkerIndex worker, const engine::BlockHash& h,
               const Holder& before, const Holder& after)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // How many live holders `h` has in `tiers`; lists them in `out` unless it
  // is null.
  using WorkerList = absl::InlinedVector<WorkerIndex, 16>;
  size_t LiveHolders(const engine::BlockHash& h, absl::Time now, TierMask tiers,
                     WorkerList* out) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The live pool holders of `h` as a set, when the entry's sets tell
  // (Entry::PoolSet; no ClearWorker running); else false.
  bool LivePoolSet(const engine::BlockHash& h, int64_t now_ns,
                   WorkerSet* out) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Both forms of LeadingBlocksOfPrompt; `prefetch`: hash_at is cheap for
  // any position (the chain is hashed), so upcoming probes may be fetched.
  void LeadingBlocksWalk(size_t num_blocks,
                         absl::FunctionRef<engine::BlockHash(size_t)> hash_at,
                         bool prefetch, std::vector<int32_t>* counts,
                         TierMask tiers) const ABSL_LOCKS_EXCLUDED(mu_);
  void StoredLocked(WorkerIndex worker, std::span<const engine::BlockHash> h,
                    engine::KvTierKind tier) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemovedLocked(WorkerIndex worker, std::span<const engine::BlockHash> h,
                     engine::KvTierKind tier)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One speculative (hash, worker) entry's expiry, in a min-heap on
  // `expires`. Renewal pushes another; a stale one is skipped when popped.
  struct Expiry {
    absl::Time expires;
    engine::BlockHash hash;
    WorkerIndex worker;
  };
  // Pops up to `budget` expiries due by `now` and erases the entries that
  // are still speculative and expired (and hashes left with no holder).
  void PurgeExpired(absl::Time now, size_t budget)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Clock clock_;
  mutable absl::Mutex mu_;
  // Routing calls waiting for mu_. ClearWorker yields between its batches
  // while any wait: absl::Mutex is not fair, and a thread that releases and
  // at once re-takes the lock can otherwise starve routing for the whole
  // clear of a large worker.
  mutable std::atomic<int> routing_waiters_{0};
  absl::flat_hash_map<
      engine::BlockHash, Entry, engine::BlockHashHasher,
      std::equal_to<engine::BlockHash>,
      HugePageAllocator<std::pair<const engine::BlockHash, Entry>>>
      index_ ABSL_GUARDED_BY(mu_);
  // Workers a ClearWorker is erasing (the sum of their `clearing`): while
  // any, holders may be stale and counts cover them, so probes read lists.
  int clearing_workers_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Expiry> expiries_ ABSL_GUARDED_BY(mu_);      // a heap
  std::vector<WorkerState> workers_ ABSL_GUARDED_BY(mu_);  // by WorkerIndex
};

}  // namespace pdserve::router
