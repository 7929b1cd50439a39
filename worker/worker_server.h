// One worker process: the engine thread, the internal Worker and KvTransfer
// gRPC services (with health and reflection), the KV event stream for the
// router, and the worker metrics, over the two handler libraries
// (prefill_service/, decode_service/). Roles: PREFILL serves Prefill, DECODE
// serves Generate (and prefills locally when asked), BOTH serves all — the
// colocated baseline.
//
// Thread-safety: thread-safe. RPCs that arrive before Start has finished
// wiring the handlers are refused with UNAVAILABLE ("starting"), never served
// half-built.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/metrics.h"
#include "engine/engine.h"
#include "kv_transfer/transport.h"
#include "pdserve/v1/internal.pb.h"

namespace pdserve::kv_transfer::nccl {
class CommunicatorFactory;
}

namespace pdserve::worker {

struct WorkerConfig {
  v1::WorkerRole role = v1::WORKER_ROLE_BOTH;
  std::string model_dir;
  engine::EngineConfig engine;
  std::string listen_host = "127.0.0.1";  // 0.0.0.0 in containers
  int port = 0;                           // 0: any free port
  std::string advertise_host;  // how others reach us; default listen_host
  std::string id;              // default role@host:port
  absl::Duration admission_timeout = absl::Seconds(10);
  absl::Duration kv_stall_timeout = absl::Seconds(10);
  // nccl needs a CUDA+NCCL build and a visible GPU (FAILED_PRECONDITION at
  // Start otherwise); its control plane is the KvTransfer.Control stream of
  // this worker's gRPC server.
  kv_transfer::KvTransportKind kv_transport =
      kv_transfer::KvTransportKind::kGrpc;
  int kv_cuda_device =
      0;  // nccl: the GPU whose communicators this worker joins
  // Tests only: replaces NCCL (e.g. the in-process fake). Must outlive the
  // worker; the same factory must serve both ends of a pair.
  kv_transfer::nccl::CommunicatorFactory* kv_communicators = nullptr;
  // Prefill: send layer l of a request's KV as soon as the forward pass wrote
  // it, overlapping transfer with the rest of the prefill.
  bool kv_layerwise = true;
  // Bound on layer spans queued for sending per request (bytes); beyond it
  // the rest is sent when the prefill ends.
  int64_t kv_stream_queue_bytes = int64_t{64} << 20;
  // Memory gRPC may use for this server's requests and threads (bytes; 0: no
  // quota). Bounds what a flood of connections can take.
  int64_t grpc_memory_quota_bytes = int64_t{1} << 30;
  int grpc_max_threads = 256;
  // Called on the engine thread when the engine gets work after having none
  // (true) and when it runs out (false); may be null.
  std::function<void(bool busy)> on_engine_busy;
  // Tests only: called with the bound port after the server listens and
  // before the handlers are wired (the start-up window).
  std::function<void(int port)> after_listen_for_test;

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

}  // namespace pdserve::worker
