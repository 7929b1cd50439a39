// What the files of `pdserve sim route` share (router_sim.cc: the event
// loop and the simulated workers; router_sim_policies.cc: the router's side,
// routing and peer-pull decisions, and the policy names; router_sim_report.cc:
// the figures of a run and the report's JSON, table and SVG;
// router_sim_trace.cc: reading and preparing the trace). Nothing else
// includes it.
#pragma once

#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <queue>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "bench/router_sim.h"
#include "bench/trace.h"
#include "kv_cache/block_manager.h"
#include "router/peer_pull.h"
#include "router/policy.h"
#include "router/prefix_index.h"
#include "router/worker_registry.h"

namespace pdserve::bench::router_sim_internal {

using Micros = int64_t;
using engine::BlockHash;

constexpr int32_t kVocabSize = 32000;
// Speculative entries are confirmed by the worker's `stored` events in
// simulated time; the index's TTL is wall-clock, so it is set far beyond any
// run to keep the result independent of how fast the host simulates.
constexpr absl::Duration kSpeculativeTtl = absl::Hours(24);
constexpr char kOracle[] = "oracle";
constexpr char kUnbounded[] = "unbounded";
constexpr char kPullSuffix[] = "+pull";
constexpr char kTierSuffix[] = "+tier";
constexpr char kDecodeTierSuffix[] = "+dtier";

// "cache_aware+tier+pull" -> "cache_aware" (the suffixes in any order).
std::string BasePolicy(const std::string& name);
bool HasOption(const std::string& name, const char* suffix);
bool IsOracle(const std::string& base);

// A worker's lower tier in the sim (kv_cache/kv_tier.h's policy): the hashes
// of blocks its pool evicted, an LRU of `capacity`; a hit leaves the block
// there and makes it the most recent (as KvTier::Match). Its changes reach
// the router's index as the engine's do: an eviction it keeps is a `moved`
// (pool -> disk) event of the pool, a block it drops a `removed` event of
// the tier, in the worker's one event stream.
class SimTier {
 public:
  SimTier(int64_t capacity, bool refresh)
      : capacity_(capacity), refresh_(refresh) {}
  // Keeps `h`; returns the hash dropped to make room, if any.
  std::optional<BlockHash> Offer(const BlockHash& h) {
    std::optional<BlockHash> dropped;
    if (capacity_ <= 0 || pos_.contains(h)) return dropped;
    if (static_cast<int64_t>(lru_.size()) >= capacity_) {
      dropped = lru_.front();
      pos_.erase(lru_.front());
      lru_.pop_front();
    }
    pos_[h] = lru_.insert(lru_.end(), h);
    return dropped;
  }
  bool Contains(const BlockHash& h) const { return pos_.contains(h); }
  // How many of `hashes` it holds, leading; they become the most recent,
  // the first of them last (a chain's head is the last to be dropped).
  int32_t Match(std::span<const BlockHash> hashes) {
    size_t n = 0;
    while (n < hashes.size() && pos_.contains(hashes[n])) ++n;
    for (size_t i = n; refresh_ && i-- > 0;)
      lru_.splice(lru_.end(), lru_, pos_.find(hashes[i])->second);
    return static_cast<int32_t>(n);
  }
  std::vector<BlockHash> Hashes() const {
    return std::vector<BlockHash>(lru_.begin(), lru_.end());
  }

 private:
  const int64_t capacity_;
  const bool refresh_;
  std::list<BlockHash> lru_;  // least recent first
  absl::flat_hash_map<BlockHash, std::list<BlockHash>::iterator,
                      engine::BlockHashHasher>
      pos_;
};

inline engine::ModelFingerprint SimFingerprint(int32_t block_size) {
  return {0x7064736572766573ULL /* "pdserves" */,
          static_cast<uint64_t>(block_size)};
}

// The monotonic clock in microseconds, which times each decision as a
// caller of the router waits for it. It is read in user space (tens of
// nanoseconds); the thread CPU-time clock is a system call, over a
// microsecond on a nested guest, which would be a tenth of the span timed.
double MonotonicMicros();

// A dependent multiply-add chain of `iterations` steps: constant work with
// no memory traffic, the reference that decision times are set against.
uint64_t ReferenceLoop(int64_t iterations, uint64_t seed);
// Iterations of ReferenceLoop per microsecond of the monotonic clock
// (the best of a few timed runs).
double ReferenceLoopRate();

inline Micros FromMs(double ms) {
  return static_cast<Micros>(std::llround(ms * 1000.0));
}

// The q-quantile of `v` (nearest rank); 0 when empty.
double Percentile(std::vector<double> v, double q);
// max / mean of `v`; 1 when the sum is 0, 0 when empty.
double MaxOverMean(const std::vector<int64_t>& v);

// A trace request ready to replay: arrival in simulated µs and the block
// hashes of its synthesized prompt (full blocks), computed once per trace.
struct Prepared {
  const TraceRequest* trace = nullptr;
  Micros arrival = 0;
  std::vector<BlockHash> hashes;
};

// One policy at one cluster size. Single-threaded.
class Simulation {
 public:
  Simulation(const SimConfig& config, const std::vector<Prepared>& requests,
             std::string policy, int32_t num_prefill,
             int64_t working_set_blocks, int64_t max_request_blocks)
      : c_(config),
        requests_(requests),
        policy_name_(std::move(policy)),
        base_policy_(BasePolicy(policy_name_)),
        oracle_(IsOracle(base_policy_)),
        unbounded_(base_policy_ == kUnbounded),
        pull_(!oracle_ && HasOption(policy_name_, kPullSuffix)),
        tier_(!oracle_ && HasOption(policy_name_, kTierSuffix)),
        decode_tier_(!oracle_ && HasOption(policy_name_, kDecodeTierSuffix)),
        working_set_blocks_(working_set_blocks),
        max_request_blocks_(max_request_blocks),
        num_prefill_(num_prefill),
        num_decode_(config.decode_workers),
        bs_(config.block_size),
        fingerprint_(SimFingerprint(config.block_size)),
        rng_(config.seed * 0x9e3779b97f4a7c15ULL +
             static_cast<uint64_t>(num_prefill)),
        reqs_(requests.size()) {}

