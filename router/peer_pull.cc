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
  return absl::OkStatus();
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
  for (const PeerPullCandidate& c : input.candidates) {
    if (c.index == input.prefill || !c.up || c.address.empty() ||
        !c.same_cache) {
      continue;
    }
    const int32_t held = std::min(c.leading_blocks, input.prompt_blocks);
    const int32_t gain = held - input.prefill_cached_blocks;
    if (gain < config.min_blocks) continue;
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
    d.reason = "no_holder";
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
