// Bearer-token authentication for the public Router API. Tokens come from a
// file of lines
//
//   TOKEN TENANT [max_concurrent=N] [tokens_per_minute=N]
//
// ('#' starts a comment; blank lines are ignored; the optional fields
// override the router-wide per-tenant limits for that tenant). The file is
// re-read when its modification time or size changes, checked at most once a
// second, so a Kubernetes Secret update applies without a restart; a file
// that fails to parse keeps the previous table and logs why.
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pdserve::router {

// Per-tenant limits; 0 means unlimited.
struct TenantLimits {
  int32_t max_concurrent = 0;     // requests in flight
  int64_t tokens_per_minute = 0;  // prompt + generated tokens
};

struct Tenant {
  std::string name;
  TenantLimits limits;
};

// The parsed token file.
class TokenTable {
 public:
  // INVALID_ARGUMENT with the line number for a malformed line.
  static absl::StatusOr<TokenTable> Parse(absl::string_view text,
                                          const TenantLimits& defaults);
  // The tenant of `token`, or nullptr.
  const Tenant* Find(absl::string_view token) const;
  size_t size() const { return tenants_by_token_.size(); }

 private:
  absl::flat_hash_map<std::string, Tenant> tenants_by_token_;
};

class Authenticator {
 public:
  static absl::StatusOr<std::unique_ptr<Authenticator>> Create(
      const std::string& path, const TenantLimits& defaults);

  // The tenant for an `authorization` metadata value ("Bearer TOKEN").
  // UNAUTHENTICATED when it is missing, malformed or unknown; the message
  // never echoes the token.
  absl::StatusOr<Tenant> Authenticate(absl::string_view authorization);

 private:
  Authenticator(std::string path, TenantLimits defaults)
      : path_(std::move(path)), defaults_(defaults) {}
  absl::Status Load() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeReload() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  const TenantLimits defaults_;
  absl::Mutex mu_;
  TokenTable table_ ABSL_GUARDED_BY(mu_);
  int64_t mtime_ns_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t size_ ABSL_GUARDED_BY(mu_) = -1;
  absl::Time last_check_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace pdserve::router
