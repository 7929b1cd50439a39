#include "router/tenant_limiter.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace pdserve::router {

TenantLimiter::State& TenantLimiter::Refill(const Tenant& tenant,
                                            absl::Time now) {
  State& s = tenants_[tenant.name];
  const double capacity = static_cast<double>(tenant.limits.tokens_per_minute);
  if (s.refilled == absl::InfinitePast()) {
    s.bucket = capacity;
  } else if (now > s.refilled) {
    s.bucket = std::min(
        capacity,
        s.bucket + capacity / 60.0 * absl::ToDoubleSeconds(now - s.refilled));
  }
  s.refilled = std::max(s.refilled, now);
  return s;
}

std::optional<TenantLimiter::Rejection> TenantLimiter::Admit(
    const Tenant& tenant, int64_t prompt_tokens, absl::Time now) {
  absl::MutexLock l(&mu_);
  State& s = Refill(tenant, now);
  const TenantLimits& lim = tenant.limits;
  if (lim.max_concurrent > 0 && s.in_flight >= lim.max_concurrent) {
    // No way to know when one finishes; a short back-off is the honest hint.
    return Rejection{
        "concurrency", absl::Milliseconds(500),
        absl::StrCat("tenant \"", tenant.name, "\" has ", s.in_flight,
                     " requests in flight (limit ", lim.max_concurrent, ")")};
  }
  if (lim.tokens_per_minute > 0) {
    const double capacity = static_cast<double>(lim.tokens_per_minute);
    const double need = std::min(
        capacity, static_cast<double>(std::max<int64_t>(1, prompt_tokens)));
    if (s.bucket < need) {
      const double seconds = (need - s.bucket) / (capacity / 60.0);
      return Rejection{
          "tokens_per_minute", absl::Milliseconds(std::ceil(seconds * 1000.0)),
          absl::StrCat("tenant \"", tenant.name, "\" is over its limit of ",
                       lim.tokens_per_minute, " tokens per minute")};
    }
    s.bucket -= static_cast<double>(prompt_tokens);
  }
  ++s.in_flight;
  return std::nullopt;
}

void TenantLimiter::Charge(const Tenant& tenant, int64_t tokens,
                           absl::Time now) {
  if (tenant.limits.tokens_per_minute <= 0 || tokens == 0) return;
  absl::MutexLock l(&mu_);
  Refill(tenant, now).bucket -= static_cast<double>(tokens);
}

void TenantLimiter::Release(const Tenant& tenant) {
  absl::MutexLock l(&mu_);
  auto it = tenants_.find(tenant.name);
  if (it != tenants_.end() && it->second.in_flight > 0) --it->second.in_flight;
}

}  // namespace pdserve::router
