// The router's view of the cluster: workers from static flags, DNS names (a
// Kubernetes headless Service) or registration, each polled for status
// (heartbeat) and subscribed to for KV events that feed the PrefixIndex.
// A worker that stops answering is marked down and its index entries are
// dropped; it comes back when it answers again. A worker that registered
// itself and then stays down (neither answering polls nor re-registering)
// for `forget_registered_after` is forgotten; static and DNS entries stay
// (DNS ones until they leave DNS).
//
// A forgotten worker's entry (and its channel) is evicted once nothing refers
// to it: no poll or event stream in flight and no routed request still
// charged to it. Its index entries are cleared again and its WorkerIndex
// reused, so
// registry slots, index state and per-worker vectors stay bounded by the
// workers alive at once however often addresses change (pod-IP churn).
//
// Status polls are asynchronous and concurrent, one in flight per worker, so
// a worker that hangs delays only its own status. Every RPC the registry has
// in flight is cancellable: Stop() cancels them all and returns once they
// have ended, whatever the workers do. Thread-safe.
#pragma once

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv_cache/block_manager.h"
#include "pdserve/v1/internal.grpc.pb.h"
#include "router/prefix_index.h"

namespace pdserve::router {

// Every routing decision reads the fields before `status` of every worker,
// and a few of the status's, so they come first: a decision over N workers
// then touches about three cache lines of each view, not its whole length
// and a sub-message elsewhere on the heap.
struct WorkerView {
  WorkerIndex index = -1;
  v1::WorkerRole role = v1::WORKER_ROLE_UNSPECIFIED;
  // status.layout().block_size(), copied with the status like role and
  // fingerprint.
  int32_t block_size = 0;
  bool up = false;
  engine::ModelFingerprint fingerprint{};
  // Router-side in-flight accounting, exact between heartbeats: prefill
  // tokens routed whose first token has not come back, and open requests.
  int64_t routed_prefill_tokens = 0;
  int64_t routed_requests = 0;
  v1::WorkerStatus status;
  std::string address;
  std::string id;
  std::shared_ptr<v1::Worker::Stub> stub;
};

struct RegistryConfig {
  // "host:port" or "dns:name:port" entries per role.
  std::vector<std::string> prefill, decode, both;
  absl::Duration heartbeat = absl::Milliseconds(500);  // between status polls
  // Deadline of one status poll.
  absl::Duration status_timeout = absl::Seconds(1);
  // Consecutive polls a worker may miss by the deadline before it is marked
  // down: a worker busy with long steps on a loaded machine answers late, not
  // never. Any other failure (refused connection, error) marks it down at once.
  int max_missed_polls = 3;
  // A registered worker down this long (no answered poll, no re-registration)
  // is forgotten. Workers re-register every few seconds.
  absl::Duration forget_registered_after = absl::Minutes(1);
  // A KV event stream that delivers nothing this long is cancelled and
  // re-opened (a worker sends a batch at least every second), which also
  // bounds a subscription stuck connecting to a worker that hangs.
  absl::Duration event_stream_idle_timeout = absl::Seconds(10);
  // Sent in every status poll (WorkerInfoRequest.peer_pull_key): the key
  // workers check this router's peer-pull grants with. Empty: none.
  std::string peer_pull_key;
  // A forgotten worker's entry is evicted this long after it was forgotten
  // (and once nothing refers to it): a grace period for a request routed
  // from a view taken just before, whose load accounting still names it.
  absl::Duration evict_retired_after = absl::Seconds(10);

