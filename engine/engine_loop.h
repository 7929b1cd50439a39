// The engine thread of a worker (STYLE.md: one engine thread owns the
// scheduler and the KV pool; gRPC threads hand work to it through a queue).
//
// Other threads run closures on the engine thread with Call(), and receive a
// request's StepOutputs through a RequestStream they registered. The loop
// steps the engine whenever it has work and otherwise sleeps until a closure
// arrives. Thread-safe.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
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
  // Ends the stream with an engine error (step failure).
  void Fail(absl::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status error() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  std::deque<StepOutput> queue_ ABSL_GUARDED_BY(mu_);
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

class EngineLoop {
 public:
  explicit EngineLoop(std::unique_ptr<Engine> engine);
  ~EngineLoop();
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  // Runs `fn(engine)` on the engine thread and returns its result.
  template <typename F>
  auto Call(F fn) -> decltype(fn(std::declval<Engine&>())) {
    using R = decltype(fn(std::declval<Engine&>()));
    absl::Mutex done_mu;
    bool done = false;
    std::optional<R> result;
    Post([&](Engine& e) {
      R r = fn(e);
      absl::MutexLock l(&done_mu);
      result.emplace(std::move(r));
      done = true;
    });
    absl::MutexLock l(&done_mu);
    done_mu.Await(absl::Condition(&done));
    return std::move(*result);
  }

  // Adds a request whose outputs go to the returned stream.
  absl::StatusOr<std::shared_ptr<RequestStream>> Submit(EngineRequest request);
  // Routes outputs of an existing (e.g. reserved) request to a new stream.
  // Must run on the engine thread (inside Call).
  std::shared_ptr<RequestStream> AttachStream(const std::string& id);
  // Aborts a request if it is still live; safe from any thread.
  void Abort(const std::string& id);

  // Stats as of the last step, without waiting for the engine thread.
  EngineStats stats() const ABSL_LOCKS_EXCLUDED(mu_);
  const KvCacheSpec& kv_spec() const { return spec_; }
  int32_t max_model_len() const { return max_model_len_; }
  int64_t num_blocks() const { return num_blocks_; }
  // The KV pool, for transfers that read blocks the engine keeps pinned for
  // them (held or reserved blocks are never written by the engine thread).
  KvPool& pool_for_transfer() { return engine_->pool(); }

 private:
  void Post(std::function<void(Engine&)> fn) ABSL_LOCKS_EXCLUDED(mu_);
  void Run();

  std::unique_ptr<Engine> engine_;
  const KvCacheSpec spec_;
  const int32_t max_model_len_;
  const int64_t num_blocks_;
  mutable absl::Mutex mu_;
  std::deque<std::function<void(Engine&)>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  EngineStats stats_ ABSL_GUARDED_BY(mu_);
  // Engine thread only.
  absl::flat_hash_map<std::string, std::shared_ptr<RequestStream>> streams_;
  std::thread thread_;
};

}  // namespace pdserve::engine
