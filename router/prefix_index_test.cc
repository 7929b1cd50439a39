#include "router/prefix_index.h"

#include <gtest/gtest.h>

#include <chrono>
#include <vector>

namespace pdserve::router {
namespace {

std::vector<engine::BlockHash> Chain(int n, uint64_t salt) {
  std::vector<engine::BlockHash> h;
  for (int i = 0; i < n; ++i) h.push_back({salt, static_cast<uint64_t>(i) * 7919 + salt});
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
  for (WorkerIndex w = 0; w < 16; ++w) index.Stored(w, std::span(h).first(250 * w));
  std::vector<WorkerIndex> workers;
  for (WorkerIndex w = 0; w < 16; ++w) workers.push_back(w);
  const auto t0 = std::chrono::steady_clock::now();
  constexpr int kReps = 20;
  for (int i = 0; i < kReps; ++i) ASSERT_EQ(index.LeadingBlocks(h, workers)[15], 3750);
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / kReps;
  std::printf("LeadingBlocks over 4000 blocks x 16 workers: %.1f us\n", us);
  EXPECT_LT(us, 5000);  // generous bound for a shared 2-core CI machine
}

}  // namespace
}  // namespace pdserve::router
