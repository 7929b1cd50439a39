// The router's side of `pdserve sim route`: the heartbeats that refresh its
// worker views, routing each arrival through the real router::Policy and
// PrefixIndex (timed), the peer-pull decision through router::DecidePeerPull,
// and the policy names ("cache_aware+tier+pull", "oracle", ...) that
// SimConfig::Validate checks.
#include <algorithm>
#include <ctime>
#include <limits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "bench/router_sim.h"
#include "bench/router_sim_internal.h"
#include "common/status_macros.h"

namespace pdserve::bench {
namespace router_sim_internal {

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
bool IsOracle(const std::string& base) {
  return base == kOracle || base == kUnbounded;
}

double MonotonicMicros() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 +
         static_cast<double>(ts.tv_nsec) / 1e3;
}

uint64_t ReferenceLoop(int64_t iterations, uint64_t seed) {
  uint64_t x = seed;
  for (int64_t i = 0; i < iterations; ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    asm volatile("" : "+r"(x));  // keeps the chain: one step per iteration
  }
  return x;
}

double ReferenceLoopRate() {
  constexpr int64_t kIterations = 200'000;
  double best = std::numeric_limits<double>::infinity();
  uint64_t sink = 0;
  for (int i = 0; i < 5; ++i) {
    const double t0 = MonotonicMicros();
    sink += ReferenceLoop(kIterations, sink + i);
    best = std::min(best, MonotonicMicros() - t0);
  }
  asm volatile("" : : "r"(sink));
  return static_cast<double>(kIterations) / std::max(best, 1.0);
}

void Simulation::Heartbeat() {
  for (int32_t w = 0; w < num_prefill_; ++w) {
    const PrefillWorker& p = prefill_[w];
    v1::WorkerStatus& s = views_[w].status;
    int64_t queued = p.queued_tokens;
    if (p.running >= 0 && p.run_end > p.run_start) {
      queued += p.run_computed * (p.run_end - now_) / (p.run_end - p.run_start);
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

absl::Status Simulation::Arrive(int32_t r) {
  DeliverEvents(now_);
  const Prepared& prep = P(r);
  const std::vector<int32_t> tokens =
      SynthesizePrompt(*prep.trace, c_.seed, kVocabSize);
  router::PromptHashes hashes(&tokens, "");
  router::RouteRequest route{Input(r), "", &tokens, {}, &hashes};
  const double hash0 = MonotonicMicros();
  if (!oracle_) hashes.For(fingerprint_, bs_);  // as the service, at intake
  const double t0 = MonotonicMicros();
  absl::StatusOr<router::RouteDecision> d = policy_->Choose(route, views_);
  const double t1 = MonotonicMicros();
  decision_us_.push_back(t1 - t0);
  hash_us_.push_back(t0 - hash0);
  route_us_.push_back(t1 - hash0);
  if (!oracle_) MeasureReference(t1 - t0);
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

void Simulation::MeasureReference(double decision_us) {
  if (reference_iterations_ == 0) {
    decision_median_us_ = decision_us;
    reference_iterations_ = std::max(1.0, decision_us * ReferenceLoopRate());
  }
  // Running medians, a step of 1% toward each new time: the tail being
  // measured does not stretch the reference, and a cold first decision is
  // forgotten within a few hundred.
  decision_median_us_ *= decision_us > decision_median_us_ ? 1.01 : 0.99;
  const double t0 = MonotonicMicros();
  reference_sink_ = ReferenceLoop(static_cast<int64_t>(reference_iterations_),
                                  reference_sink_);
  const double us = MonotonicMicros() - t0;
  reference_us_.push_back(us);
  // The loop's length is steered so that its own median follows the
  // decisions' (the calibrated rate is a best case; a busy host runs slower).
  reference_iterations_ *= us > decision_median_us_ ? 0.99 : 1.01;
  reference_iterations_ = std::max(reference_iterations_, 1.0);
}

void Simulation::DecidePull(int32_t r) {
  Req& q = reqs_[r];
  const std::vector<BlockHash>& chain = P(r).hashes;
  // The engine always computes at least the last token.
  const size_t usable =
      std::min<size_t>(chain.size(), static_cast<size_t>((Input(r) - 1) / bs_));
  std::vector<int32_t> counts, all_counts;
  const std::span<const BlockHash> prefix = std::span(chain).first(usable);
  index_.LeadingBlocksOfPrompt(prefix, &counts);
  if (tier_ || decode_tier_) {
    index_.LeadingBlocksOfPrompt(prefix, &all_counts, router::kAllTiers);
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

}  // namespace router_sim_internal

using router_sim_internal::BasePolicy;
using router_sim_internal::HasOption;
using router_sim_internal::IsOracle;
using router_sim_internal::kDecodeTierSuffix;
using router_sim_internal::kTierSuffix;

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
  if (decision_replays < 1)
    return absl::InvalidArgumentError("--decision-replays must be at least 1");
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

}  // namespace pdserve::bench
