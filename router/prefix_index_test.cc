#include "router/prefix_index.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <random>
#include <set>
#include <thread>
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

// A clock that moves only when the test says so.
struct FakeClock {
  absl::Time now = absl::FromUnixSeconds(1'000'000);
  PrefixIndex::Clock fn() {
    return [this] { return now; };
  }
};

TEST(PrefixIndexTest, SpeculativeEntriesExpireUnlessConfirmed) {
  FakeClock clock;
  PrefixIndex index(clock.fn());
  auto h = Chain(4, 2);
  const std::vector<WorkerIndex> w = {5};
  index.Speculate(5, h, absl::Milliseconds(50));
  EXPECT_EQ(index.LeadingBlocks(h, w)[0], 4);
  index.Stored(5, std::span(h).first(2));  // confirmed
  clock.now += absl::Milliseconds(49);
  EXPECT_EQ(index.LeadingBlocks(h, w)[0], 4);
  clock.now += absl::Milliseconds(1);
  EXPECT_EQ(index.LeadingBlocks(h, w)[0], 2);
  std::vector<int32_t> counts;
  index.LeadingBlocksOfPrompt(
      h.size(), [&](size_t i) { return h[i]; }, &counts);
  ASSERT_GT(counts.size(), 5u);
  EXPECT_EQ(counts[5], 2);
}

// Requests refused after routing (the decode worker was full, the client
// went away) leave speculative entries that no `stored` event confirms. They
// used to stay in the table for good: the index grew by every refused
// prompt's blocks.
TEST(PrefixIndexTest, RefusedRequestsDoNotGrowTheIndexWithoutBound) {
  FakeClock clock;
  PrefixIndex index(clock.fn());
  constexpr int kRequests = 10000, kBlocks = 8;
  const absl::Duration ttl = absl::Seconds(1), gap = absl::Milliseconds(10);
  for (int i = 0; i < kRequests; ++i) {
    index.Speculate(i % 4, Chain(kBlocks, 1000 + i), ttl);
    clock.now += gap;
  }
  // At most one TTL's worth of requests (100) is live; allow one more TTL of
  // expired entries waiting for the next purges.
  const size_t live = (ttl / gap) * kBlocks;
  const PrefixIndex::MemoryUsage m = index.Memory();
  EXPECT_LE(m.hashes, 2 * live)
      << "of " << kRequests * kBlocks << " speculated";
  EXPECT_LE(m.holders, 2 * live);
  EXPECT_LE(m.pending_expiries, 2 * live);
}

TEST(PrefixIndexTest, PurgeKeepsConfirmedAndRenewedSpeculation) {
  FakeClock clock;
  PrefixIndex index(clock.fn());
  auto confirmed = Chain(3, 20), renewed = Chain(3, 21), dropped = Chain(3, 22);
  index.Speculate(0, confirmed, absl::Seconds(1));
  index.Stored(0, confirmed);
  index.Speculate(1, renewed, absl::Seconds(1));
  index.Speculate(2, dropped, absl::Seconds(1));
  // Another worker speculates the same blocks and confirms them: only
  // worker 2's holder goes, the hashes stay.
  index.Stored(3, dropped);
  clock.now += absl::Milliseconds(900);
  index.Speculate(1, renewed, absl::Seconds(1));  // now expires at 1.9 s
  clock.now += absl::Milliseconds(200);
  index.Speculate(9, Chain(1, 99), absl::Seconds(1));  // triggers a purge
  const std::vector<WorkerIndex> w = {0, 1, 2, 3};
  EXPECT_EQ(index.LeadingBlocks(confirmed, w),
            (std::vector<int32_t>{3, 0, 0, 0}));
  EXPECT_EQ(index.LeadingBlocks(renewed, w),
            (std::vector<int32_t>{0, 3, 0, 0}));
  EXPECT_EQ(index.LeadingBlocks(dropped, w),
            (std::vector<int32_t>{0, 0, 0, 3}));
  // 3 + 3 + 3 hashes kept (worker 2's holders gone) + 1 new.
  EXPECT_EQ(index.Memory().holders, 10u);
  clock.now += absl::Seconds(1);
  index.Speculate(9, Chain(1, 98), absl::Milliseconds(1));
  EXPECT_EQ(index.LeadingBlocks(renewed, w),
            (std::vector<int32_t>{0, 0, 0, 0}));
  EXPECT_EQ(index.num_hashes(), 7u);  // confirmed + dropped (by 3) + newest
}

