#include "router/policy.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <span>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "wire/enums.h"

namespace pdserve::router {
namespace {

// Failed this request already, or draining (it finishes what it has but
// takes nothing new; the router filters those too, this keeps every policy
// safe on its own).
bool Excluded(const RouteRequest& r, const WorkerView& w) {
  return w.status.draining() || std::find(r.exclude.begin(), r.exclude.end(),
                                          w.index) != r.exclude.end();
}

bool CanDecode(const WorkerView& w) { return wire::ServesDecode(w.role); }
bool CanPrefill(const WorkerView& w) {
  return w.role == v1::WORKER_ROLE_PREFILL;
}

double DecodeLoad(const WorkerView& w) {
  return static_cast<double>(w.status.num_running() + w.status.num_waiting() +
                             w.routed_requests);
}

// Per-thread buffers that routing decisions reuse: once grown to the
// cluster's size, a decision allocates nothing (an allocation on a fragmented
// heap is the slowest step of a decision at the tail). Lent to one decision
// at a time; a nested one (none today) gets its own.
struct Scratch {
  std::vector<const WorkerView*> decoders, prefillers;
  struct Option {
    const WorkerView* w;
    int64_t cached;  // pool + tier
    int64_t tier;
    double cost;
  };
  std::vector<Option> options;
  // Leading blocks by WorkerIndex, lent in order to PrefixMatches' queries
  // (a deque: lending another leaves those lent in place).
  std::deque<std::vector<int32_t>> counts;
  size_t counts_lent = 0;
  bool busy = false;
};

class ScratchLease {
 public:
  ScratchLease() {
    thread_local Scratch mine;
    if (mine.busy) {
      own_ = std::make_unique<Scratch>();
      s_ = own_.get();
    } else {
      s_ = &mine;
    }
    s_->busy = true;
    s_->counts_lent = 0;
  }
  ~ScratchLease() { s_->busy = false; }
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;
  Scratch& operator*() const { return *s_; }
  Scratch* operator->() const { return s_; }

  // An empty counts vector, with the capacity of its earlier uses.
  std::vector<int32_t>* Counts() {
    if (s_->counts_lent == s_->counts.size()) s_->counts.emplace_back();
    std::vector<int32_t>* c = &s_->counts[s_->counts_lent++];
    c->clear();
    return c;
  }

 private:
  std::unique_ptr<Scratch> own_;
  Scratch* s_;
};

// Cached leading tokens per worker for one request, from one index query per
// cache fingerprint (workers with another KV dtype or block size hash
// differently). Blocks are hashed lazily, only as far as the query probes:
// hashing a long prompt costs more than the query.
class PrefixMatches {
 public:
  PrefixMatches(const RouteRequest& r, const PrefixIndex* index,
                ScratchLease* scratch)
      : r_(r), index_(index), scratch_(scratch) {}

  // Leading prompt tokens in `w`'s pool.
  int64_t CachedTokens(const WorkerView& w) { return Tokens(w, false); }
  // Leading prompt tokens after those that `w`'s KV tier holds (0 for a
  // worker without one: the index is not asked).
  int64_t TierTokens(const WorkerView& w) {
    if (w.status.kv_tier() == v1::KV_TIER_POOL) return 0;
    return std::max<int64_t>(0, Tokens(w, true) - Tokens(w, false));
  }

 private:
  int64_t Tokens(const WorkerView& w, bool with_tier) {
    const int32_t bs = w.block_size;
    if (bs <= 0 || r_.tokens == nullptr || w.index < 0) return 0;
    const std::vector<int32_t>& counts =
        CountsFor(w.fingerprint, bs, with_tier);
    const int32_t blocks =
        static_cast<size_t>(w.index) < counts.size() ? counts[w.index] : 0;
    return std::min<int64_t>(r_.num_tokens, int64_t{blocks} * bs);
  }

