#include "router/kv_event_applier.h"

#include <gtest/gtest.h>

namespace pdserve::router {
namespace {

engine::KvEvent Event(uint64_t seq, engine::KvEvent::Type type,
                      std::vector<engine::BlockHash> h) {
  return {seq, type, {}, std::move(h)};
}

TEST(KvEventApplierTest, SnapshotThenConsecutiveEventsThenGapNeedsResync) {
  PrefixIndex index;
  KvEventApplier applier(&index, 3);
  const std::vector<WorkerIndex> w = {3};
  const engine::BlockHash a{1, 1}, b{2, 2}, c{3, 3};
  EXPECT_FALSE(applier.Apply(
      Event(1, engine::KvEvent::Type::kStored, {a})));  // no snapshot yet
  applier.Snapshot(5, {a});
  EXPECT_TRUE(applier.Apply(Event(6, engine::KvEvent::Type::kStored, {b})));
  const std::vector<engine::BlockHash> chain = {a, b, c};
  EXPECT_EQ(index.LeadingBlocks(chain, w)[0], 2);
  EXPECT_TRUE(
      applier.Apply(Event(7, engine::KvEvent::Type::kRemoved,
                          {c, engine::BlockHash{9, 9}})));  // unknown ignored
  EXPECT_FALSE(applier.Apply(
      Event(9, engine::KvEvent::Type::kStored, {c})));  // 8 was lost
  EXPECT_FALSE(applier.synced());
  EXPECT_EQ(index.LeadingBlocks(chain, w)[0],
            2);  // nothing applied from the bad event
  applier.Snapshot(9, {a, b, c});
  EXPECT_EQ(index.LeadingBlocks(chain, w)[0], 3);
  EXPECT_TRUE(applier.Apply(Event(10, engine::KvEvent::Type::kCleared, {})));
  EXPECT_EQ(index.LeadingBlocks(chain, w)[0], 0);
}

std::string HashBytes(const engine::BlockHash& h) {
  std::string out(16, '\0');
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<char>(h.hi >> (56 - 8 * i));
    out[8 + i] = static_cast<char>(h.lo >> (56 - 8 * i));
  }
  return out;
}

// The wire decoding: a hash that is not 16 bytes or an unknown event type
// used to be applied as hash 0 / as `cleared`; now it asks for a resync and
// changes nothing (found while fuzzing the decoder, tests/fuzz/kv_event_fuzz).
TEST(KvEventApplierTest, MalformedWireEventsNeedResyncAndApplyNothing) {
  PrefixIndex index;
  KvEventApplier applier(&index, 0);
  const std::vector<WorkerIndex> w = {0};
  const engine::BlockHash a{1, 1}, b{2, 2};
  const std::vector<engine::BlockHash> chain = {a, b};
  v1::KvEventBatch snapshot;
  snapshot.set_snapshot(true);
  auto* e = snapshot.add_events();
  e->set_seq(4);
  e->add_hashes(HashBytes(a));
  ASSERT_TRUE(applier.ApplyBatch(snapshot));
  EXPECT_EQ(index.LeadingBlocks(chain, w)[0], 1);

  v1::KvEventBatch short_hash;
  e = short_hash.add_events();
  e->set_seq(5);
  e->add_hashes(HashBytes(b).substr(0, 15));
  EXPECT_FALSE(applier.ApplyBatch(short_hash));
  EXPECT_FALSE(applier.synced());

  ASSERT_TRUE(applier.ApplyBatch(snapshot));
  v1::KvEventBatch unknown_type;
  e = unknown_type.add_events();
  e->set_seq(5);
  e->set_type(static_cast<v1::KvEventProto::Type>(7));
  EXPECT_FALSE(applier.ApplyBatch(unknown_type));
  EXPECT_EQ(index.LeadingBlocks(chain, w)[0], 1);  // not cleared

  ASSERT_TRUE(applier.ApplyBatch(snapshot));
  v1::KvEventBatch stored;
  e = stored.add_events();
  e->set_seq(5);
  e->set_parent_hash(HashBytes(a));
  e->add_hashes(HashBytes(b));
  EXPECT_TRUE(applier.ApplyBatch(stored));
  EXPECT_EQ(index.LeadingBlocks(chain, w)[0], 2);
}

TEST(KvEventApplierTest, SnapshotAndEventsCarryTiers) {
  PrefixIndex index;
  KvEventApplier applier(&index, 0);
  const std::vector<WorkerIndex> w = {0};
  const engine::BlockHash a{1, 1}, b{2, 2}, c{3, 3}, d{4, 4};
  const std::vector<engine::BlockHash> chain = {a, b, c, d};
  // Snapshot: a, b in the pool; c, d on disk (and a tier number from a
  // newer worker, skipped).
  v1::KvEventBatch snapshot;
  snapshot.set_snapshot(true);
  auto* pool = snapshot.add_events();
  pool->set_seq(7);
  pool->add_hashes(HashBytes(a));
  pool->add_hashes(HashBytes(b));
  auto* disk = snapshot.add_events();
  disk->set_seq(7);
  disk->set_tier(v1::KV_TIER_DISK);
  disk->add_hashes(HashBytes(c));
  disk->add_hashes(HashBytes(d));
  auto* future = snapshot.add_events();
  future->set_seq(7);
  future->set_tier(static_cast<v1::KvTier>(9));
  future->add_hashes(HashBytes(engine::BlockHash{5, 5}));
  ASSERT_TRUE(applier.ApplyBatch(snapshot));
  EXPECT_EQ(index.LeadingBlocks(chain, w)[0], 2);
  EXPECT_EQ(index.LeadingBlocks(chain, w, kAllTiers)[0], 4);
  EXPECT_EQ(index.Summary(0, engine::KvTierKind::kDisk).blocks, 2u);
  EXPECT_EQ(index.num_hashes(), 4u);
  // Incremental: b moves pool -> disk, d is dropped from disk, an event of
  // an unknown tier is skipped but keeps the sequence.
  v1::KvEventBatch batch;
  auto* moved = batch.add_events();
  moved->set_seq(8);
  moved->set_type(v1::KvEventProto::MOVED);
  moved->set_from_tier(v1::KV_TIER_POOL);
  moved->set_tier(v1::KV_TIER_DISK);
  moved->add_hashes(HashBytes(b));
  auto* dropped = batch.add_events();
  dropped->set_seq(9);
  dropped->set_type(v1::KvEventProto::REMOVED);
  dropped->set_tier(v1::KV_TIER_DISK);
  dropped->add_hashes(HashBytes(d));
  dropped->add_hashes(HashBytes(engine::BlockHash{42, 42}));  // unknown
  auto* odd = batch.add_events();
  odd->set_seq(10);
  odd->set_type(v1::KvEventProto::STORED);
  odd->set_tier(static_cast<v1::KvTier>(77));
  odd->add_hashes(HashBytes(d));
  ASSERT_TRUE(applier.ApplyBatch(batch));
  EXPECT_EQ(applier.last_seq(), 10u);
  EXPECT_EQ(index.LeadingBlocks(chain, w)[0], 1);
  EXPECT_EQ(index.LeadingBlocks(chain, w, kAllTiers)[0], 3);
  EXPECT_EQ(index.Summary(0, engine::KvTierKind::kDisk).blocks, 2u);  // b, c
  // A gap, then a resync from a snapshot with nothing on disk: the disk
  // entries go too.
  v1::KvEventBatch late;
  auto* gap = late.add_events();
  gap->set_seq(12);
  gap->add_hashes(HashBytes(d));
  EXPECT_FALSE(applier.ApplyBatch(late));
  v1::KvEventBatch resync;
  resync.set_snapshot(true);
  auto* only = resync.add_events();
  only->set_seq(20);
  only->add_hashes(HashBytes(a));
  ASSERT_TRUE(applier.ApplyBatch(resync));
  EXPECT_EQ(index.LeadingBlocks(chain, w, kAllTiers)[0], 1);
  EXPECT_EQ(index.Summary(0, engine::KvTierKind::kDisk).blocks, 0u);
  // cleared empties every tier.
  v1::KvEventBatch more;
  auto* st = more.add_events();
  st->set_seq(21);
  st->set_tier(v1::KV_TIER_HOST_MEMORY);
  st->add_hashes(HashBytes(b));
  auto* cl = more.add_events();
  cl->set_seq(22);
  cl->set_type(v1::KvEventProto::CLEARED);
  ASSERT_TRUE(applier.ApplyBatch(more));
  EXPECT_EQ(index.num_hashes(), 0u);
}

}  // namespace
}  // namespace pdserve::router
