// A bounded, sequence-numbered log of a worker's KV events for subscribers
// (the router's prefix index). The engine thread appends; subscriber threads
// read everything after the sequence number they hold. A subscriber that
// falls further behind than the log's capacity gets OUT_OF_RANGE and must
// re-read a snapshot (ARCHITECTURE.md: resync on gaps). Thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv_cache/block_manager.h"

namespace pdserve::engine {

class KvEventLog {
 public:
  explicit KvEventLog(size_t capacity = 4096) : capacity_(capacity) {}
  void Append(const KvEvent& event) ABSL_LOCKS_EXCLUDED(mu_);
  // Events with seq > after, waiting up to `timeout` for at least one.
  absl::StatusOr<std::vector<KvEvent>> ReadAfter(uint64_t after,
                                                 absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t last_seq() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::deque<KvEvent> events_ ABSL_GUARDED_BY(mu_);
  uint64_t last_seq_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pdserve::engine
