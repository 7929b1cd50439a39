// Fuzzes the request headers of the router's OpenAI HTTP front on its real
// path: raw bytes over loopback TCP into OpenAiServer (cpp-httplib), which
// forwards the Authorization header as gRPC metadata on an in-process channel
// to a Router service. gRPC aborts the process on a metadata value outside
// printable ASCII, so an unchecked copy of the header ends the whole router;
// every input must instead get an HTTP response, and every value that reaches
// the service must be printable ASCII within the front's length bound.
//
// Input: one selector byte (completions, chat, models), then the bytes of the
// Authorization value. CR and LF pass through as they are, so an input can
// also end the header early and add header lines of its own.
//
// The Router service here answers every Generate with one finished token: the
// crash this guards against is on the client side of the in-process channel,
// before any router logic runs.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "common/metrics.h"
#include "pdserve/v1/router.grpc.pb.h"
#include "router/openai/openai_server.h"
#include "tokenizer/tokenizer.h"

namespace {

constexpr size_t kMaxMetadataBytes = 8192;

class AnswerOnce final : public pdserve::v1::Router::Service {
 public:
  grpc::Status Generate(
      grpc::ServerContext* ctx, const pdserve::v1::GenerateRequest*,
      grpc::ServerWriter<pdserve::v1::GenerateResponse>* writer) override {
    for (const auto& [key, value] : ctx->client_metadata()) {
      if (key != "authorization") continue;
      if (value.size() > kMaxMetadataBytes) std::abort();
      for (char c : value) {
        if (c < 0x20 || c > 0x7E) std::abort();
      }
    }
    pdserve::v1::GenerateResponse r;
    r.set_request_id("fuzz");
    r.add_token_ids(65);
    r.set_text("A");
    r.set_finish_reason("length");
    r.mutable_usage()->set_prompt_tokens(1);
    r.mutable_usage()->set_completion_tokens(1);
    writer->Write(r);
    return grpc::Status::OK;
  }
};

struct Front {
  AnswerOnce service;
  std::unique_ptr<grpc::Server> grpc_server;
  pdserve::metrics::Registry registry;
  std::unique_ptr<pdserve::router::openai::OpenAiServer> http;
  int port = 0;
};

Front* StartFront() {
  auto* f = new Front;
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      ("pdserve_header_fuzz_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "tokenizer.json")
      << pdserve::engine::ByteTokenizer::TokenizerJson();
  grpc::ServerBuilder builder;
  builder.RegisterService(&f->service);
  f->grpc_server = builder.BuildAndStart();
  pdserve::router::openai::OpenAiServerConfig config;
  config.port = 0;
  config.served_model_name = "model";
  config.model_dir = dir.string();
  config.max_connections = 4;
  pdserve::router::openai::RouterHooks hooks;
  hooks.channel = f->grpc_server->InProcessChannel(grpc::ChannelArguments());
  auto http = pdserve::router::openai::OpenAiServer::Start(
      config, std::move(hooks), &f->registry);
  if (!http.ok()) {
    std::fprintf(stderr, "cannot start the HTTP front: %s\n",
                 std::string(http.status().message()).c_str());
    std::abort();
  }
  f->http = std::move(*http);
  f->port = f->http->port();
  return f;
}

// Sends `request` and reads until the server closes; the response's bytes.
std::string RoundTrip(int port, const std::string& request) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) std::abort();
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    int err = errno;
    if (err == EINTR) {  // the connect goes on in the background: await it
      pollfd p{fd, POLLOUT, 0};
      while (poll(&p, 1, 10000) < 0 && errno == EINTR) {
      }
      socklen_t len = sizeof(err);
      if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    }
    if (err != 0) std::abort();  // the front is gone
  }
  // libFuzzer's -timeout alarm (SIGALRM) interrupts these calls, and a
  // socket call with a timeout set is never restarted: EINTR is retried here
  // rather than read as the server's close.
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n =
        send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // the server may answer and close early
    sent += static_cast<size_t>(n);
  }
  // No half-close: the front takes a client's FIN for a hangup. Every
  // request says "Connection: close", so the server ends the exchange.
  std::string response;
  char buf[4096];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    response.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return response;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Front* front = StartFront();
  if (size == 0 || size > 64 << 10) return 0;
  const std::string value(reinterpret_cast<const char*>(data) + 1, size - 1);
  const char* kPaths[] = {"/v1/completions", "/v1/chat/completions",
                          "/v1/models"};
  const int which = data[0] % 3;
  const std::string body =
      which == 1 ? R"({"model":"model","max_tokens":1,)"
                   R"("messages":[{"role":"user","content":"hi"}]})"
                 : R"({"model":"model","prompt":"hi","max_tokens":1})";
  std::string request = which == 2 ? "GET " : "POST ";
  request += kPaths[which];
  request += " HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\nAuthorization: ";
  request += value;
  request += "\r\nContent-Type: application/json\r\nContent-Length: ";
  request += std::to_string(which == 2 ? 0 : body.size());
  request += "\r\n\r\n";
  if (which != 2) request += body;
  RoundTrip(front->port, request);
  // The front still answers: a well-formed request right after gets its 200.
  const std::string after =
      RoundTrip(front->port,
                "GET /health HTTP/1.1\r\nHost: fuzz\r\nConnection: close"
                "\r\n\r\n");
  if (after.rfind("HTTP/1.1 200", 0) != 0) {
    std::fprintf(stderr, "GET /health after the input got: %s\n",
                 after.c_str());
    std::abort();
  }
  return 0;
}
