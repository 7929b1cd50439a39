#include "kv_cache/block_manager.h"

// The header's inline build of XXH3: for the 96-128 byte inputs of a block
// it runs about 2x faster than the shared library's exported function (no
// call, no generic dispatch), and computes the same function.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_format.h"

namespace pdserve::engine {

std::string BlockHash::Hex() const {
  return absl::StrFormat("%016x%016x", hi, lo);
}

namespace {
// Byte layout of a block's hash input (little-endian): parent.hi, parent.lo,
// fingerprint[0], fingerprint[1], salt bytes, then block_size uint32 token
// ids. The salt's length is implied, since the token part has a fixed size.
constexpr size_t kHeadBytes = 4 * sizeof(uint64_t);
// Inputs up to this size are hashed one-shot from a contiguous copy on the
// stack: 2-3x faster than the streaming API for the usual 96-1056 bytes, and
// the same hash (XXH3's result depends only on the bytes).
constexpr size_t kStackBytes = 512;

BlockHash Digest(XXH128_hash_t h) { return {h.high64, h.low64}; }

// ExtendBlockHashes's one-shot loop (total input up to kStackBytes). The
// fingerprint and the salt are the same for every block of the chain:
// written once, then each block rewrites only its parent and its tokens.
// kBlockSize > 0 (unsalted chains only) fixes every length at compile time,
// so the copies are plain moves and XXH3 is specialised for its one input
// length: about 3x faster a block at 16 tokens than with run-time lengths,
// and the same bytes, so the same hashes. kBlockSize = 0 takes block_size
// and the salt as given.
template <int kBlockSize>
void ExtendOneShot(const ModelFingerprint& fingerprint,
                   absl::string_view cache_salt,
                   std::span<const int32_t> tokens, int block_size, size_t full,
                   std::vector<BlockHash>* hashes) {
  const size_t bs = kBlockSize > 0 ? kBlockSize : block_size;
  const size_t salt_bytes = kBlockSize > 0 ? 0 : cache_salt.size();
  const size_t token_bytes = sizeof(int32_t) * bs;
  const size_t total = kHeadBytes + salt_bytes + token_bytes;
  alignas(8) unsigned char buf[kStackBytes];
  std::memcpy(buf + 2 * sizeof(uint64_t), fingerprint.data(),
              2 * sizeof(uint64_t));
  std::memcpy(buf + kHeadBytes, cache_salt.data(), salt_bytes);
  unsigned char* const token_part = buf + kHeadBytes + salt_bytes;
  BlockHash parent = hashes->empty() ? BlockHash{} : hashes->back();
  for (size_t b = hashes->size(); b < full; ++b) {
    std::memcpy(buf, &parent.hi, sizeof(uint64_t));
    std::memcpy(buf + sizeof(uint64_t), &parent.lo, sizeof(uint64_t));
    std::memcpy(token_part, tokens.data() + b * bs, token_bytes);
    parent = Digest(XXH3_128bits(buf, total));
    hashes->push_back(parent);
  }
}

BlockHash HashStreaming(const BlockHash& parent,
                        const ModelFingerprint& fingerprint,
                        absl::string_view cache_salt, const int32_t* tokens,
                        size_t token_bytes) {
  const uint64_t head[4] = {parent.hi, parent.lo, fingerprint[0],
                            fingerprint[1]};
  XXH3_state_t state;
  XXH3_128bits_reset(&state);
  XXH3_128bits_update(&state, head, sizeof(head));
  XXH3_128bits_update(&state, cache_salt.data(), cache_salt.size());
  XXH3_128bits_update(&state, tokens, token_bytes);
  return Digest(XXH3_128bits_digest(&state));
}
}  // namespace

BlockHash HashBlock(const BlockHash& parent,
                    const ModelFingerprint& fingerprint,
                    absl::string_view cache_salt, const int32_t* tokens,
                    int block_size) {
  const uint64_t head[4] = {parent.hi, parent.lo, fingerprint[0],
                            fingerprint[1]};
  const size_t token_bytes = sizeof(int32_t) * block_size;
  const size_t total = sizeof(head) + cache_salt.size() + token_bytes;
  if (total > kStackBytes) {
    return HashStreaming(parent, fingerprint, cache_salt, tokens, token_bytes);
  }
  alignas(8) unsigned char buf[kStackBytes];
  std::memcpy(buf, head, sizeof(head));
  std::memcpy(buf + sizeof(head), cache_salt.data(), cache_salt.size());
  std::memcpy(buf + sizeof(head) + cache_salt.size(), tokens, token_bytes);
  return Digest(XXH3_128bits(buf, total));
}

void ExtendBlockHashes(const ModelFingerprint& fingerprint,
                       absl::string_view cache_salt,
                       std::span<const int32_t> tokens, int block_size,
                       std::vector<BlockHash>* hashes) {
  if (block_size <= 0) return;
  const size_t full = tokens.size() / block_size;
  if (hashes->size() >= full) return;
  // Callers extend a chain a little at a time (lazy hashing, decode): grow
  // geometrically, so that extending by one block stays amortised O(1).
  if (hashes->capacity() < full)
    hashes->reserve(std::max(full, 2 * hashes->capacity()));
  const size_t token_bytes = sizeof(int32_t) * block_size;
  if (kHeadBytes + cache_salt.size() + token_bytes > kStackBytes) {
    BlockHash parent = hashes->empty() ? BlockHash{} : hashes->back();
    for (size_t b = hashes->size(); b < full; ++b) {
      parent = HashStreaming(parent, fingerprint, cache_salt,
                             tokens.data() + b * block_size, token_bytes);
      hashes->push_back(parent);
    }
    return;
  }
  if (cache_salt.empty() && block_size == 16)
    return ExtendOneShot<16>(fingerprint, cache_salt, tokens, block_size, full,
                             hashes);
  if (cache_salt.empty() && block_size == 32)
    return ExtendOneShot<32>(fingerprint, cache_salt, tokens, block_size, full,
                             hashes);
  ExtendOneShot<0>(fingerprint, cache_salt, tokens, block_size, full, hashes);
}

BlockManager::BlockManager(int64_t num_blocks, KvEventSink sink)
    : ref_(num_blocks, 0),
      hash_of_(num_blocks),
      lru_pos_(num_blocks),
      sink_(std::move(sink)) {
  free_.reserve(num_blocks);
  // Stack order: block 0 is handed out first.
  for (int64_t b = num_blocks - 1; b >= 0; --b)
    free_.push_back(static_cast<int32_t>(b));
}

std::vector<int32_t> BlockManager::Lookup(
    std::span<const BlockHash> hashes) const {
  std::vector<int32_t> blocks;
  for (const BlockHash& h : hashes) {
    auto it = cached_.find(h);
    if (it == cached_.end()) break;
    blocks.push_back(it->second);
  }
  return blocks;
}

void BlockManager::Acquire(std::span<const int32_t> blocks) {
  for (int32_t b : blocks) {
    if (ref_[b]++ == 0)
      lru_.erase(lru_pos_[b]);  // only cached blocks can be looked up
  }
}

bool BlockManager::Allocate(int64_t n, std::vector<int32_t>* out) {
  if (n > num_free()) return false;
  std::vector<BlockHash> removed;
  for (int64_t i = 0; i < n; ++i) {
    int32_t b;
    if (!free_.empty()) {
      b = free_.back();
      free_.pop_back();
    } else {
      b = lru_.front();
      lru_.pop_front();
      Evict(b, &removed);
    }
    ref_[b] = 1;
    out->push_back(b);
  }
  if (!removed.empty())
    Publish(KvEvent::Type::kRemoved, {}, std::move(removed));
  FlushEvictions();
  return true;
}

void BlockManager::Evict(int32_t block, std::vector<BlockHash>* removed) {
  const BlockHash hash = *hash_of_[block];
  cached_.erase(hash);
  hash_of_[block].reset();
  if (!tier_hooks_.on_evict) {
    removed->push_back(hash);
    return;
  }
  // With a tier, the evictions are published in order with the events the
  // offers caused (the hook publishes those: blocks the tier dropped to make
  // room; PublishTierEvent flushes the evictions queued before them), so
  // that one stream orders the pool's and the tier's changes. A run of
  // evictions of one kind is one event.
  const bool kept = tier_hooks_.on_evict(block, hash);
  const KvEvent::Type type =
      kept ? KvEvent::Type::kMoved : KvEvent::Type::kRemoved;
  if (!evictions_.hashes.empty() && evictions_.type != type) FlushEvictions();
  evictions_.type = type;
  evictions_.tier = kept ? tier_hooks_.kind : KvTierKind::kPool;
  evictions_.from_tier = KvTierKind::kPool;
  evictions_.hashes.push_back(hash);
}

void BlockManager::FlushEvictions() {
  if (evictions_.hashes.empty()) return;
  KvEvent e = std::move(evictions_);
  evictions_ = KvEvent();
  e.seq = ++event_seq_;
  if (sink_) sink_(e);
}

void BlockManager::Release(std::span<const int32_t> blocks) {
  for (int32_t b : blocks) {
    if (--ref_[b] > 0) continue;
    if (hash_of_[b]) {
      lru_pos_[b] = lru_.insert(lru_.end(), b);
    } else {
      free_.push_back(b);
    }
  }
}

void BlockManager::Commit(const BlockHash& parent,
                          std::span<const int32_t> blocks,
                          std::span<const BlockHash> hashes) {
  std::vector<BlockHash> stored;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (hash_of_[blocks[i]] || cached_.count(hashes[i])) continue;
    hash_of_[blocks[i]] = hashes[i];
    cached_[hashes[i]] = blocks[i];
    stored.push_back(hashes[i]);
  }
  if (!stored.empty())
    Publish(KvEvent::Type::kStored, parent, std::move(stored));
}

