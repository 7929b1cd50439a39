#include "common/metrics_http.h"

#include <arpa/inet.h>
#include <civetweb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string_view>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace pdserve::metrics {
namespace {

constexpr std::string_view kMetricsContentType =
    "text/plain; version=0.0.4; charset=utf-8";
constexpr std::string_view kTextContentType = "text/plain; charset=utf-8";

// civetweb keeps process-wide state; initialise it once, never tear it down.
void InitCivetwebOnce() {
  static const unsigned features = mg_init_library(0);
  (void)features;
}

int LogCivetwebMessage(const mg_connection* /*conn*/, const char* message) {
  PDSERVE_LOG(WARNING) << "metrics http: " << message;
  return 1;  // Handled: keep civetweb from also writing to stderr.
}

// Writes a complete response and returns its status, as civetweb handlers do.
int Respond(mg_connection* conn, bool head, int status, const char* reason,
            std::string_view content_type, std::string_view body,
            const char* extra_headers = "") {
  mg_printf(conn,
            "HTTP/1.1 %d %s\r\n"
            "Content-Type: %.*s\r\n"
            "Content-Length: %zu\r\n"
            "Cache-Control: no-store\r\n"
            "%s"
            "Connection: close\r\n\r\n",
            status, reason, static_cast<int>(content_type.size()),
            content_type.data(), body.size(), extra_headers);
  if (!head) mg_write(conn, body.data(), body.size());
  return status;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    Registry* registry, const std::string& bind_address, int port) {
  if (registry == nullptr) {
    return absl::InvalidArgumentError("metrics http: registry is null");
  }
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics http: port ", port, " is out of range"));
  }
  // Only numeric addresses: civetweb does not resolve names, and this also
  // keeps a stray ',' from adding listening ports.
  in_addr address;
  in6_addr address6;
  if (inet_pton(AF_INET6, bind_address.c_str(), &address6) == 1) {
    return absl::UnimplementedError(absl::StrCat(
        "metrics http: cannot bind to ", bind_address,
        ": this civetweb build has no IPv6 support; use an IPv4 address such "
        "as 0.0.0.0"));
  }
  if (inet_pton(AF_INET, bind_address.c_str(), &address) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics http: bind address \"", bind_address,
                     "\" is not a numeric IPv4 address"));
  }
  const std::string listen = absl::StrCat(bind_address, ":", port);

  InitCivetwebOnce();
  auto server =
      std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(registry));
  server->wake_address_ = address.s_addr == htonl(INADDR_ANY)
                              ? htonl(INADDR_LOOPBACK)
                              : address.s_addr;
  // Scrapes are rare and short, so two worker threads are plenty.
  // clang-format off
  const char* options[] = {
      "listening_ports", listen.c_str(),
      "num_threads", "2",
      "request_timeout_ms", "10000",
      "enable_keep_alive", "no",
      nullptr};
  // clang-format on
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof(callbacks));
  // begin_request sees every request before civetweb's own handling, and is
  // in place before the socket listens, so no request escapes it.
  callbacks.begin_request = &HandleRequest;
  callbacks.log_message = &LogCivetwebMessage;
  mg_init_data init{&callbacks, server.get(), options};
  unsigned error_code = 0;
  char error_text[256] = "";
  mg_error_data error{&error_code, error_text, sizeof(error_text)};
  server->context_ = mg_start2(&init, &error);
  if (server->context_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "metrics http: cannot listen on ", listen, ": ", error_text));
  }
  mg_server_port ports[4];
  const int num_ports = mg_get_server_ports(server->context_, 4, ports);
  if (num_ports < 1 || ports[0].port <= 0) {
    return absl::InternalError(
        absl::StrCat("metrics http: cannot read the port bound for ", listen));
  }
  server->port_ = ports[0].port;
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (context_ == nullptr) return;
  // civetweb's listener thread checks the stop flag only when its poll()
  // returns, which takes up to 2 s on an idle server. Connecting while
  // mg_stop waits wakes it at once; those connections are closed unread.
  std::atomic<bool> stopped = false;
  std::thread waker([this, &stopped] {
    sockaddr_in target{};
    target.sin_family = AF_INET;
    target.sin_port = htons(port_);
    target.sin_addr.s_addr = wake_address_;
    while (!stopped.load()) {
      const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd >= 0) {
        connect(fd, reinterpret_cast<const sockaddr*>(&target), sizeof(target));
        close(fd);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  mg_stop(context_);
  stopped = true;
  waker.join();
}

int MetricsHttpServer::HandleRequest(mg_connection* conn) {
  const mg_request_info* request = mg_get_request_info(conn);
  const auto* server =
      static_cast<const MetricsHttpServer*>(request->user_data);
  const std::string_view path =
      request->local_uri != nullptr ? request->local_uri : "";
  const std::string_view method =
      request->request_method != nullptr ? request->request_method : "";
  const bool head = method == "HEAD";

  if (path != "/metrics" && path != "/healthz") {
    return Respond(conn, head, 404, "Not Found", kTextContentType,
                   "not found\n");
  }
  if (method != "GET" && !head) {
    return Respond(conn, head, 405, "Method Not Allowed", kTextContentType,
                   "method not allowed\n", "Allow: GET, HEAD\r\n");
  }
  if (path == "/healthz") {
    return Respond(conn, head, 200, "OK", kTextContentType, "ok");
  }
  return Respond(conn, head, 200, "OK", kMetricsContentType,
                 server->registry_->Render());
}

}  // namespace pdserve::metrics
