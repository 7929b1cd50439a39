// The HTTP front over real loopback HTTP, in front of a stand-in Router
// service on an in-process gRPC channel: header values that gRPC would abort
// on, connection limits, keep-alive, and cancellation when a client hangs up.
#include "router/openai/openai_server.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/metrics.h"
#include "pdserve/v1/router.grpc.pb.h"
#include "router/openai/headers.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::router::openai {
namespace {

// Answers each Generate with one finished token, or, while `block` is set,
// holds the call until the client cancels it.
class StandInRouter final : public v1::Router::Service {
 public:
  grpc::Status Generate(
      grpc::ServerContext* ctx, const v1::GenerateRequest*,
      grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    calls.fetch_add(1);
    if (block.load()) {
      started.Notify();
      while (!ctx->IsCancelled()) absl::SleepFor(absl::Milliseconds(1));
      cancelled.Notify();
      return grpc::Status::CANCELLED;
    }
    v1::GenerateResponse r;
    r.set_request_id("r1");
    r.add_token_ids(65);
    r.set_text("A");
    r.set_finish_reason("length");
    writer->Write(r);
    return grpc::Status::OK;
  }

  std::atomic<bool> block{false};
  std::atomic<int> calls{0};
  absl::Notification started, cancelled;
};

int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{20, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  return fd;
}

void SendAll(int fd, const std::string& data) {
  size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n =
        send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    ASSERT_GT(n, 0);
    sent += static_cast<size_t>(n);
  }
}

// Everything the server sends until it closes the connection.
std::string ReadToClose(int fd) {
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;)
    out.append(buf, static_cast<size_t>(n));
  return out;
}

