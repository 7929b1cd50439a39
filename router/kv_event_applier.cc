#include "router/kv_event_applier.h"

namespace pdserve::router {
namespace {

// 16 bytes, big-endian: hi then lo.
bool HashFromBytes(const std::string& b, engine::BlockHash* h) {
  if (b.size() != 16) return false;
  *h = engine::BlockHash();
  for (int i = 0; i < 8; ++i) {
    h->hi = (h->hi << 8) | static_cast<uint8_t>(b[i]);
    h->lo = (h->lo << 8) | static_cast<uint8_t>(b[8 + i]);
  }
  return true;
}

}  // namespace

bool DecodeKvEvent(const v1::KvEventProto& proto, engine::KvEvent* event) {
  event->seq = proto.seq();
  switch (proto.type()) {
    case v1::KvEventProto::STORED:
      event->type = engine::KvEvent::Type::kStored;
      break;
    case v1::KvEventProto::REMOVED:
      event->type = engine::KvEvent::Type::kRemoved;
      break;
    case v1::KvEventProto::CLEARED:
      event->type = engine::KvEvent::Type::kCleared;
      break;
    default:
      return false;
  }
  event->parent = engine::BlockHash();
  if (!proto.parent_hash().empty() &&
      !HashFromBytes(proto.parent_hash(), &event->parent))
    return false;
  event->hashes.clear();
  event->hashes.reserve(proto.hashes_size());
  for (const std::string& b : proto.hashes()) {
    if (!HashFromBytes(b, &event->hashes.emplace_back())) return false;
  }
  return true;
}

bool KvEventApplier::ApplyBatch(const v1::KvEventBatch& batch) {
  engine::KvEvent event;
  if (batch.snapshot()) {
    // One STORED event with every cached hash; several are merged.
    std::vector<engine::BlockHash> hashes;
    uint64_t seq = 0;
    for (const v1::KvEventProto& e : batch.events()) {
      if (!DecodeKvEvent(e, &event) ||
          event.type != engine::KvEvent::Type::kStored) {
        synced_ = false;
        return false;
      }
      hashes.insert(hashes.end(), event.hashes.begin(), event.hashes.end());
      seq = event.seq;
    }
    Snapshot(seq, hashes);
    return true;
  }
  for (const v1::KvEventProto& e : batch.events()) {
    if (!DecodeKvEvent(e, &event) || !Apply(event)) {
      synced_ = false;
      return false;
    }
  }
  return true;
}

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
