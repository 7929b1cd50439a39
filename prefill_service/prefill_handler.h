// The prefill side of disaggregation: compute a prompt's KV (reusing this
// worker's prefix cache, so only the uncached suffix is computed), push the
// blocks the decode worker lacks into its reservation, and return the first
// sampled token. The blocks stay referenced until the transfer ends, then
// remain in this worker's prefix cache (LRU). Thread-safe: one handler
// serves all concurrent Prefill RPCs.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

#include "engine/engine_loop.h"
#include "kv_transfer/transfer_metrics.h"
#include "kv_transfer/transport.h"
#include "pdserve/v1/internal.pb.h"
#include "prefill_service/peer_pull.h"

namespace pdserve::prefill {

struct PrefillOptions {
  // Send layer l of the KV as soon as the forward pass wrote it (see
  // layer_streamer.h); otherwise everything is sent after the prefill.
  bool layerwise = true;
  // Per request: bytes queued for sending but not yet sent, at most.
  int64_t max_queued_bytes = int64_t{64} << 20;
  // Counts the bytes sent while the forward pass still ran; may be null.
  kv_transfer::TransferMetrics* metrics = nullptr;
  // Peer pull (peer_pull.h): serves PrefillRequest.peer_pull; null: such
  // requests recompute the prefix as if it were unset.
  PeerPuller* puller = nullptr;
  // Measured rates for WorkerStatus (may be null): prompt tokens computed per
  // second of prefill, and KV bytes per second of the sends that follow the
  // forward pass.
  RateMeter* prefill_rate = nullptr;
  RateMeter* transfer_rate = nullptr;
};

class PrefillHandler {
 public:
  PrefillHandler(engine::EngineLoop* loop, kv_transfer::KvTransport* transport,
                 kv_transfer::KvLayout layout, std::string worker_id,
                 PrefillOptions options = {})
      : loop_(loop),
        transport_(transport),
        layout_(std::move(layout)),
        worker_id_(std::move(worker_id)),
        options_(options) {}

  grpc::Status Prefill(grpc::ServerContext* context,
                       const v1::PrefillRequest& request,
                       v1::PrefillResponse* response);

 private:
  engine::EngineLoop* loop_;
  kv_transfer::KvTransport* transport_;
  const kv_transfer::KvLayout layout_;
  const std::string worker_id_;
  const PrefillOptions options_;
};

}  // namespace pdserve::prefill
