#include "kernels/cpu/task_pool.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace pdserve::kernels {
namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// How long an idle helper keeps polling for the next job before it sleeps,
// and how long the caller polls for claimed chunks before it yields its CPU
// (to a helper that may be waiting for it on the same core).
constexpr int64_t kHelperSpinNs = 200'000;
constexpr int64_t kCallerSpinNs = 20'000;

// Jobs run on the caller alone after a job that helpers slowed down: the
// first backoff, and the most it doubles to.
constexpr int kMinBackoffJobs = 4;
constexpr int kMaxBackoffJobs = 512;
constexpr double kLossSlackNs = 50'000;

thread_local ChunkRunStats last_stats;
// Set on a helper while it runs a chunk of a two-ended job.
thread_local bool claiming_from_back = false;
// A two-ended claim keeps both ends in 16 bits each.
constexpr int64_t kMaxTwoEndedTasks = 0xffff;

}  // namespace

bool HelpPolicy::UseHelpers() {
  if (solo_left_ == 0) return true;
  --solo_left_;
  return false;
}

void HelpPolicy::Record(int64_t own_ns, int64_t own_tasks, int64_t tasks,
                        int64_t wait_ns) {
  if (own_tasks <= 0 || own_tasks >= tasks) return;  // no helper ran
  // The helpers' tasks at the caller's own pace: what running them here
  // would have cost, against what waiting for them did cost.
  const double alone_ns = static_cast<double>(own_ns) *
                          static_cast<double>(tasks - own_tasks) /
                          static_cast<double>(own_tasks);
  // A helper that joined late and holds the last chunk makes the wait about
  // equal to that estimate; only a wait well beyond it (a helper that was
  // descheduled: milliseconds) counts as a loss.
  if (static_cast<double>(wait_ns) > 2 * alone_ns + kLossSlackNs) {
    solo_left_ = backoff_;
    backoff_ = std::min(backoff_ * 2, kMaxBackoffJobs);
    ++losses_;
  } else {
    backoff_ = kMinBackoffJobs;
  }
}

HelpPolicy::HelpPolicy() : backoff_(kMinBackoffJobs) {}

namespace {

class TaskPool {
 public:
  static TaskPool& Get() {
    static TaskPool* pool = new TaskPool();  // helpers live as long as the
    return *pool;                            // process: never destroyed
  }

  // A job of threads - 1 empty tasks that only helpers take: it ends once
  // each was claimed, by then a helper polls for the next job. After
  // timeout_ns the caller takes what is left. True if helpers took every
  // task.
  bool Wake(int threads, int64_t timeout_ns) {
    if (threads <= 1) return true;
    if (busy_.exchange(true)) return false;
    EnsureHelpers(threads - 1);
    const int64_t tasks = threads - 1;
    std::atomic<int64_t> by_helpers{0};
    const int64_t start = NowNs();
    // A helper waits in its task until every task is taken, so that each
    // task goes to a different helper.
    auto count = [&](int64_t begin, int64_t end, bool) {
      by_helpers.fetch_add(end - begin, std::memory_order_acq_rel);
      while (by_helpers.load(std::memory_order_acquire) < tasks &&
             NowNs() - start < timeout_ns) {
        _mm_pause();
      }
    };
    const ChunkFn fn = count;
    const uint32_t gen = Publish(Job{&fn, tasks, 1, threads - 1});
    while (done_.load(std::memory_order_acquire) < tasks &&
           NowNs() - start < timeout_ns) {
      std::this_thread::yield();
    }
    // What no helper took in time: claimed here, not counted.
    int64_t begin, end, own = 0;
    while (Claim(gen, tasks, 1, false, false, &begin, &end)) own += end - begin;
    done_.fetch_add(own, std::memory_order_acq_rel);
    while (done_.load(std::memory_order_acquire) < tasks)
      std::this_thread::yield();
    busy_.store(false, std::memory_order_release);
    return by_helpers.load() == tasks;  // the caller ran none of them
  }

  // Waits until no job runs, then forgets the policy's history.
  void ResetPolicy() {
    while (busy_.exchange(true)) std::this_thread::yield();
    policy_ = HelpPolicy();
    busy_.store(false, std::memory_order_release);
  }