  const std::vector<int32_t>& CountsFor(const engine::ModelFingerprint& fp,
                                        int32_t bs, bool with_tier) {
    // The fingerprint covers the block size, so it is a sufficient key.
    Group* g = nullptr;
    for (Group& x : groups_) {
      if (x.fingerprint == fp) g = &x;
    }
    if (g == nullptr) {
      g = &groups_.emplace_back();
      g->fingerprint = fp;
    }
    std::vector<int32_t>*& counts = with_tier ? g->tier_counts : g->counts;
    if (counts != nullptr) return *counts;
    counts = scratch_->Counts();
    const TierMask tiers = with_tier ? kAllTiers : kPoolTier;
    const std::span<const int32_t> tokens(*r_.tokens);
    if (r_.hashes != nullptr) {
      index_->LeadingBlocksOfPrompt(r_.hashes->For(fp, bs), counts, tiers);
      return *counts;
    }
    index_->LeadingBlocksOfPrompt(
        tokens.size() / bs,
        [&](size_t i) {
          if (i >= g->hashes.size()) {
            engine::ExtendBlockHashes(
                fp, r_.cache_salt, tokens.first((i + 1) * bs), bs, &g->hashes);
          }
          return g->hashes[i];
        },
        counts, tiers);
    return *counts;
  }

  struct Group {
    engine::ModelFingerprint fingerprint{};
    std::vector<engine::BlockHash> hashes;  // lazy hashing only
    // By WorkerIndex, from the scratch; null until queried.
    std::vector<int32_t>* counts = nullptr;       // pool
    std::vector<int32_t>* tier_counts = nullptr;  // pool + lower tiers
  };
  const RouteRequest& r_;
  const PrefixIndex* index_;
  ScratchLease* scratch_;
  absl::InlinedVector<Group, 1> groups_;
};

// The eligible workers of one role, in an order rotated by `start` so that a
// strict "<" scan breaks ties round-robin instead of always favouring the
// first worker (which would pile new prompts onto it whenever loads tie).
void Candidates(const RouteRequest& r, const std::vector<WorkerView>& workers,
                bool (*role)(const WorkerView&), uint64_t start,
                std::vector<const WorkerView*>* out) {
  out->clear();
  for (const WorkerView& w : workers) {
    if (role(w) && !Excluded(r, w)) out->push_back(&w);
  }
  if (!out->empty())
    std::rotate(out->begin(), out->begin() + start % out->size(), out->end());
}
std::vector<const WorkerView*> Candidates(
    const RouteRequest& r, const std::vector<WorkerView>& workers,
    bool (*role)(const WorkerView&), uint64_t start) {
  std::vector<const WorkerView*> out;
  Candidates(r, workers, role, start, &out);
  return out;
}

// Prefill tokens waiting at `w`. The heartbeat's figure covers every
// router's requests but lags; routed_prefill_tokens is this router's exact
// in-flight share, which the heartbeat already counts until they finish, so
// the two overlap and are not added.
double QueuedPrefill(const WorkerView& w) {
  return static_cast<double>(
      std::max<int64_t>(static_cast<int64_t>(w.status.queued_prefill_tokens()),
                        w.routed_prefill_tokens));
}

double FreeFraction(const WorkerView& w) {
  return w.status.total_blocks()
             ? double(w.status.free_blocks()) / w.status.total_blocks()
             : 0;
}

// Fewest sequences, then the most free blocks.
const WorkerView* LeastLoadedDecode(
    const std::vector<const WorkerView*>& decoders) {
  const WorkerView* best = nullptr;
  for (const WorkerView* w : decoders) {
    if (best == nullptr || DecodeLoad(*w) < DecodeLoad(*best) ||
        (DecodeLoad(*w) == DecodeLoad(*best) &&
         FreeFraction(*w) > FreeFraction(*best))) {
      best = w;
    }
  }
  return best;
}

// Fewest queued prefill tokens, then the fewest sequences.
const WorkerView* LeastLoadedPrefill(
    const std::vector<const WorkerView*>& prefillers) {
  const WorkerView* best = nullptr;
  for (const WorkerView* w : prefillers) {
    if (best == nullptr || QueuedPrefill(*w) < QueuedPrefill(*best) ||
        (QueuedPrefill(*w) == QueuedPrefill(*best) &&
         DecodeLoad(*w) < DecodeLoad(*best))) {
      best = w;
    }
  }
  return best;
}

// Shared by the cache-blind policies: local prefill only for short prompts.
void SetPrefill(const RouteRequest& request, const WorkerView* prefill,
                const PolicyConfig& config, RouteDecision* d) {
  if (prefill == nullptr) {
    d->reason = d->decode->role == v1::WORKER_ROLE_BOTH ? "colocated"
                                                        : "local:no_prefill";
  } else if (request.num_tokens <= config.local_prefill_threshold) {
    d->reason = "local:short";
  } else {
    d->prefill = prefill;
    d->reason = "remote";
  }
}

class CacheAwarePolicy : public Policy {
 public:
  CacheAwarePolicy(PolicyConfig config, PrefixIndex* index)
      : config_(config), index_(index) {}
  const char* name() const override { return "cache_aware"; }

