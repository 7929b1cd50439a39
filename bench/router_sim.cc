#include "bench/router_sim.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <deque>
#include <fstream>
#include <limits>
#include <list>
#include <memory>
#include <queue>
#include <random>
#include <span>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/json.h"
#include "common/status_macros.h"
#include "kv_cache/block_manager.h"
#include "router/kv_event_applier.h"
#include "router/peer_pull.h"
#include "router/prefix_index.h"
#include "router/worker_registry.h"

namespace pdserve::bench {
namespace {

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
std::string BasePolicy(const std::string& name) {
  std::string base = name;
  for (bool again = true; again;) {
    again = false;
    for (const char* suffix : {kPullSuffix, kTierSuffix, kDecodeTierSuffix}) {
      if (absl::EndsWith(base, suffix)) {
        base.resize(base.size() - std::strlen(suffix));
        again = true;
      }
    }
  }
  return base;
}
bool HasOption(const std::string& name, const char* suffix) {
  return absl::StrContains(name, suffix);
}

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
bool IsOracle(const std::string& base) {
  return base == kOracle || base == kUnbounded;
}

engine::ModelFingerprint SimFingerprint(int32_t block_size) {
  return {0x7064736572766573ULL /* "pdserves" */,
          static_cast<uint64_t>(block_size)};
}

// CPU time of the calling thread: the decision's own cost, without the
// preemptions of a busy host that wall-clock time would add.
double ThreadCpuMicros() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 +
         static_cast<double>(ts.tv_nsec) / 1e3;
}

Micros FromMs(double ms) {
  return static_cast<Micros>(std::llround(ms * 1000.0));
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t rank =
      static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

double MaxOverMean(const std::vector<int64_t>& v) {
  if (v.empty()) return 0;
  int64_t sum = 0, max = 0;
  for (int64_t x : v) {
    sum += x;
    max = std::max(max, x);
  }
  return sum > 0 ? static_cast<double>(max) * static_cast<double>(v.size()) /
                       static_cast<double>(sum)
                 : 1.0;
}

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

  absl::StatusOr<SimRun> Run() {
    ASSIGN_OR_RETURN(
        policy_, router::Policy::Create(oracle_ ? "least_loaded" : base_policy_,
                                        c_.policy, &index_));
    pull_config_.enabled = pull_;
    pull_config_.overhead_seconds = c_.pull_overhead_ms / 1000;
    pull_config_.default_prefill_tokens_per_second =
        c_.prefill_us_per_token > 0 ? 1e6 / c_.prefill_us_per_token : 1e12;
    // The sim counts KV in tokens: one "byte" per token.
    pull_config_.default_transfer_bytes_per_second =
        c_.transfer_us_per_token > 0 ? 1e6 / c_.transfer_us_per_token : 1e12;
    Build();
    Schedule(0, Ev::kHeartbeat, 0);
    size_t next_arrival = 0;
    while (next_arrival < requests_.size() || !heap_.empty()) {
      const bool arrival =
          next_arrival < requests_.size() &&
          (heap_.empty() || requests_[next_arrival].arrival < heap_.top().t);
      if (arrival) {
        now_ = requests_[next_arrival].arrival;
        RETURN_IF_ERROR(Arrive(static_cast<int32_t>(next_arrival++)));
        continue;
      }
      const Event e = heap_.top();
      heap_.pop();
      now_ = e.t;
      switch (e.type) {
        case Ev::kHeartbeat:
          Heartbeat();
          if (next_arrival < requests_.size() || !heap_.empty())
            Schedule(now_ + heartbeat_, Ev::kHeartbeat, 0);
          break;
        case Ev::kPrefillDone:
          PrefillDone(e.id);
          break;
        case Ev::kLocalPrefillDone:
          FirstToken(e.id);
          DecodeJoin(e.id);
          break;
        case Ev::kDecodeJoin:
          DecodeJoin(e.id);
          break;
        case Ev::kStepDone:
          StepDone(e.id);
          break;
        case Ev::kResync:
          Resync(e.id);
          break;
      }
    }
    DeliverEvents(std::numeric_limits<Micros>::max());
    return Report();
  }

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

  void Build() {
    int64_t p_blocks = c_.prefill_cache_tokens / bs_;
    int64_t d_blocks = c_.decode_kv_tokens / bs_;
    const int32_t n = num_prefill_ + num_decode_;
    if (c_.pool_fraction > 0) {
      p_blocks = std::max<int64_t>(
          1,
          static_cast<int64_t>(c_.pool_fraction *
                               static_cast<double>(working_set_blocks_) / n));
      d_blocks = std::max(p_blocks, max_request_blocks_);
    }
    prefill_pool_tokens_ = p_blocks * bs_;
    decode_pool_tokens_ = d_blocks * bs_;
    auto sink = [this](int32_t w) {
      return [this, w](const engine::KvEvent& e) { Emit(w, e); };
    };
    if (oracle_) {
      // One cache for the whole tier; nothing routes on it, so no events.
      // Unbounded: the working set plus every prefill worker's prompt in
      // flight, so nothing is ever evicted.
      caches_.push_back(std::make_unique<engine::BlockManager>(
          unbounded_
              ? working_set_blocks_ + (num_prefill_ + 1) * max_request_blocks_
              : p_blocks * num_prefill_));
    } else {
      for (int32_t w = 0; w < num_prefill_; ++w) {
        caches_.push_back(
            std::make_unique<engine::BlockManager>(p_blocks, sink(w)));
        feeds_.push_back(
            std::make_unique<SimEventStream>(&index_, w, caches_.back().get()));
        if (tier_) AddTier(w, caches_.back().get(), p_blocks);
      }
    }
    prefill_.resize(num_prefill_);
    for (int32_t w = 0; w < num_prefill_; ++w)
      prefill_[w].cache = caches_[oracle_ ? 0 : w].get();
    decode_.resize(num_decode_);
    for (int32_t j = 0; j < num_decode_; ++j) {
      decode_[j].kv = std::make_unique<engine::BlockManager>(
          d_blocks, sink(num_prefill_ + j));
      feeds_.push_back(std::make_unique<SimEventStream>(
          &index_, num_prefill_ + j, decode_[j].kv.get()));
      if (decode_tier_)
        AddTier(num_prefill_ + j, decode_[j].kv.get(), d_blocks);
    }
    for (auto& f : feeds_) f->Resync();  // subscribed before the first request
    views_.resize(n);
    for (int32_t w = 0; w < n; ++w) {
      router::WorkerView& v = views_[w];
      v.index = w;
      v.role =
          w < num_prefill_ ? v1::WORKER_ROLE_PREFILL : v1::WORKER_ROLE_DECODE;
      v.id = absl::StrCat(w < num_prefill_ ? "prefill" : "decode", "-", w);
      v.address = v.id;
      v.up = true;
      v.fingerprint = fingerprint_;
      v.status.set_role(v.role);
      v.status.mutable_layout()->set_block_size(bs_);
      // The rates a worker measures and exports (the cost model's), for the
      // policy's tier pricing and the pull decision.
      if (c_.prefill_us_per_token > 0)
        v.status.set_prefill_tokens_per_second(1e6 / c_.prefill_us_per_token);
      if (TierOf(w) != nullptr) {
        v.status.set_kv_tier(v1::KV_TIER_DISK);
        if (c_.tier_read_us_per_token > 0)
          v.status.set_kv_tier_load_tokens_per_second(
              1e6 / c_.tier_read_us_per_token);
      }
    }
    heartbeat_ = std::max<Micros>(1, FromMs(c_.heartbeat_ms));
  }

  // A tier of tier_multiple x `pool_blocks` below worker `w`'s pool, with
  // the engine's events (engine.cc's tier hooks): a block it drops is
  // published as removed from the tier before the pool's eviction that
  // caused it, and an eviction it keeps as moved (pool -> disk).
  void AddTier(int32_t w, engine::BlockManager* cache, int64_t pool_blocks) {
    if (static_cast<int32_t>(tiers_.size()) <= w) tiers_.resize(w + 1);
    tiers_[w] = std::make_unique<SimTier>(
        static_cast<int64_t>(c_.tier_multiple *
                             static_cast<double>(pool_blocks)),
        c_.tier_refresh_on_hit);
    SimTier* t = tiers_[w].get();
    cache->set_tier_hooks(engine::BlockManager::TierHooks(
        engine::KvTierKind::kDisk,
        [t, cache](int32_t, const BlockHash& h) {
          if (const std::optional<BlockHash> dropped = t->Offer(h)) {
            engine::KvEvent e;
            e.type = engine::KvEvent::Type::kRemoved;
            e.tier = engine::KvTierKind::kDisk;
            e.hashes = {*dropped};
            cache->PublishTierEvent(std::move(e));
          }
          return t->Contains(h);
        },
        std::function<void()>()));
    Feed(w).SetTier(engine::KvTierKind::kDisk, [t] { return t->Hashes(); });
  }
  // Leading blocks of `hashes` worker `w` holds now: its pool's run, then its
  // tier's (no LRU change).
  int32_t HeldRun(int32_t w, std::span<const BlockHash> hashes) {
    size_t n = PoolOf(w)->Lookup(hashes).size();
    if (const SimTier* t = TierOf(w); t != nullptr) {
      while (n < hashes.size() && t->Contains(hashes[n])) ++n;
    }
    return static_cast<int32_t>(n);
  }
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

  void Emit(int32_t w, const engine::KvEvent& e) {
    const bool lost = c_.event_loss > 0 && Uniform() < c_.event_loss;
    events_lost_ += lost;
    Feed(w).Publish(e, now_, FromMs(c_.event_delay_ms), lost);
  }

  void DeliverEvents(Micros until) {
    for (size_t i = 0; i < feeds_.size(); ++i) {
      const std::optional<int64_t> gap = feeds_[i]->Deliver(until);
      if (gap && until != std::numeric_limits<Micros>::max()) {
        // Resubscribe after the service's back-off.
        const int32_t w =
            static_cast<int32_t>(i) + (oracle_ ? num_prefill_ : 0);
        Schedule(std::max(now_, *gap + FromMs(c_.resync_delay_ms)), Ev::kResync,
                 w);
      }
    }
  }

  void Resync(int32_t w) {
    Feed(w).Resync();
    ++resyncs_;
  }

  void Heartbeat() {
    for (int32_t w = 0; w < num_prefill_; ++w) {
      const PrefillWorker& p = prefill_[w];
      v1::WorkerStatus& s = views_[w].status;
      int64_t queued = p.queued_tokens;
      if (p.running >= 0 && p.run_end > p.run_start) {
        queued +=
            p.run_computed * (p.run_end - now_) / (p.run_end - p.run_start);
      }
      s.set_num_running(p.running >= 0 ? 1 : 0);
      s.set_num_waiting(static_cast<uint32_t>(p.queue.size()));
      s.set_free_blocks(static_cast<uint32_t>(p.cache->num_free()));
      s.set_total_blocks(static_cast<uint32_t>(p.cache->num_blocks()));
      s.set_queued_prefill_tokens(static_cast<uint64_t>(queued));
    }
    for (int32_t j = 0; j < num_decode_; ++j) {
      const DecodeWorker& d = decode_[j];
      v1::WorkerStatus& s = views_[num_prefill_ + j].status;
      s.set_num_running(
          static_cast<uint32_t>(d.running.size() + d.joining.size()));
      s.set_num_waiting(static_cast<uint32_t>(d.admit.size()));
      s.set_free_blocks(static_cast<uint32_t>(d.kv->num_free()));
      s.set_total_blocks(static_cast<uint32_t>(d.kv->num_blocks()));
    }
  }

  const Prepared& P(int32_t r) const { return requests_[r]; }
  int64_t Input(int32_t r) const { return P(r).trace->input_length; }

  absl::Status Arrive(int32_t r) {
    DeliverEvents(now_);
    const Prepared& prep = P(r);
    const std::vector<int32_t> tokens =
        SynthesizePrompt(*prep.trace, c_.seed, kVocabSize);
    router::PromptHashes hashes(&tokens, "");
    router::RouteRequest route{Input(r), "", &tokens, {}, &hashes};
    const double hash0 = ThreadCpuMicros();
    if (!oracle_) hashes.For(fingerprint_, bs_);  // as the service, at intake
    const auto wall0 = std::chrono::steady_clock::now();
    const double cpu0 = ThreadCpuMicros();
    absl::StatusOr<router::RouteDecision> d = policy_->Choose(route, views_);
    const double cpu1 = ThreadCpuMicros();
    decision_us_.push_back(cpu1 - cpu0);
    hash_us_.push_back(cpu0 - hash0);
    route_us_.push_back(cpu1 - hash0);
    decision_wall_us_.push_back(std::chrono::duration<double, std::micro>(
                                    std::chrono::steady_clock::now() - wall0)
                                    .count());
    if (!d.ok()) return d.status();
    Req& q = reqs_[r];
    q.decode = static_cast<int32_t>(d->decode - views_.data());
    q.prefill =
        d->prefill ? static_cast<int32_t>(d->prefill - views_.data()) : -1;
    q.routed_uncached = Input(r) - d->prefill_cached_tokens;
    views_[q.prefill >= 0 ? q.prefill : q.decode].routed_prefill_tokens +=
        q.routed_uncached;
    views_[q.decode].routed_requests += 1;
    // Peer pull, as the service asks it: before the speculative entries.
    if (pull_ && q.prefill >= 0) DecidePull(r);
    // As the service does right after routing (`hashes` holds exactly
    // prep.hashes: same fingerprint, salt and block size).
    if (q.prefill >= 0 && !oracle_)
      index_.Speculate(q.prefill, prep.hashes, kSpeculativeTtl);
    index_.Speculate(q.decode, prep.hashes, kSpeculativeTtl);
    decode_[q.decode - num_prefill_].admit.push_back(r);
    TryAdmit(q.decode - num_prefill_);
    return absl::OkStatus();
  }

  // router_service's PeerPullFor on the simulated views and index: per tier,
  // the pool's counts and the pool's plus the tiers'.
  void DecidePull(int32_t r) {
    Req& q = reqs_[r];
    const std::vector<BlockHash>& chain = P(r).hashes;
    // The engine always computes at least the last token.
    const size_t usable = std::min<size_t>(
        chain.size(), static_cast<size_t>((Input(r) - 1) / bs_));
    std::vector<int32_t> counts, all_counts;
    index_.LeadingBlocksOfPrompt(
        usable, [&](size_t i) { return chain[i]; }, &counts);
    if (tier_ || decode_tier_) {
      index_.LeadingBlocksOfPrompt(
          usable, [&](size_t i) { return chain[i]; }, &all_counts,
          router::kAllTiers);
    }
    auto held = [&](int32_t w) {
      return static_cast<size_t>(w) < counts.size() ? counts[w] : 0;
    };
    auto held_all = [&](int32_t w) {
      return std::max(held(w), static_cast<size_t>(w) < all_counts.size()
                                   ? all_counts[w]
                                   : 0);
    };
    router::PeerPullInput in;
    in.prefill = q.prefill;
    in.prefill_cached_blocks = held(q.prefill);
    in.prefill_tier_blocks = held_all(q.prefill);
    in.prefill_tier_load_tokens_per_second =
        views_[q.prefill].status.kv_tier_load_tokens_per_second();
    in.prompt_blocks = static_cast<int32_t>(usable);
    in.block_size = bs_;
    in.bytes_per_block = bs_;
    for (const router::WorkerView& w : views_) {
      if ((c_.pull_from_tiers ? held_all(w.index) : held(w.index)) <=
          in.prefill_cached_blocks)
        continue;
      router::PeerPullCandidate c;
      c.index = w.index;
      c.address = w.address;
      c.id = w.id;
      c.up = w.up;
      c.same_cache = true;
      c.leading_blocks = c_.pull_from_tiers ? held_all(w.index) : held(w.index);
      c.tier_blocks = c.leading_blocks - held(w.index);
      c.tier_load_tokens_per_second = w.status.kv_tier_load_tokens_per_second();
      in.candidates.push_back(std::move(c));
    }
    const router::PeerPullDecision d = router::DecidePeerPull(pull_config_, in);
    if (!d.pull) return;
    q.pull_holder = d.holder;
    q.pull_blocks = d.blocks;
  }

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
  int32_t Pull(int32_t r, int32_t have, int32_t* from_tier) {
    Req& q = reqs_[r];
    *from_tier = 0;
    q.pull_partial = false;
    if (q.pull_holder < 0 || q.pull_blocks <= have) return 0;
    engine::BlockManager* holder = PoolOf(q.pull_holder);
    const std::span<const BlockHash> want =
        std::span<const BlockHash>(P(r).hashes)
            .subspan(have, q.pull_blocks - have);
    std::vector<int32_t> blocks = holder->Lookup(want);
    const int32_t pool = static_cast<int32_t>(blocks.size());
    holder->Acquire(blocks);
    int32_t tier = 0;
    if (SimTier* t = c_.pull_from_tiers ? TierOf(q.pull_holder) : nullptr;
        t != nullptr && static_cast<size_t>(pool) < want.size()) {
      tier = t->Match(want.subspan(pool));
      tier = static_cast<int32_t>(std::min<int64_t>(tier, holder->num_free()));
      if (tier > 0) holder->Allocate(tier, &blocks);
    }
    std::reverse(blocks.begin(), blocks.end());
    holder->Release(blocks);
    const int32_t got = pool + tier;
    if (got == 0) {
      ++peer_pulls_failed_;
      return 0;
    }
    ++peer_pulls_;
    if (static_cast<size_t>(got) < want.size()) {
      ++peer_pulls_partial_;
      q.pull_partial = true;
    }
    *from_tier = tier;
    return got;
  }

  // Admits waiting requests FIFO while the KV pool can reserve prompt +
  // output blocks (its own prefix hits are shared, not reserved again).
  void TryAdmit(int32_t j) {
    DecodeWorker& d = decode_[j];
    while (!d.admit.empty()) {
      const int32_t r = d.admit.front();
      Req& q = reqs_[r];
      const int64_t total =
          (Input(r) + P(r).trace->output_length + bs_ - 1) / bs_;
      if (total > d.kv->num_blocks()) {
        d.admit.pop_front();
        q.rejected = true;
        ++rejected_;
        views_[q.prefill >= 0 ? q.prefill : q.decode].routed_prefill_tokens -=
            q.routed_uncached;
        views_[q.decode].routed_requests -= 1;
        continue;
      }
      std::vector<int32_t> hits = d.kv->Lookup(P(r).hashes);
      int64_t idle = 0;
      for (int32_t b : hits) idle += d.kv->RefCount(b) == 0;
      const int64_t need = total - static_cast<int64_t>(hits.size());
      if (need + idle > d.kv->num_free()) return;
      d.admit.pop_front();
      d.kv->Acquire(hits);
      const int32_t pool_hits = static_cast<int32_t>(hits.size());
      q.d_blocks = std::move(hits);
      d.kv->Allocate(need, &q.d_blocks);
      q.d_hit_blocks = pool_hits;
      // "+dtier": the prompt continues in the decode worker's own tier, read
      // back into the blocks just reserved and committed at once (as
      // Engine::Reserve does): its own, not sent by the prefill worker.
      if (SimTier* t = TierOf(q.decode); t != nullptr) {
        const int32_t from_tier = t->Match(
            std::span<const BlockHash>(P(r).hashes).subspan(pool_hits));
        if (from_tier > 0) {
          q.d_hit_blocks += from_tier;
          Commit(d.kv.get(), P(r).hashes, pool_hits,
                 std::vector<int32_t>(q.d_blocks.begin(),
                                      q.d_blocks.begin() + q.d_hit_blocks));
        }
      }
      q.admitted = now_;
      StartPrefill(r);
    }
  }

  void StartPrefill(int32_t r) {
    Req& q = reqs_[r];
    if (q.prefill < 0) {
      // Local: the engine always computes at least the last token.
      const int64_t usable =
          std::min<int64_t>(q.d_hit_blocks, (Input(r) - 1) / bs_);
      q.hit_tokens = usable * bs_;
      q.prefill_start = now_;
      ++local_prefills_;
      Schedule(now_ + FromMs(c_.prefill_overhead_ms) +
                   static_cast<Micros>(std::llround(
                       static_cast<double>(Input(r) - q.hit_tokens) *
                       c_.prefill_us_per_token)),
               Ev::kLocalPrefillDone, r);
      return;
    }
    PrefillWorker& p = prefill_[q.prefill];
    p.queue.push_back(r);
    p.queued_tokens += Input(r);
    if (p.running < 0) BeginPrefill(q.prefill);
  }

  void BeginPrefill(int32_t w) {
    PrefillWorker& p = prefill_[w];
    const int32_t r = p.queue.front();
    p.queue.pop_front();
    p.queued_tokens -= Input(r);
    Req& q = reqs_[r];
    const std::vector<BlockHash>& hashes = P(r).hashes;
    const size_t usable = std::min<size_t>(
        hashes.size(), static_cast<size_t>((Input(r) - 1) / bs_));
    std::vector<int32_t> hits =
        p.cache->Lookup(std::span<const BlockHash>(hashes).first(usable));
    const int64_t blocks = (Input(r) + bs_ - 1) / bs_;
    const int64_t need = blocks - static_cast<int64_t>(hits.size());
    int64_t idle = 0;
    for (int32_t b : hits) idle += p.cache->RefCount(b) == 0;
    // Diagnosis: the longest run of this prompt's leading blocks one worker
    // holds (pool, then its tier) as the prompt starts, this one or another.
    int32_t held_anywhere = 0;
    if (!oracle_) {
      const std::span<const BlockHash> head =
          std::span<const BlockHash>(hashes).first(usable);
      for (int32_t v = 0; v < num_prefill_ + num_decode_; ++v)
        held_anywhere = std::max(held_anywhere, HeldRun(v, head));
    }
    if (need + idle <= p.cache->num_free()) {
      p.cache->Acquire(hits);
      q.p_hit_blocks = static_cast<int32_t>(hits.size());
      q.p_blocks = std::move(hits);
      p.cache->Allocate(need, &q.p_blocks);
      q.p_cached = true;
      // Tier hits continue the pool's, then pulled blocks; both fill the
      // fresh blocks after the hits and are committed with the computed
      // ones when the prompt ends.
      if (SimTier* t = TierOf(w); t != nullptr) {
        q.tier_blocks = t->Match(std::span<const BlockHash>(hashes).subspan(
            q.p_hit_blocks, usable - q.p_hit_blocks));
      }
      q.pulled_blocks =
          Pull(r, q.p_hit_blocks + q.tier_blocks, &q.pulled_tier_blocks);
    } else {
      // The prompt does not fit the cache: computed, not kept.
      q.p_hit_blocks = 0;
      q.p_cached = false;
    }
    const int64_t pulled_tokens = int64_t{q.pulled_blocks} * bs_;
    const int64_t tier_tokens = int64_t{q.tier_blocks} * bs_;
    pulled_tokens_ += pulled_tokens;
    tier_hit_tokens_ += tier_tokens;
    q.hit_tokens = int64_t{q.p_hit_blocks} * bs_ + tier_tokens + pulled_tokens;
    held_missed_tokens_ +=
        std::max<int64_t>(0, int64_t{held_anywhere} * bs_ - q.hit_tokens);
    const int64_t computed = Input(r) - q.hit_tokens;
    q.prefill_start = now_;
    p.running = r;
    p.run_start = now_;
    // A pull: its fixed cost (twice for a partial one: the holder says how
    // many it has, then sends them), the holder's tier reads, the transfer.
    const Micros pull_time =
        q.pulled_blocks == 0
            ? 0
            : FromMs(c_.pull_overhead_ms) * (q.pull_partial ? 2 : 1) +
                  static_cast<Micros>(std::llround(
                      static_cast<double>(pulled_tokens) *
                          c_.transfer_us_per_token +
                      static_cast<double>(int64_t{q.pulled_tier_blocks} * bs_) *
                          c_.tier_read_us_per_token));
    pulled_tier_tokens_ += int64_t{q.pulled_tier_blocks} * bs_;
    const Micros tier_time = static_cast<Micros>(std::llround(
        static_cast<double>(tier_tokens) * c_.tier_read_us_per_token));
    p.run_end = now_ + FromMs(c_.prefill_overhead_ms) + pull_time + tier_time +
                static_cast<Micros>(std::llround(static_cast<double>(computed) *
                                                 c_.prefill_us_per_token));
    p.run_computed = computed;
    p.computed_total += computed;
    Schedule(p.run_end, Ev::kPrefillDone, w);
  }

  void PrefillDone(int32_t w) {
    PrefillWorker& p = prefill_[w];
    const int32_t r = p.running;
    p.running = -1;
    Req& q = reqs_[r];
    if (q.p_cached) {
      Commit(p.cache, P(r).hashes, q.p_hit_blocks, q.p_blocks);
      // Tail first, so the prompt's prefix is the last to be evicted.
      std::reverse(q.p_blocks.begin(), q.p_blocks.end());
      p.cache->Release(q.p_blocks);
      q.p_blocks = {};
    }
    FirstToken(r);
    const int64_t moved = Input(r) - int64_t{q.d_hit_blocks} * bs_;
    Schedule(now_ + static_cast<Micros>(std::llround(
                        static_cast<double>(moved) * c_.transfer_us_per_token)),
             Ev::kDecodeJoin, r);
    if (!p.queue.empty()) BeginPrefill(w);
  }

  // Commits the full blocks of a prompt that were not hits.
  static void Commit(engine::BlockManager* cache,
                     const std::vector<BlockHash>& hashes, int32_t hit_blocks,
                     const std::vector<int32_t>& blocks) {
    const size_t full = std::min(hashes.size(), blocks.size());
    if (static_cast<size_t>(hit_blocks) >= full) return;
    const BlockHash parent =
        hit_blocks == 0 ? BlockHash{} : hashes[hit_blocks - 1];
    cache->Commit(
        parent,
        std::span<const int32_t>(blocks).subspan(hit_blocks, full - hit_blocks),
        std::span<const BlockHash>(hashes).subspan(hit_blocks,
                                                   full - hit_blocks));
  }

  void FirstToken(int32_t r) {
    Req& q = reqs_[r];
    q.first_token = now_;
    views_[q.prefill >= 0 ? q.prefill : q.decode].routed_prefill_tokens -=
        q.routed_uncached;
    ttft_ms_.push_back(static_cast<double>(now_ - P(r).arrival) / 1000.0);
    prefill_queue_ms_.push_back(
        static_cast<double>(q.prefill_start - q.admitted) / 1000.0);
    decode_admit_ms_.push_back(static_cast<double>(q.admitted - P(r).arrival) /
                               1000.0);
    hit_tokens_ += q.hit_tokens;
    input_tokens_ += Input(r);
  }

  void DecodeJoin(int32_t r) {
    Req& q = reqs_[r];
    const int32_t j = q.decode - num_prefill_;
    DecodeWorker& d = decode_[j];
    Commit(d.kv.get(), P(r).hashes, q.d_hit_blocks, q.d_blocks);
    q.join = now_;
    q.remaining =
        P(r).trace->output_length - 1;  // the first token came from prefill
    q.context = Input(r) + 1;
    if (q.remaining <= 0) {
      Finish(r);
      TryAdmit(j);
      return;
    }
    d.joining.push_back(r);
    if (!d.stepping) StartStep(j);
  }

  void StartStep(int32_t j) {
    DecodeWorker& d = decode_[j];
    for (int32_t r : d.joining) {
      reqs_[r].in_batch = true;
      d.context += reqs_[r].context;
      d.running.push_back(r);
    }
    d.joining.clear();
    if (d.running.empty()) {
      d.stepping = false;
      return;
    }
    const double ms =
        c_.decode_step_ms +
        c_.decode_step_per_seq_ms * static_cast<double>(d.running.size()) +
        c_.decode_step_per_kctx_ms * static_cast<double>(d.context) / 1000.0;
    d.stepping = true;
    Schedule(now_ + std::max<Micros>(1, FromMs(ms)), Ev::kStepDone, j);
  }

  void StepDone(int32_t j) {
    DecodeWorker& d = decode_[j];
    std::vector<int32_t> still;
    still.reserve(d.running.size());
    bool freed = false;
    for (int32_t r : d.running) {
      Req& q = reqs_[r];
      --q.remaining;
      ++q.context;
      ++d.context;
      if (q.remaining > 0) {
        still.push_back(r);
      } else {
        Finish(r);
        freed = true;
      }
    }
    d.running = std::move(still);
    if (freed) TryAdmit(j);
    StartStep(j);
  }

  void Finish(int32_t r) {
    Req& q = reqs_[r];
    DecodeWorker& d = decode_[q.decode - num_prefill_];
    if (q.in_batch) d.context -= q.context;
    std::reverse(q.d_blocks.begin(), q.d_blocks.end());
    d.kv->Release(q.d_blocks);
    q.d_blocks = {};
    views_[q.decode].routed_requests -= 1;
    ++d.decoded;
    ++served_;
    makespan_ = std::max(makespan_, now_);
    const int64_t out = P(r).trace->output_length;
    if (out > 1)
      tpot_ms_.push_back(static_cast<double>(now_ - q.join) / 1000.0 /
                         static_cast<double>(out - 1));
  }

  SimRun Report() {
    SimRun run;
    run.policy = policy_name_;
    run.prefill_workers = num_prefill_;
    run.decode_workers = num_decode_;
    run.requests = served_;
    run.rejected = rejected_;
    run.input_tokens = input_tokens_;
    run.hit_tokens = hit_tokens_;
    run.hit_ratio = input_tokens_ > 0 ? static_cast<double>(hit_tokens_) /
                                            static_cast<double>(input_tokens_)
                                      : 0;
    std::vector<int64_t> computed, decoded;
    for (const auto& p : prefill_) computed.push_back(p.computed_total);
    for (const auto& d : decode_) decoded.push_back(d.decoded);
    run.imbalance = MaxOverMean(computed);
    run.decode_imbalance = MaxOverMean(decoded);
    run.local_prefills = local_prefills_;
    run.ttft_p50_ms = Percentile(ttft_ms_, 0.5);
    run.ttft_p99_ms = Percentile(ttft_ms_, 0.99);
    run.prefill_queue_p50_ms = Percentile(prefill_queue_ms_, 0.5);
    run.prefill_queue_p99_ms = Percentile(prefill_queue_ms_, 0.99);
    run.decode_admit_p50_ms = Percentile(decode_admit_ms_, 0.5);
    run.decode_admit_p99_ms = Percentile(decode_admit_ms_, 0.99);
    run.tpot_p50_ms = Percentile(tpot_ms_, 0.5);
    run.tpot_p99_ms = Percentile(tpot_ms_, 0.99);
    if (oracle_) {
      run.decision_p50_us = run.decision_p99_us = run.decision_wall_p99_us =
          run.hash_p50_us = run.hash_p99_us = run.route_p50_us =
              run.route_p99_us = std::numeric_limits<double>::quiet_NaN();
    } else {
      run.decision_p50_us = Percentile(decision_us_, 0.5);
      run.decision_p99_us = Percentile(decision_us_, 0.99);
      run.decision_wall_p99_us = Percentile(decision_wall_us_, 0.99);
      run.hash_p50_us = Percentile(hash_us_, 0.5);
      run.hash_p99_us = Percentile(hash_us_, 0.99);
      run.route_p50_us = Percentile(route_us_, 0.5);
      run.route_p99_us = Percentile(route_us_, 0.99);
      const router::PrefixIndex::MemoryUsage m = index_.Memory();
      run.index_hashes = static_cast<int64_t>(m.hashes);
      run.index_entries = static_cast<int64_t>(m.holders);
      run.index_bytes = static_cast<int64_t>(m.bytes);
      run.index_bytes_per_block = m.holders ? static_cast<double>(m.bytes) /
                                                  static_cast<double>(m.holders)
                                            : 0;
    }
    run.events_lost = events_lost_;
    run.resyncs = resyncs_;
    run.makespan_s = static_cast<double>(makespan_) / 1e6;
    run.pulled_tokens = pulled_tokens_;
    run.tier_hit_tokens = tier_hit_tokens_;
    run.peer_pulls = peer_pulls_;
    run.peer_pulls_failed = peer_pulls_failed_;
    run.peer_pulls_partial = peer_pulls_partial_;
    run.pulled_tier_tokens = pulled_tier_tokens_;
    run.held_missed_tokens = held_missed_tokens_;
    run.prefill_pool_tokens = prefill_pool_tokens_;
    run.decode_pool_tokens = decode_pool_tokens_;
    return run;
  }

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
      decision_us_, decision_wall_us_, hash_us_, route_us_;
};

}  // namespace

