// Serves a metrics Registry over HTTP for Prometheus scrapes, using civetweb:
//
//   GET /metrics  200, Registry::Render() (prometheus-cpp's TextSerializer) as
//                 "text/plain; version=0.0.4; charset=utf-8"
//   GET /healthz  200, "ok"
//   other paths   404; methods other than GET and HEAD on the two paths, 405
//
// Nothing else is served (no document root), request bodies are never read,
// and slow clients are cut off after a timeout, so a scraper or a stray client
// cannot disturb the serving process.
//
// Why civetweb directly and not prometheus::Exposer (prometheus-cpp-pull,
// itself civetweb underneath): the Exposer serves only Collectables, so it
// cannot answer /healthz on the same port with "ok"; it also answers HEAD and
// POST with 404, drops "version=0.0.4" from the content type, and adds its
// own exposer_* families to every scrape, all of which would change the
// metrics port's contract. The HTTP part here is one request callback; the
// Prometheus text is still produced by prometheus-cpp alone.
//
// civetweb (Debian's 1.15) starts its threads with a fixed 100 KiB stack (no
// option changes it), out of which glibc takes every loaded library's static
// TLS; the `pdserve` binary raises it (cli/main.cc explains). A process that
// serves metrics next to OpenBLAS, NCCL and cudart needs the same.
//
// Thread-safety: civetweb answers requests on its own worker threads. Start,
// port() and the destructor may be called from any thread. The registry must
// outlive the server.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/metrics.h"

struct mg_connection;
struct mg_context;

namespace pdserve::metrics {

class MetricsHttpServer {
 public:
  // Listens on `bind_address`, a numeric IPv4 address such as "0.0.0.0" or
  // "127.0.0.1", and `port` (0 picks a free one; see port()). INVALID_ARGUMENT
  // for a bad address or port, UNIMPLEMENTED for IPv6 (Debian's civetweb is
  // built without it), UNAVAILABLE when civetweb cannot start (for example,
  // the port is taken).
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      Registry* registry, const std::string& bind_address, int port);

  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;
  // Stops listening; returns once in-flight requests have finished (within
  // milliseconds when idle).
  ~MetricsHttpServer();

  // The port actually bound.
  int port() const { return port_; }

 private:
  explicit MetricsHttpServer(Registry* registry) : registry_(registry) {}

  static int HandleRequest(mg_connection* conn);

  Registry* const registry_;
  mg_context* context_ = nullptr;
  int port_ = 0;
  // IPv4 address (network byte order) the destructor connects to, to wake
  // civetweb's listener thread.
  uint32_t wake_address_ = 0;
};

}  // namespace pdserve::metrics
