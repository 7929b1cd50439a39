// Per-tenant admission: concurrent requests and tokens per minute.
//
// Tokens per minute is a token bucket of capacity `tokens_per_minute` that
// refills continuously at tokens_per_minute / 60 per second. A request is
// admitted when the bucket holds at least its prompt tokens (or is full, for
// a prompt larger than the bucket); the prompt is charged at admission and
// generated tokens as they stream, so the balance may go negative and a
// heavy tenant waits for it to refill. Rejections carry how long to wait.
//
// Memory is bounded by the number of tenants (they come from the token
// file). Thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "router/auth.h"

namespace pdserve::router {

class TenantLimiter {
 public:
  struct Rejection {
    std::string limit;           // "concurrency" | "tokens_per_minute"
    absl::Duration retry_after;  // hint for the client
    std::string message;
  };

  // Admits one request of `tenant` with `prompt_tokens`, or says why not.
  // On admission the caller must call Release() exactly once.
  std::optional<Rejection> Admit(const Tenant& tenant, int64_t prompt_tokens,
                                 absl::Time now);
  // Charges generated tokens to the tenant's bucket.
  void Charge(const Tenant& tenant, int64_t tokens, absl::Time now);
  void Release(const Tenant& tenant);

 private:
  struct State {
    int32_t in_flight = 0;
    double bucket = 0;  // tokens; starts full
    absl::Time refilled = absl::InfinitePast();
  };
  State& Refill(const Tenant& tenant, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, State> tenants_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::router
