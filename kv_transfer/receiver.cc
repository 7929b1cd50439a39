#include "kv_transfer/receiver.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace pdserve::kv_transfer {

KvReceiver::KvReceiver(engine::KvPool* pool, KvLayout layout,
                       ReceiverCounters counters)
    : pool_(pool), layout_(std::move(layout)), counters_(std::move(counters)) {}

uint64_t KvReceiver::Expect(const std::string& request_id,
                            std::vector<int32_t> blocks, int32_t skip_blocks) {
  absl::MutexLock l(&mu_);
  const uint64_t id = next_id_++;
  Pending p;
  p.request_id = request_id;
  p.skip_blocks =
      std::clamp<int32_t>(skip_blocks, 0, static_cast<int32_t>(blocks.size()));
  p.remaining = int64_t{layout_.num_layers} *
                (static_cast<int64_t>(blocks.size()) - p.skip_blocks);
  p.received.assign(static_cast<size_t>(layout_.num_layers) * blocks.size(), 0);
  p.blocks = std::move(blocks);
  p.started = p.last_progress = absl::Now();
  pending_.emplace(id, std::move(p));
  return id;
}

void KvReceiver::Fail(Pending* p, const std::string& reason,
                      const std::string& message) {
  if (!p->failed) {
    p->failed = true;
    p->error = message;
  }
  if (counters_.on_failure) counters_.on_failure(reason);
}

absl::Status KvReceiver::Begin(uint64_t reservation_id,
                               const std::string& request_id,
                               const KvLayout& sender) {
  absl::MutexLock l(&mu_);
  auto it = pending_.find(reservation_id);
  if (it == pending_.end() || it->second.request_id != request_id) {
    if (counters_.on_failure) counters_.on_failure("unknown_reservation");
    return absl::NotFoundError(absl::StrCat("no KV reservation ",
                                            reservation_id, " for request \"",
                                            request_id, "\""));
  }
  if (absl::Status s = CheckLayouts(sender, layout_); !s.ok()) {
    Fail(&it->second, "handshake", std::string(s.message()));
    return s;
  }
  return absl::OkStatus();
}

absl::Status KvReceiver::Write(uint64_t reservation_id, int32_t layer,
                               int32_t block_index, std::string_view data,
                               std::string_view scales) {
  return Write(reservation_id, layer, block_index,
               std::span<const std::string_view>(&data, 1),
               std::span<const std::string_view>(&scales, 1));
}

absl::Status KvReceiver::Write(uint64_t reservation_id, int32_t layer,
                               int32_t block_index,
                               std::span<const std::string_view> data_pieces,
                               std::span<const std::string_view> scale_pieces) {
  size_t data_size = 0, scale_size = 0;
  for (std::string_view p : data_pieces) data_size += p.size();
  for (std::string_view p : scale_pieces) scale_size += p.size();
  absl::MutexLock l(&mu_);
  auto it = pending_.find(reservation_id);
  if (it == pending_.end()) {
    if (counters_.on_failure) counters_.on_failure("unknown_reservation");
    return absl::NotFoundError(
        absl::StrCat("KV reservation ", reservation_id, " is not open"));
  }
  Pending& p = it->second;
  if (p.failed) return absl::AbortedError(p.error);
  const int32_t nblocks = static_cast<int32_t>(p.blocks.size());
  if (layer < 0 || layer >= layout_.num_layers || block_index < p.skip_blocks ||
      block_index >= nblocks) {
    const std::string msg =
        absl::StrCat("chunk (layer ", layer, ", block ", block_index,
                     ") is outside reservation ", reservation_id,
                     " (layers 0..", layout_.num_layers - 1, ", blocks ",
                     p.skip_blocks, "..", nblocks - 1, ")");
    Fail(&p, "out_of_range", msg);
    return absl::InvalidArgumentError(msg);
  }
  const engine::KvCacheSpec& spec = pool_->spec();
  const size_t want_scales =
      spec.dtype == DType::kI8 ? 2 * spec.num_kv_heads * sizeof(float) : 0;
  if (data_size != static_cast<size_t>(spec.LayerBlockBytes()) ||
      scale_size != want_scales) {
    const std::string msg =
        absl::StrCat("chunk (layer ", layer, ", block ", block_index, ") has ",
                     data_size, "+", scale_size, " bytes, expected ",
                     spec.LayerBlockBytes(), "+", want_scales);
    Fail(&p, "bad_length", msg);
    return absl::InvalidArgumentError(msg);
  }
  const int32_t physical = p.blocks[block_index];
  uint8_t* dst = pool_->LayerBlockData(layer, physical);
  for (std::string_view p : data_pieces) {
    std::memcpy(dst, p.data(), p.size());
    dst += p.size();
  }
  dst = reinterpret_cast<uint8_t*>(pool_->LayerBlockScales(layer, physical));
  for (std::string_view p : scale_pieces) {
    if (p.empty()) continue;
    std::memcpy(dst, p.data(), p.size());
    dst += p.size();
  }
  uint8_t& seen =
      p.received[static_cast<size_t>(layer) * nblocks + block_index];
  if (!seen) {
    seen = 1;
    --p.remaining;
  }
  p.last_progress = absl::Now();
  if (counters_.on_bytes) counters_.on_bytes(data_size + scale_size);
  return absl::OkStatus();
}