void SimEventStream::Resync() {
  // Everything published so far is in the snapshot; later events follow it.
  in_flight_.clear();
  if (tier_hashes_) {
    router::KvEventApplier::TierHashes by_tier;
    by_tier[static_cast<size_t>(engine::KvTierKind::kPool)] =
        cache_->CachedHashes();
    by_tier[static_cast<size_t>(tier_kind_)] = tier_hashes_();
    applier_.SnapshotTiers(cache_->last_event_seq(), by_tier);
  } else {
    applier_.Snapshot(cache_->last_event_seq(), cache_->CachedHashes());
  }
  broken_ = false;
}

void SimEventStream::Publish(const engine::KvEvent& event, int64_t now_us,
                             int64_t delay_us, bool lost) {
  if (!lost) in_flight_.emplace_back(now_us + delay_us, event);
}

std::optional<int64_t> SimEventStream::Deliver(int64_t until_us) {
  std::optional<int64_t> gap;
  while (!in_flight_.empty() && in_flight_.front().first <= until_us) {
    const int64_t at = in_flight_.front().first;
    const engine::KvEvent event = std::move(in_flight_.front().second);
    in_flight_.pop_front();
    // The stream was dropped; the next snapshot covers these.
    if (broken_) continue;
    if (!applier_.Apply(event)) {
      broken_ = true;
      gap = at;
    }
  }
  return gap;
}

