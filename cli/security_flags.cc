#include "cli/security_flags.h"

#include <cstdlib>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(bool, insecure, false,
          "plaintext gRPC everywhere (local use only; servers refuse to start "
          "without either this or --tls-cert/--tls-key/--tls-ca)");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain of this process (servers: its identity on "
          "every port; generate: optional client certificate)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA bundle: servers verify peers' certificates (mTLS) against "
          "it; generate verifies the router's (default: system roots)");
ABSL_FLAG(int32_t, tls_reload_seconds, 10,
          "re-read --tls-cert/--tls-key/--tls-ca this often, so rotated "
          "certificates apply to new connections without a restart");
ABSL_FLAG(bool, tls, false,
          "generate --router: connect with TLS (implied by --tls-ca)");
ABSL_FLAG(std::string, tls_server_name, "",
          "generate --router: expected name in the router's certificate "
          "(default: the host of --router)");
ABSL_FLAG(std::string, auth_token, "",
          "generate --router: bearer token (default: $PDSERVE_AUTH_TOKEN)");
ABSL_FLAG(std::string, auth_tokens, "",
          "router: file of \"TOKEN TENANT [max_concurrent=N] "
          "[tokens_per_minute=N]\" lines; requires a bearer token on every "
          "Generate call (re-read when it changes)");
ABSL_FLAG(int32_t, tenant_max_concurrent, 0,
          "router: requests in flight per tenant (0: unlimited)");
ABSL_FLAG(int64_t, tenant_tokens_per_minute, 0,
          "router: prompt + generated tokens per tenant per minute (0: "
          "unlimited)");
ABSL_FLAG(bool, shared_prefix_cache, false,
          "router: let tenants share prefix-cache blocks (default: the tenant "
          "is part of every cache_salt)");
ABSL_FLAG(int32_t, request_timeout_ms, 600000,
          "router: server-side ceiling on a request's duration");
ABSL_FLAG(int64_t, max_message_bytes, 4 << 20,
          "router: largest request message accepted on the public port");
ABSL_FLAG(int32_t, max_prompt_tokens, 0,
          "router: longest prompt in tokens (0: the workers' max_model_len)");
ABSL_FLAG(int32_t, max_output_tokens, 0,
          "router: largest max_tokens accepted (0: the workers' "
          "max_model_len)");
ABSL_FLAG(int32_t, max_stop_strings, 16, "router: stop strings per request");
ABSL_FLAG(int32_t, max_stop_string_bytes, 256, "router: bytes per stop string");
ABSL_FLAG(int32_t, max_streams_per_connection, 100,
          "router: concurrent HTTP/2 streams per client connection");
ABSL_FLAG(int32_t, max_inflight_requests, 1024,
          "router: Generate calls in flight; more are shed with "
          "RESOURCE_EXHAUSTED (0: unlimited)");

namespace pdserve::cli {

absl::StatusOr<tls::TlsConfig> TlsConfigFromFlags() {
  tls::TlsConfig c;
  c.insecure = absl::GetFlag(FLAGS_insecure);
  c.cert_file = absl::GetFlag(FLAGS_tls_cert);
  c.key_file = absl::GetFlag(FLAGS_tls_key);
  c.ca_file = absl::GetFlag(FLAGS_tls_ca);
  c.reload_interval = absl::Seconds(absl::GetFlag(FLAGS_tls_reload_seconds));
  if (absl::Status s = c.Validate(); !s.ok()) return s;
  return c;
}

absl::Status InstallTlsFromFlags() {
  absl::StatusOr<tls::TlsConfig> c = TlsConfigFromFlags();
  if (!c.ok()) return c.status();
  return tls::Install(*c);
}

std::vector<std::string> TlsArgsFromFlags() {
  if (absl::GetFlag(FLAGS_insecure) || (absl::GetFlag(FLAGS_tls_cert).empty() &&
                                        absl::GetFlag(FLAGS_tls_key).empty() &&
                                        absl::GetFlag(FLAGS_tls_ca).empty()))
    return {"--insecure"};
  return {"--tls-cert=" + absl::GetFlag(FLAGS_tls_cert),
          "--tls-key=" + absl::GetFlag(FLAGS_tls_key),
          "--tls-ca=" + absl::GetFlag(FLAGS_tls_ca),
          "--tls-reload-seconds=" +
              std::to_string(absl::GetFlag(FLAGS_tls_reload_seconds))};
}

void RouterSecurityFromFlags(router::RouterConfig* config) {
  absl::StatusOr<tls::TlsConfig> t = TlsConfigFromFlags();
  if (t.ok()) config->tls = *t;
  config->auth_tokens_file = absl::GetFlag(FLAGS_auth_tokens);
  config->tenant_limits.max_concurrent =
      absl::GetFlag(FLAGS_tenant_max_concurrent);
  config->tenant_limits.tokens_per_minute =
      absl::GetFlag(FLAGS_tenant_tokens_per_minute);
  config->shared_prefix_cache = absl::GetFlag(FLAGS_shared_prefix_cache);
  config->request_timeout =
      absl::Milliseconds(absl::GetFlag(FLAGS_request_timeout_ms));
  router::RequestLimits& l = config->limits;
  l.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  l.max_prompt_tokens = absl::GetFlag(FLAGS_max_prompt_tokens);
  l.max_output_tokens = absl::GetFlag(FLAGS_max_output_tokens);
  l.max_stop_strings = absl::GetFlag(FLAGS_max_stop_strings);
  l.max_stop_string_bytes = absl::GetFlag(FLAGS_max_stop_string_bytes);
  l.max_streams_per_connection =
      absl::GetFlag(FLAGS_max_streams_per_connection);
  l.max_inflight_requests = absl::GetFlag(FLAGS_max_inflight_requests);
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> RouterChannelFromFlags(
    const std::string& address) {
  grpc::ChannelArguments args;
  // Responses are small; the router bounds what it accepts.
  args.SetMaxReceiveMessageSize(64 << 20);
  if (!absl::GetFlag(FLAGS_tls) && absl::GetFlag(FLAGS_tls_ca).empty()) {
    return grpc::CreateCustomChannel(address,
                                     grpc::InsecureChannelCredentials(), args);
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds =
      tls::PublicChannelCredentials(absl::GetFlag(FLAGS_tls_ca),
                                    absl::GetFlag(FLAGS_tls_cert),
                                    absl::GetFlag(FLAGS_tls_key));
  if (!creds.ok()) return creds.status();
  if (!absl::GetFlag(FLAGS_tls_server_name).empty())
    args.SetSslTargetNameOverride(absl::GetFlag(FLAGS_tls_server_name));
  return grpc::CreateCustomChannel(address, *creds, args);
}

std::string AuthTokenFromFlags() {
  if (!absl::GetFlag(FLAGS_auth_token).empty())
    return absl::GetFlag(FLAGS_auth_token);
  const char* env = std::getenv("PDSERVE_AUTH_TOKEN");
  return env ? env : "";
}

}  // namespace pdserve::cli
