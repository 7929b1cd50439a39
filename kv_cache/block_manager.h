// Block allocation, reference counting and the prefix cache of one KV pool.
//
// Prefix cache (ARCHITECTURE.md, contract):
//  - only full blocks are cached, identified by a chained XXH3-128 hash
//    h_i = XXH3_128(h_{i-1} || model_fingerprint || cache_salt || tokens_i),
//    h_{-1} = 0 (never a per-process randomised hash);
//  - blocks are ref-counted; at zero a cached block stays, evictable in LRU
//    order; uncached free blocks are handed out before any cached one;
//  - a block in transfer is pinned simply by holding a reference.
// Every change to the set of cached hashes is published as a sequence-
// numbered KvEvent (stored / removed / cleared) for the router's index.
//
// Owned by the worker's engine thread; not thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <list>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"

namespace pdserve::engine {

struct BlockHash {
  uint64_t hi = 0;
  uint64_t lo = 0;
  bool operator==(const BlockHash&) const = default;
  std::string Hex() const;
};

// The block hash's low 64 bits are already uniformly distributed.
struct BlockHashHasher {
  size_t operator()(const BlockHash& h) const { return h.lo; }
};

using ModelFingerprint = std::array<uint64_t, 2>;

// Hash of one full block given its parent's hash.
BlockHash HashBlock(const BlockHash& parent,
                    const ModelFingerprint& fingerprint,
                    absl::string_view cache_salt, const int32_t* tokens,
                    int block_size);

// Appends the hashes of full blocks of `tokens` not yet in `hashes`.
void ExtendBlockHashes(const ModelFingerprint& fingerprint,
                       absl::string_view cache_salt,
                       std::span<const int32_t> tokens, int block_size,
                       std::vector<BlockHash>* hashes);

// Where a worker holds a block: its pool, or the tier below the pool
// (kv_cache/kv_tier.h). Values match v1::KvTier on the wire.
enum class KvTierKind : uint8_t { kPool = 0, kHostMemory = 1, kDisk = 2 };
inline constexpr int kNumKvTierKinds = 3;
const char* KvTierKindName(KvTierKind t);  // "pool", "host_memory", "disk"

struct KvEvent {
  // cleared: every tier. moved: the blocks left `from_tier` and are now in
  // `tier` (a pool block evicted that the tier below already holds).
  enum class Type { kStored, kRemoved, kCleared, kMoved };
  uint64_t seq = 0;  // 1, 2, 3, ... per worker; a gap means a lost event
  Type type = Type::kStored;
  BlockHash
      parent;  // stored: hash of the block before the first one, 0 if none
  std::vector<BlockHash> hashes;
  // Each tier is its own set of hashes; a block may be in several.
  KvTierKind tier = KvTierKind::kPool;       // stored/removed; moved: to
  KvTierKind from_tier = KvTierKind::kPool;  // moved only
};
using KvEventSink = std::function<void(const KvEvent&)>;

class BlockManager {
 public:
  BlockManager(int64_t num_blocks, KvEventSink sink = nullptr);

  int64_t num_blocks() const { return static_cast<int64_t>(ref_.size()); }
  // Blocks an allocation can take now: never-used/uncached free plus evictable
  // cached.
  int64_t num_free() const {
    return static_cast<int64_t>(free_.size() + lru_.size());
  }
  int64_t num_active() const { return num_blocks() - num_free(); }
  // Unreferenced blocks that still hold a cached prefix.
  int64_t num_cached() const { return static_cast<int64_t>(lru_.size()); }

  // Block ids holding the longest cached prefix of `hashes` (no refs taken).
  std::vector<int32_t> Lookup(std::span<const BlockHash> hashes) const;
  // Takes one reference on each block (e.g. the result of Lookup).
  void Acquire(std::span<const int32_t> blocks);
  // Appends `n` fresh blocks with one reference each, evicting cached blocks
  // in LRU order if needed. Returns false, changing nothing, if fewer than n
  // blocks are free.
  bool Allocate(int64_t n, std::vector<int32_t>* out);
  // Drops one reference from each block. Blocks reaching zero stay cached (if
  // committed) and are appended to the LRU in the given order, so pass a
  // sequence's blocks tail first to make its prefix the last to go.
  void Release(std::span<const int32_t> blocks);
  // Records that `blocks[i]` now holds the full block with hash `hashes[i]`,
  // a chain continuing `parent`. A hash already cached elsewhere keeps its
  // block; the duplicate stays uncached.
  void Commit(const BlockHash& parent, std::span<const int32_t> blocks,
              std::span<const BlockHash> hashes);
  // Forgets every cached hash (publishes `cleared`); unreferenced cached
  // blocks become plain free blocks.
  void ClearCache();

  int32_t RefCount(int32_t block) const { return ref_[block]; }
  bool IsCached(int32_t block) const { return hash_of_[block].has_value(); }
  uint64_t last_event_seq() const { return event_seq_; }
  // Hashes of every cached block (for a subscriber's resync snapshot).
  std::vector<BlockHash> CachedHashes() const;

  // A lower tier below the pool (kv_cache/kv_tier.h). on_evict runs for each
  // cached block the LRU evicts for reuse, before Allocate hands it out (its
  // data still intact), publishes the tier's queued events, and returns
  // whether the tier now holds the block loadable: the eviction is then
  // published as moved(pool -> kind) instead of removed. on_clear runs on
  // ClearCache, whose `cleared` covers the tier.
  struct TierHooks {
    using OnEvict = std::function<bool(int32_t block, const BlockHash& hash)>;
    TierHooks() = default;
    TierHooks(KvTierKind kind, OnEvict on_evict, std::function<void()> on_clear)
        : kind(kind),
          on_evict(std::move(on_evict)),
          on_clear(std::move(on_clear)) {}
    // A tier that does not say what it holds (a model, e.g. in `sim
    // route`): every eviction is published as removed from the pool.
    TierHooks(std::function<void(int32_t block, const BlockHash& hash)> offer,
              std::function<void()> on_clear)
        : on_evict([offer = std::move(offer)](int32_t b, const BlockHash& h) {
            if (offer) offer(b, h);
            return false;
          }),
          on_clear(std::move(on_clear)) {}
    KvTierKind kind = KvTierKind::kDisk;
    OnEvict on_evict;
    std::function<void()> on_clear;
  };
  void set_tier_hooks(TierHooks hooks) { tier_hooks_ = std::move(hooks); }
  // Publishes a change of the tier's own set (stored / removed there) in
  // this pool's sequence: one event stream per worker. Sets `e.seq`.
  void PublishTierEvent(KvEvent e);

 private:
  void Publish(KvEvent::Type type, const BlockHash& parent,
               std::vector<BlockHash> hashes);
  // Without a tier, appends the block's hash to `removed` (one event per
  // Allocate); with one, queues its removed or moved event in evictions_.
  void Evict(int32_t block, std::vector<BlockHash>* removed);
  // Publishes the queued evictions (a tier's run of one type).
  void FlushEvictions();

  std::vector<int32_t> ref_;
  std::vector<std::optional<BlockHash>> hash_of_;
  std::vector<int32_t> free_;  // unreferenced and uncached (stack)
  std::list<int32_t> lru_;     // unreferenced and cached, least recent first
  std::vector<std::list<int32_t>::iterator> lru_pos_;
  absl::flat_hash_map<BlockHash, int32_t, BlockHashHasher> cached_;
  KvEventSink sink_;
  TierHooks tier_hooks_;
  KvEvent evictions_;  // with a tier: evictions not yet published
  uint64_t event_seq_ = 0;
};

}  // namespace pdserve::engine