absl::Status SimConfig::Validate() const {
  if (policies.empty())
    return absl::InvalidArgumentError("no routing policy to simulate");
  router::PrefixIndex index;
  for (const std::string& p : policies) {
    const std::string base = BasePolicy(p);
    if (IsOracle(base)) {
      if (base != p)
        return absl::InvalidArgumentError("an oracle has no peer pull or tier");
      continue;
    }
    if (HasOption(p, kDecodeTierSuffix) && !HasOption(p, kTierSuffix)) {
      return absl::InvalidArgumentError(
          absl::StrCat(p,
                       ": \"+dtier\" (a tier on decode workers too) "
                       "goes with \"+tier\""));
    }
    RETURN_IF_ERROR(router::Policy::Create(base, policy, &index).status());
  }
  if (!(pool_fraction >= 0) || !(pull_overhead_ms >= 0) ||
      !(tier_multiple >= 0) || !(tier_read_us_per_token >= 0))
    return absl::InvalidArgumentError(
        "--pool-fraction and the pull overhead must be >= 0");
  if (prefill_workers.empty())
    return absl::InvalidArgumentError("no prefill worker count to simulate");
  for (int32_t n : prefill_workers) {
    if (n < 1)
      return absl::InvalidArgumentError(
          "prefill worker counts must be at least 1");
  }
  if (decode_workers < 1)
    return absl::InvalidArgumentError("--decode must be at least 1");
  if (block_size < 1)
    return absl::InvalidArgumentError("--block-size must be positive");
  if (prefill_cache_tokens < block_size)
    return absl::InvalidArgumentError("--cache-tokens must hold a block");
  if (decode_kv_tokens < block_size)
    return absl::InvalidArgumentError("--decode-kv-tokens must hold a block");
  if (!(time_scale > 0))
    return absl::InvalidArgumentError("--time-scale must be positive");
  if (max_requests < 0)
    return absl::InvalidArgumentError("--max-requests must not be negative");
  for (double v : {prefill_us_per_token, prefill_overhead_ms, decode_step_ms,
                   decode_step_per_seq_ms, decode_step_per_kctx_ms,
                   transfer_us_per_token, event_delay_ms, resync_delay_ms}) {
    if (!(v >= 0) || !std::isfinite(v))
      return absl::InvalidArgumentError(
          "cost model figures must be finite and >= 0");
  }
  if (!(heartbeat_ms > 0))
    return absl::InvalidArgumentError("--heartbeat-ms must be positive");
  if (!(event_loss >= 0 && event_loss < 1))
    return absl::InvalidArgumentError("--event-loss must be in [0, 1)");
  if (!(policy.balance_slack >= 0) || !(policy.cache_threshold >= 0)) {
    return absl::InvalidArgumentError(
        "--balance-slack and --cache-threshold must not be negative");
  }
  if (policy.w_prefill < 0 || policy.w_decode < 0) {
    return absl::InvalidArgumentError("routing weights must not be negative");
  }
  return absl::OkStatus();
}

