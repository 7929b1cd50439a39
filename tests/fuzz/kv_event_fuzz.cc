// Fuzzes the router's KV event decoding and application
// (router/kv_event_applier.h): KvEventBatch messages decoded from arbitrary
// bytes go through KvEventApplier::ApplyBatch for two workers sharing one
// PrefixIndex, exactly as the router's subscription loop applies them.
//
// Input: frames of [u8 worker][u16 little-endian length][a serialized
// pdserve.v1.KvEventBatch]. Besides ASan/UBSan, a plain reference model of
// the stream rules per tier (snapshot replaces, stored adds, removed erases,
// moved goes from one tier to another, cleared empties; an out-of-sequence or
// malformed batch leaves the worker unsynced until the next snapshot) must
// agree with the index on every hash seen, tier by tier.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <utility>
#include <vector>

#include "router/kv_event_applier.h"
#include "router/prefix_index.h"

namespace {

using pdserve::engine::BlockHash;
using pdserve::engine::KvEvent;

using Key = std::pair<uint64_t, uint64_t>;
constexpr int kTiers = pdserve::engine::kNumKvTierKinds;

// Each tier of a worker is its own set of hashes: stored and
// removed name a tier, moved takes the blocks from one tier to another,
// cleared empties every tier, and events naming a tier this release does not
// know change nothing (but still advance the sequence).
struct Model {
  std::set<Key> hashes[kTiers];
  bool synced = false;
  uint64_t seq = 0;

  static bool Known(pdserve::engine::KvTierKind t) {
    return static_cast<int>(t) < kTiers;
  }
  static Key K(const BlockHash& h) { return {h.hi, h.lo}; }

  // Mirrors ApplyBatch on decoded events; an event's `ok` is false when it
  // failed to decode (the applier stops at the first bad event).
  void Apply(bool snapshot, const std::vector<std::pair<bool, KvEvent>>& evs) {
    if (snapshot) {
      std::set<Key> all[kTiers];
      uint64_t last = 0;
      for (const auto& [ok, e] : evs) {
        if (!ok || e.type != KvEvent::Type::kStored) {
          synced = false;
          return;
        }
        last = e.seq;
        if (!Known(e.tier)) continue;
        for (const auto& h : e.hashes)
          all[static_cast<int>(e.tier)].insert(K(h));
      }
      for (int t = 0; t < kTiers; ++t) hashes[t] = std::move(all[t]);
      seq = last;
      synced = true;
      return;
    }
    for (const auto& [ok, e] : evs) {
      if (!ok || !synced || e.seq != seq + 1) {
        synced = false;
        return;
      }
      seq = e.seq;
      const int to = static_cast<int>(e.tier);
      const int from = static_cast<int>(e.from_tier);
      switch (e.type) {
        case KvEvent::Type::kStored:
          if (Known(e.tier))
            for (const auto& h : e.hashes) hashes[to].insert(K(h));
          break;
        case KvEvent::Type::kRemoved:
          if (Known(e.tier))
            for (const auto& h : e.hashes) hashes[to].erase(K(h));
          break;
        case KvEvent::Type::kMoved:
          if (Known(e.tier) && Known(e.from_tier) && to != from) {
            for (const auto& h : e.hashes) {
              hashes[to].insert(K(h));
              hashes[from].erase(K(h));
            }
          }
          break;
        case KvEvent::Type::kCleared:
          for (auto& tier : hashes) tier.clear();
          break;
      }
    }
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pdserve::router::PrefixIndex index;
  std::vector<pdserve::router::KvEventApplier> appliers = {{&index, 0},
                                                           {&index, 1}};
  Model models[2];
  std::set<std::pair<uint64_t, uint64_t>> seen;
  size_t at = 0;
  while (at + 3 <= size) {
    const int worker = data[at] & 1;
    const size_t len = data[at + 1] | (size_t{data[at + 2]} << 8);
    at += 3;
    if (len > size - at) break;
    pdserve::v1::KvEventBatch batch;
    const bool parsed = batch.ParseFromArray(data + at, static_cast<int>(len));
    at += len;
    if (!parsed) continue;
    std::vector<std::pair<bool, KvEvent>> decoded;
    for (const auto& e : batch.events()) {
      KvEvent event;
      const bool ok = pdserve::router::DecodeKvEvent(e, &event);
      if (ok) {
        for (const auto& h : event.hashes) seen.insert({h.hi, h.lo});
      }
      decoded.emplace_back(ok, std::move(event));
    }
    const bool applied = appliers[worker].ApplyBatch(batch);
    models[worker].Apply(batch.snapshot(), decoded);
    // A rejected batch always leaves the worker unsynced.
    if ((!applied && appliers[worker].synced()) ||
        appliers[worker].synced() != models[worker].synced) {
      std::abort();
    }
  }
  const std::vector<pdserve::router::WorkerIndex> workers = {0, 1};
  for (const auto& [hi, lo] : seen) {
    const BlockHash h{hi, lo};
    for (int t = 0; t < kTiers; ++t) {
      const std::vector<int32_t> held =
          index.LeadingBlocks({&h, 1}, workers,
                              pdserve::router::TierBit(
                                  static_cast<pdserve::engine::KvTierKind>(t)));
      for (int w = 0; w < 2; ++w) {
        // Unsynced workers keep what they had; the model does too.
        if ((held[w] == 1) != (models[w].hashes[t].count({hi, lo}) == 1))
          std::abort();
      }
    }
  }
  return 0;
}