  absl::StatusOr<SimRun> Run();

 private:
  enum class Ev {
    kHeartbeat,
    kPrefillDone,
    kLocalPrefillDone,
    kDecodeJoin,
    kStepDone,
    kResync
  };
  struct Event {
    Micros t;
    uint64_t order;  // FIFO among equal times, for determinism
    Ev type;
    int32_t id;  // worker or request, by type
    bool operator>(const Event& o) const {
      return t != o.t ? t > o.t : order > o.order;
    }
  };

  struct Req {
    int32_t prefill = -1;  // view index; -1: the decode worker prefills locally
    int32_t decode = -1;   // view index
    // Router-side load accounting, undone at the first token.
    int64_t routed_uncached = 0;
    bool rejected = false;
    std::vector<int32_t> p_blocks;  // at the prefill worker, while prefilling
    bool p_cached = false;          // p_blocks belong to the prefix cache
    int32_t p_hit_blocks = 0;
    // At the decode worker, from admission to finish.
    std::vector<int32_t> d_blocks;
    int32_t d_hit_blocks = 0;
    int64_t hit_tokens = 0;
    // Peer pull: the holder (view index, -1: none) and the leading blocks it
    // holds, decided at routing; the blocks pulled when the prompt started.
    int32_t pull_holder = -1;
    int32_t pull_blocks = 0;
    int32_t pulled_blocks = 0;
    int32_t pulled_tier_blocks = 0;  // of pulled_blocks, from the holder's tier
    bool pull_partial = false;       // fewer than asked: a second round trip
    int32_t tier_blocks = 0;         // "+tier": read from the worker's own tier
    int64_t remaining = 0;           // decode tokens still to generate
    int64_t context = 0;             // tokens in the decode worker's KV
    bool in_batch = false;
    Micros admitted = 0, prefill_start = 0, first_token = 0, join = 0;
  };

  struct PrefillWorker {
    engine::BlockManager* cache = nullptr;
    std::deque<int32_t> queue;
    int32_t running = -1;
    Micros run_start = 0, run_end = 0;
    int64_t run_computed = 0;
    int64_t queued_tokens = 0;  // prompt tokens waiting in `queue`
    int64_t computed_total = 0;
  };

  struct DecodeWorker {
    std::unique_ptr<engine::BlockManager> kv;
    std::deque<int32_t> admit;
    std::vector<int32_t> running, joining;
    bool stepping = false;
    int64_t context = 0;
    int64_t decoded = 0;
  };

  // The event loop and the workers (router_sim.cc).
  void Build();

  // A tier of tier_multiple x `pool_blocks` below worker `w`'s pool, with
  // the engine's events (engine.cc's tier hooks): a block it drops is
  // published as removed from the tier before the pool's eviction that
  // caused it, and an eviction it keeps as moved (pool -> disk).
  void AddTier(int32_t w, engine::BlockManager* cache, int64_t pool_blocks);

  // Leading blocks of `hashes` worker `w` holds now: its pool's run, then its
  // tier's (no LRU change).
  int32_t HeldRun(int32_t w, std::span<const BlockHash> hashes);

  SimTier* TierOf(int32_t w) {
    return w >= 0 && static_cast<size_t>(w) < tiers_.size() ? tiers_[w].get()
                                                            : nullptr;
  }

  void Schedule(Micros t, Ev type, int32_t id) {
    heap_.push({t, order_++, type, id});
  }

  double Uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

  // Feeds are indexed by WorkerIndex; the oracle's shared cache has none.
  SimEventStream& Feed(int32_t w) {
    return *feeds_[oracle_ ? w - num_prefill_ : w];
  }