absl::Status ApplyEngineCalibration(absl::string_view bench_engine_json,
                                    SimConfig* config) {
  constexpr absl::string_view kWhat = "bench engine JSON";
  ASSIGN_OR_RETURN(const json::Value v, json::Parse(bench_engine_json, kWhat));
  ASSIGN_OR_RETURN(const double tps,
                   json::GetDouble(v, "prefill_tokens_per_s", kWhat));
  if (!(tps > 0))
    return absl::InvalidArgumentError(
        "bench engine JSON: prefill_tokens_per_s must be positive");
  // Least squares step_ms = a + b x batch over the decode figures.
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  if (const json::Value* decode = json::Find(v, "decode"); decode != nullptr) {
    if (!decode->is_array()) {
      return absl::InvalidArgumentError(
          "bench engine JSON: \"decode\" must be an array");
    }
    for (const json::Value& f : *decode) {
      ASSIGN_OR_RETURN(const double x, json::GetDouble(f, "batch", kWhat));
      ASSIGN_OR_RETURN(const double y, json::GetDouble(f, "step_ms", kWhat));
      n += 1;
      sx += x;
      sy += y;
      sxx += x * x;
      sxy += x * y;
    }
  }
  config->prefill_us_per_token = 1e6 / tps;
  if (n >= 1) {
    const double den = n * sxx - sx * sx;
    const double b =
        n >= 2 && den > 0 ? std::max(0.0, (n * sxy - sx * sy) / den) : 0.0;
    config->decode_step_per_seq_ms = b;
    config->decode_step_ms = std::max(0.0, (sy - b * sx) / n);
  }
  return absl::OkStatus();
}

