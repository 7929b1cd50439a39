// A worker's registration with a router: RegisterWorker at once, then again
// every `interval` as the heartbeat, until Stop. The router treats a worker
// whose heartbeats stop as gone (router/worker_registry.h).
//
// Thread-safety: thread-safe. One background thread per registration. Stop
// (and the destructor) returns within one RPC's cancellation, not one
// interval: it wakes the sleeping thread and cancels an RPC in flight.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "pdserve/v1/internal.grpc.pb.h"

namespace pdserve::worker {

struct RegistrationConfig {
  std::string router;   // host:port of the router's RouterControl service
  std::string address;  // what the router dials back (the advertised address)
  v1::WorkerRole role = v1::WORKER_ROLE_UNSPECIFIED;
  absl::Duration interval = absl::Seconds(2);
  absl::Duration rpc_timeout = absl::Seconds(2);

  absl::Status Validate() const;
};

class RouterRegistration {
 public:
  // Starts the heartbeat thread. `credentials` are the internal channel's
  // (mTLS, or insecure with --insecure).
  static absl::StatusOr<std::unique_ptr<RouterRegistration>> Start(
      const RegistrationConfig& config,
      std::shared_ptr<grpc::ChannelCredentials> credentials);
  ~RouterRegistration();
  RouterRegistration(const RouterRegistration&) = delete;
  RouterRegistration& operator=(const RouterRegistration&) = delete;

  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  // Heartbeats the router accepted so far, and the last one's status.
  int64_t accepted() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status last_status() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  RouterRegistration(const RegistrationConfig& config,
                     std::shared_ptr<grpc::ChannelCredentials> credentials);
  void Run() ABSL_LOCKS_EXCLUDED(mu_);

  const RegistrationConfig config_;
  std::unique_ptr<v1::RouterControl::Stub> stub_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* in_flight_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t accepted_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status last_status_ ABSL_GUARDED_BY(mu_);
  bool warned_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace pdserve::worker
