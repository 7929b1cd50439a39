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

}  // namespace
}  // namespace pdserve::router