double SimReport::HitVsUnbounded(const SimRun& run) const {
  for (const SimRun& o : runs) {
    if (o.policy == kUnbounded && o.prefill_workers == run.prefill_workers &&
        o.decode_workers == run.decode_workers) {
      return o.hit_ratio > 0 ? run.hit_ratio / o.hit_ratio
                             : std::numeric_limits<double>::quiet_NaN();
    }
  }
  return std::numeric_limits<double>::quiet_NaN();
}

double SimReport::HitVsOracle(const SimRun& run) const {
  for (const SimRun& o : runs) {
    if (o.policy == kOracle && o.prefill_workers == run.prefill_workers &&
        o.decode_workers == run.decode_workers) {
      return o.hit_ratio > 0 ? run.hit_ratio / o.hit_ratio
                             : std::numeric_limits<double>::quiet_NaN();
    }
  }
  return std::numeric_limits<double>::quiet_NaN();
}

std::string SimReport::ToJson() const {
  const SimConfig& c = config;
  json::OrderedValue out = {
      {"config",
       {{"trace", c.trace_path},
        {"trace_requests", trace_requests},
        {"policies", c.policies},
        {"prefill_workers", c.prefill_workers},
        {"decode_workers", c.decode_workers},
        {"prefill_cache_tokens", c.prefill_cache_tokens},
        {"decode_kv_tokens", c.decode_kv_tokens},
        {"block_size", c.block_size},
        {"time_scale", c.time_scale},
        {"max_requests", c.max_requests},
        {"prefill_us_per_token", c.prefill_us_per_token},
        {"prefill_overhead_ms", c.prefill_overhead_ms},
        {"decode_step_ms", c.decode_step_ms},
        {"decode_step_per_seq_ms", c.decode_step_per_seq_ms},
        {"decode_step_per_kctx_ms", c.decode_step_per_kctx_ms},
        {"transfer_us_per_token", c.transfer_us_per_token},
        {"heartbeat_ms", c.heartbeat_ms},
        {"event_delay_ms", c.event_delay_ms},
        {"event_loss", c.event_loss},
        {"resync_delay_ms", c.resync_delay_ms},
        {"seed", c.seed},
        {"w_prefill", c.policy.w_prefill},
        {"w_decode", c.policy.w_decode},
        {"local_prefill_threshold", c.policy.local_prefill_threshold},
        {"cache_threshold", c.policy.cache_threshold},
        {"balance_slack", c.policy.balance_slack},
        {"pool_fraction", c.pool_fraction},
        {"pull_overhead_ms", c.pull_overhead_ms},
        {"tier_multiple", c.tier_multiple},
        {"tier_read_us_per_token", c.tier_read_us_per_token},
        {"working_set_tokens", working_set_tokens}}},
      {"runs", json::OrderedValue::array()}};
  for (const SimRun& r : runs) {
    out["runs"].push_back({{"policy", r.policy},
                           {"prefill_workers", r.prefill_workers},
                           {"decode_workers", r.decode_workers},
                           {"requests", r.requests},
                           {"rejected", r.rejected},
                           {"input_tokens", r.input_tokens},
                           {"hit_tokens", r.hit_tokens},
                           {"hit_ratio", r.hit_ratio},
                           {"hit_vs_oracle", HitVsOracle(r)},
                           {"imbalance", r.imbalance},
                           {"decode_imbalance", r.decode_imbalance},
                           {"local_prefills", r.local_prefills},
                           {"ttft_p50_ms", r.ttft_p50_ms},
                           {"ttft_p99_ms", r.ttft_p99_ms},
                           {"prefill_queue_p50_ms", r.prefill_queue_p50_ms},
                           {"prefill_queue_p99_ms", r.prefill_queue_p99_ms},
                           {"decode_admit_p50_ms", r.decode_admit_p50_ms},
                           {"decode_admit_p99_ms", r.decode_admit_p99_ms},
                           {"tpot_p50_ms", r.tpot_p50_ms},
                           {"tpot_p99_ms", r.tpot_p99_ms},
                           {"decision_p50_us", r.decision_p50_us},
                           {"decision_p99_us", r.decision_p99_us},
                           {"decision_wall_p99_us", r.decision_wall_p99_us},
                           {"hash_p50_us", r.hash_p50_us},
                           {"hash_p99_us", r.hash_p99_us},
                           {"route_p50_us", r.route_p50_us},
                           {"route_p99_us", r.route_p99_us},
                           {"index_hashes", r.index_hashes},
                           {"index_entries", r.index_entries},
                           {"index_bytes", r.index_bytes},
                           {"index_bytes_per_block", r.index_bytes_per_block},
                           {"events_lost", r.events_lost},
                           {"resyncs", r.resyncs},
                           {"makespan_s", r.makespan_s},
                           {"hit_vs_unbounded", HitVsUnbounded(r)},
                           {"pulled_tokens", r.pulled_tokens},
                           {"tier_hit_tokens", r.tier_hit_tokens},
                           {"peer_pulls", r.peer_pulls},
                           {"peer_pulls_failed", r.peer_pulls_failed},
                           {"peer_pulls_partial", r.peer_pulls_partial},
                           {"pulled_tier_tokens", r.pulled_tier_tokens},
                           {"held_missed_tokens", r.held_missed_tokens},
                           {"prefill_pool_tokens", r.prefill_pool_tokens},
                           {"decode_pool_tokens", r.decode_pool_tokens}});
  }
  return json::Dump(out) + "\n";
}

