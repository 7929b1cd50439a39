#include "prefill_service/layer_streamer.h"

#include <algorithm>
#include <utility>

namespace pdserve::prefill {

LayerStreamer::LayerStreamer(int32_t num_layers, int32_t block_size,
                             int32_t skip_blocks, int64_t span_bytes,
                             int64_t max_queued_bytes)
    : num_layers_(num_layers),
      block_size_(block_size),
      skip_blocks_(std::max(0, skip_blocks)),
      span_bytes_(span_bytes),
      max_queued_bytes_(max_queued_bytes),
      queued_upto_(static_cast<size_t>(num_layers), std::max(0, skip_blocks)) {}

void LayerStreamer::OnLayerWritten(const engine::LayerWritten& w,
                                   engine::BlockManager& blocks) {
  absl::MutexLock l(&mu_);
  if (closed_ || w.layer < 0 || w.layer >= num_layers_) return;
  const int32_t computed = std::min(w.num_computed, w.num_prompt);
  const bool whole_prompt = computed == w.num_prompt;
  if (whole_prompt && w.layer == num_layers_ - 1) forward_done_ = true;
  // Blocks whose every token has its K/V at this layer.
  int32_t complete = whole_prompt
                         ? (w.num_prompt + block_size_ - 1) / block_size_
                         : computed / block_size_;
  complete = std::min(complete, static_cast<int32_t>(w.blocks.size()));
  int32_t& upto = queued_upto_[w.layer];
  if (upto >= complete) return;
  const int64_t bytes = int64_t{complete - upto} * span_bytes_;
  if (queued_bytes_ + bytes > max_queued_bytes_) {
    ++stats_.reports_skipped;  // a later report or SendRest takes them
    return;
  }
  Unit unit{w.layer, {}, bytes};
  unit.blocks.reserve(complete - upto);
  std::vector<int32_t> pin;
  for (int32_t i = upto; i < complete; ++i) {
    const int32_t physical = w.blocks[i];
    unit.blocks.emplace_back(i, physical);
    if (pinned_.insert(physical).second) pin.push_back(physical);
  }
  blocks.Acquire(pin);
  upto = complete;
  queued_bytes_ += bytes;
  queue_.push_back(std::move(unit));
}

absl::Status LayerStreamer::SendQueued(kv_transfer::KvSendSession* session,
                                       absl::Duration wait) {
  std::vector<Unit> units;
  bool before_end;
  {
    absl::MutexLock l(&mu_);
    mu_.AwaitWithTimeout(
        absl::Condition(
            +[](LayerStreamer* s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
              return !s->queue_.empty() || s->forward_done_ || s->closed_;
            },
            this),
        wait);
    units.swap(queue_);
    before_end = !forward_done_;
  }
  absl::Status status;
  uint64_t spans = 0;
  int64_t bytes = 0;
  for (const Unit& unit : units) {
    if (status.ok()) {
      status = session->SendBlocks(unit.layer, unit.layer + 1, unit.blocks);
      if (status.ok()) spans += unit.blocks.size();
    }
    bytes += unit.bytes;
  }
  absl::MutexLock l(&mu_);
  queued_bytes_ -= bytes;
  stats_.spans_streamed += spans;
  if (before_end) stats_.spans_before_forward_end += spans;
  return status;
}

bool LayerStreamer::forward_done() const {
  absl::MutexLock l(&mu_);
  return forward_done_;
}

absl::Status LayerStreamer::SendRest(kv_transfer::KvSendSession* session,
                                     std::span<const int32_t> table) {
  // The request finished, so no report comes any more: the queue is final.
  if (absl::Status s = SendQueued(session, absl::ZeroDuration()); !s.ok()) {
    return s;
  }
  std::vector<int32_t> from;
  {
    absl::MutexLock l(&mu_);
    from = queued_upto_;
  }
  const int32_t n = static_cast<int32_t>(table.size());
  uint64_t spans = 0;
  // Consecutive layers that miss the same blocks go in one call.
  for (int32_t first = 0; first < num_layers_;) {
    int32_t last = first + 1;
    while (last < num_layers_ && from[last] == from[first]) ++last;
    if (from[first] < n) {
      std::vector<kv_transfer::BlockRef> refs;
      for (int32_t i = from[first]; i < n; ++i) refs.emplace_back(i, table[i]);
      if (absl::Status s = session->SendBlocks(first, last, refs); !s.ok()) {
        return s;
      }
      spans += static_cast<uint64_t>(last - first) * refs.size();
    }
    first = last;
  }
  absl::MutexLock l(&mu_);
  std::fill(queued_upto_.begin(), queued_upto_.end(),
            std::max(n, skip_blocks_));
  stats_.spans_at_end += spans;
  return absl::OkStatus();
}

std::vector<int32_t> LayerStreamer::Close() {
  absl::MutexLock l(&mu_);
  closed_ = true;
  std::vector<int32_t> out(pinned_.begin(), pinned_.end());
  pinned_.clear();
  return out;
}

LayerStreamer::Stats LayerStreamer::stats() const {
  absl::MutexLock l(&mu_);
  return stats_;
}

}  // namespace pdserve::prefill
