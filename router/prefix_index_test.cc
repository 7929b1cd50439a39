#include "router/prefix_index.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <random>
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

TEST(PrefixIndexTest, PromptQueryAgreesWithTheExactWalkOnPrefixClosedSets) {
  // Random prefix-closed sets (what workers' tail-first eviction keeps), some
  // speculative and some expired: the bisecting query must equal the
  // block-by-block walk for every worker.
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    PrefixIndex index;
    const int n = 1 + static_cast<int>(rng() % 300);
    auto h = Chain(n, 10 + trial);
    const int workers = 1 + static_cast<int>(rng() % 40);
    std::vector<WorkerIndex> ids;
    for (WorkerIndex w = 0; w < workers; ++w) {
      ids.push_back(w);
      const int len = static_cast<int>(rng() % (n + 1));
      switch (rng() % 4) {
        case 0:
          index.Speculate(w, std::span(h).first(len), absl::Hours(1));
          break;
        case 1:
          index.Speculate(w, std::span(h).first(len), absl::Milliseconds(-1));
          break;
        default:
          index.Stored(w, std::span(h).first(len));
      }
    }
    std::vector<int32_t> counts;
    size_t hashed = 0;  // the query asks for hashes lazily
    index.LeadingBlocksOfPrompt(
        h.size(),
        [&](size_t i) {
          hashed = std::max(hashed, i + 1);
          return h[i];
        },
        &counts);
    counts.resize(workers, 0);
    const std::vector<int32_t> exact = index.LeadingBlocks(h, ids);
    ASSERT_EQ(counts, exact) << "trial " << trial;
    const int32_t longest = *std::max_element(exact.begin(), exact.end());
    EXPECT_LE(hashed, std::min<size_t>(n, 2 * longest + 1))
        << "trial " << trial;
  }
}

TEST(PrefixIndexTest, PromptQueryOfALongPromptAt256WorkersTakesMicroseconds) {
  // Every worker holds a shared 32-block system prompt; one holds a 5,000
  // block conversation, another half of it. The exact walk visits every
  // block; the bisecting query a few dozen.
  PrefixIndex index;
  auto h = Chain(5000, 11);
  for (WorkerIndex w = 0; w < 256; ++w) index.Stored(w, std::span(h).first(32));
  index.Stored(7, h);
  index.Stored(9, std::span(h).first(2500));
  std::vector<int32_t> counts;
  size_t probes = 0;
  const auto t0 = std::chrono::steady_clock::now();
  constexpr int kReps = 50;
  for (int i = 0; i < kReps; ++i) {
    counts.clear();
    index.LeadingBlocksOfPrompt(
        h.size(),
        [&](size_t b) {
          ++probes;
          return h[b];
        },
        &counts);
  }
  const double us = std::chrono::duration<double, std::micro>(
                        std::chrono::steady_clock::now() - t0)
                        .count() /
                    kReps;
  ASSERT_EQ(counts.size(), 256u);
  EXPECT_EQ(counts[7], 5000);
  EXPECT_EQ(counts[9], 2500);
  EXPECT_EQ(counts[0], 32);
  EXPECT_EQ(counts[255], 32);
  std::printf("prompt query, 5000 blocks x 256 workers: %.1f us, %zu probes\n",
              us, probes / kReps);
  EXPECT_LT(probes / kReps, 100u);
  EXPECT_LT(us, 2000);  // generous bound for a shared 2-core CI machine
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