void KvReceiver::End(uint64_t reservation_id, bool ok) {
  absl::MutexLock l(&mu_);
  auto it = pending_.find(reservation_id);
  if (it == pending_.end()) return;
  if (!ok) {
    Fail(&it->second, "sender_aborted", "the sender aborted the transfer");
  } else if (it->second.remaining > 0 && !it->second.failed) {
    Fail(&it->second, "incomplete",
         absl::StrCat("the sender finished with ", it->second.remaining,
                      " (layer, block) spans missing"));
  }
}

absl::Status KvReceiver::Wait(uint64_t reservation_id,
                              absl::Duration stall_timeout,
                              absl::Time deadline) {
  absl::MutexLock l(&mu_);
  auto it = pending_.find(reservation_id);
  if (it == pending_.end())
    return absl::NotFoundError("KV reservation is not open");
  Pending* p = &it->second;
  p->waiting = true;
  absl::Status result;
  while (true) {
    if (p->failed) {
      result =
          absl::AbortedError(absl::StrCat("KV transfer failed: ", p->error));
      break;
    }
    if (p->remaining == 0) {
      if (counters_.on_complete)
        counters_.on_complete(absl::ToDoubleSeconds(absl::Now() - p->started));
      break;
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      if (counters_.on_failure) counters_.on_failure("deadline");
      result =
          absl::DeadlineExceededError("deadline passed while receiving KV");
      break;
    }
    if (now - p->last_progress >= stall_timeout) {
      if (counters_.on_failure) counters_.on_failure("timeout");
      result = absl::UnavailableError(absl::StrCat(
          "KV transfer stalled for ", absl::FormatDuration(stall_timeout)));
      break;
    }
    const absl::Time wake =
        std::min(deadline, p->last_progress + stall_timeout);
    mu_.AwaitWithDeadline(
        absl::Condition(
            +[](Pending* q) { return q->failed || q->remaining == 0; }, p),
        wake);
  }
  pending_.erase(it);
  return result;
}

void KvReceiver::Cancel(uint64_t reservation_id) {
  absl::MutexLock l(&mu_);
  auto it = pending_.find(reservation_id);
  if (it == pending_.end()) return;
  if (it->second.waiting) {
    // Wait() owns the entry: wake it, it ends the reservation.
    it->second.failed = true;
    it->second.error = "cancelled";
  } else {
    pending_.erase(it);
  }
}

int64_t KvReceiver::num_reservations() const {
  absl::MutexLock l(&mu_);
  return static_cast<int64_t>(pending_.size());
}

}  // namespace pdserve::kv_transfer
