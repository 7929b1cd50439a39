// `pdserve sim route`: a discrete-event simulation of a prefill/decode cluster
// replaying a request trace through the real router code: the same Policy
// objects, PrefixIndex and KvEventApplier as the service, fed by simulated
// workers whose caches are real engine::BlockManagers, so their KV events
// (stored / removed, sequence-numbered) take the service's path into the
// index, with delivery delay, optional loss, gap detection and resync.
//
// Model (all times simulated, not wall-clock):
//  - arrivals at the trace timestamps x time_scale;
//  - the router routes each arrival at once; before each decision the views
//    carry the last heartbeat's WorkerStatus plus exact router-side routed
//    load, as in the service, and after it the chosen workers are speculated
//    into the index as the service does;
//  - a decode worker admits requests FIFO when its KV pool can reserve
//    prompt + output blocks (less its own prefix hits), then hands the prompt
//    to the chosen prefill worker (or, for a local decision, prefills the
//    few uncached tokens itself, beside its batch);
//  - a prefill worker serves its queue FIFO, one prompt at a time, taking
//    prefill_overhead + uncached tokens x prefill_us_per_token; its prefix
//    cache is looked up when the prompt starts and committed when it ends;
//    the first token (TTFT) comes out then;
//  - the KV moves to the decode worker (transfer_us_per_token per token it
//    does not hold), which commits the prompt blocks and joins the request to
//    its continuous batch; a step takes decode_step_ms + per_seq x batch +
//    per_kctx x context/1000 and yields one token per running request;
//  - the oracle routes like least_loaded but every prefill worker reads and
//    fills one shared cache of the cluster's total capacity: the hit ratio a
//    global LRU cache would reach, whatever the routing; "unbounded" is the
//    oracle with a cache that holds the whole working set;
//  - peer pull (a policy name ending in "+pull"): right after
//    routing, before its speculative entries, the router asks
//    router::DecidePeerPull whether the chosen prefill worker should pull
//    the prompt prefix it lacks from another worker (prefill or decode:
//    whoever the index says holds it, in its pool or its tier), with the
//    cost model's rates; when the prompt starts, the holder sends the run it
//    still has, from its pool and then its tier (pull_overhead_ms +
//    transfer_us_per_token per token + tier_read_us_per_token per token read
//    from its tier; counted as prefix hits and committed to the puller's
//    cache); a shorter run is a partial pull, none a failed one, and the
//    puller recomputes the rest;
//  - a lower tier per prefill worker (a name with "+tier"; "+dtier": decode
//    workers too): evicted prefix blocks go to an LRU tier of tier_multiple
//    x the pool, published to the index as the engine does (moved / removed
//    per tier), so routing and pulls see them; a prompt's prefix continues
//    there after its pool hits (before any pull), and a hit refreshes it.
// Speculative index entries are confirmed or dropped by the workers' events
// in simulated time (their wall-clock TTL is set beyond any run).
// Every figure except the measured decision latency is a function of the
// trace and the config: the same seed gives the same report.
//
// Thread-compatible: RunRouterSim keeps all state local to the call.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "bench/trace.h"
#include "kv_cache/block_manager.h"
#include "router/kv_event_applier.h"
#include "router/policy.h"
#include "router/prefix_index.h"

namespace pdserve::bench {

struct SimConfig {
  std::string trace_path;  // Mooncake JSONL (RunRouterSim's first overload)
  // Policy::Create names plus "oracle"; each runs once per prefill count.
  std::vector<std::string> policies = {"cache_aware", "cache_threshold",
                                       "least_loaded", "round_robin", "oracle"};
  std::vector<int32_t> prefill_workers = {16};
  int32_t decode_workers = 8;
  int64_t prefill_cache_tokens = 900000;  // prefix cache per prefill worker
  int64_t decode_kv_tokens = 2000000;     // KV pool per decode worker
  // pdserve block; a trace block is 512 / block_size of them.
  int32_t block_size = 16;
  // Arrival = timestamp x time_scale; < 1 raises the load.
  double time_scale = 1.0;
  int64_t max_requests = 0;  // first N trace requests; 0 = all
  // Each (prefill count, policy) is simulated this many times. Replays are
  // deterministic (same decisions, same index), so a request's fastest
  // decision over them is its own cost with most of the host's
  // interruptions left out (decision_min_p50_us, decision_min_p99_us).
  int32_t decision_replays = 1;

