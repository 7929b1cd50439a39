#include "router/prefix_index.h"

#include <algorithm>
#include <bit>
#include <thread>

namespace pdserve::router {
namespace {
// Counts a routing call in `waiters` while it waits for the index lock.
class RoutingWait {
 public:
  explicit RoutingWait(std::atomic<int>* waiters) : waiters_(waiters) {
    waiters_->fetch_add(1, std::memory_order_relaxed);
  }
  void Acquired() {
    if (waiters_ != nullptr) waiters_->fetch_sub(1, std::memory_order_release);
    waiters_ = nullptr;
  }
  ~RoutingWait() { Acquired(); }

 private:
  std::atomic<int>* waiters_;
};
}  // namespace

namespace {
bool KnownTier(engine::KvTierKind t) {
  return static_cast<int>(t) < engine::kNumKvTierKinds;
}
}  // namespace

PrefixIndex::WorkerState* PrefixIndex::State(WorkerIndex worker) {
  if (worker < 0) return nullptr;
  if (static_cast<size_t>(worker) >= workers_.size())
    workers_.resize(static_cast<size_t>(worker) + 1);
  return &workers_[static_cast<size_t>(worker)];
}

bool PrefixIndex::Stale(const Holder& x, const engine::BlockHash& h) const {
  const WorkerState& w = workers_[static_cast<size_t>(x.worker)];
  return w.clearing > 0 && !w.hashes.contains(h);
}

PrefixIndex::Holder* PrefixIndex::FindLive(Holders& holders, WorkerIndex worker,
                                           const engine::BlockHash& h) {
  for (Holder& x : holders) {
    if (x.worker == worker) return Stale(x, h) ? nullptr : &x;
  }
  return nullptr;
}

PrefixIndex::Holder& PrefixIndex::Touch(Entry& entry, WorkerIndex worker,
                                        const engine::BlockHash& h) {
  WorkerState* w = State(worker);
  for (Holder& x : entry.holders) {
    if (x.worker != worker) continue;
    if (Stale(x, h)) {
      x.lower = 0;
      entry.SetExpires(x, absl::InfinitePast());
      w->hashes.insert(h);
    }
    return x;
  }
  w->hashes.insert(h);
  entry.holders.push_back({worker, 0, absl::InfinitePast()});
  return entry.holders.back();
}

void PrefixIndex::Account(WorkerIndex worker, const engine::BlockHash& h,
                          const Holder& before, const Holder& after) {
  WorkerState& w = workers_[static_cast<size_t>(worker)];
  auto flip = [&](engine::KvTierKind tier) {
    WorkerSummary& s = w.summary[static_cast<size_t>(tier)];
    s.digest.hi ^= h.hi;
    s.digest.lo ^= h.lo;
    return &s;
  };
  const bool was = before.expires == absl::InfiniteFuture();
  const bool is = after.expires == absl::InfiniteFuture();
  if (was != is) {
    WorkerSummary* s = flip(engine::KvTierKind::kPool);
    s->blocks = is ? s->blocks + 1 : s->blocks - 1;
  }
  for (int t = 0; t < engine::kNumKvTierKinds; ++t) {
    const auto tier = static_cast<engine::KvTierKind>(t);
    if (tier == engine::KvTierKind::kPool) continue;
    const bool had = (before.lower & TierBit(tier)) != 0;
    const bool has = (after.lower & TierBit(tier)) != 0;
    if (had == has) continue;
    WorkerSummary* s = flip(tier);
    s->blocks = has ? s->blocks + 1 : s->blocks - 1;
  }
  if (after.Empty()) w.hashes.erase(h);
}

void PrefixIndex::StoredLocked(WorkerIndex worker,
                               std::span<const engine::BlockHash> hashes,
                               engine::KvTierKind tier) {
  if (!KnownTier(tier) || worker < 0) return;
  const bool pool = tier == engine::KvTierKind::kPool;
  for (const auto& h : hashes) {
    Entry& entry = index_[h];
    Holder& x = Touch(entry, worker, h);
    const Holder before = x;
    if (pool) {
      entry.SetExpires(x, absl::InfiniteFuture());  // new, or confirmed
    } else {
      x.lower |= TierBit(tier);
    }
    Account(worker, h, before, x);
  }
}

void PrefixIndex::RemovedLocked(WorkerIndex worker,
                                std::span<const engine::BlockHash> hashes,
                                engine::KvTierKind tier) {
  if (!KnownTier(tier) || worker < 0 ||
      static_cast<size_t>(worker) >= workers_.size())
    return;
  const bool pool = tier == engine::KvTierKind::kPool;
  for (const auto& h : hashes) {
    auto it = index_.find(h);
    if (it == index_.end()) continue;
    Entry& entry = it->second;
    Holder* x = FindLive(entry.holders, worker, h);
    if (x == nullptr) continue;
    const Holder before = *x;
    if (pool) {
      entry.SetExpires(*x, absl::InfinitePast());
    } else {
      x->lower &= static_cast<TierMask>(~TierBit(tier));
    }
    Account(worker, h, before, *x);
    if (x->Empty()) entry.Erase(x);
    if (entry.holders.empty()) index_.erase(it);
  }
}

void PrefixIndex::Stored(WorkerIndex worker,
                         std::span<const engine::BlockHash> hashes,
                         engine::KvTierKind tier) {
  absl::MutexLock l(&mu_);
  StoredLocked(worker, hashes, tier);
}

void PrefixIndex::Removed(WorkerIndex worker,
                          std::span<const engine::BlockHash> hashes,
                          engine::KvTierKind tier) {
  absl::MutexLock l(&mu_);
  RemovedLocked(worker, hashes, tier);
}

void PrefixIndex::Moved(WorkerIndex worker,
                        std::span<const engine::BlockHash> hashes,
                        engine::KvTierKind from, engine::KvTierKind to) {
  if (!KnownTier(from) || !KnownTier(to) || from == to) return;
  // Stored first, so that a hash held nowhere else keeps its entry.
  absl::MutexLock l(&mu_);
  StoredLocked(worker, hashes, to);
  RemovedLocked(worker, hashes, from);
}

void PrefixIndex::ClearWorker(WorkerIndex worker) {
  absl::flat_hash_set<engine::BlockHash, engine::BlockHashHasher> old;
  {
    absl::MutexLock l(&mu_);
    if (worker < 0 || static_cast<size_t>(worker) >= workers_.size()) return;
    WorkerState& w = workers_[static_cast<size_t>(worker)];
    // From here on the old holders are stale: queries skip them.
    old.swap(w.hashes);
    w.summary = {};
    ++w.clearing;
    ++clearing_workers_;
  }
  for (auto it = old.begin(); it != old.end();) {
    // Routing first: a waiting routing call takes the lock before the next
    // batch does.
    while (routing_waiters_.load(std::memory_order_acquire) > 0)
      std::this_thread::yield();
    absl::MutexLock l(&mu_);
    const WorkerState& w = workers_[static_cast<size_t>(worker)];
    for (size_t n = 0; n < kClearBatch && it != old.end(); ++n, ++it) {
      if (w.hashes.contains(*it)) continue;  // stored again since: live
      auto e = index_.find(*it);
      if (e == index_.end()) continue;
      Entry& entry = e->second;
      for (Holder& x : entry.holders) {
        if (x.worker == worker) {
          entry.Erase(&x);  // a worker has at most one holder per hash
          break;
        }
      }
      if (entry.holders.empty()) index_.erase(e);
    }
  }
  absl::MutexLock l(&mu_);
  --workers_[static_cast<size_t>(worker)].clearing;
  --clearing_workers_;
}

namespace {
// Min-heap order on expiry for std::push_heap/pop_heap (which keep a max-heap).
template <typename E>
bool LaterExpiry(const E& a, const E& b) {
  return a.expires > b.expires;
}
}  // namespace

void PrefixIndex::PurgeExpired(absl::Time now, size_t budget) {
  while (budget > 0 && !expiries_.empty() && expiries_.front().expires <= now) {
    --budget;
    std::pop_heap(expiries_.begin(), expiries_.end(), LaterExpiry<Expiry>);
    const Expiry e = expiries_.back();
    expiries_.pop_back();
    auto it = index_.find(e.hash);
    if (it == index_.end()) continue;  // removed or cleared meanwhile
    Entry& entry = it->second;
    // Confirmed entries expire at InfiniteFuture, renewed ones later than
    // now: both stay. An expired one leaves the pool's set; it stays for
    // the lower tiers that hold the block. (A stale one is ClearWorker's.)
    Holder* x = FindLive(entry.holders, e.worker, e.hash);
    if (x == nullptr || x->expires > now) continue;
    const Holder before = *x;
    entry.SetExpires(*x, absl::InfinitePast());
    Account(e.worker, e.hash, before, *x);
    if (x->Empty()) entry.Erase(x);
    if (entry.holders.empty()) index_.erase(it);
  }
}

void PrefixIndex::Speculate(WorkerIndex worker,
                            std::span<const engine::BlockHash> hashes,
                            absl::Duration ttl) {
  const absl::Time now = clock_();
  const absl::Time expires = now + ttl;
  absl::MutexLock l(&mu_);
  // More than this call adds, so a backlog of expired entries drains.
  PurgeExpired(now, 2 * hashes.size() + 16);
  if (expires <= now || worker < 0) return;  // nothing to record
  for (const auto& h : hashes) {
    Entry& entry = index_[h];
    Holder& x = Touch(entry, worker, h);
    if (x.expires == absl::InfiniteFuture() || expires <= x.expires)
      continue;                    // confirmed, or already expiring later
    entry.SetExpires(x, expires);  // not confirmed: no summary changes
    expiries_.push_back({expires, h, worker});
    std::push_heap(expiries_.begin(), expiries_.end(), LaterExpiry<Expiry>);
  }
}

std::vector<int32_t> PrefixIndex::LeadingBlocks(
    std::span<const engine::BlockHash> hashes,
    std::span<const WorkerIndex> workers, TierMask tiers) const {
  std::vector<int32_t> result(workers.size(), 0);
  std::vector<bool> alive(workers.size(), true);
  const absl::Time now = clock_();
  RoutingWait wait(&routing_waiters_);
  absl::MutexLock l(&mu_);
  wait.Acquired();
  size_t still = workers.size();
  for (size_t b = 0; b < hashes.size() && still > 0; ++b) {
    auto it = index_.find(hashes[b]);
    for (size_t w = 0; w < workers.size(); ++w) {
      if (!alive[w]) continue;
      bool has = false;
      if (it != index_.end()) {
        for (const Holder& x : it->second.holders) {
          if (x.worker == workers[w] && x.Holds(tiers, now) &&
              !Stale(x, hashes[b])) {
            has = true;
            break;
          }
        }
      }
      if (has) {
        ++result[w];
      } else {
        alive[w] = false;
        --still;
      }
    }
  }
  return result;
}

size_t PrefixIndex::LiveHolders(const engine::BlockHash& h, absl::Time now,
                                TierMask tiers, WorkerList* out) const {
  if (out != nullptr) out->clear();
  auto it = index_.find(h);
  if (it == index_.end()) return 0;
  const Entry& entry = it->second;
  // No holder is stale unless a ClearWorker is running.
  const bool maybe_stale = clearing_workers_ > 0;
  // A count of the pool alone that the entry's counts answer: the holder
  // list, on the heap for a block many workers hold, stays unread.
  if (out == nullptr && tiers == kPoolTier && !maybe_stale) {
    const int64_t n = entry.PoolHolders(absl::ToUnixNanos(now));
    if (n >= 0) return static_cast<size_t>(n);
  }
  size_t n = 0;
  for (const Holder& x : entry.holders) {
    if (!x.Holds(tiers, now) || (maybe_stale && Stale(x, h))) continue;
    ++n;
    if (out != nullptr) out->push_back(x.worker);
  }
  return n;
}

bool PrefixIndex::LivePoolSet(const engine::BlockHash& h, int64_t now_ns,
                              WorkerSet* out) const {
  if (clearing_workers_ > 0) return false;
  auto it = index_.find(h);
  if (it == index_.end()) {
    *out = WorkerSet{};
    return true;
  }
  return it->second.PoolSet(now_ns, out);
}

void PrefixIndex::LeadingBlocksOfPrompt(
    size_t num_blocks, absl::FunctionRef<engine::BlockHash(size_t)> hash_at,
    std::vector<int32_t>* counts, TierMask tiers) const {
  LeadingBlocksWalk(num_blocks, hash_at, /*prefetch=*/false, counts, tiers);
}

void PrefixIndex::LeadingBlocksOfPrompt(
    std::span<const engine::BlockHash> hashes, std::vector<int32_t>* counts,
    TierMask tiers) const {
  LeadingBlocksWalk(
      hashes.size(), [&](size_t i) { return hashes[i]; }, /*prefetch=*/true,
      counts, tiers);
}

void PrefixIndex::LeadingBlocksWalk(
    size_t num_blocks, absl::FunctionRef<engine::BlockHash(size_t)> hash_at,
    bool prefetch, std::vector<int32_t>* counts, TierMask tiers) const {
  if (num_blocks == 0) return;
  // A probe is a block position and how many live holders it has; who holds
  // a block is read only where a count drops between neighbours, from the
  // entries' worker sets or, where those cannot tell, the holder lists.
  struct Probe {
    size_t pos;
    size_t holders;
  };
  // Scratch sized for the usual case, so that a walk does not allocate: a
  // gallop has at most 64 probes, the bisection stack at most two entries
  // per gallop interval and level, and the bitset covers 256 workers inline.
  WorkerList here, next;
  absl::InlinedVector<uint64_t, 4> in_next;  // bit per WorkerIndex
  absl::InlinedVector<Probe, 32> probes;
  absl::InlinedVector<std::pair<Probe, Probe>, 64> work;
  const absl::Time now = clock_();
  RoutingWait wait(&routing_waiters_);
  absl::ReaderMutexLock l(&mu_);
  wait.Acquired();
  // Index memory is far larger than the caches and every probe a miss; the
  // walk's next probes are known ahead (the gallop's positions, the mids of
  // the intervals it will bisect), so their slots are requested early.
  auto fetch = [&](size_t pos) {
    if (prefetch) index_.prefetch(hash_at(pos));
  };
  // Workers holding block `pos` but not block `pos + 1` (or the prompt ends
  // there) hold exactly pos + 1 leading blocks.
  const int64_t now_ns = absl::ToUnixNanos(now);
  auto ends_at = [&](size_t w, size_t pos) {
    if (w >= counts->size()) counts->resize(w + 1, 0);
    (*counts)[w] = static_cast<int32_t>(pos + 1);
  };
  auto credit = [&](size_t pos) {
    // From the entries' worker sets where they tell: both slots were just
    // probed, so this reads no further memory.
    WorkerSet here_set, next_set{};
    if (tiers == kPoolTier && LivePoolSet(hash_at(pos), now_ns, &here_set) &&
        (pos + 1 >= num_blocks ||
         LivePoolSet(hash_at(pos + 1), now_ns, &next_set))) {
      for (size_t word = 0; word < here_set.size(); ++word) {
        for (uint64_t ended = here_set[word] & ~next_set[word]; ended != 0;
             ended &= ended - 1) {
          ends_at(word * 64 + static_cast<size_t>(std::countr_zero(ended)),
                  pos);
        }
      }
      return;
    }
    LiveHolders(hash_at(pos), now, tiers, &here);
    next.clear();
    if (pos + 1 < num_blocks) LiveHolders(hash_at(pos + 1), now, tiers, &next);
    for (WorkerIndex w : next) {
      const size_t word = static_cast<size_t>(w) / 64;
      if (word >= in_next.size()) in_next.resize(word + 1, 0);
      in_next[word] |= uint64_t{1} << (w % 64);
    }
    for (WorkerIndex w : here) {
      const size_t word = static_cast<size_t>(w) / 64;
      if (word < in_next.size() && (in_next[word] >> (w % 64) & 1)) continue;
      ends_at(static_cast<size_t>(w), pos);
    }
    for (WorkerIndex w : next) in_next[static_cast<size_t>(w) / 64] = 0;
  };
  // Gallop: probes at 0, 1, 3, 7, ... until no worker holds the block (or
  // the prompt ends), so hashing stops within twice the longest match.
  if (prefetch) {
    fetch(0);
    for (size_t pos = 0, step = 1; pos + 1 < num_blocks; step *= 2) {
      pos = std::min(num_blocks - 1, pos + step);
      fetch(pos);
    }
  }
  probes.push_back({0, LiveHolders(hash_at(0), now, tiers, nullptr)});
  for (size_t step = 1; probes.back().holders > 0;) {
    const size_t pos = std::min(num_blocks - 1, probes.back().pos + step);
    if (pos == probes.back().pos) {  // the last block is held
      credit(pos);
      break;
    }
    step *= 2;
    probes.push_back({pos, LiveHolders(hash_at(pos), now, tiers, nullptr)});
  }
  // Bisect each gallop interval whose holder count drops. Prefix-closed
  // sets: a later block's holders are a subset of an earlier one's, so equal
  // counts mean nobody's match ends in between.
  auto mid_of = [](const Probe& lo, const Probe& hi) {
    return lo.pos + (hi.pos - lo.pos) / 2;
  };
  // The next probe of interval (lo, hi), if it will be bisected.
  auto fetch_mid = [&](const Probe& lo, const Probe& hi) {
    if (lo.holders != hi.holders && hi.pos > lo.pos + 1) fetch(mid_of(lo, hi));
  };
  for (size_t i = 0; i + 1 < probes.size(); ++i) {
    work.emplace_back(probes[i], probes[i + 1]);
    fetch_mid(probes[i], probes[i + 1]);
  }
  while (!work.empty()) {
    const auto [lo, hi] = work.back();
    work.pop_back();
    if (lo.holders == hi.holders) continue;
    if (hi.pos == lo.pos + 1) {
      credit(lo.pos);
      continue;
    }
    const size_t mid = mid_of(lo, hi);
    const Probe m{mid, LiveHolders(hash_at(mid), now, tiers, nullptr)};
    fetch_mid(lo, m);
    fetch_mid(m, hi);
    work.emplace_back(m, hi);
    work.emplace_back(lo, m);
  }
}

PrefixIndex::MemoryUsage PrefixIndex::Memory() const {
  absl::MutexLock l(&mu_);
  MemoryUsage m;
  m.hashes = index_.size();
  // A flat_hash_map slot holds the key and value inline, plus one control
  // byte; the table keeps `capacity` slots whatever its size.
  m.bytes = index_.capacity() * (sizeof(decltype(index_)::value_type) + 1);
  m.pending_expiries = expiries_.size();
  m.bytes += expiries_.capacity() * sizeof(Expiry);
  for (const auto& [h, entry] : index_) {
    const Holders& holders = entry.holders;
    m.holders += holders.size();
    if (holders.capacity() > kInlineHolders)
      m.bytes += holders.capacity() * sizeof(Holder);
  }
  m.workers = workers_.size();
  m.bytes += workers_.capacity() * sizeof(WorkerState);
  for (const WorkerState& w : workers_) {
    m.reverse_entries += w.hashes.size();
    m.bytes += w.hashes.capacity() * (sizeof(engine::BlockHash) + 1);
  }
  return m;
}

PrefixIndex::WorkerSummary PrefixIndex::Summary(WorkerIndex worker,
                                                engine::KvTierKind tier) const {
  absl::ReaderMutexLock l(&mu_);
  if (!KnownTier(tier) || worker < 0 ||
      static_cast<size_t>(worker) >= workers_.size())
    return WorkerSummary{};
  return workers_[static_cast<size_t>(worker)]
      .summary[static_cast<size_t>(tier)];
}

size_t PrefixIndex::num_hashes() const {
  absl::MutexLock l(&mu_);
  return index_.size();
}

}  // namespace pdserve::router
