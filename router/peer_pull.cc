#include "router/peer_pull.h"

#include <algorithm>

namespace pdserve::router {

absl::Status PeerPullConfig::Validate() const {
  if (!(min_speedup > 0)) {
    return absl::InvalidArgumentError("--peer-pull-min-speedup must be > 0");
  }
  if (min_blocks < 1) {
    return absl::InvalidArgumentError("peer pull min_blocks must be >= 1");
  }
  if (overhead_seconds < 0 || default_prefill_tokens_per_second <= 0 ||
      default_transfer_bytes_per_second <= 0 || !(default_tier_load_cost > 0)) {
    return absl::InvalidArgumentError(
        "peer pull rates must be > 0 and the overhead >= 0");
  }
  return backoff.Validate();
}

PeerPullDecision DecidePeerPull(const PeerPullConfig& config,
                                const PeerPullInput& input) {
  PeerPullDecision d;
  if (!config.enabled) {
    d.reason = "disabled";
    return d;
  }
  const double prefill_rate = input.prefill_tokens_per_second > 0
                                  ? input.prefill_tokens_per_second
                                  : config.default_prefill_tokens_per_second;
  const double bs = static_cast<double>(input.block_size);
  // Reading `blocks` back from a tier measured at `rate` tokens/s.
  auto tier_seconds = [&](int32_t blocks, double rate) {
    if (blocks <= 0) return 0.0;
    const double tokens = static_cast<double>(blocks) * bs;
    return rate > 0 ? tokens / rate
                    : tokens / prefill_rate * config.default_tier_load_cost;
  };
  // The first `held` blocks without a pull: P's pool, then its own tier's
  // run, then recompute.
  auto without_pull = [&](int32_t held) {
    const int32_t own =
        std::clamp(input.prefill_tier_blocks, input.prefill_cached_blocks,
                   std::max(held, input.prefill_cached_blocks));
    return tier_seconds(own - input.prefill_cached_blocks,
                        input.prefill_tier_load_tokens_per_second) +
           static_cast<double>(std::max(0, held - own)) * bs / prefill_rate;
  };
  struct Option {
    const PeerPullCandidate* c = nullptr;
    int32_t gain = 0, tier = 0;
    double pull = 0, without = 0;
    bool passes = false;
    double saving() const { return without - pull; }
  };
  Option best;
  bool skipped_backed_off = false;
  for (const PeerPullCandidate& c : input.candidates) {
    if (c.index == input.prefill || !c.up || c.address.empty() ||
        !c.same_cache) {
      continue;
    }
    const int32_t held = std::min(c.leading_blocks, input.prompt_blocks);
    const int32_t gain = held - input.prefill_cached_blocks;
    if (gain < config.min_blocks) continue;
    if (c.backed_off) {
      skipped_backed_off = true;
      continue;
    }
    // The holder sends; until it has measured, P's own send rate over the
    // same transport is the next best guess.
    double rate = c.transfer_bytes_per_second;
    if (rate <= 0) rate = input.prefill_transfer_bytes_per_second;
    if (rate <= 0) rate = config.default_transfer_bytes_per_second;
    Option o;
    o.c = &c;
    o.gain = gain;
    // The tier part is the tail of what the holder holds.
    o.tier = std::clamp(c.tier_blocks - (c.leading_blocks - held), 0, gain);
    o.pull = config.overhead_seconds +
             tier_seconds(o.tier, c.tier_load_tokens_per_second) +
             static_cast<double>(gain) *
                 static_cast<double>(input.bytes_per_block) / rate;
    o.without = without_pull(held);
    o.passes = o.without > config.min_speedup * o.pull;
    if (best.c == nullptr || (o.passes && !best.passes) ||
        (o.passes == best.passes &&
         (o.saving() > best.saving() ||
          (o.saving() == best.saving() && o.gain > best.gain)))) {
      best = o;
    }
  }
  if (best.c == nullptr) {
    d.reason = skipped_backed_off ? "backed_off" : "no_holder";
    return d;
  }
  d.holder = best.c->index;
  d.holder_address = best.c->address;
  d.holder_id = best.c->id;
  d.blocks = std::min(best.c->leading_blocks, input.prompt_blocks);
  d.gain_blocks = best.gain;
  d.tier_blocks = best.tier;
  d.transfer_seconds = best.pull;
  d.recompute_seconds = best.without;
  d.pull = best.passes;
  if (!d.pull) d.reason = "not_faster";
  return d;
}

absl::Status PeerPullBackoffConfig::Validate() const {
  if (initial <= absl::ZeroDuration() || max < initial || max_holders < 1) {
    return absl::InvalidArgumentError(
        "peer pull backoff: initial must be > 0, max >= initial and "
        "max_holders >= 1");
  }
  return absl::OkStatus();
}

absl::Duration PeerPullBackoff::Failed(const std::string& holder,
                                       absl::Time now) {
  absl::MutexLock l(&mu_);
  if (!holders_.contains(holder) && holders_.size() >= config_.max_holders) {
    // Forget every holder whose backoff has ended; if none has, the one
    // ending soonest.
    for (auto it = holders_.begin(); it != holders_.end();) {
      if (it->second.until <= now) {
        holders_.erase(it++);
      } else {
        ++it;
      }
    }
    if (holders_.size() >= config_.max_holders) {
      auto soonest = holders_.begin();
      for (auto it = holders_.begin(); it != holders_.end(); ++it) {
        if (it->second.until < soonest->second.until) soonest = it;
      }
      holders_.erase(soonest);
    }
  }
  State& s = holders_[holder];
  s.failures = std::min(s.failures + 1, 30);
  absl::Duration d = config_.initial;
  for (int i = 1; i < s.failures && d < config_.max; ++i) d *= 2;
  d = std::min(d, config_.max);
  s.until = now + d;
  return d;
}

void PeerPullBackoff::Succeeded(const std::string& holder) {
  absl::MutexLock l(&mu_);
  holders_.erase(holder);
}

bool PeerPullBackoff::BackedOff(const std::string& holder,
                                absl::Time now) const {
  absl::MutexLock l(&mu_);
  auto it = holders_.find(holder);
  return it != holders_.end() && now < it->second.until;
}

size_t PeerPullBackoff::size() const {
  absl::MutexLock l(&mu_);
  return holders_.size();
}

int64_t BytesPerBlock(const v1::KvLayout& layout) {
  int64_t elem = 4;
  int64_t scales = 0;
  switch (layout.dtype()) {
    case v1::KV_DTYPE_FP16:
    case v1::KV_DTYPE_BF16:
      elem = 2;
      break;
    case v1::KV_DTYPE_INT8:
    case v1::KV_DTYPE_FP8_E4M3:
      elem = 1;
      scales = int64_t{2} * layout.kv_heads() * sizeof(float);
      break;
    default:
      elem = 4;
  }
  // MLA (kv_lora_rank > 0) keeps one latent row per token, no separate K
  // and V: kv_heads is 1 and head_dim the latent width (engine KvCacheSpec).
  const int64_t planes = layout.kv_lora_rank() > 0 ? 1 : 2;
  const int64_t per_layer = planes * layout.kv_heads() * layout.block_size() *
                                layout.head_dim() * elem +
                            scales;
  return per_layer * layout.num_layers();
}

}  // namespace pdserve::router