  absl::Status Validate() const;
};

class WorkerRegistry {
 public:
  WorkerRegistry(RegistryConfig config, PrefixIndex* index);
  ~WorkerRegistry();
  // Starts polling. At most once.
  void Start() ABSL_LOCKS_EXCLUDED(mu_);
  // Cancels every RPC in flight and joins every thread; returns within about
  // one RPC cancellation however the workers behave. Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  // Adds (or refreshes) a worker that announced itself; a forgotten one
  // comes back.
  void Register(const std::string& address, v1::WorkerRole role)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Workers currently up, as one snapshot shared by every caller until a
  // worker's view changes (its status, state or role; AddLoad updates the
  // snapshot's counters in place while nobody else holds it). Routing reads
  // it per request: copying 64 views with their status messages would cost
  // more than the decision.
  std::shared_ptr<const std::vector<WorkerView>> UpSnapshot() const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The same, copied.
  std::vector<WorkerView> UpWorkers() const;
  std::vector<WorkerView> AllWorkers() const;
  // A call to this worker just failed at the transport level: mark it down
  // until a heartbeat succeeds again.
  void ReportFailure(WorkerIndex index);
  // Router-side load accounting (deltas; negative when work completes).
  void AddLoad(WorkerIndex index, int64_t prefill_tokens, int64_t requests);
  // Worker slots held: listed workers plus forgotten ones not yet evicted.
  size_t slots() const ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks until at least `n` workers are up or `timeout` passes.
  bool WaitForWorkers(size_t n, absl::Duration timeout) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry;
  struct StatusPoll;
  void PollLoop() ABSL_LOCKS_EXCLUDED(mu_);
  // Issues one asynchronous status poll unless one is in flight.
  void StartPoll(Entry* entry) ABSL_LOCKS_EXCLUDED(mu_);
  // A status poll's completion, on a gRPC thread.
  void OnStatus(Entry* entry, StatusPoll* poll, const grpc::Status& st)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Starts the KV event thread of entries that answered but have none.
  void StartEventStreams() ABSL_LOCKS_EXCLUDED(mu_);
  // Cancels event streams idle past the timeout; forgets registered workers
  // down past forget_registered_after.
  void Sweep(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  void EventLoop(Entry* entry) ABSL_LOCKS_EXCLUDED(mu_);
  void ResolveDns() ABSL_LOCKS_EXCLUDED(mu_);
  // The entry for `address`, created (and `*added` set) if there is none.
  Entry* Add(const std::string& address, v1::WorkerRole role,
             bool* added = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What retiring entries leaves to its caller once mu_ is released: a
  // cancelled call may complete inline, and a completion takes mu_.
  struct Retired {
    std::vector<WorkerIndex> indices;  // their index entries: ClearWorker
    std::vector<std::shared_ptr<StatusPoll>> polls;             // cancelled
    std::vector<std::shared_ptr<grpc::ClientContext>> streams;  // cancelled
  };
  // No longer polled, routed to or counted; its calls in flight and index
  // entries go to `out`, for Release once mu_ is released. It keeps its
  // channel until eviction: a callback call must not outlive its channel.
  void Retire(Entry* e, Retired* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A retired entry that comes back: polled and routed to again, on a fresh
  // channel unless a poll is still in flight on the old one. Returns the old
  // one, to be dropped once mu_ is released.
  std::shared_ptr<v1::Worker::Stub> Revive(Entry* e)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Cancels the polls and streams, then clears the index entries.
  void Release(const Retired& retired) ABSL_LOCKS_EXCLUDED(mu_);
  // Evicts retired entries nothing refers to any more, freeing their index.
  void EvictRetired() ABSL_LOCKS_EXCLUDED(mu_);
  // Drops the snapshot: called wherever a view changes, except for the
  // load counters.
  void ViewsChanged() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { up_.reset(); }

  const RegistryConfig config_;
  PrefixIndex* const index_;
  mutable absl::Mutex mu_;
  // By WorkerIndex; null where an evicted entry's index awaits reuse.
  std::vector<std::unique_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  // UpSnapshot()'s, built on the first call after a change; with each
  // WorkerIndex's position in it (-1: not in it).
  mutable std::shared_ptr<std::vector<WorkerView>> up_ ABSL_GUARDED_BY(mu_);
  mutable std::vector<int32_t> up_position_ ABSL_GUARDED_BY(mu_);
  std::vector<WorkerIndex> free_indices_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int polls_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread poll_thread_;  // touched only by Start and Stop
};

}  // namespace pdserve::router
