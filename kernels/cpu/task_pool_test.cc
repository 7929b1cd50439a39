#include "kernels/cpu/task_pool.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace pdserve::kernels {
namespace {

TEST(TaskPoolTest, RunsEveryTaskOnceForAnyChunkAndThreadCount) {
  for (int threads : {1, 2, 4}) {
    for (int64_t tasks : {0, 1, 2, 3, 17, 1000}) {
      for (int64_t chunk : {1, 3, 64}) {
        std::vector<std::atomic<int>> hits(tasks);
        RunChunks(tasks, chunk, threads, [&](int64_t begin, int64_t end, bool) {
          ASSERT_LE(end - begin, chunk);
          for (int64_t t = begin; t < end; ++t) hits[t]++;
        });
        for (int64_t t = 0; t < tasks; ++t) {
          ASSERT_EQ(hits[t].load(), 1)
              << "task " << t << " of " << tasks << ", chunk " << chunk
              << ", threads " << threads;
        }
      }
    }
  }
}

TEST(TaskPoolTest, FirstIsTrueOnceAndOnlyOnEachThreadsFirstChunk) {
  for (int rep = 0; rep < 200; ++rep) {
    std::atomic<int> firsts{0}, chunks{0};
    RunChunks(64, 1, 2, [&](int64_t, int64_t, bool first) {
      thread_local int last_rep = -1;
      chunks++;
      if (first) {
        firsts++;
        EXPECT_NE(last_rep, rep) << "a second first chunk on one thread";
        last_rep = rep;
      } else {
        EXPECT_EQ(last_rep, rep) << "a chunk before this thread's first";
      }
    });
    EXPECT_EQ(chunks.load(), 64);
    EXPECT_GE(firsts.load(), 1);
    EXPECT_LE(firsts.load(), 2);
  }
}

// Nothing runs after RunChunks returns: each job writes into a buffer that
// the caller overwrites right after, so a late helper chunk would show.
TEST(TaskPoolTest, NoChunkRunsAfterTheCallReturns) {
  std::vector<int> data(256);
  for (int job = 0; job < 2000; ++job) {
    RunChunks(256, 1, 2, [&](int64_t begin, int64_t end, bool) {
      for (int64_t t = begin; t < end; ++t) data[t] = job;
    });
    for (int v : data) ASSERT_EQ(v, job);
    std::fill(data.begin(), data.end(), -1);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  for (int v : data) EXPECT_EQ(v, -1);
}

// Two callers at once: one gets the helpers, the other runs alone; both
// complete every task.
TEST(TaskPoolTest, ConcurrentCallersEachCompleteTheirTasks) {
  std::atomic<int64_t> sums[2] = {0, 0};
  auto caller = [&](int id) {
    for (int job = 0; job < 300; ++job) {
      RunChunks(100, 2, 2, [&](int64_t begin, int64_t end, bool) {
        for (int64_t t = begin; t < end; ++t) sums[id] += t;
      });
    }
  };
  std::thread a(caller, 0), b(caller, 1);
  a.join();
  b.join();
  EXPECT_EQ(sums[0].load(), 300 * 4950);
  EXPECT_EQ(sums[1].load(), 300 * 4950);
}

TEST(TaskPoolTest, StatsSayWhetherAHelperRan) {
  RunChunks(4, 1, 1, [](int64_t, int64_t, bool) {});
  EXPECT_FALSE(LastChunkRunStats().helped);
  // A helper takes part once it is awake: with chunks that each take a
  // while, some run on it within a few tries.
  bool helped = false;
  for (int rep = 0; rep < 50 && !helped; ++rep) {
    RunChunks(64, 1, 2, [](int64_t, int64_t, bool) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    });
    helped = LastChunkRunStats().helped;
  }
  EXPECT_TRUE(helped);
}

}  // namespace
}  // namespace pdserve::kernels
