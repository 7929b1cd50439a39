#include "engine/engine_loop.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_cause.h"

namespace pdserve::engine {
namespace {

absl::Status Stopped() {
  return absl::UnavailableError("the engine loop has stopped");
}

}  // namespace

void RequestStream::Push(StepOutput out) {
  absl::MutexLock l(&mu_);
  queue_.push_back(std::move(out));
}

std::vector<StepOutput> RequestStream::Pop(absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  mu_.AwaitWithTimeout(
      absl::Condition(
          +[](RequestStream* s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return !s->queue_.empty() || !s->error_.ok();
          },
          this),
      timeout);
  std::vector<StepOutput> out(std::make_move_iterator(queue_.begin()),
                              std::make_move_iterator(queue_.end()));
  queue_.clear();
  return out;
}

void RequestStream::Fail(absl::Status status) {
  absl::MutexLock l(&mu_);
  error_ = std::move(status);
}

absl::Status RequestStream::error() const {
  absl::MutexLock l(&mu_);
  return error_;
}

EngineLoop::EngineLoop(std::unique_ptr<Engine> engine,
                       std::function<void(bool busy)> on_busy)
    : engine_(std::move(engine)),
      on_busy_(std::move(on_busy)),
      spec_(engine_->kv_spec()),
      max_model_len_(engine_->max_model_len()),
      num_blocks_(engine_->block_manager().num_blocks()),
      max_queued_calls_(engine_->config().max_queued_calls),
      max_pending_reservations_(engine_->config().max_pending_reservations) {
  stats_ = engine_->Stats();
  // A request (or reservation) whose KV tier reads are in flight waits for
  // them; each finished read wakes the engine thread to retry admission.
  if (KvTier* tier = engine_->kv_tier()) {
    tier->SetReadListener([this] {
      Task wake;
      wake.run = [this](Engine&) { free_at_last_try_ = -1; };
      Post(std::move(wake), /*new_work=*/false).IgnoreError();
    });
  }
  thread_ = std::thread([this] { Run(); });
}

EngineLoop::~EngineLoop() {
  Stop();
  thread_.join();
  // Waits for a listener call in progress: none touches this loop after.
  if (KvTier* tier = engine_->kv_tier()) tier->SetReadListener(nullptr);
}

void EngineLoop::Stop() {
  absl::MutexLock l(&mu_);
  stop_ = true;
}

absl::Status EngineLoop::Post(Task task, bool new_work) {
  absl::MutexLock l(&mu_);
  if (stop_) return Stopped();
  if (new_work) {
    if (queued_new_work_ >= max_queued_calls_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("engine loop busy: ", queued_new_work_,
                       " new requests already queued for the engine thread "
                       "(max_queued_calls)"));
    }
    ++queued_new_work_;
  }
  task.new_work = new_work;
  tasks_.push_back(std::move(task));
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<RequestStream>> EngineLoop::Submit(
    EngineRequest request) {
  return CallImpl(
      [this, req = std::move(request)](
          Engine& e) mutable -> absl::StatusOr<std::shared_ptr<RequestStream>> {
        const std::string id = req.id;
        if (absl::Status s = e.AddRequest(std::move(req)); !s.ok()) return s;
        return AttachStream(id);
      },
      /*new_work=*/true);
}

absl::StatusOr<Reservation> EngineLoop::Reserve(
    EngineRequest request, absl::Time admit_by,
    std::function<bool()> cancelled) {
  using State = PendingReservation::State;
  auto w = std::make_shared<PendingReservation>();
  w->request = std::move(request);
  Task task;
  task.run = [this, w](Engine&) { EnqueueReservation(w); };
  task.fail = [w](const absl::Status& s) {
    absl::MutexLock l(&w->mu);
    if (w->state != State::kWaiting) return;
    w->result = s;
    w->state = State::kDone;
  };
  if (absl::Status s = Post(std::move(task), /*new_work=*/true); !s.ok())
    return s;

  absl::Status gave_up;
  {
    absl::MutexLock l(&w->mu);
    const absl::Condition decided(
        +[](PendingReservation* p) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return p->state == State::kDone;
        },
        w.get());
    while (true) {
      const absl::Time wake =
          cancelled ? std::min(admit_by, absl::Now() + absl::Milliseconds(50))
                    : admit_by;
      w->mu.AwaitWithDeadline(decided, wake);
      if (w->state == State::kDone) return std::move(w->result);
      if (absl::Now() >= admit_by) {
        gave_up = WithCause(
            absl::ResourceExhaustedError(
                "KV cache full: the reservation was not admitted in time"),
            StatusCause::kPoolBusy);
        break;
      }
      if (cancelled && cancelled()) {
        gave_up = absl::CancelledError(
            "request cancelled while waiting for KV blocks");
        break;
      }
    }
    w->state = State::kAbandoned;
  }
  // Leave the queue now rather than when the entry reaches its head, so that
  // abandoned waiters never count against max_pending_reservations for long.
  Task remove;
  remove.run = [this, w](Engine&) {
    auto it = std::find(reservations_.begin(), reservations_.end(), w);
    if (it == reservations_.end()) return;
    if (it == reservations_.begin()) free_at_last_try_ = -1;
    reservations_.erase(it);
    num_pending_reservations_.store(static_cast<int64_t>(reservations_.size()),
                                    std::memory_order_relaxed);
  };
  Post(std::move(remove), /*new_work=*/false).IgnoreError();
  return gave_up;
}

