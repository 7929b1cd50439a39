// Transport security for every gRPC endpoint of a pdserve process, built in
// one place from a TlsConfig: certificate, key and CA bundle come from files
// (Kubernetes Secrets) that gRPC's FileWatcherCertificateProvider re-reads
// every `reload_interval`, so rotated certificates apply to new connections
// without a restart.
//
// Two kinds of endpoint:
//   - internal (worker Worker/KvTransfer services, router RouterControl, and
//     every channel between processes): mutual TLS. Servers require a client
//     certificate that chains to the CA; channels present this process's
//     certificate and verify the peer's against the same CA. Peers are
//     addressed by pod IP, so the peer's host name is not checked: holding a
//     certificate issued by the cluster CA is what makes a peer trusted.
//   - public (the router's port): TLS with the same identity; a client
//     certificate is requested and verified when presented, so one port
//     serves API clients (bearer tokens) and workers (mTLS) alike.
//
// Channels to peers are created in several libraries (router registry, KV
// transfer, decode→prefill, worker→router registration). One process has one
// identity, so the credentials are installed once per process with Install()
// and read anywhere with InternalChannelCredentials(). Until Install() runs
// they fail closed: servers get no credentials (FAILED_PRECONDITION) and
// channels get TLS credentials that trust no pdserve peer, so a process that
// forgot to configure TLS can never fall back to plaintext. Plaintext must be
// asked for explicitly: Install(TlsConfig::Plaintext()) (--insecure, and
// in-process tests through tests/support/plaintext_tls.cc).
//
// Thread-safety: Install() may race with readers; every accessor is
// thread-safe and returns a shared_ptr snapshot.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace pdserve::tls {

struct TlsConfig {
  // Plaintext everywhere. Only for local use; must be asked for explicitly.
  bool insecure = false;
  std::string cert_file;  // PEM certificate chain of this process
  std::string key_file;   // PEM private key of cert_file
  std::string ca_file;    // PEM CA bundle that peers' certificates chain to
  // How often the files are re-read (gRPC's file watcher; whole seconds).
  absl::Duration reload_interval = absl::Seconds(10);

  // INVALID_ARGUMENT unless exactly one of `insecure` or all three files is
  // given, and each file is readable PEM.
  absl::Status Validate() const;
  // The plaintext config (what in-process tests and `pdserve up` use).
  static TlsConfig Plaintext() {
    TlsConfig c;
    c.insecure = true;
    return c;
  }
};

// Which client certificates a server asks for.
enum class ClientAuth {
  kRequire,  // internal services: mTLS only
  kOptional  // router port: verified if presented (RouterControl checks it)
};

// Server credentials for `config` (plaintext when config.insecure).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const TlsConfig& config, ClientAuth client_auth);

// Channel credentials presenting this process's certificate and verifying
// the server's against config.ca_file (host name not checked, see above).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>>
MutualChannelCredentials(const TlsConfig& config);

// Client credentials for the public API: verifies the router's certificate
// against `ca_file` (system roots when empty), including its host name;
// presents `cert_file`/`key_file` when both are given.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>>
PublicChannelCredentials(const std::string& ca_file,
                         const std::string& cert_file,
                         const std::string& key_file);

// Validates `config` and makes it this process's identity for the accessors
// below. Call once at start-up, before any server or channel is created.
absl::Status Install(const TlsConfig& config);
// Whether Install() succeeded at least once in this process.
bool IsInstalled();
// Whether the installed config is TLS (true before Install(): fail closed).
bool Enabled();
// The installed config (before Install(): TlsConfig{}, which is not
// plaintext).
TlsConfig Installed();
// Channel credentials for calls to other pdserve processes. Before Install():
// TLS credentials verifying against the system roots, which no pdserve peer
// presents, so every call fails (logged once).
std::shared_ptr<grpc::ChannelCredentials> InternalChannelCredentials();
// Server credentials for internal services (mTLS required);
// FAILED_PRECONDITION before Install().
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>>
InternalServerCredentials();

// True when the call's peer presented a client certificate that the TLS
// handshake verified against the CA (always false on plaintext ports).
bool PeerHasVerifiedCertificate(const grpc::ServerContext& ctx);

}  // namespace pdserve::tls