  absl::StatusOr<RouteDecision> Choose(
      const RouteRequest& request,
      const std::vector<WorkerView>& workers) override {
    ScratchLease scratch;
    PrefixMatches matches(request, index_, &scratch);
    const uint64_t start = next_++;
    RouteDecision d;
    double best_decode = std::numeric_limits<double>::infinity();
    Candidates(request, workers, CanDecode, start, &scratch->decoders);
    for (const WorkerView* w : scratch->decoders) {
      const int64_t cached = matches.CachedTokens(*w);
      const int64_t tier = matches.TierTokens(*w);
      // Fewer running sequences, more free blocks, more of the prompt cached
      // (a tier token saves its recompute less its load; TierLoadCost is
      // finite, so with no tier tokens the term is 0 and is not priced).
      const double tier_saving =
          tier == 0
              ? 0
              : static_cast<double>(tier) * (1 - TierLoadCost(*w, config_));
      const double cost =
          config_.w_decode * DecodeLoad(*w) -
          config_.w_decode * FreeFraction(*w) -
          config_.w_prefill * (static_cast<double>(cached) + tier_saving);
      if (cost < best_decode) {
        best_decode = cost;
        d.decode = w;
        d.decode_cached_tokens = cached + tier;
        d.decode_tier_tokens = tier;
      }
    }
    if (d.decode == nullptr)
      return absl::UnavailableError("no decode worker is up");
    const int64_t uncached_at_decode =
        request.num_tokens - d.decode_cached_tokens;
    using Option = Scratch::Option;
    std::vector<Option>& options = scratch->options;
    options.clear();
    double best_prefill = std::numeric_limits<double>::infinity();
    Candidates(request, workers, CanPrefill, start, &scratch->prefillers);
    for (const WorkerView* w : scratch->prefillers) {
      const int64_t pool = matches.CachedTokens(*w);
      const int64_t tier = matches.TierTokens(*w);
      // Pool hits are free, tier hits cost their load, the rest recompute.
      const double tier_load =
          tier == 0 ? 0 : static_cast<double>(tier) * TierLoadCost(*w, config_);
      const double cost =
          config_.w_prefill *
              (static_cast<double>(request.num_tokens - pool - tier) +
               tier_load + QueuedPrefill(*w)) +
          config_.w_decode * DecodeLoad(*w);
      options.push_back({w, pool + tier, tier, cost});
      best_prefill = std::min(best_prefill, cost);
    }
    // Costs within the slack of the cheapest count as equal, and the worker
    // with the least work routed so far wins. Otherwise a prefix every prompt
    // shares (a system prompt) makes the few workers that already hold it
    // cheaper for every new conversation, and at light load they take them
    // all: the rest of the tier's cache sits unused and its work piles up.
    const double slack = config_.w_prefill * config_.balance_slack *
                         static_cast<double>(request.num_tokens);
    absl::MutexLock l(&mu_);
    const Option* pick = nullptr;
    double pick_work = 0;
    for (const Option& o : options) {
      if (o.cost > best_prefill + slack) continue;
      const double work = RoutedWork(o.w->index);
      if (pick == nullptr || work < pick_work) {
        pick = &o;
        pick_work = work;
      }
    }
    if (pick == nullptr) {
      d.reason = d.decode->role == v1::WORKER_ROLE_BOTH ? "colocated"
                                                        : "local:no_prefill";
      d.prefill_cached_tokens = d.decode_cached_tokens;
      d.prefill_tier_tokens = d.decode_tier_tokens;
    } else if (uncached_at_decode <= config_.local_prefill_threshold) {
      d.reason = "local:short";
      d.prefill_cached_tokens = d.decode_cached_tokens;
      d.prefill_tier_tokens = d.decode_tier_tokens;
    } else {
      d.reason = "remote";
      d.prefill = pick->w;
      d.prefill_cached_tokens = pick->cached;
      d.prefill_tier_tokens = pick->tier;
      // RoutedWork() above sized the vector for every candidate.
      if (pick->w->index >= 0) {
        routed_work_[pick->w->index] +=
            static_cast<double>(request.num_tokens - pick->cached);
      }
    }
    return d;
  }