void EngineLoop::EnqueueReservation(std::shared_ptr<PendingReservation> w) {
  using State = PendingReservation::State;
  absl::StatusOr<Reservation> result;
  bool wait = false;
  if (reservations_.empty()) {
    result = engine_->Reserve(w->request);
    wait = !result.ok() && CauseOf(result.status()) == StatusCause::kPoolBusy;
    if (wait) free_at_last_try_ = engine_->block_manager().num_free();
  } else {
    // FIFO: never ahead of those already waiting, but refused at once for
    // what waiting cannot cure (a bad request, one that never fits).
    absl::Status valid = engine_->Validate(w->request);
    wait = valid.ok();
    if (!wait) result = valid;
  }
  if (wait) {
    if (static_cast<int64_t>(reservations_.size()) <
        max_pending_reservations_) {
      reservations_.push_back(std::move(w));
      num_pending_reservations_.store(
          static_cast<int64_t>(reservations_.size()),
          std::memory_order_relaxed);
      return;
    }
    result = WithCause(absl::ResourceExhaustedError(absl::StrCat(
                           "KV cache full and ", reservations_.size(),
                           " reservations already wait for blocks "
                           "(max_pending_reservations)")),
                       StatusCause::kPoolBusy);
  }
  absl::MutexLock l(&w->mu);
  if (w->state == State::kWaiting) {
    w->result = std::move(result);
    w->state = State::kDone;
    return;
  }
  // The caller gave up while this task was queued: return what it got.
  if (result.ok()) engine_->Abort(w->request.id);
}

void EngineLoop::ServeReservations() {
  using State = PendingReservation::State;
  while (!reservations_.empty()) {
    std::shared_ptr<PendingReservation> w = reservations_.front();
    {
      absl::MutexLock l(&w->mu);
      if (w->state == State::kWaiting) {
        const int64_t free = engine_->block_manager().num_free();
        if (free == free_at_last_try_) break;  // nothing was released
        absl::StatusOr<Reservation> r = engine_->Reserve(w->request);
        if (!r.ok() && CauseOf(r.status()) == StatusCause::kPoolBusy) {
          free_at_last_try_ = free;
          break;
        }
        w->result = std::move(r);
        w->state = State::kDone;
      }
    }
    reservations_.pop_front();
    free_at_last_try_ = -1;
  }
  num_pending_reservations_.store(static_cast<int64_t>(reservations_.size()),
                                  std::memory_order_relaxed);
}

std::shared_ptr<RequestStream> EngineLoop::AttachStream(const std::string& id) {
  auto stream = std::make_shared<RequestStream>();
  streams_[id] = stream;
  return stream;
}

void EngineLoop::DetachStream(const std::string& id, RequestStream* stream) {
  auto it = streams_.find(id);
  if (it != streams_.end() && it->second.get() == stream) {
    // Still routed, so the request is still live: its final output (an
    // abort) will find no stream and hold nothing.
    streams_.erase(it);
    engine_->Abort(id);
  }
  // Only the engine thread pushes, so nothing arrives after this drain.
  for (StepOutput& out : stream->Pop(absl::ZeroDuration())) {
    if (!out.held_blocks.empty()) engine_->ReleaseBlocks(out.held_blocks);
  }
}

