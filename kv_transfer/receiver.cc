#include "kv_transfer/receiver.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pdserve::kv_transfer {
namespace {

// Pending::received values.
constexpr uint8_t kMissing = 0, kWriting = 1, kWritten = 2;

}  // namespace

KvReceiver::KvReceiver(engine::KvStorage* pool, KvLayout layout,
                       ReceiverCounters counters)
    : storage_(pool),
      layout_(std::move(layout)),
      counters_(std::move(counters)) {}

uint64_t KvReceiver::Expect(const std::string& request_id,
                            std::vector<int32_t> blocks, int32_t skip_blocks) {
  auto p = std::make_shared<Pending>();
  p->request_id = request_id;
  p->skip_blocks =
      std::clamp<int32_t>(skip_blocks, 0, static_cast<int32_t>(blocks.size()));
  p->started = absl::Now();
  {
    absl::MutexLock pl(&p->mu);
    p->remaining = int64_t{layout_.num_layers} *
                   (static_cast<int64_t>(blocks.size()) - p->skip_blocks);
    p->received.assign(static_cast<size_t>(layout_.num_layers) * blocks.size(),
                       kMissing);
    p->last_progress = p->started;
  }
  p->blocks = std::move(blocks);
  absl::MutexLock l(&mu_);
  const uint64_t id = next_id_++;
  pending_.emplace(id, std::move(p));
  return id;
}

std::shared_ptr<KvReceiver::Pending> KvReceiver::Find(
    uint64_t reservation_id) const {
  absl::MutexLock l(&mu_);
  auto it = pending_.find(reservation_id);
  return it == pending_.end() ? nullptr : it->second;
}

void KvReceiver::Remove(uint64_t reservation_id) {
  absl::MutexLock l(&mu_);
  pending_.erase(reservation_id);
}

void KvReceiver::Fail(Pending* p, const std::string& reason,
                      const std::string& message) {
  if (!p->failed) {
    p->failed = true;
    p->error = message;
  }
  if (counters_.on_failure) counters_.on_failure(reason);
}

void KvReceiver::EndWrites(Pending* p) {
  p->ended = true;
  p->mu.Await(absl::Condition(
      +[](Pending* q)
           ABSL_NO_THREAD_SAFETY_ANALYSIS { return q->writers == 0; },
      p));
}

