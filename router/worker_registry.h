// The router's view of the cluster: workers from static flags, DNS names (a
// Kubernetes headless Service) or registration, each polled for status
// (heartbeat) and subscribed to for KV events that feed the PrefixIndex.
// A worker that stops answering is marked down and its index entries are
// dropped; it comes back when it answers again. Thread-safe.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/block_manager.h"
#include "pdserve/v1/internal.grpc.pb.h"
#include "router/prefix_index.h"

namespace pdserve::router {

struct WorkerView {
  WorkerIndex index = -1;
  std::string address;
  std::string id;
  v1::WorkerRole role = v1::WORKER_ROLE_UNSPECIFIED;
  bool up = false;
  v1::WorkerStatus status;
  engine::ModelFingerprint fingerprint{};
  // Router-side in-flight accounting, exact between heartbeats: prefill
  // tokens routed whose first token has not come back, and open requests.
  int64_t routed_prefill_tokens = 0;
  int64_t routed_requests = 0;
  std::shared_ptr<v1::Worker::Stub> stub;
};

struct RegistryConfig {
  // "host:port" or "dns:name:port" entries per role.
  std::vector<std::string> prefill, decode, both;
  absl::Duration heartbeat = absl::Milliseconds(500);
};

class WorkerRegistry {
 public:
  WorkerRegistry(RegistryConfig config, PrefixIndex* index);
  ~WorkerRegistry();
  void Start();
  void Stop();
  // Adds (or refreshes) a worker that announced itself.
  void Register(const std::string& address, v1::WorkerRole role);
  // Workers currently up.
  std::vector<WorkerView> UpWorkers() const;
  std::vector<WorkerView> AllWorkers() const;
  // A call to this worker just failed at the transport level: mark it down
  // until a heartbeat succeeds again.
  void ReportFailure(WorkerIndex index);
  // Router-side load accounting (deltas; negative when work completes).
  void AddLoad(WorkerIndex index, int64_t prefill_tokens, int64_t requests);
  // Blocks until at least `n` workers are up or `timeout` passes.
  bool WaitForWorkers(size_t n, absl::Duration timeout) const;

 private:
  struct Entry;
  void PollLoop();
  void EventLoop(Entry* entry);
  void ResolveDns();
  Entry* Add(const std::string& address, v1::WorkerRole role)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  RegistryConfig config_;
  PrefixIndex* index_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

}  // namespace pdserve::router
