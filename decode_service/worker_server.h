// One worker process: the engine thread, the internal Worker and KvTransfer
// gRPC services (with health and reflection), the KV event stream for the
// router, and the worker metrics. Roles: "prefill" serves Prefill, "decode"
// serves Generate (and prefills locally when asked), "both" serves all —
// the colocated baseline. Thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/metrics.h"
#include "engine/engine.h"

namespace pdserve::decode {

struct WorkerConfig {
  std::string role = "both";  // prefill | decode | both
  std::string model_dir;
  engine::EngineConfig engine;
  std::string listen_host = "127.0.0.1";  // 0.0.0.0 in containers
  int port = 0;                           // 0: any free port
  std::string advertise_host;  // how others reach us; default listen_host
  std::string id;              // default role@host:port
  absl::Duration admission_timeout = absl::Seconds(10);
  absl::Duration kv_stall_timeout = absl::Seconds(10);
  std::string kv_transport = "grpc";

  absl::Status Validate() const;
};

class WorkerServer {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerServer>> Start(
      const WorkerConfig& config, metrics::Registry* registry);
  ~WorkerServer();
  const std::string& address() const;
  const std::string& id() const;
  // Graceful drain: report NOT_SERVING (health and status), refuse new work
  // with UNAVAILABLE (the router retries elsewhere), and wait up to `grace`
  // for in-flight requests to finish. Requests still running after that are
  // cut off when the server shuts down; the router migrates them.
  void Drain(absl::Duration grace);
  void Shutdown();
  void Wait();

  struct Impl;

 private:
  explicit WorkerServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdserve::decode
