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
#include "common/tls.h"
#include "pdserve/v1/internal.grpc.pb.h"
#include "pdserve/v1/router.grpc.pb.h"
#include "router/auth.h"
#include "router/peer_pull.h"
#include "router/policy.h"
#include "router/prefix_index.h"
#include "router/worker_registry.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::router {

// Per-request and per-connection bounds; 0 means no limit where noted.
struct RequestLimits {
  int64_t max_message_bytes = 4 << 20;  // public port, per received message
  int32_t max_prompt_tokens = 0;        // 0: only the workers' max_model_len
  int32_t max_output_tokens = 0;        // ceiling on max_tokens; 0: none
  int32_t max_stop_strings = 16;
  int32_t max_stop_string_bytes = 256;
  // Client-chosen strings hashed into every block (cache_salt) or carried in
  // every message and log line (request_id).
  int32_t max_cache_salt_bytes = 256;
  int32_t max_request_id_bytes = 128;
  int32_t max_streams_per_connection = 100;  // HTTP/2 concurrent streams
  // Generate calls in flight on this router; beyond it new ones are shed
  // with RESOURCE_EXHAUSTED at once (the router never queues). 0: no limit.
  int32_t max_inflight_requests = 1024;
};

struct RouterConfig {
  std::string model_dir;  // for the tokenizer
  RegistryConfig workers;
  std::string policy = "cache_aware";
  PolicyConfig policy_config;
  PeerPullConfig peer_pull;  // --peer-pull: off by default
  int32_t max_retries = 3;
  absl::Duration speculative_ttl = absl::Seconds(2);
  absl::Duration request_timeout =
      absl::Minutes(10);  // server-side ceiling per request

  // Security and limits (README "Security"). The public port's credentials;
  // RouterControl (worker registration, ListWorkers) then requires a verified
  // client certificate. The default is neither plaintext nor valid: a caller
  // must choose certificates or TlsConfig::Plaintext() (fails closed).
  tls::TlsConfig tls;
  // Bearer tokens ("TOKEN TENANT [overrides]" lines); empty: no auth, and
  // every request belongs to the unnamed tenant.
  std::string auth_tokens_file;
  TenantLimits tenant_limits;  // defaults for tenants without overrides
  // Let tenants share prefix blocks (and prefix-hit timing). Off: the tenant
  // is prepended to every request's cache_salt.
  bool shared_prefix_cache = false;
  RequestLimits limits;

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
  // A channel to this server's Router service that never leaves the process
  // (the OpenAI HTTP front calls Generate through it, so both fronts share
  // one code path). Valid after Serve.
  std::shared_ptr<grpc::Channel> InProcessChannel();
  // OK when `authorization` ("Bearer TOKEN") names a tenant of
  // --auth-tokens, or when the router has none; else UNAUTHENTICATED.
  absl::Status CheckAuthorization(absl::string_view authorization);

  struct Impl;

 private:
  explicit RouterServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdserve::router
