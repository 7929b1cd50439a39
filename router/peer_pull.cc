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
      default_transfer_bytes_per_second <= 0) {
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
  const PeerPullCandidate* best = nullptr;
  double best_transfer = 0;
  int32_t best_gain = 0;
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
    const double transfer = config.overhead_seconds +
                            static_cast<double>(gain) *
                                static_cast<double>(input.bytes_per_block) /
                                rate;
    if (best == nullptr || gain > best_gain ||
        (gain == best_gain && transfer < best_transfer)) {
      best = &c;
      best_gain = gain;
      best_transfer = transfer;
    }
  }
  if (best == nullptr) {
    d.reason = "no_holder";
    return d;
  }
  d.holder = best->index;
  d.holder_address = best->address;
  d.holder_id = best->id;
  d.blocks = std::min(best->leading_blocks, input.prompt_blocks);
  d.gain_blocks = best_gain;
  d.transfer_seconds = best_transfer;
  d.recompute_seconds =
      static_cast<double>(best_gain) * input.block_size / prefill_rate;
  d.pull = d.recompute_seconds > config.min_speedup * d.transfer_seconds;
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
