// Before a process installs a TLS config, internal servers must not start
// and internal channels must not speak plaintext: a forgotten Install() can
// never silently downgrade the cluster (this binary does not link
// tests/support/plaintext_tls.cc).
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/tls.h"

namespace pdserve::tls {
namespace {

// Whether a channel with `creds` gets connected to `address` (the TLS
// handshake against a plaintext server fails, so it never does).
bool Connects(const std::string& address,
              std::shared_ptr<grpc::ChannelCredentials> creds) {
  auto channel = grpc::CreateChannel(address, creds);
  return channel->WaitForConnected(std::chrono::system_clock::now() +
                                   std::chrono::seconds(3));
}

TEST(TlsFailClosedTest, NothingIsPlaintextUntilInstallAsksForIt) {
  ASSERT_FALSE(IsInstalled());
  EXPECT_TRUE(Enabled());  // the default is TLS, not plaintext
  auto server_creds = InternalServerCredentials();
  ASSERT_FALSE(server_creds.ok());
  EXPECT_EQ(server_creds.status().code(),
            absl::StatusCode::kFailedPrecondition);

  // A plaintext server (made directly, as a misconfigured peer would be).
  // Answers every call with UNIMPLEMENTED: enough to have a service.
  struct AnyService : grpc::CallbackGenericService {
    grpc::ServerGenericBidiReactor* CreateReactor(
        grpc::GenericCallbackServerContext*) override {
      struct Reactor : grpc::ServerGenericBidiReactor {
        Reactor() { Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "")); }
        void OnDone() override { delete this; }
      };
      return new Reactor;
    }
  } any_service;
  grpc::ServerBuilder builder;
  builder.RegisterCallbackGenericService(&any_service);
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  const std::string address = absl::StrCat("127.0.0.1:", port);
  // The control: the server answers plaintext health checks.
  ASSERT_TRUE(Connects(address, grpc::InsecureChannelCredentials()));

  // Internal channels before Install: refused, never plaintext.
  EXPECT_FALSE(Connects(address, InternalChannelCredentials()));

  // Asked for explicitly, plaintext works.
  ASSERT_TRUE(Install(TlsConfig::Plaintext()).ok());
  EXPECT_TRUE(IsInstalled());
  EXPECT_FALSE(Enabled());
  EXPECT_TRUE(InternalServerCredentials().ok());
  EXPECT_TRUE(Connects(address, InternalChannelCredentials()));
  server->Shutdown();
}

TEST(TlsFailClosedTest, DefaultConfigIsNeitherPlaintextNorValid) {
  TlsConfig c;  // what a caller gets without choosing
  EXPECT_FALSE(c.insecure);
  EXPECT_FALSE(c.Validate().ok());
}

}  // namespace
}  // namespace pdserve::tls