absl::Status KvReceiver::Begin(uint64_t reservation_id,
                               const std::string& request_id,
                               const KvLayout& sender) {
  std::shared_ptr<Pending> p = Find(reservation_id);
  if (p == nullptr || p->request_id != request_id) {
    if (counters_.on_failure) counters_.on_failure("unknown_reservation");
    return absl::NotFoundError(absl::StrCat("no KV reservation ",
                                            reservation_id, " for request \"",
                                            request_id, "\""));
  }
  if (absl::Status s = CheckLayouts(sender, layout_); !s.ok()) {
    absl::MutexLock l(&p->mu);
    Fail(p.get(), "handshake", std::string(s.message()));
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

absl::StatusOr<KvReceiver::Claim> KvReceiver::ClaimSpan(
    uint64_t reservation_id, Pending* p, int32_t layer, int32_t block_index,
    size_t data_size, size_t scale_size) {
  const auto not_open = [&] {
    if (counters_.on_failure) counters_.on_failure("unknown_reservation");
    return absl::NotFoundError(
        absl::StrCat("KV reservation ", reservation_id, " is not open"));
  };
  const int32_t nblocks = static_cast<int32_t>(p->blocks.size());
  absl::MutexLock l(&p->mu);
  if (p->failed) return absl::AbortedError(p->error);
  if (p->ended) return not_open();
  if (layer < 0 || layer >= layout_.num_layers ||
      block_index < p->skip_blocks || block_index >= nblocks) {
    const std::string msg =
        absl::StrCat("chunk (layer ", layer, ", block ", block_index,
                     ") is outside reservation ", reservation_id,
                     " (layers 0..", layout_.num_layers - 1, ", blocks ",
                     p->skip_blocks, "..", nblocks - 1, ")");
    Fail(p, "out_of_range", msg);
    return absl::InvalidArgumentError(msg);
  }
  const engine::KvCacheSpec& spec = storage_->spec();
  const size_t want_scales =
      DTypeHasScales(spec.dtype) ? 2 * spec.num_kv_heads * sizeof(float) : 0;
  if (data_size != static_cast<size_t>(spec.LayerBlockBytes()) ||
      scale_size != want_scales) {
    const std::string msg =
        absl::StrCat("chunk (layer ", layer, ", block ", block_index, ") has ",
                     data_size, "+", scale_size, " bytes, expected ",
                     spec.LayerBlockBytes(), "+", want_scales);
    Fail(p, "bad_length", msg);
    return absl::InvalidArgumentError(msg);
  }
  Claim c;
  c.slot = static_cast<size_t>(layer) * nblocks + block_index;
  if (p->received[c.slot] == kWriting) {
    // Two copies into one span at once: only a broken or hostile sender
    // does that, and the bytes would be a mix of both.
    const std::string msg =
        absl::StrCat("chunk (layer ", layer, ", block ", block_index,
                     ") arrived again while it was being written");
    Fail(p, "duplicate", msg);
    return absl::InvalidArgumentError(msg);
  }
  c.first_copy = p->received[c.slot] == kMissing;
  p->received[c.slot] = kWriting;
  ++p->writers;
  // The span is this reservation's (checked above) and stays reserved: the
  // reservation cannot end while `writers` > 0.
  c.layer = layer;
  c.physical = p->blocks[block_index];
  c.bytes = data_size + scale_size;
  return c;
}

void KvReceiver::Commit(Pending* p, const Claim& c,
                        const absl::Status& copied) {
  if (copied.ok() && counters_.on_bytes) counters_.on_bytes(c.bytes);
  absl::MutexLock l(&p->mu);
  --p->writers;
  if (!copied.ok()) {
    p->received[c.slot] = kMissing;
    Fail(p, "copy_failed", std::string(copied.message()));
    return;
  }
  p->received[c.slot] = kWritten;
  if (c.first_copy) --p->remaining;
  p->last_progress = absl::Now();
}

absl::Status KvReceiver::Write(uint64_t reservation_id, int32_t layer,
                               int32_t block_index,
                               std::span<const std::string_view> data_pieces,
                               std::span<const std::string_view> scale_pieces) {
  size_t data_size = 0, scale_size = 0;
  for (std::string_view piece : data_pieces) data_size += piece.size();
  for (std::string_view piece : scale_pieces) scale_size += piece.size();
  std::shared_ptr<Pending> found = Find(reservation_id);
  if (found == nullptr) {
    if (counters_.on_failure) counters_.on_failure("unknown_reservation");
    return absl::NotFoundError(
        absl::StrCat("KV reservation ", reservation_id, " is not open"));
  }
  ASSIGN_OR_RETURN(const Claim claim,
                   ClaimSpan(reservation_id, found.get(), layer, block_index,
                             data_size, scale_size));
  // Outside every lock.
  const absl::Status copied =
      CopyIntoSpan(claim.layer, claim.physical, data_pieces, scale_pieces);
  Commit(found.get(), claim, copied);
  return copied;
}

absl::Status KvReceiver::WriteSpans(
    uint64_t reservation_id, std::span<const SpanRef> spans,
    absl::FunctionRef<absl::Status(std::span<const engine::KvSpan>)> copy) {
  std::shared_ptr<Pending> found = Find(reservation_id);
  if (found == nullptr) {
    if (counters_.on_failure) counters_.on_failure("unknown_reservation");
    return absl::NotFoundError(
        absl::StrCat("KV reservation ", reservation_id, " is not open"));
  }
  const engine::KvCacheSpec& spec = storage_->spec();
  const size_t data_size = static_cast<size_t>(spec.LayerBlockBytes());
  const size_t scale_size =
      DTypeHasScales(spec.dtype) ? 2 * spec.num_kv_heads * sizeof(float) : 0;
  std::vector<Claim> claims;
  std::vector<engine::KvSpan> targets;
  claims.reserve(spans.size());
  targets.reserve(spans.size());
  absl::Status status;
  for (const SpanRef& s : spans) {
    absl::StatusOr<Claim> c = ClaimSpan(reservation_id, found.get(), s.layer,
                                        s.block_index, data_size, scale_size);
    if (!c.ok()) {
      status = c.status();
      break;
    }
    claims.push_back(*c);
    targets.push_back(storage_->Span(c->layer, c->physical));
  }
  // One copy for the whole batch (e.g. one device stream synchronisation),
  // outside every lock, while every claimed span counts as being written.
  if (status.ok()) status = copy(targets);
  for (const Claim& c : claims) {
    // A claim refused mid-batch fails the reservation; the spans claimed
    // before it are released unwritten.
    Commit(found.get(), c,
           status.ok() ? absl::OkStatus()
                       : absl::AbortedError(std::string(status.message())));
  }
  return status;
}

absl::Status KvReceiver::CopyIntoSpan(
    int32_t layer, int32_t physical, std::span<const std::string_view> data,
    std::span<const std::string_view> scales) {
  const engine::KvSpan span = storage_->Span(layer, physical);
  if (span.memory.kind == engine::MemoryKind::kHost) {
    uint8_t* dst = static_cast<uint8_t*>(span.data);
    for (std::string_view piece : data) {
      std::memcpy(dst, piece.data(), piece.size());
      dst += piece.size();
    }
    dst = reinterpret_cast<uint8_t*>(span.scales);
    for (std::string_view piece : scales) {
      if (piece.empty()) continue;
      std::memcpy(dst, piece.data(), piece.size());
      dst += piece.size();
    }
    return absl::OkStatus();
  }
  // Device memory: one contiguous host image of the span, one device copy
  // (a span that arrived in one piece is copied from where it lies).
  auto contiguous = [](std::span<const std::string_view> pieces,
                       std::string* scratch) -> const void* {
    if (pieces.size() == 1) return pieces[0].data();
    scratch->clear();
    for (std::string_view piece : pieces) scratch->append(piece);
    return scratch->data();
  };
  thread_local std::string data_scratch, scale_scratch;
  const void* d = contiguous(data, &data_scratch);
  const void* s =
      span.scale_bytes > 0 ? contiguous(scales, &scale_scratch) : nullptr;
  return storage_->CopyFromHost(layer, physical, d, s);
}

void KvReceiver::End(uint64_t reservation_id, bool ok) {
  std::shared_ptr<Pending> p = Find(reservation_id);
  if (p == nullptr) return;
  absl::MutexLock l(&p->mu);
  if (!ok) {
    Fail(p.get(), "sender_aborted", "the sender aborted the transfer");
  } else if (p->remaining > 0 && !p->failed) {
    Fail(p.get(), "incomplete",
         absl::StrCat("the sender finished with ", p->remaining,
                      " (layer, block) spans missing"));
  }
}

absl::Status KvReceiver::Wait(uint64_t reservation_id,
                              absl::Duration stall_timeout, absl::Time deadline,
                              const std::function<bool()>& cancelled) {
  std::shared_ptr<Pending> found = Find(reservation_id);
  if (found == nullptr)
    return absl::NotFoundError("KV reservation is not open");
  Pending* p = found.get();
  absl::Status result;
  {
    absl::MutexLock l(&p->mu);
    if (p->ended) return absl::NotFoundError("KV reservation is not open");
    p->waiting = true;
    while (true) {
      if (p->failed) {
        result =
            absl::AbortedError(absl::StrCat("KV transfer failed: ", p->error));
        break;
      }
      if (p->remaining == 0) {
        if (counters_.on_complete) {
          counters_.on_complete(
              absl::ToDoubleSeconds(absl::Now() - p->started));
        }
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
      if (cancelled && cancelled()) {
        result = absl::CancelledError("cancelled while receiving KV");
        break;
      }
      absl::Time wake = std::min(deadline, p->last_progress + stall_timeout);
      if (cancelled) wake = std::min(wake, now + absl::Milliseconds(50));
      p->mu.AwaitWithDeadline(
          absl::Condition(
              +[](Pending* q) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                return q->failed || q->remaining == 0;
              },
              p),
          wake);
    }
    EndWrites(p);
  }
  Remove(reservation_id);
  return result;
}

void KvReceiver::Cancel(uint64_t reservation_id) {
  std::shared_ptr<Pending> p = Find(reservation_id);
  if (p == nullptr) return;
  bool waiting;
  {
    absl::MutexLock l(&p->mu);
    waiting = p->waiting;
    if (waiting && !p->failed) {
      // Wait() owns the entry: wake it, it removes the reservation.
      p->failed = true;
      p->error = "cancelled";
    }
    EndWrites(p.get());
  }
  if (!waiting) Remove(reservation_id);
}

int64_t KvReceiver::num_reservations() const {
  absl::MutexLock l(&mu_);
  return static_cast<int64_t>(pending_.size());
}

}  // namespace pdserve::kv_transfer
