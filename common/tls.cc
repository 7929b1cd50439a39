#include "common/tls.h"

#include <grpc/grpc_security_constants.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_certificate_verifier.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"

namespace pdserve::tls {
namespace {

using grpc::experimental::FileWatcherCertificateProvider;

absl::Status CheckPemFile(const std::string& flag, const std::string& path,
                          const char* kind) {
  std::ifstream in(path);
  if (!in)
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read \"", path, "\""));
  std::stringstream ss;
  ss << in.rdbuf();
  if (!absl::StrContains(ss.str(), "-----BEGIN ") ||
      !absl::StrContains(ss.str(), kind)) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, ": \"", path, "\" is not a PEM file with a ", kind, " block"));
  }
  return absl::OkStatus();
}

unsigned ReloadSeconds(const TlsConfig& c) {
  return static_cast<unsigned>(
      std::max<int64_t>(1, absl::ToInt64Seconds(c.reload_interval)));
}

std::shared_ptr<FileWatcherCertificateProvider> Provider(const TlsConfig& c) {
  return std::make_shared<FileWatcherCertificateProvider>(
      c.key_file, c.cert_file, c.ca_file, ReloadSeconds(c));
}

struct State {
  absl::Mutex mu;
  bool installed ABSL_GUARDED_BY(mu) = false;
  bool warned ABSL_GUARDED_BY(mu) = false;
  TlsConfig config ABSL_GUARDED_BY(mu);
  std::shared_ptr<grpc::ChannelCredentials> channel ABSL_GUARDED_BY(mu);
  std::shared_ptr<grpc::ServerCredentials> server ABSL_GUARDED_BY(mu);
  State() {
    // Fail closed: TLS that trusts only the system roots, which no pdserve
    // peer's certificate chains to, and never plaintext.
    grpc::experimental::TlsChannelCredentialsOptions options;
    options.set_verify_server_certs(true);
    channel = grpc::experimental::TlsCredentials(options);
  }
};

State& Global() {
  static State* s = new State();
  return *s;
}

}  // namespace

absl::Status TlsConfig::Validate() const {
  const bool any_file =
      !cert_file.empty() || !key_file.empty() || !ca_file.empty();
  if (insecure && any_file) {
    return absl::InvalidArgumentError(
        "--insecure and --tls-cert/--tls-key/--tls-ca are mutually exclusive");
  }
  if (insecure) return absl::OkStatus();
  if (cert_file.empty() || key_file.empty() || ca_file.empty()) {
    return absl::InvalidArgumentError(
        "transport security needs --tls-cert, --tls-key and --tls-ca (mutual "
        "TLS between pdserve processes), or --insecure for plaintext "
        "(local use only)");
  }
  if (reload_interval < absl::Seconds(1))
    return absl::InvalidArgumentError(
        "--tls-reload-seconds must be at least 1");
  if (absl::Status s = CheckPemFile("--tls-cert", cert_file, "CERTIFICATE");
      !s.ok())
    return s;
  if (absl::Status s = CheckPemFile("--tls-key", key_file, "PRIVATE KEY");
      !s.ok())
    return s;
  return CheckPemFile("--tls-ca", ca_file, "CERTIFICATE");
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const TlsConfig& config, ClientAuth client_auth) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  if (config.insecure) return grpc::InsecureServerCredentials();
  grpc::experimental::TlsServerCredentialsOptions options(Provider(config));
  options.watch_identity_key_cert_pairs();
  options.watch_root_certs();
  options.set_cert_request_type(
      client_auth == ClientAuth::kRequire
          ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
          : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  return grpc::experimental::TlsServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>>
MutualChannelCredentials(const TlsConfig& config) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  if (config.insecure) return grpc::InsecureChannelCredentials();
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(Provider(config));
  options.watch_identity_key_cert_pairs();
  options.watch_root_certs();
  // The chain is verified against the CA; peers are pod IPs, so no host name.
  options.set_verify_server_certs(true);
  options.set_certificate_verifier(
      std::make_shared<grpc::experimental::NoOpCertificateVerifier>());
  options.set_check_call_host(false);
  return grpc::experimental::TlsCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>>
PublicChannelCredentials(const std::string& ca_file,
                         const std::string& cert_file,
                         const std::string& key_file) {
  if (cert_file.empty() != key_file.empty())
    return absl::InvalidArgumentError(
        "--tls-cert and --tls-key go together (a client certificate)");
  if (!ca_file.empty()) {
    if (absl::Status s = CheckPemFile("--tls-ca", ca_file, "CERTIFICATE");
        !s.ok())
      return s;
  }
  grpc::experimental::TlsChannelCredentialsOptions options;
  if (!ca_file.empty() || !cert_file.empty()) {
    options.set_certificate_provider(
        std::make_shared<FileWatcherCertificateProvider>(key_file, cert_file,
                                                         ca_file, 60));
  }
  if (!ca_file.empty()) options.watch_root_certs();
  if (!cert_file.empty()) options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);
  options.set_certificate_verifier(
      std::make_shared<grpc::experimental::HostNameCertificateVerifier>());
  return grpc::experimental::TlsCredentials(options);
}

absl::Status Install(const TlsConfig& config) {
  auto server = ServerCredentials(config, ClientAuth::kRequire);
  if (!server.ok()) return server.status();
  auto channel = MutualChannelCredentials(config);
  if (!channel.ok()) return channel.status();
  State& g = Global();
  absl::MutexLock l(&g.mu);
  g.installed = true;
  g.config = config;
  g.server = *server;
  g.channel = *channel;
  return absl::OkStatus();
}

bool IsInstalled() {
  State& g = Global();
  absl::MutexLock l(&g.mu);
  return g.installed;
}

bool Enabled() {
  State& g = Global();
  absl::MutexLock l(&g.mu);
  return !g.config.insecure;
}

TlsConfig Installed() {
  State& g = Global();
  absl::MutexLock l(&g.mu);
  return g.config;
}

std::shared_ptr<grpc::ChannelCredentials> InternalChannelCredentials() {
  State& g = Global();
  absl::MutexLock l(&g.mu);
  if (!g.installed && !g.warned) {
    g.warned = true;
    PDSERVE_LOG(ERROR) << "TLS was never configured (tls::Install): internal "
                          "channels refuse plaintext and will fail; pass "
                          "--insecure or --tls-cert/--tls-key/--tls-ca";
  }
  return g.channel;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>>
InternalServerCredentials() {
  State& g = Global();
  absl::MutexLock l(&g.mu);
  if (!g.installed) {
    return absl::FailedPreconditionError(
        "TLS was never configured: internal servers do not start in "
        "plaintext by default (pass --insecure or --tls-cert/--tls-key/"
        "--tls-ca; in-process code calls tls::Install)");
  }
  return g.server;
}

bool PeerHasVerifiedCertificate(const grpc::ServerContext& ctx) {
  std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth == nullptr) return false;
  // With REQUEST_..._AND_VERIFY, a presented certificate is only accepted by
  // the handshake if it chains to the CA; its presence means it verified.
  return !auth->FindPropertyValues(GRPC_X509_PEM_CERT_PROPERTY_NAME).empty();
}

}  // namespace pdserve::tls
