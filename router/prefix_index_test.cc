#include "router/prefix_index.h"

#include <gtest/gtest.h>

#include <chrono>
#include <vector>

namespace pdserve::router {
namespace {

std::vector<engine::BlockHash> Chain(int n, uint64_t salt) {
  std::vector<engine::BlockHash> h;
  for (int i = 0; i < n; ++i)
    h.push_back({salt, static_cast<uint64_t>(i) * 7919 + salt});
  return h;
}

TEST(PrefixIndexTest, CountsLeadingBlocksPerWorker) {
  PrefixIndex index;
  auto h = Chain(10, 1);
  index.Stored(0, std::span(h).first(6));
  index.Stored(1, std::span(h).first(3));
  index.Stored(1, std::span(h).subspan(4, 3));  // a hole at block 3
  const std::vector<WorkerIndex> workers = {0, 1, 2};
  EXPECT_EQ(index.LeadingBlocks(h, workers), (std::vector<int32_t>{6, 3, 0}));
  index.Removed(0, std::span(h).subspan(2, 1));
  EXPECT_EQ(index.LeadingBlocks(h, workers)[0], 2);
  // Unknown hashes in `removed` are ignored.
  auto other = Chain(3, 99);
  index.Removed(0, other);
  index.ClearWorker(1);
  EXPECT_EQ(index.LeadingBlocks(h, workers), (std::vector<int32_t>{2, 0, 0}));
}

TEST(PrefixIndexTest, SpeculativeEntriesExpireUnlessConfirmed) {
  PrefixIndex index;
  auto h = Chain(4, 2);
  const std::vector<WorkerIndex> w = {5};
  index.Speculate(5, h, absl::Milliseconds(50));
  EXPECT_EQ(index.LeadingBlocks(h, w)[0], 4);
  index.Stored(5, std::span(h).first(2));  // confirmed
  absl::SleepFor(absl::Milliseconds(80));
  EXPECT_EQ(index.LeadingBlocks(h, w)[0], 2);
}

TEST(PrefixIndexTest, QueryOfThousandsOfBlocksTakesMicroseconds) {
  PrefixIndex index;
  auto h = Chain(4000, 3);
  for (WorkerIndex w = 0; w < 16; ++w)
    index.Stored(w, std::span(h).first(250 * w));
  std::vector<WorkerIndex> workers;
  for (WorkerIndex w = 0; w < 16; ++w) workers.push_back(w);
  const auto t0 = std::chrono::steady_clock::now();
  constexpr int kReps = 20;
  for (int i = 0; i < kReps; ++i)
    ASSERT_EQ(index.LeadingBlocks(h, workers)[15], 3750);
  const double us = std::chrono::duration<double, std::micro>(
                        std::chrono::steady_clock::now() - t0)
                        .count() /
                    kReps;
  std::printf("LeadingBlocks over 4000 blocks x 16 workers: %.1f us\n", us);
  EXPECT_LT(us, 5000);  // generous bound for a shared 2-core CI machine
}

TEST(PrefixIndexTest, ExtendLeadingBlocksInChunksAgreesWithLeadingBlocks) {
  PrefixIndex index;
  auto h = Chain(100, 4);
  index.Stored(0, std::span(h).first(70));
  index.Stored(2, std::span(h).first(10));
  index.Stored(2, std::span(h).subspan(11, 50));  // a hole at block 10
  index.Speculate(5, std::span(h).first(90), absl::Hours(1));
  index.Speculate(6, h, absl::Milliseconds(-1));  // already expired
  std::vector<int32_t> counts;
  size_t first = 0;
  for (size_t end = 32;; end = std::min<size_t>(end + 32, h.size())) {
    const bool more =
        index.ExtendLeadingBlocks(std::span(h).first(end), first, &counts);
    first = end;
    if (!more || end == h.size()) break;
  }
  counts.resize(8, 0);
  const std::vector<WorkerIndex> workers = {0, 1, 2, 3, 4, 5, 6, 7};
  EXPECT_EQ(counts, index.LeadingBlocks(h, workers));
  EXPECT_EQ(counts, (std::vector<int32_t>{70, 0, 10, 0, 0, 90, 0, 0}));
  // Nobody holds block 90, so the walk stops there; someone holds all of 40.
  counts.clear();
  EXPECT_FALSE(index.ExtendLeadingBlocks(h, 0, &counts));
  counts.clear();
  EXPECT_TRUE(index.ExtendLeadingBlocks(std::span(h).first(40), 0, &counts));
}

TEST(PrefixIndexTest, MemoryCountsHashesAndHolders) {
  PrefixIndex index;
  auto h = Chain(10, 5);
  for (WorkerIndex w = 0; w < 4; ++w) index.Stored(w, std::span(h).first(5));
  index.Stored(0, h);
  const PrefixIndex::MemoryUsage m = index.Memory();
  EXPECT_EQ(m.hashes, 10u);
  EXPECT_EQ(m.holders, 25u);
  EXPECT_GE(m.bytes, 10 * (sizeof(engine::BlockHash) + 1));
}

TEST(PrefixIndexTest, SummaryCountsConfirmedBlocksOfOneWorker) {
  PrefixIndex index;
  const engine::BlockHash a{1, 2}, b{4, 8}, c{16, 32};
  const std::vector<engine::BlockHash> ab = {a, b}, bc = {b, c};
  index.Stored(0, ab);
  index.Stored(1, bc);
  index.Speculate(0, bc, absl::Seconds(60));  // c is not confirmed for 0
  const PrefixIndex::WorkerSummary s0 = index.Summary(0);
  EXPECT_EQ(s0.blocks, 2u);
  EXPECT_EQ(s0.digest, (engine::BlockHash{1 ^ 4, 2 ^ 8}));
  const std::vector<engine::BlockHash> just_a = {a};
  index.Removed(0, just_a);
  EXPECT_EQ(index.Summary(0).blocks, 1u);
  EXPECT_EQ(index.Summary(1).digest, (engine::BlockHash{4 ^ 16, 8 ^ 32}));
  EXPECT_EQ(index.Summary(7).blocks, 0u);
}

}  // namespace
}  // namespace pdserve::router
