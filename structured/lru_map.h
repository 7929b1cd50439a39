// A small thread-safe map from string keys to shared values that evicts the
// least recently used entry past its capacity: the compile caches of
// structured/ (automata by constraint text, token guides by constraint).
#pragma once

#include <list>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace pdserve::structured {

template <typename T>
class LruMap {
 public:
  explicit LruMap(size_t capacity) : capacity_(capacity == 0 ? 1 : capacity) {}

  // The value of `key` (now most recently used), or nullptr.
  std::shared_ptr<T> Find(const std::string& key) {
    absl::MutexLock lock(&mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return nullptr;
    lru_.splice(lru_.begin(), lru_, it->second);
    return it->second->second;
  }
  // Inserts `value` unless `key` is present; returns the stored value.
  std::shared_ptr<T> Insert(const std::string& key, std::shared_ptr<T> value) {
    absl::MutexLock lock(&mu_);
    auto it = index_.find(key);
    if (it != index_.end()) return it->second->second;
    lru_.emplace_front(key, std::move(value));
    index_[key] = lru_.begin();
    while (lru_.size() > capacity_) {
      index_.erase(lru_.back().first);
      lru_.pop_back();
    }
    return lru_.front().second;
  }
  size_t size() const {
    absl::MutexLock lock(&mu_);
    return lru_.size();
  }

 private:
  using Entry = std::pair<std::string, std::shared_ptr<T>>;
  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::list<Entry> lru_ ABSL_GUARDED_BY(mu_);  // front: most recently used
  absl::flat_hash_map<std::string, typename std::list<Entry>::iterator> index_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::structured
