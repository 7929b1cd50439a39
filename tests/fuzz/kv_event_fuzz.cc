// Fuzzes the router's KV event decoding and application
// (router/kv_event_applier.h): KvEventBatch messages decoded from arbitrary
// bytes go through KvEventApplier::ApplyBatch for two workers sharing one
// PrefixIndex, exactly as the router's subscription loop applies them.
//
// Input: frames of [u8 worker][u16 little-endian length][a serialized
// pdserve.v1.KvEventBatch]. Besides ASan/UBSan, a plain reference model of
// the stream rules (snapshot replaces, stored adds, removed erases, cleared
// empties; an out-of-sequence or malformed batch leaves the worker unsynced
// until the next snapshot) must agree with the index on every hash seen.
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

struct Model {
  std::set<std::pair<uint64_t, uint64_t>> hashes;
  bool synced = false;
  uint64_t seq = 0;

  // Mirrors ApplyBatch on decoded events; an event's `ok` is false when it
  // failed to decode (the applier stops at the first bad event).
  void Apply(bool snapshot, const std::vector<std::pair<bool, KvEvent>>& evs) {
    auto key = [](const BlockHash& h) { return std::make_pair(h.hi, h.lo); };
    if (snapshot) {
      std::set<std::pair<uint64_t, uint64_t>> all;
      uint64_t last = 0;
      for (const auto& [ok, e] : evs) {
        if (!ok || e.type != KvEvent::Type::kStored) {
          synced = false;
          return;
        }
        for (const auto& h : e.hashes) all.insert(key(h));
        last = e.seq;
      }
      hashes = std::move(all);
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
      if (e.type == KvEvent::Type::kStored) {
        for (const auto& h : e.hashes) hashes.insert(key(h));
      } else if (e.type == KvEvent::Type::kRemoved) {
        for (const auto& h : e.hashes) hashes.erase(key(h));
      } else {
        hashes.clear();
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
    const std::vector<int32_t> held = index.LeadingBlocks({&h, 1}, workers);
    for (int w = 0; w < 2; ++w) {
      // Unsynced workers keep what they had; the model does too.
      if ((held[w] == 1) != (models[w].hashes.count({hi, lo}) == 1))
        std::abort();
    }
  }
  return 0;
}
