// Layer-wise KV streaming for one prefill request: the engine thread reports
// each layer the forward pass has written (EngineRequest::on_layer_written),
// and the request's handler thread sends what became ready while the engine
// computes the next layers and chunks.
//
// A (layer, block) is queued once, when every token of the block has its
// K/V at that layer: a full block once the chunk covering its end was
// computed, the prompt's last (partial) block once the whole prompt was.
// Blocks the decode worker already holds (skip_blocks) are never sent; blocks
// served from this worker's own prefix cache are sent with the first layer
// reports. Each queued block is pinned (one BlockManager reference, taken on
// the engine thread) until Close, so preemption or eviction can never reuse
// it while it waits to be sent.
//
// The engine thread never waits on the network: when the queued-but-unsent
// bytes would exceed max_queued_bytes, a layer report is skipped; the next
// report of that layer, or SendRest at the end, picks its blocks up. Each
// (layer, block) is sent exactly once, as KvReceiver requires.
//
// Thread-safe: OnLayerWritten and Close run on the engine thread; the Send*
// calls on one handler thread.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "kv_transfer/transport.h"

namespace pdserve::prefill {

class LayerStreamer {
 public:
  struct Stats {
    uint64_t spans_streamed = 0;  // sent from the queue, during the prefill
    // Of those, sent before the forward pass wrote the prompt's last layer.
    uint64_t spans_before_forward_end = 0;
    uint64_t spans_at_end = 0;     // sent by SendRest
    uint64_t reports_skipped = 0;  // layer reports left for later (queue full)
  };

  // `span_bytes`: bytes of one (layer, block) (data + scales).
  LayerStreamer(int32_t num_layers, int32_t block_size, int32_t skip_blocks,
                int64_t span_bytes, int64_t max_queued_bytes);

  // Engine thread: the hook. Queues the (layer, block) spans `w` completed.
  void OnLayerWritten(const engine::LayerWritten& w,
                      engine::BlockManager& blocks) ABSL_LOCKS_EXCLUDED(mu_);

  // Handler thread: waits up to `wait` for queued spans (or the end of the
  // forward pass), then sends everything queued. Returns the send error.
  absl::Status SendQueued(kv_transfer::KvSendSession* session,
                          absl::Duration wait) ABSL_LOCKS_EXCLUDED(mu_);
  // True once the forward pass wrote the prompt's last layer.
  bool forward_done() const ABSL_LOCKS_EXCLUDED(mu_);
  // Handler thread, after the request finished with its blocks held
  // (`table`, by logical index): sends the queue and every span not sent yet.
  absl::Status SendRest(kv_transfer::KvSendSession* session,
                        std::span<const int32_t> table)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Engine thread: no report is taken after this. Returns the pinned blocks,
  // which the caller releases (Engine::ReleaseBlocks). Idempotent.
  std::vector<int32_t> Close() ABSL_LOCKS_EXCLUDED(mu_);

  Stats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Unit {
    int32_t layer;
    std::vector<kv_transfer::BlockRef> blocks;
    int64_t bytes;
  };

  const int32_t num_layers_, block_size_, skip_blocks_;
  const int64_t span_bytes_, max_queued_bytes_;
  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool forward_done_ ABSL_GUARDED_BY(mu_) = false;
  // Per layer: logical blocks below this were queued (or are skipped).
  std::vector<int32_t> queued_upto_ ABSL_GUARDED_BY(mu_);
  std::vector<Unit> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // queued or being sent
  absl::flat_hash_set<int32_t> pinned_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::prefill