  // Prefill: per uncached token, plus a fixed cost per prompt.
  double prefill_us_per_token = 100;  // 10k tokens/s
  double prefill_overhead_ms = 5;
  // Decode step time = decode_step_ms + decode_step_per_seq_ms x batch
  //                    + decode_step_per_kctx_ms x (context tokens / 1000).
  double decode_step_ms = 6;
  double decode_step_per_seq_ms = 0.05;
  double decode_step_per_kctx_ms = 0.04;
  double transfer_us_per_token = 0.5;  // prefill -> decode KV transfer

  // Router plumbing, as in the service.
  double heartbeat_ms = 500;  // WorkerStatus refresh period
  double event_delay_ms = 2;  // KV event delivery latency
  double event_loss = 0;  // probability that an event is lost (gap -> resync)
  double resync_delay_ms = 500;  // resubscribe back-off after a gap
  uint64_t seed = 1;             // token synthesis and event loss
  router::PolicyConfig policy;
  // > 0: every worker's pool (prefill cache and decode KV) holds this
  // fraction of the trace's working set (distinct prompt blocks) divided by
  // the worker count (prefill + decode), instead of prefill_cache_tokens and
  // decode_kv_tokens (a decode pool never below its largest request).
  double pool_fraction = 0;
  // Peer pull ("+pull" policies): fixed cost of one pull.
  double pull_overhead_ms = 2;
  // "+tier" policies: each prefill worker keeps the hashes its pool evicts
  // in an LRU tier of tier_multiple x its pool (kv_cache/kv_tier.h), and a
  // prompt's prefix continues there after its pool hits, read at this cost
  // (default: 128 KiB/token at 2 GB/s, as `sim route --tiers`).
  double tier_multiple = 4;
  double tier_read_us_per_token = 65.536;
  // "+pull" with a "+tier": a holder serves a pull from its tier too (as
  // PeerBlockHolder does); false: from its pool only (the index is then
  // asked pool counts for holders), for comparison.
  bool pull_from_tiers = true;
  // A tier hit makes the block the tier's most recent (KvTier::Match does);
  // false: the tier stays in insertion order, for comparison.
  bool tier_refresh_on_hit = true;

