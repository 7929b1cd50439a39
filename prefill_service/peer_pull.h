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
// either way and no block leaks on either side. P reports how the pull ended
// in its PrefillResponse (peer_pull_outcome), which the decode worker passes
// on to the router, so that the router backs off a holder whose pulls fail.
//
// What the holder checks before it pins anything (its caller is untrusted):
// the router's grant (wire/peer_pull_grant.h: signed by a router that polled
// this worker, naming this worker as the holder, not expired, for this pull's
// request and covering its blocks), and it pushes only to the grant's puller
// address, the puller's address in the router's registry: a kv_destination
// naming anything else is PERMISSION_DENIED. At most max_concurrent_pulls
// pulls are served at once and at most max_blocks_per_pull blocks per call;
// past either it answers RESOURCE_EXHAUSTED before pinning a block, so pulls
// cannot starve the holder's own admission.
//
// Thread-safe: PeerPuller and PeerBlockHolder serve concurrent RPCs;
// RateMeter and PeerPullMetrics may be shared.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <functional>
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
#include "wire/peer_pull_grant.h"

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
  // Refused before pinning anything: a grant that does not verify or a
  // destination other than the grant's ("refused"), or past the caps
  // ("busy").
  metrics::Counter* served_refused;
  metrics::Counter* served_busy;
  metrics::Counter* served_pool_blocks;
  metrics::Counter* served_tier_blocks;

 private:
  metrics::Counter* outcomes_[kNumOutcomes];
};

struct PeerBlockHolderConfig {
  // This worker's address as routers know it (grants name the holder by it).
  std::string address;
  // The keys grants are checked against (filled from the routers' polls).
  // Required; must outlive the holder.
  const wire::PeerPullKeys* keys = nullptr;
  // Pulls served at once; more are RESOURCE_EXHAUSTED at once.
  int32_t max_concurrent_pulls = 4;
  // Blocks one call may ask for; more is RESOURCE_EXHAUSTED. Also never more
  // than the pool.
  int32_t max_blocks_per_pull = 1024;
  // Tests only: runs once a pull holds its blocks, before it sends them.
  std::function<void()> before_send_for_test;

  absl::Status Validate() const;
};

// Holder side of Worker.PullBlocks.
class PeerBlockHolder {
 public:
  // `transfer_rate` (may be null) gets each pull's bytes and send time.
  // `metrics` may be null. `config` must be valid.
  PeerBlockHolder(engine::EngineLoop* loop, kv_transfer::KvTransport* transport,
                  kv_transfer::KvLayout layout, std::string worker_id,
                  RateMeter* transfer_rate, PeerPullMetrics* metrics,
                  PeerBlockHolderConfig config)
      : loop_(loop),
        transport_(transport),
        layout_(std::move(layout)),
        worker_id_(std::move(worker_id)),
        transfer_rate_(transfer_rate),
        metrics_(metrics),
        config_(std::move(config)) {}

  grpc::Status PullBlocks(grpc::ServerContext* context,
                          const v1::PullBlocksRequest& request,
                          v1::PullBlocksResponse* response);

  // Pulls being served now.
  int32_t active_pulls() const { return active_.load(); }
  int32_t max_blocks_per_pull() const { return config_.max_blocks_per_pull; }

 private:
  // The checks before anything is pinned; OK or the status to answer.
  grpc::Status Admit(const v1::PullBlocksRequest& request);
  grpc::Status Serve(grpc::ServerContext* context,
                     const v1::PullBlocksRequest& request,
                     v1::PullBlocksResponse* response);

  engine::EngineLoop* loop_;
  kv_transfer::KvTransport* transport_;
  const kv_transfer::KvLayout layout_;
  const std::string worker_id_;
  RateMeter* transfer_rate_;
  PeerPullMetrics* metrics_;
  const PeerBlockHolderConfig config_;
  std::atomic<int32_t> active_{0};
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
    // For the router (PrefillResponse.peer_pull_outcome); NONE when no pull
    // was asked for.
    v1::PeerPullOutcome report = v1::PEER_PULL_OUTCOME_NONE;
  };
  // Pulls `request.peer_pull()`; never fails the request: on any failure
  // nothing is held and the prefill recomputes.
  Pulled Pull(grpc::ServerContext* context, const v1::PrefillRequest& request);
  void Release(const Pulled& pulled);

  // Holder stubs kept (one channel each). A holder whose call fails as
  // unreachable is dropped at once; past kMaxHolderStubs an arbitrary one is
  // dropped, so churn of holder addresses cannot grow the map.
  static constexpr size_t kMaxHolderStubs = 64;
  size_t num_holder_stubs() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void ForgetHolder(const std::string& address) ABSL_LOCKS_EXCLUDED(mu_);
  std::shared_ptr<v1::Worker::Stub> HolderStub(const std::string& address)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Count(PeerPullMetrics::Outcome o) {
    if (options_.metrics) options_.metrics->Count(o);
  }

  engine::EngineLoop* loop_;
  kv_transfer::KvReceiver* receiver_;
  const kv_transfer::KvLayout layout_;
  const PeerPullerOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<v1::Worker::Stub>> stubs_
      ABSL_GUARDED_BY(mu_);
};

// 16 bytes, big-endian hi then lo (as in KvEventProto).
std::string BlockHashToBytes(const engine::BlockHash& h);
// False when `bytes` is not 16 bytes long.
bool BlockHashFromBytes(const std::string& bytes, engine::BlockHash* h);

}  // namespace pdserve::prefill
