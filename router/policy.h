// Routing policies: given a request's block hashes and the live workers,
// pick the prefill worker (or local prefill) and the decode worker.
// An interface because there are real alternatives, compared in benchmarks
// and the router-scale simulation. Implementations are thread-safe.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "router/prefix_index.h"
#include "router/worker_registry.h"

namespace pdserve::router {

// One request's block hashes per cache fingerprint (workers with another KV
// dtype or block size hash differently), computed once at intake, like the
// tokens, and shared by the routing decision and the speculative index
// entries that follow it. Not thread-safe: one per request.
class PromptHashes {
 public:
  PromptHashes(const std::vector<int32_t>* tokens, std::string cache_salt)
      : tokens_(tokens), salt_(std::move(cache_salt)) {}
  // The chain of the full blocks under this fingerprint and block size.
  const std::vector<engine::BlockHash>& For(
      const engine::ModelFingerprint& fingerprint, int32_t block_size);

 private:
  struct Group {
    engine::ModelFingerprint fingerprint{};
    std::vector<engine::BlockHash> hashes;
  };
  const std::vector<int32_t>* tokens_;
  std::string salt_;
  absl::InlinedVector<Group, 1> groups_;
};

struct RouteRequest {
  int64_t num_tokens = 0;
  std::string cache_salt;
  const std::vector<int32_t>* tokens = nullptr;
  std::vector<WorkerIndex> exclude;  // workers that failed this request
  // The tokens' block hashes; when null, the policy hashes lazily itself.
  PromptHashes* hashes = nullptr;
};

struct RouteDecision {
  // Null: the decode worker prefills locally.
  const WorkerView* prefill = nullptr;
  const WorkerView* decode = nullptr;
  // Expected hit at the chosen prefill (or decode) worker: its pool's and
  // its KV tier's (read back before prefill; the tier's share below).
  int64_t prefill_cached_tokens = 0;
  int64_t decode_cached_tokens = 0;
  int64_t prefill_tier_tokens = 0;  // of prefill_cached_tokens
  int64_t decode_tier_tokens = 0;   // of decode_cached_tokens
  // "remote", "local:short", "local:no_prefill", "colocated".
  std::string reason;
};

struct PolicyConfig {
  double w_prefill = 1.0;  // per uncached + queued prefill token
  double w_decode = 64.0;  // per running/waiting sequence on the decode side
  // Uncached tokens at or below this prefill on the decode worker.
  int64_t local_prefill_threshold = 32;
  // cache_threshold: follow the best prefix match when it covers more than
  // this fraction of the prompt, else the least-loaded prefill worker.
  double cache_threshold = 0.5;
  // cache_aware: prefill costs within this fraction of the prompt's tokens
  // (x w_prefill) of the cheapest count as equal; among them the worker with
  // the least uncached work routed to it so far wins. 0: cheapest only.
  double balance_slack = 0.1;
  // cache_aware: a prompt token read back from a worker's KV tier costs this
  // fraction of recomputing it, until the worker has measured both its tier
  // load rate and its prefill rate (WorkerStatus); then the ratio of the
  // two, kept within [kMinTierLoadCost, kMaxTierLoadCost] so that a tier hit
  // always prices between a pool hit (0) and recompute (1).
  double tier_load_cost = 0.25;
};
inline constexpr double kMinTierLoadCost = 0.01;
inline constexpr double kMaxTierLoadCost = 0.95;
// The price of one tier token at `w` as a fraction of a recomputed one.
double TierLoadCost(const WorkerView& w, const PolicyConfig& config);

class Policy {
 public:
  virtual ~Policy() = default;
  virtual const char* name() const = 0;
  // UNAVAILABLE when no worker can decode.
  virtual absl::StatusOr<RouteDecision> Choose(
      const RouteRequest& request, const std::vector<WorkerView>& workers) = 0;

  // "cache_aware" (default): lowest w_prefill x (uncached + tier tokens x
  //   TierLoadCost + queued prefill tokens) + w_decode x load; near-ties
  //   (balance_slack) go to the worker with the least work routed so far,
  //   exact ties rotate;
  // "round_robin";
  // "least_loaded": fewest queued prefill tokens (the larger of the heartbeat's
  //   figure and the router's own in-flight count), cache-blind;
  // "cache_threshold" (SGLang router style): the best prefix match if its
  //   match rate exceeds cache_threshold, else least_loaded's choice.
  // Decode: cache_aware weighs load, free blocks and cached tokens; the
  // others pick the fewest running + waiting + routed sequences.
  static absl::StatusOr<std::unique_ptr<Policy>> Create(const std::string& name,
                                                        PolicyConfig config,
                                                        PrefixIndex* index);
};

}  // namespace pdserve::router
