// Peer pull: a prefill worker that the
// router told to pull a prompt prefix from another worker's pool (the
// holder) receives those blocks over the KV transport instead of recomputing
// them.
//
// Protocol (one unary RPC, Worker.PullBlocks, in the puller-reserves
// direction of the existing transfer): the puller P takes local blocks for
// the prefix it lacks (pinning the part it has, so the chain stays whole),
// registers them as a KvReceiver reservation, and calls PullBlocks on the
// holder H with their hashes and the reservation. H pins the leading blocks
// still in its pool; when the chain continues in H's KV tier (engine/
// kv_tier.h: blocks its pool evicted), H pins that run in the tier, takes
// free pool blocks and reads the records into them on the RPC thread (each
// checksum checked; the engine thread does no I/O), holding them like the
// pool's. With every block in hand, H pushes them with a KvSendSession of its
// own transport into P's reservation, gives them back (the tier's copies were
// never committed to H's pool: they return to its free list) and answers.
// When only the first k blocks can be served (the rest evicted, or a tier
// record missing, short or corrupt: the tier counts and drops it), H sends
// nothing and answers blocks_available = k (NOT_FOUND when k = 0); P then
// shrinks the pull to those k and asks again (at most 3 attempts), so it
// gets what is valid and recomputes the rest. P then commits the blocks to
// its prefix cache (a KV `stored` event), so the prefill that follows finds
// them as a prefix hit. Any failure (NOT_FOUND, a dead or slow holder, a
// transfer error, no free blocks on P) ends the pull: P cancels the
// reservation, frees the blocks and recomputes, so the output is the same
// either way and no block leaks on either side.
//
// Thread-safe: PeerPuller and PeerBlockHolder serve concurrent RPCs;
// RateMeter and PeerPullMetrics may be shared.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metric_handles.h"
#include "engine/engine_loop.h"
#include "kv_transfer/receiver.h"
#include "kv_transfer/transport.h"
#include "pdserve/v1/internal.grpc.pb.h"

namespace pdserve::prefill {

// An exponentially weighted rate (units per second) from (units, seconds)
// samples, for the measured rates a worker exports in WorkerStatus. 0 until
// the first sample.
class RateMeter {
 public:
  // `weight`: of the newest sample, in (0, 1].
  explicit RateMeter(double weight = 0.2) : weight_(weight) {}
  void Add(double units, double seconds) ABSL_LOCKS_EXCLUDED(mu_);
  double rate() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const double weight_;
  mutable absl::Mutex mu_;
  double rate_ ABSL_GUARDED_BY(mu_) = 0;
};

// The peer-pull metrics of one worker, registered once at start-up.
class PeerPullMetrics {
 public:
  // Puller outcomes (the `outcome` label of pdserve_kv_peer_pull_total).
  // kPartial: the holder still had only the first part of the prefix (the
  // rest evicted, or a bad tier record); that part was pulled, the rest
  // recomputed.
  enum Outcome {
    kPulled,
    kEvicted,
    kFailed,
    kNoBlocks,
    kLocal,
    kPartial,
    kNumOutcomes
  };
  static const char* OutcomeName(Outcome o);
  explicit PeerPullMetrics(metrics::Registry& r);
  void Count(Outcome o) { outcomes_[o]->Increment(); }
  double count(Outcome o) const { return outcomes_[o]->Value(); }
  metrics::Counter* blocks_pulled;
  metrics::Counter* bytes_pulled;
  // Holder side: pulls served by outcome ("sent" | "not_found" | "failed" |
  // "partial": only the first blocks were there, and the puller was told how
  // many), and blocks sent by source ("pool" | "tier").
  metrics::Counter* served_sent;
  metrics::Counter* served_not_found;
  metrics::Counter* served_failed;
  metrics::Counter* served_partial;
  metrics::Counter* served_pool_blocks;
  metrics::Counter* served_tier_blocks;

 private:
  metrics::Counter* outcomes_[kNumOutcomes];
};

// Holder side of Worker.PullBlocks.
class PeerBlockHolder {
 public:
  // `transfer_rate` (may be null) gets each pull's bytes and send time.
  // `metrics` may be null.
  PeerBlockHolder(engine::EngineLoop* loop, kv_transfer::KvTransport* transport,
                  kv_transfer::KvLayout layout, std::string worker_id,
                  RateMeter* transfer_rate, PeerPullMetrics* metrics)
      : loop_(loop),
        transport_(transport),
        layout_(std::move(layout)),
        worker_id_(std::move(worker_id)),
        transfer_rate_(transfer_rate),
        metrics_(metrics) {}

  grpc::Status PullBlocks(grpc::ServerContext* context,
                          const v1::PullBlocksRequest& request,
                          v1::PullBlocksResponse* response);

 private:
  engine::EngineLoop* loop_;
  kv_transfer::KvTransport* transport_;
  const kv_transfer::KvLayout layout_;
  const std::string worker_id_;
  RateMeter* transfer_rate_;
  PeerPullMetrics* metrics_;
};

struct PeerPullerOptions {
  std::string kv_address;  // this worker's KvTransfer (where H pushes)
  // Bound on one pull (the holder RPC and the transfer), within the request's
  // own deadline; past it the puller recomputes.
  absl::Duration timeout = absl::Seconds(5);
  PeerPullMetrics* metrics = nullptr;  // may be null
};

// Puller side: called by the prefill handler before it submits the prefill.
class PeerPuller {
 public:
  PeerPuller(engine::EngineLoop* loop, kv_transfer::KvReceiver* receiver,
             kv_transfer::KvLayout layout, PeerPullerOptions options)
      : loop_(loop),
        receiver_(receiver),
        layout_(std::move(layout)),
        options_(std::move(options)) {}

  // The blocks a pull left in this worker's cache, still referenced so that
  // they are not evicted before the prefill admits them; give them back with
  // Release once the prefill ended (however it ended).
  struct Pulled {
    std::vector<int32_t> held;  // the whole prefix, pulled or already local
    int32_t pulled_blocks = 0;
    PeerPullMetrics::Outcome outcome = PeerPullMetrics::kLocal;
  };
  // Pulls `request.peer_pull()`; never fails the request: on any failure
  // nothing is held and the prefill recomputes.
  Pulled Pull(grpc::ServerContext* context, const v1::PrefillRequest& request);
  void Release(const Pulled& pulled);

 private:
  std::shared_ptr<v1::Worker::Stub> HolderStub(const std::string& address)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Count(PeerPullMetrics::Outcome o) {
    if (options_.metrics) options_.metrics->Count(o);
  }

  engine::EngineLoop* loop_;
  kv_transfer::KvReceiver* receiver_;
  const kv_transfer::KvLayout layout_;
  const PeerPullerOptions options_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<v1::Worker::Stub>> stubs_
      ABSL_GUARDED_BY(mu_);
};

// 16 bytes, big-endian hi then lo (as in KvEventProto).
std::string BlockHashToBytes(const engine::BlockHash& h);
// False when `bytes` is not 16 bytes long.
bool BlockHashFromBytes(const std::string& bytes, engine::BlockHash* h);

}  // namespace pdserve::prefill
