// Flags for transport security, authentication, tenant limits and request
// limits (docs/security.md), and the configs built from them.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tls.h"
#include "router/router_service.h"

namespace pdserve::cli {

// --insecure / --tls-cert / --tls-key / --tls-ca / --tls-reload-seconds,
// validated: a server refuses to start with neither TLS files nor --insecure.
absl::StatusOr<tls::TlsConfig> TlsConfigFromFlags();

// Validates the TLS flags and installs them as this process's identity
// (tls::Install); call before any server or channel is created.
absl::Status InstallTlsFromFlags();

// Auth, tenant and request-limit flags into `config` (not validated here).
void RouterSecurityFromFlags(router::RouterConfig* config);

// Command-line arguments that pass this process's TLS flags on (pdserve up).
std::vector<std::string> TlsArgsFromFlags();

// `generate --router`: channel credentials (TLS when --tls or --tls-ca is
// set) and the bearer token (--auth-token, else $PDSERVE_AUTH_TOKEN).
absl::StatusOr<std::shared_ptr<grpc::Channel>> RouterChannelFromFlags(
    const std::string& address);
std::string AuthTokenFromFlags();

}  // namespace pdserve::cli