  void Run(int64_t tasks, int64_t chunk, int threads, ChunkFn fn,
           bool both_ends) {
    ChunkRunStats& stats = last_stats;
    stats = ChunkRunStats();
    const int64_t start = NowNs();
    chunk = std::max<int64_t>(chunk, 1);
    if (tasks <= 0) return;
    auto run_alone = [&] {  // in the same chunks: the results do not
      for (int64_t begin = 0; begin < tasks; begin += chunk)  // depend on it
        fn(begin, std::min(tasks, begin + chunk), begin == 0);
    };
    if (threads <= 1 || tasks <= chunk || busy_.exchange(true)) {
      run_alone();
      return;
    }
    // busy_ is ours: the policy is only read and written under it.
    if (!policy_.UseHelpers()) {
      busy_.store(false, std::memory_order_release);
      stats.backed_off = true;
      run_alone();
      return;
    }
    EnsureHelpers(threads - 1);
    both_ends = both_ends && tasks <= kMaxTwoEndedTasks;
    const uint32_t gen =
        Publish(Job{&fn, tasks, chunk, threads - 1, both_ends});
    bool first = true;
    int64_t begin, end, own = 0, own_start = 0;
    while (Claim(gen, tasks, chunk, both_ends, /*from_back=*/false, &begin,
                 &end)) {
      if (first) {
        own_start = NowNs();
        stats.publish_ns = own_start - start;
      }
      fn(begin, end, first);
      first = false;
      own += end - begin;
    }
    const int64_t wait_start = NowNs();
    done_.fetch_add(own, std::memory_order_acq_rel);
    while (done_.load(std::memory_order_acquire) < tasks) {
      if (NowNs() - wait_start > kCallerSpinNs) {
        sched_yield();
      } else {
        _mm_pause();
      }
    }
    stats.wait_ns = NowNs() - wait_start;
    stats.helped = own < tasks;
    policy_.Record(wait_start - own_start, own, tasks, stats.wait_ns);
    busy_.store(false, std::memory_order_release);
  }

 private:
  struct Job {
    const ChunkFn* fn = nullptr;
    int64_t tasks = 0, chunk = 1;
    int helpers = 0;  // helpers with index < helpers may join
    bool both_ends = false;
  };

