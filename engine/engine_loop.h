// The engine thread of a worker (STYLE.md: one engine thread owns the
// scheduler and the KV pool; gRPC threads hand work to it through a queue).
//
// Other threads run closures on the engine thread with Call(), and receive a
// request's StepOutputs through a RequestStream they registered. The loop
// steps the engine whenever it has work and otherwise sleeps until a closure
// arrives. Reservations that do not fit yet wait here, on the engine side, in
// FIFO order, and are retried whenever blocks were released or a KV tier
// read ended (a disk tier reads on its own thread; see kv_cache/kv_tier.h).
//
// Shutdown (Stop or the destructor) never leaves a caller waiting: queued
// calls, waiting reservations and live streams fail with UNAVAILABLE, and
// later calls fail at once. Work queued by new requests (Submit, Reserve) is
// bounded by EngineConfig::max_queued_calls and max_pending_reservations;
// clean-up (Call, Abort) is never refused while the loop runs, so that a
// request that got in can always give its blocks back. Thread-safe.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/engine.h"

namespace pdserve::engine {

// Outputs of one request, filled by the engine thread, drained by a handler.
class RequestStream {
 public:
  void Push(StepOutput out) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits up to `timeout` for outputs; returns what is queued (maybe none).
  std::vector<StepOutput> Pop(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the stream with an engine error (step failure, shutdown).
  void Fail(absl::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status error() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  std::deque<StepOutput> queue_ ABSL_GUARDED_BY(mu_);
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

namespace internal {
template <typename T>
struct IsStatusOr : std::false_type {};
template <typename T>
struct IsStatusOr<absl::StatusOr<T>> : std::true_type {};
// What Call returns for a closure returning R: R itself when it already is a
// status, absl::Status for void, absl::StatusOr<R> otherwise.
template <typename R>
using CallResult = std::conditional_t<
    std::is_void_v<R>, absl::Status,
    std::conditional_t<std::is_same_v<R, absl::Status> || IsStatusOr<R>::value,
                       R, absl::StatusOr<R>>>;
}  // namespace internal

class EngineLoop {
 public:
  // on_busy(true) runs on the engine thread before a step when the loop had
  // no work, on_busy(false) when it runs out of work and waits (e.g. to lend
  // its cores to a neighbour: kernels::CoreShare). May be null.
  explicit EngineLoop(std::unique_ptr<Engine> engine,
                      std::function<void(bool busy)> on_busy = nullptr);
  // Stop(), then waits for the engine thread.
  ~EngineLoop();
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  // Runs `fn(engine)` on the engine thread and returns its result, or
  // UNAVAILABLE if the loop stopped before it ran. Never call it on the
  // engine thread.
  template <typename F>
  auto Call(F fn) {
    return CallImpl(std::move(fn), /*new_work=*/false);
  }

  // Adds a request whose outputs go to the returned stream. RESOURCE_EXHAUSTED
  // when max_queued_calls are queued; UNAVAILABLE after Stop.
  absl::StatusOr<std::shared_ptr<RequestStream>> Submit(EngineRequest request);

  // Engine::Reserve in FIFO order with every other reservation of this loop.
  // When the blocks are busy the request waits here, on the engine side, and
  // is retried each time blocks were released, until `admit_by` (then
  // RESOURCE_EXHAUSTED, cause kPoolBusy) or until `cancelled` returns true
  // (then CANCELLED; polled every 50 ms, may be null). A request that could
  // never fit is refused at once (RESOURCE_EXHAUSTED, cause kNeverFits); so
  // is one beyond max_pending_reservations. Blocks the calling thread.
  absl::StatusOr<Reservation> Reserve(EngineRequest request,
                                      absl::Time admit_by,
                                      std::function<bool()> cancelled = {});

  // Routes outputs of an existing (e.g. reserved) request to a new stream.
  // Must run on the engine thread (inside Call).
  std::shared_ptr<RequestStream> AttachStream(const std::string& id);
  // The handler of `stream` gives up on it. Must run on the engine thread
  // (inside Call). Outputs are no longer routed to it, the request is
  // aborted if it is still live, and blocks held by outputs the stream got
  // but nobody popped go back to the pool: this is what keeps a request that
  // finished while its handler gave up from pinning its blocks for good.
  void DetachStream(const std::string& id, RequestStream* stream);
  // Aborts a request if it is still live; safe from any thread.
  void Abort(const std::string& id);

  // Begins shutdown and returns at once: later calls fail with UNAVAILABLE;
  // the engine thread finishes the closure or step it is in, then fails
  // queued calls, waiting reservations and live streams with UNAVAILABLE and
  // exits. Idempotent; may run on any thread, the engine thread included.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  // Stats as of the last step, without waiting for the engine thread.
  EngineStats stats() const ABSL_LOCKS_EXCLUDED(mu_);
  // Closures queued for the engine thread right now (all kinds).
  int64_t num_queued_calls() const ABSL_LOCKS_EXCLUDED(mu_);
  // Reservations waiting for blocks right now.
  int64_t num_pending_reservations() const {
    return num_pending_reservations_.load(std::memory_order_relaxed);
  }
  const KvCacheSpec& kv_spec() const { return spec_; }
  int32_t max_model_len() const { return max_model_len_; }
  int64_t num_blocks() const { return num_blocks_; }
  // The KV pool, for transfers that read blocks the engine keeps pinned for
  // them (held or reserved blocks are never written by the engine thread).
  // The engine's KV storage, for transports (host or device spans).
  KvStorage& kv_storage_for_transfer() { return engine_->kv_storage(); }

 private:
  struct Task {
    std::function<void(Engine&)> run;
    // Called instead of `run` when the loop stops first; may be null.
    std::function<void(const absl::Status&)> fail;
    bool new_work = false;  // counts against max_queued_calls
  };
  // A Reserve() caller waiting for blocks. The engine thread decides it
  // (kDone) unless the caller gave up first (kAbandoned); `mu` makes that
  // decision exactly once.
  struct PendingReservation {
    enum class State { kWaiting, kDone, kAbandoned };
    EngineRequest request;
    absl::Mutex mu;
    State state ABSL_GUARDED_BY(mu) = State::kWaiting;
    absl::StatusOr<Reservation> result ABSL_GUARDED_BY(mu);
  };

  template <typename F>
  auto CallImpl(F fn, bool new_work) {
    using R = decltype(fn(std::declval<Engine&>()));
    using Out = internal::CallResult<R>;
    struct State {
      absl::Mutex mu;
      bool done ABSL_GUARDED_BY(mu) = false;
      std::optional<Out> result ABSL_GUARDED_BY(mu);
    } st;
    Task task;
    task.run = [&](Engine& e) {
      if constexpr (std::is_void_v<R>) {
        fn(e);
        absl::MutexLock l(&st.mu);
        st.result.emplace(absl::OkStatus());
        st.done = true;
      } else {
        Out r = fn(e);
        absl::MutexLock l(&st.mu);
        st.result.emplace(std::move(r));
        st.done = true;
      }
    };
    task.fail = [&](const absl::Status& s) {
      absl::MutexLock l(&st.mu);
      st.result.emplace(s);
      st.done = true;
    };
    if (absl::Status posted = Post(std::move(task), new_work); !posted.ok())
      return Out(posted);
    absl::MutexLock l(&st.mu);
    st.mu.Await(absl::Condition(&st.done));
    return Out(std::move(*st.result));
  }

  // Queues `task`; UNAVAILABLE after Stop, RESOURCE_EXHAUSTED for new work
  // beyond max_queued_calls.
  absl::Status Post(Task task, bool new_work) ABSL_LOCKS_EXCLUDED(mu_);
  void Run();
  // Engine thread: a new reservation, served now or queued behind others.
  void EnqueueReservation(std::shared_ptr<PendingReservation> w);
  // Engine thread: admits waiting reservations from the head while they fit.
  void ServeReservations();
  // Engine thread, on exit: fails everything still waiting.
  void FailEverything(std::deque<Task> tasks);

  std::unique_ptr<Engine> engine_;
  const std::function<void(bool)> on_busy_;
  const KvCacheSpec spec_;
  const int32_t max_model_len_;
  const int64_t num_blocks_;
  const int64_t max_queued_calls_;
  const int64_t max_pending_reservations_;
  mutable absl::Mutex mu_;
  std::deque<Task> tasks_ ABSL_GUARDED_BY(mu_);
  int64_t queued_new_work_ ABSL_GUARDED_BY(mu_) = 0;  // of tasks_
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  EngineStats stats_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> num_pending_reservations_{0};
  // Engine thread only.
  double step_seconds_ = 0;  // summed wall time of Engine::Step
  absl::flat_hash_map<std::string, std::shared_ptr<RequestStream>> streams_;
  std::deque<std::shared_ptr<PendingReservation>> reservations_;
  // Free blocks when the head reservation last failed to fit; it is retried
  // only once this changed (-1: never tried).
  int64_t free_at_last_try_ = -1;
  std::thread thread_;
};

}  // namespace pdserve::engine