void EngineLoop::Abort(const std::string& id) {
  Task task;
  task.run = [id](Engine& e) { e.Abort(id); };
  // After Stop there is no engine step left to free anything for.
  Post(std::move(task), /*new_work=*/false).IgnoreError();
}

int64_t EngineLoop::num_queued_calls() const {
  absl::MutexLock l(&mu_);
  return static_cast<int64_t>(tasks_.size());
}

EngineStats EngineLoop::stats() const {
  absl::MutexLock l(&mu_);
  return stats_;
}

void EngineLoop::FailEverything(std::deque<Task> tasks) {
  const absl::Status stopped = Stopped();
  for (Task& t : tasks) {
    if (t.fail) t.fail(stopped);
  }
  using State = PendingReservation::State;
  for (auto& w : reservations_) {
    absl::MutexLock l(&w->mu);
    if (w->state != State::kWaiting) continue;
    w->result = stopped;
    w->state = State::kDone;
  }
  reservations_.clear();
  num_pending_reservations_.store(0, std::memory_order_relaxed);
  for (auto& [id, stream] : streams_) stream->Fail(stopped);
  streams_.clear();
}

void EngineLoop::Run() {
  // True after a step that scheduled nothing and emitted nothing while
  // nothing runs: requests wait for blocks that only a task (a release, an
  // abort, a new reservation) or time can free. The loop then sleeps until
  // a task arrives, for at most a couple of milliseconds, instead of
  // spinning a core on empty steps.
  bool stalled = false;
  bool busy = false;
  auto set_busy = [&](bool b) {
    if (b == busy) return;
    busy = b;
    if (on_busy_) on_busy_(b);
  };
  while (true) {
    std::deque<Task> tasks;
    bool stopping = false;
    {
      absl::MutexLock l(&mu_);
      const bool has_work = engine_->HasWork();
      if (!has_work) set_busy(false);
      if (!has_work || stalled) {
        mu_.AwaitWithTimeout(
            absl::Condition(
                +[](EngineLoop* loop) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                  return loop->stop_ || !loop->tasks_.empty();
                },
                this),
            has_work ? absl::Milliseconds(2) : absl::Milliseconds(100));
      }
      tasks.swap(tasks_);
      queued_new_work_ = 0;
      stopping = stop_;
    }
    if (stopping) {
      set_busy(false);
      // Post refuses everything from now on, so `tasks` is the last batch.
      FailEverything(std::move(tasks));
      return;
    }
    for (Task& t : tasks) t.run(*engine_);
    engine_->PublishTierEvents();  // KV tier writes finished while idle
    ServeReservations();
    stalled = false;
    if (engine_->HasWork()) {
      set_busy(true);
      const int64_t steps_before = engine_->Stats().steps;
      const absl::Time step_start = absl::Now();
      auto outputs = engine_->Step();
      step_seconds_ += absl::ToDoubleSeconds(absl::Now() - step_start);
      stalled = outputs.ok() && outputs->empty() &&
                engine_->Stats().steps == steps_before;
      if (!outputs.ok()) {
        // A failed step is a bug or corrupt weights: fail every live stream
        // rather than hang them, and drop their requests.
        PDSERVE_LOG(ERROR) << "engine step failed: " << outputs.status();
        for (auto& [id, stream] : streams_) {
          stream->Fail(outputs.status());
          engine_->Abort(id);
        }
        streams_.clear();
      } else {
        for (auto& out : *outputs) {
          auto it = streams_.find(out.id);
          if (it == streams_.end()) {
            // Nobody listens (e.g. held blocks of an abandoned prefill): return
            // them.
            if (!out.held_blocks.empty())
              engine_->ReleaseBlocks(out.held_blocks);
            continue;
          }
          if (!out.error.ok()) {  // the request ended with an engine error
            it->second->Fail(out.error);
            streams_.erase(it);
            continue;
          }
          const bool finished = out.finish != FinishReason::kNone;
          it->second->Push(std::move(out));
          if (finished) streams_.erase(it);
        }
        ServeReservations();
      }
    }
    absl::MutexLock l(&mu_);
    stats_ = engine_->Stats();
    stats_.step_seconds = step_seconds_;
  }
}

}  // namespace pdserve::engine