  absl::Status Validate() const;
};

// Sets prefill_us_per_token and the decode step model from the JSON that
// `pdserve bench engine --json` prints (prefill_tokens_per_s; step_ms per
// batch, fitted as decode_step_ms + decode_step_per_seq_ms x batch).
absl::Status ApplyEngineCalibration(absl::string_view bench_engine_json,
                                    SimConfig* config);

// One policy at one cluster size.
struct SimRun {
  std::string policy;
  int32_t prefill_workers = 0;
  int32_t decode_workers = 0;
  int64_t requests = 0;  // served
  // Prompt + output larger than a decode worker's KV pool.
  int64_t rejected = 0;
  int64_t input_tokens = 0;  // of served requests
  // Served from the prefix cache where the prompt was prefilled.
  int64_t hit_tokens = 0;
  double hit_ratio = 0;  // hit_tokens / input_tokens
  // Max / mean prefill tokens computed per prefill worker.
  double imbalance = 0;
  double decode_imbalance = 0;  // max / mean requests decoded per decode worker
  int64_t local_prefills = 0;   // prompts the decode worker prefilled itself
  double ttft_p50_ms = 0, ttft_p99_ms = 0;
  double prefill_queue_p50_ms = 0,
         prefill_queue_p99_ms = 0;  // waiting at the prefill worker
  double decode_admit_p50_ms = 0,
         decode_admit_p99_ms = 0;  // waiting for decode KV
  double tpot_p50_ms = 0, tpot_p99_ms = 0;
  // The router's work per request, on the real code, in wall-clock time on
  // the monotonic clock (p50, p99). NaN for the oracle, which is not a
  // router.
  //  - decision: Policy::Choose given the prompt's block hashes (index
  //    query, scoring);
  //  - hash: hashing the prompt's blocks at intake (PromptHashes, as the
  //    service does once per request for the decision and speculation);
  //  - route: the two together, per request.
  double decision_p50_us = 0, decision_p99_us = 0;
  double hash_p50_us = 0, hash_p99_us = 0;
  double route_p50_us = 0, route_p99_us = 0;
  // The host's own share of those tails: a fixed register-only loop, sized
  // to the decision's running median and timed the same way right after
  // each decision (p50, p99). Interrupts, a hypervisor's exits and vCPU
  // preemption land in any span of time, so a decision p99
  // far above its p50 next to a reference p99 as high is the machine's,
  // not the router's. NaN for the oracle.
  double reference_p50_us = 0, reference_p99_us = 0;
  // Over SimConfig::decision_replays replays: each request's fastest
  // decision, then the percentiles of those (equal to decision_p50_us and
  // decision_p99_us with one replay). NaN for the oracle.
  int32_t decision_replays = 1;
  double decision_min_p50_us = 0, decision_min_p99_us = 0;
  // Each request's decision time in arrival order (not in the JSON).
  std::vector<double> decision_us;
  // The router's index at the end of the run.
  int64_t index_hashes = 0, index_entries = 0, index_bytes = 0;
  double index_bytes_per_block = 0;  // per (block hash, worker) entry
  int64_t events_lost = 0, resyncs = 0;
  double makespan_s = 0;  // simulated time until the last request finished
  // Peer pull ("+pull"): prompt tokens pulled from a peer (in hit_tokens),
  // pulls done, and pulls whose holder no longer had the blocks.
  int64_t pulled_tokens = 0, peer_pulls = 0, peer_pulls_failed = 0;
  // Of peer_pulls, those that got only part of what was asked (the holder
  // had lost the rest); of pulled_tokens, those read from the holder's tier.
  int64_t peer_pulls_partial = 0, pulled_tier_tokens = 0;
  // Diagnosis of the misses: prompt tokens computed although, as the prompt
  // started, one worker (this prefill worker or any other, pool then tier)
  // held them as a leading run. The other misses were held nowhere: first
  // seen (what "unbounded" misses too) or evicted everywhere.
  int64_t held_missed_tokens = 0;
  int64_t tier_hit_tokens = 0;  // "+tier": read from a worker's tier
  int64_t prefill_pool_tokens = 0, decode_pool_tokens = 0;  // per worker
};

struct SimReport {
  SimConfig config;
  int64_t trace_requests = 0;
  int64_t working_set_tokens = 0;  // distinct full prompt blocks x block_size
  std::vector<SimRun> runs;  // policies x prefill_workers, in config order
  // Hit ratio of `run` over the oracle's at the same size; NaN without one.
  double HitVsOracle(const SimRun& run) const;
  // The same over the "unbounded" oracle's; NaN without one.
  double HitVsUnbounded(const SimRun& run) const;
  std::string ToJson() const;
  std::string ToTable() const;
  // Hit ratio and imbalance against prefill worker count, one line per
  // policy: a self-contained SVG document.
  std::string ToSvg() const;
  absl::Status WriteSvg(const std::string& path) const;
  // Writes ToJson() to `json_path` and the SVG next to it (SvgPathFor).
  absl::Status WriteFiles(const std::string& json_path) const;
  // "out/sim.json" -> "out/sim.svg"; other names get ".svg" appended.
  static std::string SvgPathFor(const std::string& json_path);
};

// One simulated worker's KV event stream into the router's index, consumed
// as WorkerRegistry::EventLoop does: a snapshot on subscription, then events
// in order through a KvEventApplier; the first gap (a lost event) drops the
// stream, discarding what follows, until Resync() takes a fresh snapshot of
// the worker's cache. Times are simulated µs.
class SimEventStream {
 public:
  SimEventStream(router::PrefixIndex* index, router::WorkerIndex worker,
                 const engine::BlockManager* cache)
      : applier_(index, worker), cache_(cache) {}
  // Subscribes or resubscribes: the cache's hashes as of now replace what the
  // index knows about the worker; events published so far are covered.
  void Resync();
  // The worker published `event` at `now_us`; it arrives `delay_us` later
  // unless `lost`.
  void Publish(const engine::KvEvent& event, int64_t now_us, int64_t delay_us,
               bool lost);
  // Applies the events that arrived by `until_us`. Returns the arrival time
  // of the event that revealed a gap, once per broken stream.
  std::optional<int64_t> Deliver(int64_t until_us);
  bool broken() const { return broken_; }
  // The worker has a tier below its pool: snapshots list its hashes too.
  void SetTier(engine::KvTierKind kind,
               std::function<std::vector<engine::BlockHash>()> hashes) {
    tier_kind_ = kind;
    tier_hashes_ = std::move(hashes);
  }

 private:
  router::KvEventApplier applier_;
  const engine::BlockManager* cache_;
  engine::KvTierKind tier_kind_ = engine::KvTierKind::kDisk;
  std::function<std::vector<engine::BlockHash>()> tier_hashes_;  // may be null
  std::deque<std::pair<int64_t, engine::KvEvent>> in_flight_;
  bool broken_ = false;
};

// `progress`, when set, is called after each run (e.g. to print a line).
absl::StatusOr<SimReport> RunRouterSim(
    const SimConfig& config,
    const std::function<void(const SimRun&)>& progress = nullptr);
absl::StatusOr<SimReport> RunRouterSim(
    const SimConfig& config, const std::vector<TraceRequest>& trace,
    const std::function<void(const SimRun&)>& progress = nullptr);

}  // namespace pdserve::bench