std::string SimReport::ToTable() const {
  // Fixed-point with `digits` decimals; "-" for NaN (no figure).
  auto num = [](double v, int digits) {
    return std::isnan(v) ? std::string("-")
                         : absl::StrFormat("%.*f", digits, v);
  };
  std::string out = absl::StrFormat(
      "%-16s %5s %4s %7s %7s %6s %9s %9s %9s %9s %8s %8s %8s %8s %8s\n",
      "policy", "P", "D", "hit", "/oracle", "imbal", "ttft_p50", "ttft_p99",
      "queue_p50", "queue_p99", "tpot_p50", "dec_p50", "dec_p99", "hash_p99",
      "B/block");
  absl::StrAppend(
      &out,
      absl::StrFormat(
          "%-16s %5s %4s %7s %7s %6s %9s %9s %9s %9s %8s %8s %8s %8s %8s\n", "",
          "", "", "", "", "", "ms", "ms", "ms", "ms", "ms", "us", "us", "us",
          ""));
  for (const SimRun& r : runs) {
    absl::StrAppend(
        &out,
        absl::StrFormat(
            "%-16s %5d %4d %7s %7s %6s %9s %9s %9s %9s %8s %8s %8s %8s %8s\n",
            r.policy, r.prefill_workers, r.decode_workers, num(r.hit_ratio, 3),
            num(HitVsOracle(r), 3), num(r.imbalance, 2), num(r.ttft_p50_ms, 0),
            num(r.ttft_p99_ms, 0), num(r.prefill_queue_p50_ms, 0),
            num(r.prefill_queue_p99_ms, 0), num(r.tpot_p50_ms, 1),
            num(r.decision_p50_us, 1), num(r.decision_p99_us, 1),
            num(r.hash_p99_us, 1),
            IsOracle(r.policy) ? std::string("-")
                               : num(r.index_bytes_per_block, 0)));
  }
  return out;
}