// One response on a keep-alive connection: headers, then Content-Length
// bytes of body.
std::string ReadResponse(int fd) {
  std::string out;
  char c;
  while (out.find("\r\n\r\n") == std::string::npos && recv(fd, &c, 1, 0) == 1)
    out += c;
  const size_t at = out.find("Content-Length: ");
  if (at == std::string::npos) return out;
  size_t left = std::stoul(out.substr(at + 16));
  char buf[4096];
  while (left > 0) {
    const ssize_t n = recv(fd, buf, std::min(left, sizeof(buf)), 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
    left -= static_cast<size_t>(n);
  }
  return out;
}

int StatusOf(const std::string& response) {
  if (response.rfind("HTTP/1.1 ", 0) != 0) return -1;
  return std::stoi(response.substr(9, 3));
}

nlohmann::json BodyOf(const std::string& response) {
  const size_t at = response.find("\r\n\r\n");
  return nlohmann::json::parse(response.substr(at + 4), nullptr, false);
}

std::string Completion(const std::string& extra_headers,
                       const std::string& connection = "close") {
  const std::string body = R"({"model":"model","prompt":"hi","max_tokens":1})";
  return "POST /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: " +
         connection + "\r\nContent-Type: application/json\r\n" + extra_headers +
         "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

const char kHealth[] = "GET /health HTTP/1.1\r\nHost: t\r\n\r\n";
const char kHealthClose[] =
    "GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n";

class OpenAiServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("openai_server_test_" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
    std::ofstream(dir_ / "tokenizer.json")
        << engine::ByteTokenizer::TokenizerJson();
    grpc::ServerBuilder builder;
    builder.RegisterService(&router_);
    grpc_ = builder.BuildAndStart();
    config_.port = 0;
    config_.served_model_name = "model";
    config_.model_dir = dir_.string();
  }
  void Start() {
    RouterHooks hooks;
    hooks.channel = grpc_->InProcessChannel(grpc::ChannelArguments());
    auto http = OpenAiServer::Start(config_, std::move(hooks), &registry_);
    ASSERT_TRUE(http.ok()) << http.status();
    http_ = std::move(*http);
  }
  void TearDown() override {
    if (http_) http_->Stop();
    grpc_->Shutdown();
    std::filesystem::remove_all(dir_);
  }
  std::string Exchange(const std::string& request) {
    const int fd = Connect(http_->port());
    SendAll(fd, request);
    std::string out = ReadToClose(fd);
    close(fd);
    return out;
  }
  // Polls `done` until it holds or 10 s pass.
  template <typename F>
  bool Eventually(F done) {
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (!done()) {
      if (absl::Now() > until) return false;
      absl::SleepFor(absl::Milliseconds(2));
    }
    return true;
  }

  std::filesystem::path dir_;
  StandInRouter router_;
  std::unique_ptr<grpc::Server> grpc_;
  metrics::Registry registry_;
  OpenAiServerConfig config_;
  std::unique_ptr<OpenAiServer> http_;
};

TEST_F(OpenAiServerTest, IllegalAuthorizationBytesGet401AndTheServerStaysUp) {
  Start();
  for (const std::string bad :
       {"Bearer a\tb", "Bearer a\x7f", "Bearer caf\xe9"}) {
    const std::string response =
        Exchange(Completion("Authorization: " + bad + "\r\n"));
    ASSERT_EQ(StatusOf(response), 401) << response;
    const nlohmann::json body = BodyOf(response);
    EXPECT_EQ(body["error"]["type"], "authentication_error");
    EXPECT_EQ(body["error"]["code"], "invalid_api_key");
    EXPECT_EQ(body["error"]["message"].get<std::string>().find(bad),
              std::string::npos);
    const std::string models = Exchange(
        "GET /v1/models HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
        "Authorization: " +
        bad + "\r\n\r\n");
    EXPECT_EQ(StatusOf(models), 401) << models;
  }
  EXPECT_EQ(router_.calls.load(), 0);
  // Still serving, and a printable value goes through.
  EXPECT_EQ(StatusOf(Exchange(kHealthClose)), 200);
  const std::string ok =
      Exchange(Completion("Authorization: Bearer tok-alpha\r\n"));
  EXPECT_EQ(StatusOf(ok), 200) << ok;
  EXPECT_EQ(router_.calls.load(), 1);
}

TEST_F(OpenAiServerTest, NonStreamedRequestIsCancelledWhenTheClientHangsUp) {
  Start();
  router_.block = true;
  const int fd = Connect(http_->port());
  SendAll(fd, Completion(""));
  ASSERT_TRUE(
      router_.started.WaitForNotificationWithTimeout(absl::Seconds(30)));
  close(fd);
  // The Router call ends (and with it the workers' calls and their blocks).
  EXPECT_TRUE(
      router_.cancelled.WaitForNotificationWithTimeout(absl::Seconds(2)));
}

TEST_F(OpenAiServerTest, ConnectionsPastTheQueueGet503WithRetryAfter) {
  config_.max_connections = 1;
  config_.max_queued_connections = 0;
  Start();
  router_.block = true;
  const int busy = Connect(http_->port());
  SendAll(busy, Completion(""));
  ASSERT_TRUE(
      router_.started.WaitForNotificationWithTimeout(absl::Seconds(30)));
  const std::string refused = Exchange(kHealthClose);
  ASSERT_EQ(StatusOf(refused), 503) << refused;
  EXPECT_NE(refused.find("Retry-After: 1\r\n"), std::string::npos) << refused;
  EXPECT_EQ(BodyOf(refused)["error"]["code"], "service_unavailable");
  EXPECT_GE(http_->connection_stats().shed, 1);
  // Once the busy connection goes, its thread serves again.
  close(busy);
  ASSERT_TRUE(
      router_.cancelled.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(
      Eventually([&] { return http_->connection_stats().active == 0; }));
  EXPECT_EQ(StatusOf(Exchange(kHealthClose)), 200);
}

TEST_F(OpenAiServerTest, IdleKeepAliveConnectionGivesItsThreadToAQueuedOne) {
  config_.max_connections = 1;
  config_.max_queued_connections = 4;
  config_.keep_alive_idle_timeout = absl::Seconds(600);
  Start();
  const int idle = Connect(http_->port());
  SendAll(idle, kHealth);
  ASSERT_EQ(StatusOf(ReadResponse(idle)), 200);
  // The only thread holds an idle keep-alive connection; a new one is served
  // long before the idle timeout, and the idle one is closed.
  EXPECT_EQ(StatusOf(Exchange(kHealthClose)), 200);
  EXPECT_EQ(ReadToClose(idle), "");
  close(idle);
}

TEST_F(OpenAiServerTest, IdleKeepAliveConnectionIsClosedAfterTheTimeout) {
  config_.keep_alive_idle_timeout = absl::Milliseconds(100);
  Start();
  const int fd = Connect(http_->port());
  SendAll(fd, kHealth);
  ASSERT_EQ(StatusOf(ReadResponse(fd)), 200);
  char c;
  // recv waits up to 20 s (SO_RCVTIMEO): 0 is the server's close, -1 a
  // timeout.
  EXPECT_EQ(recv(fd, &c, 1, 0), 0);
  close(fd);
}

TEST_F(OpenAiServerTest, BodyPastTheLimitIs413) {
  config_.max_body_bytes = 2048;
  Start();
  const std::string big(4096, ' ');
  const std::string response = Exchange(
      "POST /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
      "Content-Length: 4096\r\n\r\n" +
      big);
  EXPECT_EQ(StatusOf(response), 413) << response;
  EXPECT_EQ(router_.calls.load(), 0);
}

TEST_F(OpenAiServerTest, ConfigRejectsBadLimits) {
  config_.max_queued_connections = -1;
  EXPECT_FALSE(config_.Validate().ok());
  config_.max_queued_connections = 0;
  config_.keep_alive_idle_timeout = absl::ZeroDuration();
  EXPECT_FALSE(config_.Validate().ok());
  config_.keep_alive_idle_timeout = absl::Seconds(1);
  EXPECT_TRUE(config_.Validate().ok());
}

TEST(ForwardedHeaderTest, OnlyPrintableAsciiWithinTheBound) {
  EXPECT_TRUE(CheckForwardedHeader("Authorization", "Bearer a-b_c.d~").ok());
  EXPECT_TRUE(CheckForwardedHeader("Authorization", "").ok());
  EXPECT_TRUE(CheckForwardedHeader("Authorization",
                                   std::string(kMaxForwardedHeaderBytes, '~'))
                  .ok());
  EXPECT_FALSE(
      CheckForwardedHeader("Authorization",
                           std::string(kMaxForwardedHeaderBytes + 1, 'a'))
          .ok());
  for (char c : {'\t', '\x7f', '\xe9', '\0', '\x1f', '\n'}) {
    EXPECT_FALSE(
        CheckForwardedHeader("Authorization", std::string("a") + c).ok())
        << static_cast<int>(static_cast<unsigned char>(c));
  }
}

}  // namespace
}  // namespace pdserve::router::openai
