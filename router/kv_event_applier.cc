#include "router/kv_event_applier.h"

namespace pdserve::router {

void KvEventApplier::Snapshot(uint64_t seq,
                              const std::vector<engine::BlockHash>& hashes) {
  index_->ClearWorker(worker_);
  index_->Stored(worker_, hashes);
  last_seq_ = seq;
  synced_ = true;
}

bool KvEventApplier::Apply(const engine::KvEvent& event) {
  if (!synced_ || event.seq != last_seq_ + 1) {
    synced_ = false;
    return false;
  }
  last_seq_ = event.seq;
  switch (event.type) {
    case engine::KvEvent::Type::kStored:
      index_->Stored(worker_, event.hashes);
      break;
    case engine::KvEvent::Type::kRemoved:
      index_->Removed(worker_, event.hashes);
      break;
    case engine::KvEvent::Type::kCleared:
      index_->ClearWorker(worker_);
      break;
  }
  return true;
}

}  // namespace pdserve::router
