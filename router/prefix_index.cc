#include "router/prefix_index.h"

#include <algorithm>

namespace pdserve::router {

void PrefixIndex::Stored(WorkerIndex worker,
                         std::span<const engine::BlockHash> hashes) {
  absl::MutexLock l(&mu_);
  for (const auto& h : hashes) {
    Holders& holders = index_[h];
    auto it = std::find_if(holders.begin(), holders.end(),
                           [&](const Holder& x) { return x.worker == worker; });
    if (it == holders.end()) {
      holders.push_back({worker, absl::InfiniteFuture()});
    } else {
      it->expires = absl::InfiniteFuture();  // speculation confirmed
    }
  }
}

void PrefixIndex::Removed(WorkerIndex worker,
                          std::span<const engine::BlockHash> hashes) {
  absl::MutexLock l(&mu_);
  for (const auto& h : hashes) {
    auto it = index_.find(h);
    if (it == index_.end()) continue;
    Holders& holders = it->second;
    holders.erase(
        std::remove_if(holders.begin(), holders.end(),
                       [&](const Holder& x) { return x.worker == worker; }),
        holders.end());
    if (holders.empty()) index_.erase(it);
  }
}

void PrefixIndex::ClearWorker(WorkerIndex worker) {
  absl::MutexLock l(&mu_);
  for (auto it = index_.begin(); it != index_.end();) {
    Holders& holders = it->second;
    holders.erase(
        std::remove_if(holders.begin(), holders.end(),
                       [&](const Holder& x) { return x.worker == worker; }),
        holders.end());
    if (holders.empty()) {
      index_.erase(it++);
    } else {
      ++it;
    }
  }
}

void PrefixIndex::Speculate(WorkerIndex worker,
                            std::span<const engine::BlockHash> hashes,
                            absl::Duration ttl) {
  const absl::Time expires = absl::Now() + ttl;
  absl::MutexLock l(&mu_);
  for (const auto& h : hashes) {
    Holders& holders = index_[h];
    auto it = std::find_if(holders.begin(), holders.end(),
                           [&](const Holder& x) { return x.worker == worker; });
    if (it == holders.end()) {
      holders.push_back({worker, expires});
    } else if (it->expires != absl::InfiniteFuture()) {
      it->expires = std::max(it->expires, expires);
    }
  }
}

std::vector<int32_t> PrefixIndex::LeadingBlocks(
    std::span<const engine::BlockHash> hashes,
    std::span<const WorkerIndex> workers) const {
  std::vector<int32_t> result(workers.size(), 0);
  std::vector<bool> alive(workers.size(), true);
  const absl::Time now = absl::Now();
  absl::MutexLock l(&mu_);
  size_t still = workers.size();
  for (size_t b = 0; b < hashes.size() && still > 0; ++b) {
    auto it = index_.find(hashes[b]);
    for (size_t w = 0; w < workers.size(); ++w) {
      if (!alive[w]) continue;
      bool has = false;
      if (it != index_.end()) {
        for (const Holder& x : it->second) {
          if (x.worker == workers[w] && x.expires > now) {
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

bool PrefixIndex::ExtendLeadingBlocks(std::span<const engine::BlockHash> hashes,
                                      size_t first,
                                      std::vector<int32_t>* counts) const {
  // Consecutive blocks' slots are scattered over a large table: prefetching
  // a few blocks ahead overlaps their cache misses.
  constexpr size_t kPrefetchAhead = 8;
  const absl::Time now = absl::Now();
  absl::MutexLock l(&mu_);
  for (size_t b = first; b < std::min(hashes.size(), first + kPrefetchAhead);
       ++b) {
    index_.prefetch(hashes[b]);
  }
  for (size_t b = first; b < hashes.size(); ++b) {
    if (b + kPrefetchAhead < hashes.size())
      index_.prefetch(hashes[b + kPrefetchAhead]);
    auto it = index_.find(hashes[b]);
    if (it == index_.end()) return false;
    bool any = false;
    for (const Holder& x : it->second) {
      if (x.expires <= now) continue;
      if (static_cast<size_t>(x.worker) >= counts->size())
        counts->resize(x.worker + 1, 0);
      int32_t& c = (*counts)[x.worker];
      if (c == static_cast<int32_t>(b)) {
        c = static_cast<int32_t>(b + 1);
        any = true;
      }
    }
    if (!any) return false;
  }
  return true;
}

PrefixIndex::MemoryUsage PrefixIndex::Memory() const {
  absl::MutexLock l(&mu_);
  MemoryUsage m;
  m.hashes = index_.size();
  // A flat_hash_map slot holds the key and value inline, plus one control
  // byte; the table keeps `capacity` slots whatever its size.
  m.bytes = index_.capacity() * (sizeof(decltype(index_)::value_type) + 1);
  for (const auto& [h, holders] : index_) {
    m.holders += holders.size();
    if (holders.capacity() > kInlineHolders)
      m.bytes += holders.capacity() * sizeof(Holder);
  }
  return m;
}

PrefixIndex::WorkerSummary PrefixIndex::Summary(WorkerIndex worker) const {
  absl::ReaderMutexLock l(&mu_);
  WorkerSummary s;
  for (const auto& [hash, holders] : index_) {
    for (const Holder& h : holders) {
      if (h.worker != worker || h.expires != absl::InfiniteFuture()) continue;
      ++s.blocks;
      s.digest.hi ^= hash.hi;
      s.digest.lo ^= hash.lo;
    }
  }
  return s;
}

size_t PrefixIndex::num_hashes() const {
  absl::MutexLock l(&mu_);
  return index_.size();
}

}  // namespace pdserve::router