  // Makes `job` the current one, under a new generation (returned), and
  // wakes the helpers that sleep. The caller holds busy_. No lock unless a
  // helper sleeps: job g goes in slot g % 2, which job g + 2 can overwrite
  // only after every task of g was claimed and done, so a helper that reads
  // a slot and then claims a task of g has read g's job (see HelperLoop).
  uint32_t Publish(const Job& job) {
    const uint32_t gen = ++gen_counter_;
    JobSlot& slot = slots_[gen % 2];
    slot.fn.store(job.fn, std::memory_order_relaxed);
    slot.tasks.store(job.tasks, std::memory_order_relaxed);
    slot.chunk.store(job.chunk, std::memory_order_relaxed);
    slot.helpers.store(job.helpers, std::memory_order_relaxed);
    slot.both_ends.store(job.both_ends, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    // One-ended: the next task. Two-ended: the front's next task in the low
    // 16 bits, the back's end (one past its next task) in the high 16.
    claim_.store(
        uint64_t{gen} << 32 |
            (job.both_ends ? static_cast<uint64_t>(job.tasks) << 16 : 0),
        std::memory_order_release);
    // Sequentially consistent with the sleepers' count: either a helper
    // going to sleep sees this generation, or this sees it counted.
    published_.store(gen, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      absl::MutexLock lock(&mu_);
      cv_.SignalAll();
    }
    return gen;
  }

  // Claims the next chunk of job `gen`; false when the job is exhausted or
  // already replaced by a newer one. Two-ended jobs: from_back claims the
  // chunk below the back's end, else the one at the front.
  bool Claim(uint32_t gen, int64_t tasks, int64_t chunk, bool both_ends,
             bool from_back, int64_t* begin, int64_t* end) {
    uint64_t cur = claim_.load(std::memory_order_acquire);
    for (;;) {
      if (static_cast<uint32_t>(cur >> 32) != gen) return false;
      uint64_t next_word;
      if (!both_ends) {
        const int64_t next = static_cast<int64_t>(cur & 0xffffffffu);
        if (next >= tasks) return false;
        *begin = next;
        *end = std::min(tasks, next + chunk);
        next_word = static_cast<uint64_t>(*end);
      } else {
        const int64_t front = static_cast<int64_t>(cur & 0xffffu);
        const int64_t back = static_cast<int64_t>((cur >> 16) & 0xffffu);
        if (front >= back) return false;
        if (from_back) {
          *begin = std::max(front, back - chunk);
          *end = back;
          next_word = static_cast<uint64_t>(*begin) << 16 |
                      static_cast<uint64_t>(front);
        } else {
          *begin = front;
          *end = std::min(back, front + chunk);
          next_word =
              static_cast<uint64_t>(back) << 16 | static_cast<uint64_t>(*end);
        }
      }
      if (claim_.compare_exchange_weak(cur, (uint64_t{gen} << 32) | next_word,
                                       std::memory_order_acq_rel)) {
        return true;
      }
    }
  }

  void EnsureHelpers(int count) {
    if (helpers_started_.load(std::memory_order_acquire) >= count) return;
    absl::MutexLock lock(&start_mu_);
    int have = helpers_started_.load(std::memory_order_relaxed);
    for (; have < count; ++have) {
      std::thread([this, index = have] { HelperLoop(index); }).detach();
    }
    helpers_started_.store(have, std::memory_order_release);
  }

  void HelperLoop(int index) {
    // Named for ps/top and for tools that set helpers' priority.
    pthread_setname_np(pthread_self(), "pdserve-kernel");
    // Generation 0 is no job: a helper started for a job that is already
    // published (EnsureHelpers runs first, but the thread may start late)
    // still finds it; Claim refuses it once it is over.
    uint32_t seen = 0;
    for (;;) {
      // Poll for a new job for a while, then sleep until one is published.
      const int64_t spin_start = NowNs();
      int polls = 0;
      while (published_.load(std::memory_order_acquire) == seen) {
        _mm_pause();
        if (++polls % 64 == 0 && NowNs() - spin_start > kHelperSpinNs) break;
      }
      if (published_.load(std::memory_order_acquire) == seen) {
        absl::MutexLock lock(&mu_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        while (published_.load(std::memory_order_seq_cst) == seen) {
          cv_.Wait(&mu_);
        }
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      const uint32_t gen = published_.load(std::memory_order_acquire);
      // The slot holds job gen, or a later one if gen is over; a later one
      // is never run, because Claim refuses gen once it is over.
      const JobSlot& slot = slots_[gen % 2];
      Job job;
      job.fn = slot.fn.load(std::memory_order_relaxed);
      job.tasks = slot.tasks.load(std::memory_order_relaxed);
      job.chunk = slot.chunk.load(std::memory_order_relaxed);
      job.helpers = slot.helpers.load(std::memory_order_relaxed);
      job.both_ends = slot.both_ends.load(std::memory_order_relaxed);
      seen = gen;
      if (index >= job.helpers) continue;
      bool first = true;
      int64_t begin, end;
      while (Claim(gen, job.tasks, job.chunk, job.both_ends,
                   /*from_back=*/true, &begin, &end)) {
        // The claim keeps job `gen` (and *job.fn) alive until done_ counts
        // this chunk.
        claiming_from_back = job.both_ends;
        (*job.fn)(begin, end, first);
        claiming_from_back = false;
        first = false;
        done_.fetch_add(end - begin, std::memory_order_acq_rel);
      }
    }
  }

  struct JobSlot {
    std::atomic<const ChunkFn*> fn{nullptr};
    std::atomic<int64_t> tasks{0}, chunk{1};
    std::atomic<int> helpers{0};
    std::atomic<bool> both_ends{false};
  };

  HelpPolicy policy_;         // only touched by the thread that holds busy_
  uint32_t gen_counter_ = 0;  // only touched by the thread that holds busy_
  JobSlot slots_[2];          // job g in slots_[g % 2]
  absl::Mutex mu_;            // sleeping helpers wait on cv_ under it
  absl::CondVar cv_;
  std::atomic<int> sleepers_{0};
  std::atomic<uint32_t> published_{0};  // the newest generation
  std::atomic<uint64_t> claim_{0};      // generation << 32 | next task(s)
  std::atomic<int64_t> done_{0};        // tasks finished in this job
  std::atomic<bool> busy_{false};       // a caller is running a job
  absl::Mutex start_mu_;
  std::atomic<int> helpers_started_{0};
};

}  // namespace

void RunChunks(int64_t tasks, int64_t chunk, int threads, ChunkFn fn) {
  TaskPool::Get().Run(tasks, chunk, threads, fn, /*both_ends=*/false);
}

void RunChunksFromBothEnds(int64_t tasks, int64_t chunk, int threads,
                           ChunkFn fn) {
  TaskPool::Get().Run(tasks, chunk, threads, fn, /*both_ends=*/true);
}

bool ClaimingFromBack() { return claiming_from_back; }

const ChunkRunStats& LastChunkRunStats() { return last_stats; }

void RunOnOwnThreads(int threads, absl::FunctionRef<void(int index)> fn) {
  std::vector<std::thread> others;
  others.reserve(std::max(threads - 1, 0));
  for (int i = 1; i < threads; ++i) others.emplace_back([fn, i] { fn(i); });
  fn(0);
  for (std::thread& t : others) t.join();
}

bool WakeKernelHelpers(int threads, int64_t timeout_ns) {
  return TaskPool::Get().Wake(threads, timeout_ns);
}

void ResetHelpPolicyForTesting() { TaskPool::Get().ResetPolicy(); }

}  // namespace pdserve::kernels
