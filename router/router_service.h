// The public Router service (ARCHITECTURE.md, public API): tokenizes,
// validates, routes each request to a (prefill, decode) pair, streams tokens
// back as they come (text is UTF-8 safe and stop strings are applied here),
// retries before the first token and migrates after it. Thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/metrics.h"
#include "engine/tokenizer.h"
#include "pdserve/v1/internal.grpc.pb.h"
#include "pdserve/v1/router.grpc.pb.h"
#include "router/policy.h"
#include "router/prefix_index.h"
#include "router/worker_registry.h"

namespace pdserve::router {

struct RouterConfig {
  std::string model_dir;  // for the tokenizer
  RegistryConfig workers;
  std::string policy = "cache_aware";
  PolicyConfig policy_config;
  int32_t max_retries = 3;
  absl::Duration speculative_ttl = absl::Seconds(2);
  absl::Duration request_timeout =
      absl::Minutes(10);  // server-side ceiling per request
  absl::Status Validate() const;
};

class RouterServer {
 public:
  // Builds the service and starts the registry; `Serve` binds the port.
  static absl::StatusOr<std::unique_ptr<RouterServer>> Create(
      const RouterConfig& config, metrics::Registry* registry);
  ~RouterServer();
  // Starts gRPC on host:port (port 0: any); returns the bound port.
  absl::StatusOr<int> Serve(const std::string& host, int port);
  void Shutdown();
  void Wait();
  WorkerRegistry& workers();

  struct Impl;

 private:
  explicit RouterServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdserve::router