std::string SimReport::ToSvg() const {
  // Two panels side by side: hit ratio and imbalance against prefill workers
  // on a log2 axis; one colour per policy.
  static constexpr const char* kColours[] = {"#1f77b4", "#d62728", "#2ca02c",
                                             "#ff7f0e", "#7f7f7f", "#9467bd",
                                             "#8c564b", "#e377c2"};
  constexpr double kW = 1000, kH = 460, kPanelW = 400, kPanelH = 300, kTop = 85;
  const double left[2] = {80, 580};
  std::vector<int32_t> sizes = config.prefill_workers;
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  const double x_lo = std::log2(std::max(1, sizes.empty() ? 1 : sizes.front()));
  const double x_hi = std::log2(std::max(1, sizes.empty() ? 1 : sizes.back()));
  // Axes: hit ratio from 0 to a tenth above the best; imbalance from 1 (even)
  // to the next half above the worst.
  double hit_hi = 0.1, imb_hi = 1.5;
  for (const SimRun& r : runs) {
    if (std::isfinite(r.hit_ratio)) hit_hi = std::max(hit_hi, r.hit_ratio);
    if (std::isfinite(r.imbalance)) imb_hi = std::max(imb_hi, r.imbalance);
  }
  hit_hi = std::min(1.0, std::ceil(hit_hi * 10 + 0.5) / 10);
  imb_hi = std::ceil(imb_hi * 2) / 2;
  const double y_lo[2] = {0, 1}, y_hi[2] = {hit_hi, imb_hi};
  auto px = [&](int panel, int32_t n) {
    const double t = x_hi > x_lo ? (std::log2(n) - x_lo) / (x_hi - x_lo) : 0.5;
    return left[panel] + t * kPanelW;
  };
  auto py = [&](int panel, double v) {
    return kTop + kPanelH -
           (std::clamp(v, y_lo[panel], y_hi[panel]) - y_lo[panel]) /
               (y_hi[panel] - y_lo[panel]) * kPanelH;
  };
  std::string out = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" "
      "height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%%\" "
      "height=\"100%%\" fill=\"white\"/>\n",
      kW, kH, kW, kH);
  absl::StrAppendFormat(&out,
                        "<text x=\"%.0f\" y=\"22\" font-size=\"15\" "
                        "text-anchor=\"middle\">pdserve router simulation: "
                        "%d decode workers, %d cache tokens per prefill "
                        "worker, time scale %g</text>\n",
                        kW / 2, config.decode_workers,
                        config.prefill_cache_tokens, config.time_scale);
  const char* titles[2] = {"prefix-hit ratio of input tokens",
                           "imbalance: max / mean prefill tokens computed"};
  for (int panel = 0; panel < 2; ++panel) {
    const double x0 = left[panel], y0 = kTop;
    absl::StrAppendFormat(&out,
                          "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.0f\" "
                          "height=\"%.0f\" fill=\"none\" stroke=\"#444\"/>\n",
                          x0, y0, kPanelW, kPanelH);
    absl::StrAppendFormat(
        &out, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n",
        x0 + kPanelW / 2, y0 - 8, titles[panel]);
    absl::StrAppendFormat(&out,
                          "<text x=\"%.1f\" y=\"%.1f\" "
                          "text-anchor=\"middle\">prefill workers</text>\n",
                          x0 + kPanelW / 2, y0 + kPanelH + 36);
    for (int32_t n : sizes) {
      const double x = px(panel, n);
      absl::StrAppendFormat(
          &out,
          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
          "stroke=\"#ddd\"/>\n"
          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%d</text>\n",
          x, y0, x, y0 + kPanelH, x, y0 + kPanelH + 16, n);
    }
    const int ticks = 5;
    for (int i = 0; i <= ticks; ++i) {
      const double v = y_lo[panel] + (y_hi[panel] - y_lo[panel]) * i / ticks;
      const double y = py(panel, v);
      absl::StrAppendFormat(
          &out,
          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
          "stroke=\"#ddd\"/>\n"
          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%.2f</text>\n",
          x0, y, x0 + kPanelW, y, x0 - 6, y + 4, v);
    }
    for (size_t p = 0; p < config.policies.size(); ++p) {
      const std::string& name = config.policies[p];
      const char* colour =
          kColours[p % (sizeof(kColours) / sizeof(kColours[0]))];
      std::vector<std::pair<double, double>> pts;
      for (int32_t n : sizes) {
        for (const SimRun& r : runs) {
          if (r.policy != name || r.prefill_workers != n) continue;
          pts.emplace_back(px(panel, n),
                           py(panel, panel == 0 ? r.hit_ratio : r.imbalance));
        }
      }
      std::string poly;
      for (const auto& [x, y] : pts)
        absl::StrAppendFormat(&poly, "%s%.1f,%.1f", poly.empty() ? "" : " ", x,
                              y);
      const char* dash = name == kOracle ? " stroke-dasharray=\"6,4\"" : "";
      if (pts.size() > 1) {
        absl::StrAppendFormat(&out,
                              "<polyline points=\"%s\" fill=\"none\" "
                              "stroke=\"%s\" stroke-width=\"2\"%s/>\n",
                              poly, colour, dash);
      }
      for (const auto& [x, y] : pts) {
        absl::StrAppendFormat(
            &out, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"%s\"/>\n",
            x, y, colour);
      }
    }
  }
  // Legend.
  double lx = 80;
  for (size_t p = 0; p < config.policies.size(); ++p) {
    const char* colour = kColours[p % (sizeof(kColours) / sizeof(kColours[0]))];
    absl::StrAppendFormat(&out,
                          "<line x1=\"%.0f\" y1=\"46\" x2=\"%.0f\" y2=\"46\" "
                          "stroke=\"%s\" stroke-width=\"3\"/>"
                          "<text x=\"%.0f\" y=\"50\">%s</text>\n",
                          lx, lx + 24, colour, lx + 30, config.policies[p]);
    lx += 40 + 8.0 * static_cast<double>(config.policies[p].size());
  }
  return out + "</svg>\n";
}

