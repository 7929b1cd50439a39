// The KV-tier part of `pdserve sim route --tiers`: replays a Mooncake trace
// through one prefix cache with and without a lower tier below it, and
// through an unbounded cache (the oracle), to show how much of the reuse a
// pool too small for the working set loses and how much a tier wins back.
//
// Model (mirrors kv_cache/kv_tier.h, at the trace's 512-token blocks):
//  - the pool is an LRU of `pool_blocks`; a request's blocks are looked up
//    in order and the prefix stops at the first block that neither the pool
//    nor the tier holds; then every block of the prompt is made the pool's
//    most recent (hits and new ones), evicting the pool's LRU;
//  - a block the pool evicts is offered to the tier (an LRU of
//    `tier_blocks`); a block already there only stays (as Offer() does), a
//    tier hit leaves the block in the tier (the file stays) and promotes it
//    into the pool;
//  - time: a miss costs prefill_us_per_token, a tier hit its bytes at the
//    tier's read rate (kv_bytes_per_token / tier_read_gbps), a pool hit
//    nothing; figures are totals over the trace, not queueing.
// The working set is the trace's distinct blocks; pool_fraction sizes the
// pool against it and tier_multiple the tier against the pool.
//
// Thread-compatible: RunTierSim keeps its state local to the call.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/trace.h"

namespace pdserve::bench {

struct TierSimConfig {
  // Pool sizes to model, as fractions of the working set (distinct blocks).
  std::vector<double> pool_fractions = {0.0625, 0.125, 0.25, 0.5};
  double tier_multiple = 4;  // tier blocks = tier_multiple x pool blocks
  double prefill_us_per_token = 100;    // recompute cost
  int64_t kv_bytes_per_token = 131072;  // 32 layers x 8 heads x 128 x fp16 x 2
  double tier_read_gbps = 2.0;          // tier read rate, 1e9 bytes/s
  int64_t max_requests = 0;             // first N; 0 = all
  absl::Status Validate() const;
};

struct TierSimCase {
  std::string name;  // "pool", "pool+tier", "unbounded"
  double pool_fraction = 0;
  int64_t pool_blocks = 0, tier_blocks = 0;  // -1: unbounded
  int64_t input_tokens = 0;
  int64_t pool_hit_tokens = 0, tier_hit_tokens = 0;
  double hit_ratio = 0;        // (pool + tier hits) / input tokens
  double vs_unbounded = 0;     // hit_ratio / the unbounded hit ratio
  double prefill_seconds = 0;  // recompute + tier reads, whole trace
};

struct TierSimReport {
  TierSimConfig config;
  int64_t requests = 0;
  int64_t working_set_blocks = 0;
  std::vector<TierSimCase> cases;  // unbounded first, then per fraction
  std::string ToTable() const;
  std::string ToJson() const;
};

absl::StatusOr<TierSimReport> RunTierSim(
    const TierSimConfig& config, const std::vector<TraceRequest>& trace);

}  // namespace pdserve::bench
