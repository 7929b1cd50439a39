#include "engine/engine_loop.h"

#include "common/logging.h"

namespace pdserve::engine {

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

EngineLoop::EngineLoop(std::unique_ptr<Engine> engine)
    : engine_(std::move(engine)),
      spec_(engine_->kv_spec()),
      max_model_len_(engine_->max_model_len()),
      num_blocks_(engine_->block_manager().num_blocks()) {
  stats_ = engine_->Stats();
  thread_ = std::thread([this] { Run(); });
}

EngineLoop::~EngineLoop() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void EngineLoop::Post(std::function<void(Engine&)> fn) {
  absl::MutexLock l(&mu_);
  tasks_.push_back(std::move(fn));
}

absl::StatusOr<std::shared_ptr<RequestStream>> EngineLoop::Submit(
    EngineRequest request) {
  return Call([this, req = std::move(request)](Engine& e) mutable
              -> absl::StatusOr<std::shared_ptr<RequestStream>> {
    const std::string id = req.id;
    if (absl::Status s = e.AddRequest(std::move(req)); !s.ok()) return s;
    return AttachStream(id);
  });
}

std::shared_ptr<RequestStream> EngineLoop::AttachStream(const std::string& id) {
  auto stream = std::make_shared<RequestStream>();
  streams_[id] = stream;
  return stream;
}

void EngineLoop::Abort(const std::string& id) {
  Post([id](Engine& e) { e.Abort(id); });
}

EngineStats EngineLoop::stats() const {
  absl::MutexLock l(&mu_);
  return stats_;
}

void EngineLoop::Run() {
  while (true) {
    std::deque<std::function<void(Engine&)>> tasks;
    {
      absl::MutexLock l(&mu_);
      const bool has_work = engine_->HasWork();
      if (!has_work) {
        mu_.AwaitWithTimeout(
            absl::Condition(
                +[](EngineLoop* loop) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                  return loop->stop_ || !loop->tasks_.empty();
                },
                this),
            absl::Milliseconds(100));
      }
      if (stop_) return;
      tasks.swap(tasks_);
    }
    for (auto& t : tasks) t(*engine_);
    if (engine_->HasWork()) {
      auto outputs = engine_->Step();
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
          const bool finished = out.finish != FinishReason::kNone;
          it->second->Push(std::move(out));
          if (finished) streams_.erase(it);
        }
      }
    }
    absl::MutexLock l(&mu_);
    stats_ = engine_->Stats();
  }
}

}  // namespace pdserve::engine