// Speed is measured in bench/ (timing assertions do not belong in tests);
// this checks the answer at that scale.
TEST(PrefixIndexTest, QueryOfThousandsOfBlocksCountsEveryWorker) {
  PrefixIndex index;
  auto h = Chain(4000, 3);
  for (WorkerIndex w = 0; w < 16; ++w)
    index.Stored(w, std::span(h).first(250 * w));
  std::vector<WorkerIndex> workers;
  for (WorkerIndex w = 0; w < 16; ++w) workers.push_back(w);
  const std::vector<int32_t> counts = index.LeadingBlocks(h, workers);
  for (WorkerIndex w = 0; w < 16; ++w) EXPECT_EQ(counts[w], 250 * w);
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

TEST(PrefixIndexTest, CountedProbesAgreeWithTheListsThroughEveryUpdate) {
  // The prompt query answers most probes from each entry's pool counts and
  // speculative-expiry bounds, and the hashed-chain form prefetches. Through
  // random stores, speculation (live, expiring, renewed), tail removals,
  // moves to a lower tier, clears and time passing, with worker ids past 64
  // (the walk's bitset spans several words), both forms must equal the
  // block-by-block walk, for the pool and for pool + tiers.
  FakeClock clock;
  PrefixIndex index(clock.fn());
  std::mt19937 rng(11);
  const int n = 120;
  const auto h = Chain(n, 77);
  constexpr int kWorkers = 150;
  std::vector<WorkerIndex> ids(kWorkers);
  for (WorkerIndex w = 0; w < kWorkers; ++w) ids[w] = w;
  // Each worker's pool and tier sets stay prefix-closed, as workers keep them:
  // `held` bounds what its pool holds or expects (stored or speculated).
  std::vector<int> held(kWorkers, 0);
  for (int step = 0; step < 3000; ++step) {
    const WorkerIndex w = static_cast<WorkerIndex>(rng() % kWorkers);
    const int len = static_cast<int>(rng() % (n + 1));
    switch (rng() % 8) {
      case 0:
      case 1:
        index.Stored(w, std::span(h).first(len));
        held[w] = std::max(held[w], len);
        break;
      case 2:
      case 3:
        index.Speculate(w, std::span(h).first(len),
                        absl::Milliseconds(1 + rng() % 400));
        held[w] = std::max(held[w], len);
        break;
      case 4:  // the pool drops a tail, confirmed or speculative
        index.Removed(w, std::span(h).subspan(len));
        held[w] = std::min(held[w], len);
        break;
      case 5:  // the whole pool goes down to the host-memory tier
        index.Moved(w, std::span(h).first(held[w]), engine::KvTierKind::kPool,
                    engine::KvTierKind::kHostMemory);
        held[w] = 0;
        break;
      case 6:
        if (rng() % 8 == 0) {
          index.ClearWorker(w);
          held[w] = 0;
        }
        break;
      default:
        clock.now += absl::Milliseconds(rng() % 150);
    }
    if (step % 10 != 0) continue;
    for (TierMask tiers : {kPoolTier, kAllTiers}) {
      std::vector<int32_t> counted, lazy;
      index.LeadingBlocksOfPrompt(h, &counted, tiers);
      index.LeadingBlocksOfPrompt(
          h.size(), [&](size_t i) { return h[i]; }, &lazy, tiers);
      counted.resize(kWorkers, 0);
      lazy.resize(kWorkers, 0);
      const std::vector<int32_t> exact = index.LeadingBlocks(h, ids, tiers);
      ASSERT_EQ(counted, exact) << "step " << step << " tiers " << int{tiers};
      ASSERT_EQ(lazy, exact) << "step " << step << " tiers " << int{tiers};
    }
  }
}

TEST(PrefixIndexTest, PromptQueriesDuringAClearCountTheOtherWorkersExactly) {
  // While a large clear erases worker 0's entries in batches, its old holders
  // are stale and the counts that cover them cannot answer a probe: queries
  // read the lists, and see worker 0 with nothing and the others exactly.
  PrefixIndex index;
  const auto h = Chain(200'000, 6);
  index.Stored(0, h);
  index.Stored(1, std::span(h).first(300));
  index.Stored(2, std::span(h).first(40));
  std::atomic<bool> done{false};
  std::thread clear([&] {
    index.ClearWorker(0);
    done = true;
  });
  const std::span<const engine::BlockHash> prompt = std::span(h).first(5000);
  int during = 0;
  do {
    std::vector<int32_t> counts;
    index.LeadingBlocksOfPrompt(prompt, &counts);
    counts.resize(3, 0);
    // Before the clear takes the set worker 0 holds all 5,000; after, none.
    EXPECT_TRUE(counts[0] == 5000 || counts[0] == 0) << counts[0];
    EXPECT_EQ(counts[1], 300);
    EXPECT_EQ(counts[2], 40);
    ++during;
  } while (!done.load());
  clear.join();
  std::vector<int32_t> counts;
  index.LeadingBlocksOfPrompt(prompt, &counts);
  counts.resize(3, 0);
  EXPECT_EQ(counts, (std::vector<int32_t>{0, 300, 40}));
  EXPECT_GT(during, 0);
}

TEST(PrefixIndexTest, PromptQueryOfALongPromptAt256WorkersProbesFewBlocks) {
  // Every worker holds a shared 32-block system prompt; one holds a 5,000
  // block conversation, another half of it. The exact walk visits every
  // block; the bisecting query a few dozen (the probe count is what keeps it
  // within microseconds; bench/ measures the time).
  PrefixIndex index;
  auto h = Chain(5000, 11);
  for (WorkerIndex w = 0; w < 256; ++w) index.Stored(w, std::span(h).first(32));
  index.Stored(7, h);
  index.Stored(9, std::span(h).first(2500));
  std::vector<int32_t> counts;
  size_t probes = 0;
  index.LeadingBlocksOfPrompt(
      h.size(),
      [&](size_t b) {
        ++probes;
        return h[b];
      },
      &counts);
  ASSERT_EQ(counts.size(), 256u);
  EXPECT_EQ(counts[7], 5000);
  EXPECT_EQ(counts[9], 2500);
  EXPECT_EQ(counts[0], 32);
  EXPECT_EQ(counts[255], 32);
  EXPECT_LT(probes, 100u);
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

// --- Tiers: each (hash, worker) says which of the worker's tiers hold it.

TEST(PrefixIndexTest, AnswersPerTier) {
  PrefixIndex index;
  using engine::KvTierKind;
  const auto h = Chain(8, 3);
  const std::vector<WorkerIndex> w = {0, 1};
  // Worker 0: blocks 0-3 in its pool, 4-7 on disk. Worker 1: 0-1 in its
  // pool, 0-5 in host memory.
  index.Stored(0, std::span(h).first(4));
  index.Stored(0, std::span(h).subspan(4), KvTierKind::kDisk);
  index.Stored(1, std::span(h).first(2));
  index.Stored(1, std::span(h).first(6), KvTierKind::kHostMemory);
  EXPECT_EQ(index.LeadingBlocks(h, w), (std::vector<int32_t>{4, 2}));
  EXPECT_EQ(index.LeadingBlocks(h, w, kAllTiers), (std::vector<int32_t>{8, 6}));
  EXPECT_EQ(index.LeadingBlocks(h, w, TierBit(KvTierKind::kDisk)),
            (std::vector<int32_t>{0, 0}));  // block 0 is not on 0's disk
  std::vector<int32_t> pool, all;
  index.LeadingBlocksOfPrompt(
      h.size(), [&](size_t i) { return h[i]; }, &pool);
  index.LeadingBlocksOfPrompt(
      h.size(), [&](size_t i) { return h[i]; }, &all, kAllTiers);
  EXPECT_EQ(pool, (std::vector<int32_t>{4, 2}));
  EXPECT_EQ(all, (std::vector<int32_t>{8, 6}));
  // Summaries per tier.
  EXPECT_EQ(index.Summary(0).blocks, 4u);
  EXPECT_EQ(index.Summary(0, KvTierKind::kDisk).blocks, 4u);
  EXPECT_EQ(index.Summary(0, KvTierKind::kHostMemory).blocks, 0u);
  EXPECT_EQ(index.Summary(1, KvTierKind::kHostMemory).blocks, 6u);
}

TEST(PrefixIndexTest, MovedAndRemovedChangeOneTierEach) {
  PrefixIndex index;
  using engine::KvTierKind;
  const auto h = Chain(4, 9);
  const std::vector<WorkerIndex> w = {0};
  index.Stored(0, h);
  // The pool evicts the tail into the disk tier: still there for kAllTiers.
  index.Moved(0, std::span(h).subspan(2), KvTierKind::kPool, KvTierKind::kDisk);
  EXPECT_EQ(index.LeadingBlocks(h, w)[0], 2);
  EXPECT_EQ(index.LeadingBlocks(h, w, kAllTiers)[0], 4);
  EXPECT_EQ(index.Summary(0, KvTierKind::kDisk).blocks, 2u);
  // Loaded back: in both (the tier is inclusive).
  index.Stored(0, std::span(h).subspan(2));
  EXPECT_EQ(index.LeadingBlocks(h, w)[0], 4);
  EXPECT_EQ(index.Summary(0, KvTierKind::kDisk).blocks, 2u);
  // Removed from the pool: the disk copy stays; removed from disk: gone.
  index.Removed(0, std::span(h).subspan(3));
  EXPECT_EQ(index.LeadingBlocks(h, w)[0], 3);
  EXPECT_EQ(index.LeadingBlocks(h, w, kAllTiers)[0], 4);
  index.Removed(0, std::span(h).subspan(3), KvTierKind::kDisk);
  EXPECT_EQ(index.LeadingBlocks(h, w, kAllTiers)[0], 3);
  // A tier-only entry outlives an expired speculation on the same hash.
  index.Removed(0, std::span(h).first(3));
  EXPECT_EQ(index.num_hashes(), 1u);  // h[2], on disk only
  index.Speculate(0, std::span(h).subspan(2, 1), absl::ZeroDuration());
  EXPECT_EQ(index.LeadingBlocks(std::span(h).subspan(2), w, kAllTiers)[0], 1);
  // cleared (ClearWorker) forgets every tier.
  index.ClearWorker(0);
  EXPECT_EQ(index.num_hashes(), 0u);
}

TEST(PrefixIndexTest, UnknownHashesAndTiersNeverCrash) {
  PrefixIndex index;
  using engine::KvTierKind;
  const auto h = Chain(3, 1);
  const auto unknown = Chain(3, 2);
  const std::vector<WorkerIndex> w = {0};
  index.Stored(0, h, KvTierKind::kDisk);
  index.Removed(0, unknown, KvTierKind::kDisk);
  index.Removed(0, unknown);
  index.Moved(0, unknown, KvTierKind::kHostMemory, KvTierKind::kPool);
  const auto bad = static_cast<KvTierKind>(200);
  index.Stored(0, unknown, bad);
  index.Removed(0, h, bad);
  index.Moved(0, h, KvTierKind::kDisk, bad);
  EXPECT_EQ(index.Summary(0, bad).blocks, 0u);
  EXPECT_EQ(index.LeadingBlocks(h, w, kAllTiers)[0], 3);
  // The moved unknown hashes are now in worker 0's pool (it says so).
  EXPECT_EQ(index.LeadingBlocks(unknown, w)[0], 3);
}

// The running summaries equal a recount from the holders after any mix of
// stores, removals, moves, speculation, expiry and clears.
TEST(PrefixIndexTest, IncrementalSummariesMatchARecount) {
  using engine::KvTierKind;
  FakeClock clock;
  PrefixIndex index(clock.fn());
  std::mt19937_64 rng(7);
  const auto h = Chain(64, 3);
  constexpr int kWorkers = 3;
  // What each worker holds per tier, as the events say.
  std::vector<std::array<std::set<size_t>, engine::kNumKvTierKinds>> want(
      kWorkers);
  const KvTierKind tiers[] = {KvTierKind::kPool, KvTierKind::kHostMemory,
                              KvTierKind::kDisk};
  for (int step = 0; step < 5000; ++step) {
    const WorkerIndex w = static_cast<WorkerIndex>(rng() % kWorkers);
    const size_t i = rng() % h.size();
    const KvTierKind t = tiers[rng() % 3];
    auto& set = want[w][static_cast<size_t>(t)];
    switch (rng() % 8) {
      case 0:
      case 1:
      case 2:
        index.Stored(w, std::span(h).subspan(i, 1), t);
        set.insert(i);
        break;
      case 3:
      case 4:
        index.Removed(w, std::span(h).subspan(i, 1), t);
        set.erase(i);
        break;
      case 5: {
        const KvTierKind to = tiers[rng() % 3];
        if (to == t) break;
        index.Moved(w, std::span(h).subspan(i, 1), t, to);
        set.erase(i);
        want[w][static_cast<size_t>(to)].insert(i);
        break;
      }
      case 6:
        index.Speculate(w, std::span(h).subspan(i, 1), absl::Milliseconds(5));
        clock.now += absl::Milliseconds(1);
        break;
      case 7:
        if (rng() % 50 == 0) {
          index.ClearWorker(w);
          for (auto& s : want[w]) s.clear();
        }
        break;
    }
    for (int v = 0; v < kWorkers; ++v) {
      for (KvTierKind tier : tiers) {
        PrefixIndex::WorkerSummary recount;
        for (size_t k : want[v][static_cast<size_t>(tier)]) {
          ++recount.blocks;
          recount.digest.hi ^= h[k].hi;
          recount.digest.lo ^= h[k].lo;
        }
        const PrefixIndex::WorkerSummary got = index.Summary(v, tier);
        ASSERT_EQ(got.blocks, recount.blocks) << "step " << step;
        ASSERT_EQ(got.digest, recount.digest) << "step " << step;
      }
    }
  }
}

// ClearWorker erases only the worker's own entries; each worker's reverse
// index holds exactly its entries.
TEST(PrefixIndexTest, ClearWorkerLeavesOtherWorkersAndReverseIndexesExact) {
  PrefixIndex index;
  const auto a = Chain(1000, 1), b = Chain(10, 2);
  index.Stored(0, a);
  index.Stored(1, b);
  index.Stored(1, std::span(a).first(5));
  EXPECT_EQ(index.Memory().reverse_entries, index.Memory().holders);
  index.ClearWorker(1);
  const std::vector<WorkerIndex> w = {0, 1};
  EXPECT_EQ(index.LeadingBlocks(a, w), (std::vector<int32_t>{1000, 0}));
  EXPECT_EQ(index.num_hashes(), 1000u);
  EXPECT_EQ(index.Memory().holders, 1000u);
  EXPECT_EQ(index.Memory().reverse_entries, 1000u);
  EXPECT_EQ(index.Summary(1).blocks, 0u);
  EXPECT_EQ(index.Summary(0).blocks, 1000u);
}

// Events that arrive while a clear is still erasing (a resync's snapshot)
// count, and the erasing does not take them away.
TEST(PrefixIndexTest, StoresDuringAClearSurviveIt) {
  PrefixIndex index;
  const auto h = Chain(200'000, 5);
  index.Stored(0, h);
  std::thread clear([&] { index.ClearWorker(0); });
  // Re-stored while the clear may still run.
  index.Stored(0, std::span(h).first(100));
  clear.join();
  std::vector<int32_t> counts = {0};
  index.LeadingBlocksOfPrompt(
      h.size(), [&](size_t i) { return h[i]; }, &counts);
  ASSERT_GE(counts.size(), 1u);
  // Either order of the two leaves at most the re-stored blocks, and the
  // index agrees with its own summary.
  EXPECT_LE(counts[0], 100);
  EXPECT_EQ(index.Summary(0).blocks, static_cast<size_t>(counts[0]));
  EXPECT_EQ(index.num_hashes(), static_cast<size_t>(counts[0]));
  index.ClearWorker(0);
  EXPECT_EQ(index.num_hashes(), 0u);
  EXPECT_EQ(index.Memory().reverse_entries, 0u);
}

TEST(PrefixIndexTest, MatchEndsFromWorkerSetsAgreeWithTheListsPastTheSets) {
  // The walk reads whose match ends at a block from each entry's worker
  // sets, and from the holder lists where the sets cannot tell: a holder
  // past the sets' workers, or speculative holders of which some have
  // expired and some not. Each case must give the exact counts.
  FakeClock clock;
  PrefixIndex index(clock.fn());
  const auto h = Chain(64, 91);
  index.Stored(3, std::span(h).first(40));
  index.Stored(127, std::span(h).first(20));
  index.Stored(200, std::span(h).first(30));  // past the sets
  index.Speculate(64, std::span(h).first(50), absl::Milliseconds(100));
  index.Speculate(65, std::span(h).first(10), absl::Milliseconds(300));
  const std::vector<WorkerIndex> ids = {3, 64, 65, 127, 200, 9};
  auto check = [&](const char* when) {
    std::vector<int32_t> counts;
    index.LeadingBlocksOfPrompt(h, &counts);
    std::vector<int32_t> got;
    for (WorkerIndex w : ids)
      got.push_back(static_cast<size_t>(w) < counts.size() ? counts[w] : 0);
    EXPECT_EQ(got, index.LeadingBlocks(h, ids)) << when;
    return got;
  };
  EXPECT_EQ(check("all live"), (std::vector<int32_t>{40, 50, 10, 20, 30, 0}));
  clock.now += absl::Milliseconds(200);  // worker 64's speculation expired
  EXPECT_EQ(check("one expired"), (std::vector<int32_t>{40, 0, 10, 20, 30, 0}));
  index.Removed(200, std::span(h).first(30));  // no holder past the sets
  index.Removed(3, std::span(h).subspan(25));
  EXPECT_EQ(check("tails removed"),
            (std::vector<int32_t>{25, 0, 10, 20, 0, 0}));
  clock.now += absl::Milliseconds(200);  // every speculation expired
  EXPECT_EQ(check("all expired"), (std::vector<int32_t>{25, 0, 0, 20, 0, 0}));
}

}  // namespace
}  // namespace pdserve::router
