// Routing policies: given a request's block hashes and the live workers,
// pick the prefill worker (or local prefill) and the decode worker.
// An interface because there are real alternatives, compared in benchmarks
// and the router-scale simulation. Implementations are thread-safe.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "router/prefix_index.h"
#include "router/worker_registry.h"

namespace pdserve::router {

struct RouteRequest {
  int64_t num_tokens = 0;
  std::string cache_salt;
  const std::vector<int32_t>* tokens = nullptr;
  std::vector<WorkerIndex> exclude;  // workers that failed this request
};

struct RouteDecision {
  const WorkerView* prefill = nullptr;  // null: the decode worker prefills locally
  const WorkerView* decode = nullptr;
  int64_t prefill_cached_tokens = 0;    // expected hit at the chosen prefill (or decode) worker
  int64_t decode_cached_tokens = 0;
  std::string reason;                   // "remote", "local:short", "local:no_prefill", "colocated"
};

struct PolicyConfig {
  double w_prefill = 1.0;             // per uncached + queued prefill token
  double w_decode = 64.0;             // per running/waiting sequence on the decode side
  int64_t local_prefill_threshold = 32;  // uncached tokens at or below this prefill on the decode worker
};

class Policy {
 public:
  virtual ~Policy() = default;
  virtual const char* name() const = 0;
  // UNAVAILABLE when no worker can decode.
  virtual absl::StatusOr<RouteDecision> Choose(const RouteRequest& request,
                                               const std::vector<WorkerView>& workers) = 0;

  // "cache_aware" (default) or "round_robin".
  static absl::StatusOr<std::unique_ptr<Policy>> Create(const std::string& name, PolicyConfig config,
                                                        PrefixIndex* index);
  // Block hashes of `tokens` for a worker (its fingerprint and block size).
  static std::vector<engine::BlockHash> HashesFor(const WorkerView& w, const std::string& salt,
                                                  const std::vector<int32_t>& tokens);
};

}  // namespace pdserve::router
