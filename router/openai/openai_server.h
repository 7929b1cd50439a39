// The OpenAI-compatible HTTP front of the router (ARCHITECTURE.md,
// "OpenAI-compatible front"): POST /v1/completions, POST
// /v1/chat/completions (Server-Sent Events with "stream": true), GET
// /v1/models and GET /health, on cpp-httplib.
//
// Every generation goes through the router's own gRPC Generate over an
// in-process channel, so tokenization, limits, tenants (the Authorization
// header is forwarded as the "authorization" metadata), retries, migration
// and the router's metrics are the same code path as gRPC clients'. A client
// that disconnects mid-stream cancels its gRPC call, which cancels the worker
// calls and frees their KV blocks.
//
// A client that hangs up before its non-streamed response is ready cancels
// the call the same way. Connections beyond `max_connections` wait in a
// bounded queue, and past it get 503 with Retry-After (http_connections.h).
//
// Thread-safety: Start/Stop from one thread; requests are served on the
// server's own pool of `max_connections` threads.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/metrics.h"

namespace pdserve::router::openai {

struct OpenAiServerConfig {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port
  // What clients pass as "model"; anything else is 404 model_not_found.
  std::string served_model_name;
  // The model directory: its tokenizer and chat template render "messages".
  std::string model_dir;
  // HTTPS when both are set (the router's --tls-cert/--tls-key). The files
  // are read once at start-up.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Connection threads: connections served at once; each request holds its
  // connection's thread while it runs.
  int max_connections = 256;
  // Accepted connections that may wait for a thread; past them a connection
  // gets 503 with Retry-After at once.
  int max_queued_connections = 256;
  // An idle keep-alive connection is closed after this, and at once when
  // another connection waits for its thread.
  absl::Duration keep_alive_idle_timeout = absl::Seconds(5);
  int keep_alive_max_requests = 1000;  // per connection
  // Bytes per request body (413 beyond).
  int64_t max_body_bytes = 4 << 20;

  absl::Status Validate() const;
};

// How the front reaches the router it sits on.
struct RouterHooks {
  // A channel to the Router service (RouterServer::InProcessChannel()).
  std::shared_ptr<grpc::Channel> channel;
  // Checks an Authorization header value for the endpoints that do not call
  // Generate (GET /v1/models); null: no authentication.
  std::function<absl::Status(absl::string_view authorization)> authenticate;
  // GET /health is 200 while this is true (a worker can serve), else 503;
  // null: always 200.
  std::function<bool()> healthy;
};

class OpenAiServer {
 public:
  // Binds and starts serving; INVALID_ARGUMENT for a bad config,
  // UNAVAILABLE when the port cannot be bound.
  static absl::StatusOr<std::unique_ptr<OpenAiServer>> Start(
      const OpenAiServerConfig& config, RouterHooks hooks,
      metrics::Registry* registry);
  ~OpenAiServer();  // Stop()s

  int port() const;
  bool tls() const;
  // Connections on a thread, waiting for one, and refused with 503 so far.
  struct ConnectionStats {
    int64_t active = 0;
    int64_t queued = 0;
    int64_t shed = 0;
  };
  ConnectionStats connection_stats() const;
  // Stops accepting and waits for the listener thread; idempotent.
  void Stop();

  struct Impl;

 private:
  explicit OpenAiServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdserve::router::openai