void BlockManager::ClearCache() {
  // Referenced blocks keep their data but leave the cache too, so that after
  // `cleared` no hash is advertised.
  for (const auto& [h, b] : cached_) {
    hash_of_[b].reset();
    if (ref_[b] == 0) free_.push_back(b);
  }
  cached_.clear();
  lru_.clear();
  if (tier_hooks_.on_clear) tier_hooks_.on_clear();
  Publish(KvEvent::Type::kCleared, {}, {});
}

std::vector<BlockHash> BlockManager::CachedHashes() const {
  std::vector<BlockHash> out;
  out.reserve(cached_.size());
  for (const auto& [h, b] : cached_) out.push_back(h);
  return out;
}

void BlockManager::Publish(KvEvent::Type type, const BlockHash& parent,
                           std::vector<BlockHash> hashes) {
  KvEvent e{++event_seq_, type, parent, std::move(hashes)};
  if (sink_) sink_(e);
}

void BlockManager::PublishTierEvent(KvEvent e) {
  FlushEvictions();
  e.seq = ++event_seq_;
  if (sink_) sink_(e);
}

const char* KvTierKindName(KvTierKind t) {
  switch (t) {
    case KvTierKind::kPool:
      return "pool";
    case KvTierKind::kHostMemory:
      return "host_memory";
    case KvTierKind::kDisk:
      return "disk";
  }
  return "unknown";
}

}  // namespace pdserve::engine