 private:
  // Uncached prefill tokens routed to `w` so far. A worker seen for the first
  // time starts level with the least-loaded one, so that a new or restarted
  // worker takes its share of new prompts, not all of them.
  double RoutedWork(WorkerIndex w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (w < 0) return 0;
    if (static_cast<size_t>(w) >= routed_work_.size()) {
      routed_work_.resize(w + 1, std::numeric_limits<double>::quiet_NaN());
    }
    if (std::isnan(routed_work_[w])) {
      double least = std::numeric_limits<double>::infinity();
      for (double x : routed_work_) {
        if (!std::isnan(x)) least = std::min(least, x);
      }
      routed_work_[w] = std::isinf(least) ? 0 : least;
    }
    return routed_work_[w];
  }

  PolicyConfig config_;
  PrefixIndex* index_;
  std::atomic<uint64_t> next_{0};
  absl::Mutex mu_;
  std::vector<double> routed_work_ ABSL_GUARDED_BY(mu_);  // by WorkerIndex
};

class LeastLoadedPolicy : public Policy {
 public:
  explicit LeastLoadedPolicy(PolicyConfig config) : config_(config) {}
  const char* name() const override { return "least_loaded"; }
  absl::StatusOr<RouteDecision> Choose(
      const RouteRequest& request,
      const std::vector<WorkerView>& workers) override {
    const uint64_t start = next_++;
    RouteDecision d;
    d.decode =
        LeastLoadedDecode(Candidates(request, workers, CanDecode, start));
    if (d.decode == nullptr)
      return absl::UnavailableError("no decode worker is up");
    SetPrefill(
        request,
        LeastLoadedPrefill(Candidates(request, workers, CanPrefill, start)),
        config_, &d);
    return d;
  }

 private:
  PolicyConfig config_;
  std::atomic<uint64_t> next_{0};
};

class CacheThresholdPolicy : public Policy {
 public:
  CacheThresholdPolicy(PolicyConfig config, PrefixIndex* index)
      : config_(config), index_(index) {}
  const char* name() const override { return "cache_threshold"; }
  absl::StatusOr<RouteDecision> Choose(
      const RouteRequest& request,
      const std::vector<WorkerView>& workers) override {
    const uint64_t start = next_++;
    RouteDecision d;
    d.decode =
        LeastLoadedDecode(Candidates(request, workers, CanDecode, start));
    if (d.decode == nullptr)
      return absl::UnavailableError("no decode worker is up");
    const std::vector<const WorkerView*> prefillers =
        Candidates(request, workers, CanPrefill, start);
    ScratchLease scratch;
    PrefixMatches matches(request, index_, &scratch);
    const WorkerView* best = nullptr;
    int64_t best_cached = 0;
    for (const WorkerView* w : prefillers) {
      const int64_t cached = matches.CachedTokens(*w);
      if (best == nullptr || cached > best_cached ||
          (cached == best_cached && QueuedPrefill(*w) < QueuedPrefill(*best))) {
        best = w;
        best_cached = cached;
      }
    }
    const double rate =
        request.num_tokens > 0
            ? static_cast<double>(best_cached) / request.num_tokens
            : 0;
    const WorkerView* prefill =
        rate > config_.cache_threshold ? best : LeastLoadedPrefill(prefillers);
    SetPrefill(request, prefill, config_, &d);
    if (d.prefill != nullptr)
      d.prefill_cached_tokens = matches.CachedTokens(*d.prefill);
    return d;
  }

