// Peer pull (the cluster as a KV tier): when the prefill worker chosen for a
// request lacks a prompt prefix that another live worker holds in its pool
// or in its KV tier (read back by the holder for the pull), the router may
// tell the prefill worker to pull those blocks from the holder over the KV
// transport instead of recomputing them. DecidePeerPull makes that choice
// from the prefix index's counts (per tier) and the rates the workers
// measured and export in WorkerStatus; it pulls only when the estimated pull
// time (the holder's tier reads, then the transfer) is below the estimated
// time without it (the prefill worker's own tier reads, then recompute).
//
// Pure functions over value inputs: thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "pdserve/v1/internal.pb.h"
#include "router/prefix_index.h"

namespace pdserve::router {

struct PeerPullBackoffConfig {
  // A holder whose pull failed is skipped this long, doubled for each further
  // consecutive failure up to `max`; a pull that succeeds ends it.
  absl::Duration initial = absl::Seconds(5);
  absl::Duration max = absl::Minutes(1);
  // Holders remembered; past it, those whose backoff ended are forgotten
  // first (then the one ending soonest), so churn of holder addresses cannot
  // grow it.
  size_t max_holders = 1024;

  absl::Status Validate() const;
};

struct PeerPullConfig {
  bool enabled = false;  // --peer-pull
  // Pull only when recompute_s > min_speedup x transfer_s (1: whenever the
  // transfer is estimated faster).
  double min_speedup = 1.0;
  // Fewer blocks to gain than this: not worth a round trip.
  int32_t min_blocks = 1;
  // Fixed cost of one pull (the holder RPC and the transfer handshake), s.
  double overhead_seconds = 0.002;
  // Used until a worker has measured and exported its own rate.
  double default_prefill_tokens_per_second = 2000;
  double default_transfer_bytes_per_second = 1e9;
  // A tier token read back costs this fraction of a recompute until the
  // worker has measured its tier's load rate (as PolicyConfig's).
  double default_tier_load_cost = 0.25;
  PeerPullBackoffConfig backoff;

  absl::Status Validate() const;
};

// A worker that might hold the prompt's prefix.
struct PeerPullCandidate {
  WorkerIndex index = -1;
  std::string address;  // empty: unknown, never pulled from
  std::string id;
  bool up = false;          // the registry's view; a down worker is skipped
  bool same_cache = false;  // same cache fingerprint and block size as P
  // Its recent pulls failed (PeerPullBackoff): skipped until the backoff ends.
  bool backed_off = false;
  // Leading prompt blocks it holds in its pool, then its KV tier (index).
  int32_t leading_blocks = 0;
  // Of leading_blocks, the trailing ones only its tier holds: it reads them
  // back before sending. 0: all in its pool.
  int32_t tier_blocks = 0;
  double transfer_bytes_per_second = 0;  // its measured send rate; 0: unknown
  double tier_load_tokens_per_second =
      0;  // its tier's measured rate; 0: unknown
};

struct PeerPullInput {
  WorkerIndex prefill = -1;              // the chosen prefill worker P
  int32_t prefill_cached_blocks = 0;     // leading blocks P already holds
  int32_t prompt_blocks = 0;             // full blocks of the prompt
  int32_t block_size = 16;               // tokens per block
  int64_t bytes_per_block = 0;           // KV bytes of one block, all layers
  double prefill_tokens_per_second = 0;  // P's measured rate; 0: unknown
  double prefill_transfer_bytes_per_second = 0;  // P's send rate; 0: unknown
  // Leading blocks P holds in its pool and then its own KV tier (at least
  // prefill_cached_blocks): without a pull it reads those back from its tier
  // instead of recomputing them. 0: as prefill_cached_blocks.
  int32_t prefill_tier_blocks = 0;
  double prefill_tier_load_tokens_per_second = 0;  // 0: unknown
  std::vector<PeerPullCandidate> candidates;
};

struct PeerPullDecision {
  bool pull = false;
  WorkerIndex holder = -1;
  std::string holder_address, holder_id;
  int32_t blocks = 0;       // leading prompt blocks the holder holds
  int32_t gain_blocks = 0;  // of them, blocks P lacks
  int32_t tier_blocks = 0;  // of gain_blocks, read from the holder's tier
  // Estimates: the pull (overhead, the holder's tier reads, the transfer),
  // and the same blocks without it (P's own tier reads, then recompute).
  double transfer_seconds = 0, recompute_seconds = 0;
  // "" when pulling; else why not: "disabled", "no_holder", "not_faster",
  // "backed_off" (the only holders that would gain are backed off).
  std::string reason;
};

// The best holder: among those whose pull beats going without it by
// min_speedup, the one saving the most time (so the most blocks P lacks at
// equal rates, the fastest at equal blocks). Never P itself, a down or
// unknown worker, one with another cache identity, or one holding no more
// than P has in its pool.
PeerPullDecision DecidePeerPull(const PeerPullConfig& config,
                                const PeerPullInput& input);

// Which holders the router stops choosing for a while because pulls from
// them failed (the prefill worker reports each pull's outcome back through
// the decode worker's first response). Keyed by the holder's address.
// Thread-safe.
class PeerPullBackoff {
 public:
  explicit PeerPullBackoff(PeerPullBackoffConfig config = {})
      : config_(config) {}
  // A failed pull from `holder` at `now`: returns how long it is backed off.
  absl::Duration Failed(const std::string& holder, absl::Time now)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A pull from `holder` succeeded: its backoff (if any) ends.
  void Succeeded(const std::string& holder) ABSL_LOCKS_EXCLUDED(mu_);
  bool BackedOff(const std::string& holder, absl::Time now) const
      ABSL_LOCKS_EXCLUDED(mu_);
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct State {
    absl::Time until;
    int failures = 0;  // consecutive
  };
  const PeerPullBackoffConfig config_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, State> holders_ ABSL_GUARDED_BY(mu_);
};

// KV bytes of one block across all layers for a worker's layout (the int8
// per-(block, head) scales included).
int64_t BytesPerBlock(const v1::KvLayout& layout);

}  // namespace pdserve::router