  void Emit(int32_t w, const engine::KvEvent& e);

  void DeliverEvents(Micros until);

  void Resync(int32_t w);

  // The router's side (router_sim_policies.cc): views refreshed by
  // heartbeats, routing, the peer-pull decision.
  void Heartbeat();

  const Prepared& P(int32_t r) const { return requests_[r]; }
  int64_t Input(int32_t r) const { return P(r).trace->input_length; }

  absl::Status Arrive(int32_t r);

  // router_service's PeerPullFor on the simulated views and index: per tier,
  // the pool's counts and the pool's plus the tiers'.
  void DecidePull(int32_t r);
  // Times ReferenceLoop over about the decisions' running median, given
  // the latest decision's time.
  void MeasureReference(double decision_us);

  // The workers again (router_sim.cc): the holder's side of a pull,
  // admission, prefill and decode.
  engine::BlockManager* PoolOf(int32_t w) {
    return w < num_prefill_ ? prefill_[w].cache
                            : decode_[w - num_prefill_].kv.get();
  }

  // The pull of blocks [have, q.pull_blocks) from the holder as the prompt
  // starts, as PeerBlockHolder serves it: the leading run still in its pool
  // (pinned while sent, which refreshes it in its LRU), then the run its tier
  // holds (read into free pool blocks of the holder, as many as it has room
  // for, and given back uncommitted: that evicts the holder's LRU blocks as
  // the live holder's allocation does). A shorter run than asked is a
  // partial pull (the live puller asks again for what is there); none is a
  // failed pull. Returns the blocks pulled; *from_tier gets those read from
  // the holder's tier.
  int32_t Pull(int32_t r, int32_t have, int32_t* from_tier);

  // Admits waiting requests FIFO while the KV pool can reserve prompt +
  // output blocks (its own prefix hits are shared, not reserved again).
  void TryAdmit(int32_t j);

  void StartPrefill(int32_t r);

  void BeginPrefill(int32_t w);

  void PrefillDone(int32_t w);

  // Commits the full blocks of a prompt that were not hits.
  static void Commit(engine::BlockManager* cache,
                     const std::vector<BlockHash>& hashes, int32_t hit_blocks,
                     const std::vector<int32_t>& blocks);

  void FirstToken(int32_t r);

  void DecodeJoin(int32_t r);

  void StartStep(int32_t j);

  void StepDone(int32_t j);

  void Finish(int32_t r);

  // The run's figures (router_sim_report.cc).
  SimRun Report();

  const SimConfig& c_;
  const std::vector<Prepared>& requests_;
  const std::string policy_name_;
  const std::string base_policy_;  // without "+pull"
  const bool oracle_, unbounded_, pull_, tier_, decode_tier_;
  // By WorkerIndex: "+tier" prefill workers', "+dtier" decode workers'.
  std::vector<std::unique_ptr<SimTier>> tiers_;
  int64_t tier_hit_tokens_ = 0;
  const int64_t working_set_blocks_, max_request_blocks_;
  router::PeerPullConfig pull_config_;
  int64_t pulled_tokens_ = 0, peer_pulls_ = 0, peer_pulls_failed_ = 0;
  int64_t peer_pulls_partial_ = 0, pulled_tier_tokens_ = 0;
  int64_t held_missed_tokens_ = 0;
  int64_t prefill_pool_tokens_ = 0, decode_pool_tokens_ = 0;
  const int32_t num_prefill_, num_decode_;
  const int32_t bs_;
  const engine::ModelFingerprint fingerprint_;
  std::mt19937_64 rng_;

  router::PrefixIndex index_;
  std::unique_ptr<router::Policy> policy_;
  std::vector<router::WorkerView> views_;  // prefill 0..N-1, then decode
  // Prefill (unless oracle), then decode.
  std::vector<std::unique_ptr<SimEventStream>> feeds_;
  std::vector<std::unique_ptr<engine::BlockManager>> caches_;
  std::vector<PrefillWorker> prefill_;
  std::vector<DecodeWorker> decode_;
  std::vector<Req> reqs_;

  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> heap_;
  uint64_t order_ = 0;
  Micros now_ = 0;
  Micros heartbeat_ = 1;
  Micros makespan_ = 0;

  int64_t served_ = 0, rejected_ = 0, local_prefills_ = 0;
  int64_t input_tokens_ = 0, hit_tokens_ = 0;
  int64_t events_lost_ = 0, resyncs_ = 0;
  std::vector<double> ttft_ms_, prefill_queue_ms_, decode_admit_ms_, tpot_ms_,
      decision_us_, hash_us_, route_us_, reference_us_;
  // The decisions' running median, and ReferenceLoop's iterations (0 until
  // the first decision), steered so that the loop takes about that long.
  double decision_median_us_ = 0, reference_iterations_ = 0;
  uint64_t reference_sink_ = 0;
};

}  // namespace pdserve::bench::router_sim_internal