 private:
  PolicyConfig config_;
  PrefixIndex* index_;
  std::atomic<uint64_t> next_{0};
};

class RoundRobinPolicy : public Policy {
 public:
  explicit RoundRobinPolicy(PolicyConfig config) : config_(config) {}
  const char* name() const override { return "round_robin"; }
  absl::StatusOr<RouteDecision> Choose(
      const RouteRequest& request,
      const std::vector<WorkerView>& workers) override {
    std::vector<const WorkerView*> decoders, prefillers;
    for (const WorkerView& w : workers) {
      if (Excluded(request, w)) continue;
      if (CanDecode(w)) decoders.push_back(&w);
      if (CanPrefill(w)) prefillers.push_back(&w);
    }
    if (decoders.empty())
      return absl::UnavailableError("no decode worker is up");
    const uint64_t n = next_++;
    RouteDecision d;
    d.decode = decoders[n % decoders.size()];
    if (prefillers.empty()) {
      d.reason = d.decode->role == v1::WORKER_ROLE_BOTH ? "colocated"
                                                        : "local:no_prefill";
    } else if (request.num_tokens <= config_.local_prefill_threshold) {
      d.reason = "local:short";
    } else {
      d.prefill = prefillers[n % prefillers.size()];
      d.reason = "remote";
    }
    return d;
  }

 private:
  PolicyConfig config_;
  std::atomic<uint64_t> next_{0};
};

}  // namespace

double TierLoadCost(const WorkerView& w, const PolicyConfig& config) {
  const double load = w.status.kv_tier_load_tokens_per_second();
  const double prefill = w.status.prefill_tokens_per_second();
  const double cost =
      load > 0 && prefill > 0 ? prefill / load : config.tier_load_cost;
  return std::clamp(cost, kMinTierLoadCost, kMaxTierLoadCost);
}

const std::vector<engine::BlockHash>& PromptHashes::For(
    const engine::ModelFingerprint& fingerprint, int32_t block_size) {
  // The fingerprint covers the block size, so it is a sufficient key.
  for (const Group& g : groups_) {
    if (g.fingerprint == fingerprint) return g.hashes;
  }
  Group& g = groups_.emplace_back();
  g.fingerprint = fingerprint;
  if (block_size > 0 && tokens_ != nullptr) {
    engine::ExtendBlockHashes(fingerprint, salt_, *tokens_, block_size,
                              &g.hashes);
  }
  return g.hashes;
}

absl::StatusOr<std::unique_ptr<Policy>> Policy::Create(const std::string& name,
                                                       PolicyConfig config,
                                                       PrefixIndex* index) {
  if (name == "cache_aware")
    return std::unique_ptr<Policy>(new CacheAwarePolicy(config, index));
  if (name == "round_robin")
    return std::unique_ptr<Policy>(new RoundRobinPolicy(config));
  if (name == "least_loaded")
    return std::unique_ptr<Policy>(new LeastLoadedPolicy(config));
  if (name == "cache_threshold")
    return std::unique_ptr<Policy>(new CacheThresholdPolicy(config, index));
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown routing policy \"", name,
      "\" (cache_aware, round_robin, least_loaded or cache_threshold)"));
}

}  // namespace pdserve::router
