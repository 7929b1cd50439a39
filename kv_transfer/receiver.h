// The receiving side of KV transfer, shared by every backend: reservations,
// per-chunk validation, completion and timeouts.
//
// Safety (contract): a chunk is written only if its reservation exists, its
// layout matched at the handshake, its layer and logical block index lie in
// what was reserved (and not in the leading blocks the receiver already had),
// and its byte lengths are exact. Anything else is rejected and counted. A
// reservation ends exactly once: complete, failed, timed out or cancelled;
// after that no chunk for it is written, so the engine may free its blocks.
//
// Thread-safe. Each reservation has its own lock: the map of reservations is
// locked only to look one up, and chunk copies run outside every lock, so
// transfers into different reservations (and spans of one reservation)
// proceed in parallel. A copy registers as a writer of its reservation before
// it starts; ending a reservation (Wait, Cancel) first forbids new writers and
// then waits for those in progress, so a block is never written after its
// reservation ended and the engine may free it as soon as Wait or Cancel
// returns.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv_cache/kv_cache.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv_transfer {

// Failure reasons, also the `reason` label of
// pdserve_kv_transfer_failures_total.
struct ReceiverCounters {
  std::function<void(const std::string& reason)> on_failure;  // may be null
  // Runs after a span's bytes were copied, while the span still counts as
  // being written (its reservation cannot end until this returns).
  std::function<void(uint64_t bytes)> on_bytes;     // may be null
  std::function<void(double seconds)> on_complete;  // may be null
};

class KvReceiver {
 public:
  // `storage` holds the reserved blocks: host memory (spans written with
  // memcpy) or device memory (each span assembled in host memory, then one
  // device copy).
  KvReceiver(engine::KvStorage* storage, KvLayout layout,
             ReceiverCounters counters = {});

  const KvLayout& layout() const { return layout_; }
  // Where the reserved blocks live (host, or a device).
  engine::KvMemory storage_memory() const { return storage_->memory(); }

  // Registers a reservation: `blocks` are the receiver's physical blocks by
  // logical index; indices below `skip_blocks` are already present. Returns
  // the reservation id the sender must quote.
  uint64_t Expect(const std::string& request_id, std::vector<int32_t> blocks,
                  int32_t skip_blocks);

  // Called by a transport when a stream opens: checks the reservation and
  // the layouts (FAILED_PRECONDITION with both values on mismatch).
  absl::Status Begin(uint64_t reservation_id, const std::string& request_id,
                     const KvLayout& sender);
  // Validates and writes one (layer, block) span.
  absl::Status Write(uint64_t reservation_id, int32_t layer,
                     int32_t block_index, std::string_view data,
                     std::string_view scales);
  // The same for a span whose bytes arrive in pieces (e.g. the slices a
  // network read produced); the pieces' sizes add up to the span's. Copies
  // each piece straight into the block.
  absl::Status Write(uint64_t reservation_id, int32_t layer,
                     int32_t block_index,
                     std::span<const std::string_view> data,
                     std::span<const std::string_view> scales);
  // A (layer, logical block index) of a reservation.
  struct SpanRef {
    int32_t layer = 0;
    int32_t block_index = 0;
  };
  // For transports that move bytes themselves (e.g. from a device staging
  // buffer with device copies): validates every span like Write and marks it
  // as being written, then calls `copy(targets)` once, outside every lock,
  // with the storage spans to fill, in order. `copy` must have finished
  // writing (device work synchronised) when it returns. On any refusal or a
  // failed copy the reservation fails and nothing is marked written.
  absl::Status WriteSpans(
      uint64_t reservation_id, std::span<const SpanRef> spans,
      absl::FunctionRef<absl::Status(std::span<const engine::KvSpan>)> copy);

  // The sender ended its stream (ok = it believes everything was sent).
  void End(uint64_t reservation_id, bool ok);

  // Blocks until every expected (layer, block) arrived, or the reservation
  // failed, or no progress for `stall_timeout`, or `deadline` passed, or
  // `cancelled` (may be null; polled every 50 ms, must not block) returns
  // true: then CANCELLED, so that a request whose client went away gives its
  // blocks back at once rather than after the stall timeout. Always ends the
  // reservation, and returns only once no copy into its blocks is in
  // progress.
  absl::Status Wait(uint64_t reservation_id, absl::Duration stall_timeout,
                    absl::Time deadline,
                    const std::function<bool()>& cancelled = {});
  // Ends a reservation early; returns once no copy into its blocks is in
  // progress (a copy is one span: this waits microseconds, not for a sender).
  // Idempotent; unknown ids are ignored.
  void Cancel(uint64_t reservation_id);

  int64_t num_reservations() const;

 private:
  struct Pending {
    // Set by Expect and never changed: read without `mu`.
    std::string request_id;
    std::vector<int32_t> blocks;
    int32_t skip_blocks = 0;
    absl::Time started;

    absl::Mutex mu;
    // [layer][block]: kMissing, kWriting (a copy is in progress) or kWritten.
    std::vector<uint8_t> received ABSL_GUARDED_BY(mu);
    int64_t remaining ABSL_GUARDED_BY(mu) = 0;  // spans still kMissing
    absl::Time last_progress ABSL_GUARDED_BY(mu);
    bool failed ABSL_GUARDED_BY(mu) = false;
    bool waiting ABSL_GUARDED_BY(mu) = false;  // a Wait() call owns the entry
    bool ended ABSL_GUARDED_BY(mu) = false;    // no copy may start any more
    int32_t writers ABSL_GUARDED_BY(mu) = 0;   // copies in progress
    std::string error ABSL_GUARDED_BY(mu);
  };
  std::shared_ptr<Pending> Find(uint64_t reservation_id) const
      ABSL_LOCKS_EXCLUDED(mu_);
  void Remove(uint64_t reservation_id) ABSL_LOCKS_EXCLUDED(mu_);
  void Fail(Pending* p, const std::string& reason, const std::string& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu);
  // A span a writer has claimed: validated, marked kWriting, counted in
  // `writers`.
  struct Claim {
    size_t slot = 0;
    int32_t layer = 0;
    int32_t physical = 0;
    size_t bytes = 0;
    bool first_copy = false;
  };
  absl::StatusOr<Claim> ClaimSpan(uint64_t reservation_id, Pending* p,
                                  int32_t layer, int32_t block_index,
                                  size_t data_size, size_t scale_size)
      ABSL_LOCKS_EXCLUDED(p->mu);
  // Ends a claim: written if `copied` is OK, else the reservation fails.
  void Commit(Pending* p, const Claim& c, const absl::Status& copied)
      ABSL_LOCKS_EXCLUDED(p->mu);
  // Copies one validated span's pieces into (layer, physical) of storage_.
  absl::Status CopyIntoSpan(int32_t layer, int32_t physical,
                            std::span<const std::string_view> data,
                            std::span<const std::string_view> scales);
  // Forbids new copies into `p` and waits until those in progress are done.
  static void EndWrites(Pending* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu);

  engine::KvStorage* storage_;
  const KvLayout layout_;
  ReceiverCounters counters_;
  // Guards only the map; never held during a copy or while a Pending's `mu`
  // is held (lock order: mu_ is never acquired under Pending::mu).
  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Pending>> pending_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::kv_transfer