namespace {

absl::Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) {
    return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  }
  f << text;
  f.close();
  if (!f) return absl::DataLossError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace

absl::Status SimReport::WriteSvg(const std::string& path) const {
  return WriteText(path, ToSvg());
}

std::string SimReport::SvgPathFor(const std::string& json_path) {
  constexpr absl::string_view kJson = ".json";
  if (absl::EndsWith(json_path, kJson)) {
    return absl::StrCat(json_path.substr(0, json_path.size() - kJson.size()),
                        ".svg");
  }
  return json_path + ".svg";
}

absl::Status SimReport::WriteFiles(const std::string& json_path) const {
  RETURN_IF_ERROR(WriteText(json_path, ToJson()));
  return WriteSvg(SvgPathFor(json_path));
}

absl::StatusOr<SimReport> RunRouterSim(
    const SimConfig& config,
    const std::function<void(const SimRun&)>& progress) {
  RETURN_IF_ERROR(config.Validate());
  ASSIGN_OR_RETURN(const std::vector<TraceRequest> trace,
                   LoadMooncakeTrace(config.trace_path));
  return RunRouterSim(config, trace, progress);
}

absl::StatusOr<SimReport> RunRouterSim(
    const SimConfig& config, const std::vector<TraceRequest>& trace,
    const std::function<void(const SimRun&)>& progress) {
  RETURN_IF_ERROR(config.Validate());
  if (trace.empty())
    return absl::InvalidArgumentError("the trace has no requests");
  SimReport report;
  report.config = config;
  // Replay order: by timestamp, ties in trace order.
  const size_t n = config.max_requests > 0
                       ? std::min<size_t>(trace.size(), config.max_requests)
                       : trace.size();
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return trace[a].timestamp_ms < trace[b].timestamp_ms;
  });
  const engine::ModelFingerprint fp = SimFingerprint(config.block_size);
  std::vector<Prepared> requests(n);
  for (size_t i = 0; i < n; ++i) {
    Prepared& p = requests[i];
    p.trace = &trace[order[i]];
    p.arrival = static_cast<Micros>(
        std::llround(static_cast<double>(p.trace->timestamp_ms) * 1000.0 *
                     config.time_scale));
    const std::vector<int32_t> tokens =
        SynthesizePrompt(*p.trace, config.seed, kVocabSize);
    engine::ExtendBlockHashes(fp, "", tokens, config.block_size, &p.hashes);
  }
  report.trace_requests = static_cast<int64_t>(n);
  // The working set: distinct full blocks over every prompt.
  int64_t max_request_blocks = 0;
  {
    absl::flat_hash_set<BlockHash, engine::BlockHashHasher> distinct;
    for (const Prepared& p : requests) {
      distinct.insert(p.hashes.begin(), p.hashes.end());
      max_request_blocks = std::max<int64_t>(
          max_request_blocks, (p.trace->input_length + p.trace->output_length +
                               config.block_size - 1) /
                                  config.block_size);
    }
    report.working_set_tokens =
        static_cast<int64_t>(distinct.size()) * config.block_size;
  }
  const int64_t working_set_blocks =
      report.working_set_tokens / config.block_size;
  for (int32_t workers : config.prefill_workers) {
    for (const std::string& policy : config.policies) {
      Simulation sim(config, requests, policy, workers, working_set_blocks,
                     max_request_blocks);
      ASSIGN_OR_RETURN(SimRun run, sim.Run());
      if (progress) progress(run);
      report.runs.push_back(std::move(run));
    }
  }
  return report;
}

}  // namespace pdserve::bench
