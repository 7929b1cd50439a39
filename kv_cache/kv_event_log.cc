#include "kv_cache/kv_event_log.h"

#include "absl/strings/str_cat.h"

namespace pdserve::engine {

void KvEventLog::Append(const KvEvent& event) {
  absl::MutexLock l(&mu_);
  events_.push_back(event);
  last_seq_ = event.seq;
  while (events_.size() > capacity_) events_.pop_front();
}

absl::StatusOr<std::vector<KvEvent>> KvEventLog::ReadAfter(
    uint64_t after, absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  struct Arg {
    KvEventLog* log;
    uint64_t after;
  } arg{this, after};
  mu_.AwaitWithTimeout(absl::Condition(
                           +[](Arg* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                             return a->log->last_seq_ > a->after;
                           },
                           &arg),
                       timeout);
  std::vector<KvEvent> out;
  if (last_seq_ <= after) return out;
  if (events_.empty() || events_.front().seq > after + 1) {
    return absl::OutOfRangeError(
        absl::StrCat("events after ", after, " are no longer kept"));
  }
  for (const KvEvent& e : events_) {
    if (e.seq > after) out.push_back(e);
  }
  return out;
}

uint64_t KvEventLog::last_seq() const {
  absl::MutexLock l(&mu_);
  return last_seq_;
}

}  // namespace pdserve::engine
