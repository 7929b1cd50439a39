#include "kernels/cpu/task_pool.h"

#include <atomic>
#include <chrono>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/idle_cpu_testing.h"

namespace pdserve::kernels {
namespace {

TEST(RunOnOwnThreadsTest,
     EachIndexRunsOnceOnItsOwnThreadAndNoneOutlivesTheCall) {
  for (int threads : {0, 1, 2, 4}) {
    const auto before = idle_cpu::ThreadIds();
    std::vector<std::thread::id> ran_on(std::max(threads, 1));
    std::vector<std::atomic<int>> runs(std::max(threads, 1));
    RunOnOwnThreads(threads, [&](int i) {
      ran_on[i] = std::this_thread::get_id();
      runs[i]++;
    });
    EXPECT_EQ(ran_on[0], std::this_thread::get_id()) << threads;
    std::set<std::thread::id> distinct(ran_on.begin(), ran_on.end());
    EXPECT_EQ(distinct.size(), ran_on.size()) << threads;
    for (auto& r : runs) EXPECT_EQ(r.load(), 1) << threads;
    EXPECT_EQ(idle_cpu::ThreadsStartedSince(before), 0) << threads;
  }
}

// Both claim orders; 70,000 tasks is past what a two-ended claim holds, so
// RunChunksFromBothEnds runs it as RunChunks.
TEST(TaskPoolTest, RunsEveryTaskOnceForAnyChunkAndThreadCount) {
  for (auto* run : {&RunChunks, &RunChunksFromBothEnds}) {
    for (int threads : {1, 2, 4}) {
      for (int64_t tasks : {0, 1, 2, 3, 17, 1000, 70000}) {
        for (int64_t chunk : {1, 3, 64}) {
          std::vector<std::atomic<int>> hits(tasks);
          run(tasks, chunk, threads, [&](int64_t begin, int64_t end, bool) {
            ASSERT_LE(end - begin, chunk);
            ASSERT_LT(begin, end);
            for (int64_t t = begin; t < end; ++t) hits[t]++;
          });
          for (int64_t t = 0; t < tasks; ++t) {
            ASSERT_EQ(hits[t].load(), 1)
                << "task " << t << " of " << tasks << ", chunk " << chunk
                << ", threads " << threads
                << (run == &RunChunks ? ", one end" : ", both ends");
          }
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
  ResetHelpPolicyForTesting();
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

TEST(TaskPoolTest, WakeKernelHelpersReturnsOnceEachHelperTookATask) {
  EXPECT_TRUE(WakeKernelHelpers(1));
  for (int threads : {2, 3}) {
    // Longer than the helpers poll: they sleep.
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_TRUE(WakeKernelHelpers(threads, /*timeout_ns=*/2'000'000'000))
        << threads;
  }
  // The pool runs jobs as before.
  std::vector<std::atomic<int>> hits(100);
  RunChunks(100, 3, 3, [&](int64_t begin, int64_t end, bool) {
    for (int64_t t = begin; t < end; ++t) hits[t]++;
  });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
}

// Jobs published while the helpers poll, while they fall asleep (their
// poll lasts 200 us) and while they sleep: each job still wakes them, and
// each task runs once.
TEST(TaskPoolTest, HelpersWakeForJobsPublishedAroundTheirSleep) {
  for (int rep = 0; rep < 60; ++rep) {
    std::this_thread::sleep_for(std::chrono::microseconds(150 + 5 * rep));
    ASSERT_TRUE(WakeKernelHelpers(2, /*timeout_ns=*/2'000'000'000))
        << "a helper missed job " << rep;
    std::vector<std::atomic<int>> hits(64);
    RunChunks(64, 1, 2, [&](int64_t begin, int64_t end, bool) {
      for (int64_t t = begin; t < end; ++t) hits[t]++;
    });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  }
}

TEST(HelpPolicyTest, KeepsHelpersWhileTheySpeedJobsUp) {
  HelpPolicy policy;
  for (int job = 0; job < 100; ++job) {
    ASSERT_TRUE(policy.UseHelpers());
    // Half the tasks each, and a short wait for the helper's last chunk.
    policy.Record(/*own_ns=*/1000, /*own_tasks=*/8, /*tasks=*/16,
                  /*wait_ns=*/100);
  }
  EXPECT_EQ(policy.losses(), 0);
}

TEST(HelpPolicyTest, AStalledHelperSendsJobsToTheCallerWithGrowingBackoff) {
  HelpPolicy policy;
  ASSERT_TRUE(policy.UseHelpers());
  // The helper took one chunk and was descheduled: the caller ran 15 of 16
  // tasks in 15 us, then waited 3 ms for the last.
  policy.Record(15000, 15, 16, 3'000'000);
  EXPECT_EQ(policy.losses(), 1);
  auto solo_jobs = [&] {
    int n = 0;
    while (!policy.UseHelpers()) ++n;
    return n;
  };
  EXPECT_EQ(solo_jobs(), 4);
  policy.Record(15000, 15, 16, 3'000'000);  // the probe loses again
  EXPECT_EQ(solo_jobs(), 8);
  policy.Record(15000, 15, 16, 3'000'000);
  EXPECT_EQ(solo_jobs(), 16);
  for (int i = 0; i < 10; ++i) {
    policy.Record(15000, 15, 16, 3'000'000);
    solo_jobs();
  }
  policy.Record(15000, 15, 16, 3'000'000);
  EXPECT_EQ(solo_jobs(), 512);  // capped
  // A probe that the helpers sped up resets the backoff.
  policy.Record(1000, 8, 16, 100);
  EXPECT_TRUE(policy.UseHelpers());
  policy.Record(15000, 15, 16, 3'000'000);
  EXPECT_EQ(solo_jobs(), 4);
}

TEST(HelpPolicyTest, OnlyAWaitWellBeyondTheHelpersShareIsALoss) {
  HelpPolicy policy;
  // The caller ran 12 of 16 tasks in 120 us (10 us each): the helpers' 4
  // would have cost it 40 us. A late helper finishing its last chunk (a 45 us
  // wait) is no loss; a wait beyond 2 x 40 + 50 us is.
  policy.Record(120000, 12, 16, 45000);
  EXPECT_EQ(policy.losses(), 0);
  EXPECT_TRUE(policy.UseHelpers());
  policy.Record(120000, 12, 16, 129000);
  EXPECT_EQ(policy.losses(), 0);
  EXPECT_TRUE(policy.UseHelpers());
  policy.Record(120000, 12, 16, 131000);
  EXPECT_EQ(policy.losses(), 1);
  EXPECT_FALSE(policy.UseHelpers());
}

// A helper that is descheduled while it holds chunks: the pool backs off and
// runs the following jobs on the caller, and every task still runs once.
TEST(TaskPoolTest, BacksOffFromAHelperThatStallsTheCaller) {
  ResetHelpPolicyForTesting();
  bool backed_off = false;
  int rep = 0;
  for (; rep < 200 && !backed_off; ++rep) {
    std::vector<std::atomic<int>> hits(32);
    const std::thread::id caller = std::this_thread::get_id();
    RunChunks(32, 1, 2, [&](int64_t begin, int64_t end, bool) {
      // The helper's chunks take 5 ms, the caller's 50 us.
      std::this_thread::sleep_for(std::this_thread::get_id() != caller
                                      ? std::chrono::microseconds(5000)
                                      : std::chrono::microseconds(50));
      for (int64_t t = begin; t < end; ++t) hits[t]++;
    });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
    RunChunks(32, 1, 2, [&](int64_t, int64_t, bool) {});
    backed_off = LastChunkRunStats().backed_off;
  }
  EXPECT_TRUE(backed_off) << "no back-off after " << rep << " jobs";
  ResetHelpPolicyForTesting();
}

}  // namespace
}  // namespace pdserve::kernels
