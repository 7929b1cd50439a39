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
    case v1::KvEventProto::MOVED:
      event->type = engine::KvEvent::Type::kMoved;
      break;
    default:
      return false;
  }
  auto tier = [](int t) {
    return t >= 0 && t < engine::kNumKvTierKinds
               ? static_cast<engine::KvTierKind>(t)
               : kUnknownTier;
  };
  event->tier = tier(proto.tier());
  event->from_tier = tier(proto.from_tier());
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
    // STORED events with every hash, by tier; several per tier are merged,
    // tiers this release does not know are skipped.
    TierHashes by_tier;
    uint64_t seq = 0;
    for (const v1::KvEventProto& e : batch.events()) {
      if (!DecodeKvEvent(e, &event) ||
          event.type != engine::KvEvent::Type::kStored) {
        synced_ = false;
        return false;
      }
      seq = event.seq;
      if (event.tier == kUnknownTier) continue;
      auto& hashes = by_tier[static_cast<int>(event.tier)];
      hashes.insert(hashes.end(), event.hashes.begin(), event.hashes.end());
    }
    SnapshotTiers(seq, by_tier);
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
  TierHashes by_tier;
  by_tier[static_cast<int>(engine::KvTierKind::kPool)] = hashes;
  SnapshotTiers(seq, by_tier);
}

void KvEventApplier::SnapshotTiers(uint64_t seq, const TierHashes& by_tier) {
  index_->ClearWorker(worker_);
  for (int t = 0; t < engine::kNumKvTierKinds; ++t) {
    if (!by_tier[t].empty())
      index_->Stored(worker_, by_tier[t], static_cast<engine::KvTierKind>(t));
  }
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
    // The index skips tiers it does not know.
    case engine::KvEvent::Type::kStored:
      index_->Stored(worker_, event.hashes, event.tier);
      break;
    case engine::KvEvent::Type::kRemoved:
      index_->Removed(worker_, event.hashes, event.tier);
      break;
    case engine::KvEvent::Type::kMoved:
      index_->Moved(worker_, event.hashes, event.from_tier, event.tier);
      break;
    case engine::KvEvent::Type::kCleared:
      index_->ClearWorker(worker_);
      break;
  }
  return true;
}

}  // namespace pdserve::router
