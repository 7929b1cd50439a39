// A process-wide pool of kernel helper threads that never makes the calling
// thread wait for a helper to wake up.
//
// RunChunks(tasks, chunk, threads, fn) runs fn over [0, tasks) in chunks that
// the calling thread and up to threads - 1 helpers claim from one counter.
// The caller starts claiming at once; a helper joins only if it is awake
// while unclaimed chunks are left, and the caller waits only for chunks a
// helper has claimed and not finished. An OpenMP parallel region instead
// waits at its start for every team thread to arrive and at its end for
// every one to leave: with dozens of small GEMMs per decode step on a shared
// 2-core machine, a preempted partner stalled each of them (measured:
// 9-19 ms of a 14-37 ms step in region starts, `bench engine --profile`).
// Here a descheduled helper costs nothing unless it holds a claimed chunk.
//
// Helpers that cost more than they give are left out for a while
// (HelpPolicy): on a shared host a helper preempted while it holds a chunk
// makes the caller wait a whole scheduling slice, and a short GEMM then runs
// slower on two threads than on one (measured: all GEMMs of a `small` bf16
// decode step, 1 thread 1.5 ms, 2 threads 4-5 ms median, with another process
// busy on the second core).
//
// Helpers spin briefly after a job (consecutive GEMMs of a step are
// microseconds apart), then sleep until the next one is published.
// Which thread runs a chunk must not change any result (the kernels' order
// contract), so callers stay deterministic. One job at a time: a RunChunks
// that finds the pool busy (another thread's job) runs its chunks alone on
// the calling thread. fn must not call RunChunks.
#pragma once

#include <cstdint>

#include "absl/functional/function_ref.h"

namespace pdserve::kernels {

// fn(begin, end, first): tasks [begin, end); `first` is true on the first
// chunk a thread runs in this call (for per-thread set-up such as packing;
// it runs after a successful claim, so a late helper never touches the
// caller's data once the call has returned).
using ChunkFn = absl::FunctionRef<void(int64_t begin, int64_t end, bool first)>;

// threads: the most threads to use, the caller included (<= 1: the caller
// alone). Returns when every task has run.
void RunChunks(int64_t tasks, int64_t chunk, int threads, ChunkFn fn);

// RunChunks where the calling thread claims chunks from the front, in
// order, and the helpers from the back, in reverse: where the helpers keep
// up, each thread's chunks are then next to each other (a GEMM's weight
// tiles one stream per thread) while a claim is still one chunk, so a
// preempted helper holds no more than one. Over 65,535 tasks it is
// RunChunks.
void RunChunksFromBothEnds(int64_t tasks, int64_t chunk, int threads,
                           ChunkFn fn);
// Inside fn: whether this thread claimed its chunk from the back of a
// RunChunksFromBothEnds job (its next chunk, if any, lies below).
bool ClaimingFromBack();

// What the last RunChunks on this thread waited for (for --profile):
// publish_ns from entry to the caller's first chunk, wait_ns from the
// caller's last chunk until every claimed chunk was done, and whether any
// helper ran a chunk.
struct ChunkRunStats {
  int64_t publish_ns = 0;
  int64_t wait_ns = 0;
  bool helped = false;
  bool backed_off = false;  // ran alone because HelpPolicy said so
};
const ChunkRunStats& LastChunkRunStats();

// Decides, job by job, whether helpers may join. After each helped job the
// caller compares its wait for the helpers' chunks with what those chunks
// would have cost it at its own pace (its time per task in that job); when
// the wait exceeded twice that plus 50 us (a preempted helper, not one that
// joined late), the next `backoff` jobs run on the caller alone, and the
// backoff doubles on every further loss (4 up to 512 jobs) and falls back to 4
// after a job the helpers sped up. Not thread-safe: the pool calls it only
// from the thread that currently owns the helpers.
class HelpPolicy {
 public:
  HelpPolicy();
  // Whether the next job may publish to helpers.
  bool UseHelpers();
  // One helped job: the caller ran own_tasks of tasks in own_ns, then waited
  // wait_ns for the rest.
  void Record(int64_t own_ns, int64_t own_tasks, int64_t tasks,
              int64_t wait_ns);
  int64_t losses() const { return losses_; }

 private:
  int backoff_;
  int solo_left_ = 0;
  int64_t losses_ = 0;
};

// Runs fn(0) on the calling thread and fn(1) .. fn(threads - 1) on threads
// started for this call, and returns when every one has returned; none of
// them outlives the call. For measurements (a memory triad, an FMA peak) that
// run just before timed kernels: an OpenMP team instead keeps polling for its
// next region for a while after one ends, and on a 2-core machine that
// poller takes the core the pool's helper needs in the first milliseconds of
// whatever runs next (measured: the 32 GEMMs of a `small` bf16 decode step
// right after a 1 GiB OpenMP triad ran at 0.27-0.75 of the triad's rate, and
// at 0.76-0.77 with OMP_WAIT_POLICY=passive; an OpenMP team here burns 5.7-7.7
// ms of CPU after each region).
void RunOnOwnThreads(int threads, absl::FunctionRef<void(int index)> fn);

// Wakes the helpers that a RunChunks over `threads` would use and returns
// once each has taken a (empty) task, so that they poll for the next job as
// they do between the kernels of back-to-back steps; after timeout_ns it
// stops waiting. For benchmarks whose timed step follows a pause (cache
// flushes, a triad) longer than the helpers' polling, after which they sleep
// and the first kernels of the step would run before they wake. True if
// every helper took its task in time; false also when another job runs.
bool WakeKernelHelpers(int threads, int64_t timeout_ns = 100'000'000);

// Forgets the pool's HelpPolicy history (tests that need helpers to join).
void ResetHelpPolicyForTesting();

}  // namespace pdserve::kernels
