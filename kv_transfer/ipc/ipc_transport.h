// The same-node KV transports: `shm` (host pools) and `cuda_ipc` (GPU pools).
// The prefill worker writes the blocks the decode worker reserved straight
// into the decode worker's memory, mapped once per peer, instead of sending
// bytes over a socket. One implementation for both; the difference is the
// PeerMemoryBackend (peer_memory.h): memcpy into an mmapped memfd, or
// cudaMemcpyAsync into cudaIpcOpenMemHandle'd device memory.
//
// Safety (the transport contract, as for grpc and nccl):
// - The handshake (Open) compares the layouts with CheckLayouts
//   (FAILED_PRECONDITION naming each difference) before anything is mapped.
// - The sender only writes blocks the receiver named for this transfer: for
//   each batch it names (layer, logical block) spans in a Manifest; the
//   receiver's KvReceiver::WriteSpans validates them against the
//   reservation (layer range, logical index, skipped prefix blocks, each
//   span once) and answers with the physical block of each; the sender
//   checks every block against the exported geometry (KvExport::Validate
//   proved each layer's [0, num_blocks) lies inside its region) and copies
//   exactly data_bytes (+ scale_bytes) per span. Nothing else is written.
// - While the sender copies, the receiver holds those spans claimed
//   (KvReceiver: the reservation cannot end and its blocks cannot be freed)
//   until the sender reports Copied, the stream breaks (the peer died), or
//   `timeout` passes. A sender never starts a copy after its own deadline.
//   On timeout or a broken stream the reservation fails and is freed; the
//   sender's session fails and drops the peer's mapping.
//
// No fallback: where the peer's memory cannot be mapped (other node, other
// PID namespace, CUDA IPC unsupported) Open fails with UNAVAILABLE naming
// why, and the request fails like any other transfer failure (the router
// retries it). Start workers with --kv-transport grpc in such deployments.
//
// IpcKvTransport and IpcKvReceiveEndpoint are thread-safe; sessions are not
// (KvSendSession).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv_transfer/ipc/peer_memory.h"
#include "kv_transfer/nccl/control_channel.h"
#include "kv_transfer/receiver.h"
#include "kv_transfer/transfer_metrics.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv_transfer::ipc {

using nccl::ControlChannel;
using nccl::ControlChannelFactory;

struct IpcTransportConfig {
  // Bound on every wait for the receiver (its reply to Open, Manifest, End)
  // and on each batch's copies.
  absl::Duration timeout = absl::Seconds(60);
  // Largest batch of spans (data + scales, bytes) named in one Manifest.
  uint64_t max_batch_bytes = uint64_t{64} << 20;
  // Peers whose mappings are kept; beyond it the least recently used
  // mapping no session holds is unmapped (remapped on next use). Mapping a
  // new peer also unmaps idle ones whose storage is gone
  // (PeerMapping::PeerAlive).
  int max_peers = 16;
  // Tests: runs before each batch's copies (e.g. to stall or kill a sender
  // mid-transfer). May be null.
  std::function<void()> before_copy_for_test;

  absl::Status Validate() const;
};

class IpcKvTransport : public KvTransport {
 public:
  // `control` and `backend` must outlive the transport; `metrics` may be
  // null. `config` must be valid.
  IpcKvTransport(ControlChannelFactory* control, PeerMemoryBackend* backend,
                 TransferMetrics* metrics, IpcTransportConfig config = {});
  ~IpcKvTransport() override;

  const char* name() const override { return PeerMemoryName(backend_->kind()); }
  // The handshake and, on first use of a peer, its mapping:
  // FAILED_PRECONDITION on a layout mismatch or storage of the wrong memory
  // kind, NOT_FOUND for an unknown reservation, UNAVAILABLE when the peer
  // cannot be reached or mapped. No KV byte moves before it returns OK.
  absl::StatusOr<std::unique_ptr<KvSendSession>> Open(
      const SendPlan& plan, engine::KvStorage* storage) override;

  // Peers currently mapped.
  int num_mappings() const;
  // Times a peer was mapped (first use, a new export, or after eviction).
  int64_t num_maps() const;

  // A mapped peer; shared by the sessions writing into it.
  struct Peer;

 private:
  // Maps a new peer refusing any region of `own` (the sending storage).
  absl::StatusOr<std::shared_ptr<Peer>> PeerFor(const std::string& destination,
                                                const KvExport& exported,
                                                engine::KvStorage* own);
  void Forget(const std::string& destination, const Peer* peer);
  friend class IpcSendSession;

  ControlChannelFactory* const control_;
  PeerMemoryBackend* const backend_;
  TransferMetrics* const metrics_;
  const IpcTransportConfig config_;
  mutable absl::Mutex mu_;
  struct PeerSlot {
    std::shared_ptr<Peer> peer;
    uint64_t last_used = 0;
  };
  absl::flat_hash_map<std::string, PeerSlot> peers_ ABSL_GUARDED_BY(mu_);
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t maps_ ABSL_GUARDED_BY(mu_) = 0;
};

struct IpcReceiverConfig {
  // Bound on each wait for a sender: its Open, its next message, and the
  // Copied report of a batch whose spans are claimed.
  absl::Duration timeout = absl::Seconds(60);
  // Control streams served at once (one thread each). A stream past it is
  // answered RESOURCE_EXHAUSTED and closed before its Open is read, so a
  // peer that opens streams without end costs no thread. Each transfer in
  // flight holds one stream; 256 is far above what a decode worker's
  // reservations allow at once.
  int max_streams = 256;
  absl::Status Validate() const;
};

// The decode worker's side: exports its storage once (at construction) and
// serves each transfer's control stream on its own thread, at most
// config.max_streams at once; a finished stream's thread is joined and its
// channel freed at once (by a reaper thread), not when the next stream
// arrives.
class IpcKvReceiveEndpoint {
 public:
  // FAILED_PRECONDITION when `storage` cannot be exported through
  // `backend` (ExportStorage). `receiver`, `storage` and `backend` must
  // outlive the endpoint.
  static absl::StatusOr<std::unique_ptr<IpcKvReceiveEndpoint>> Create(
      KvReceiver* receiver, engine::KvStorage* storage,
      PeerMemoryBackend* backend, IpcReceiverConfig config = {});
  // Shutdown(), then stops exporting the storage (backend Unexport), so
  // peers see it gone (PeerMapping::PeerAlive) and unmap it.
  ~IpcKvReceiveEndpoint();

  // Serves one transfer's control stream until it ends. Returns at once.
  // After Shutdown the channel is closed immediately; past
  // config.max_streams it is answered RESOURCE_EXHAUSTED and closed.
  void Serve(std::unique_ptr<ControlChannel> channel);
  // Closes every stream and waits for their threads; transfers still open
  // end as failed (their reservations are freed). Idempotent.
  void Shutdown();
  int active_streams() const;
  // Stream threads not yet joined (running, or finished and about to be
  // reaped): what the endpoint holds. Tests.
  int held_streams() const;
  // Streams refused past config.max_streams.
  int64_t refused_streams() const;
  const KvExport& exported() const { return export_; }

 private:
  IpcKvReceiveEndpoint(KvReceiver* receiver, engine::KvStorage* storage,
                       PeerMemoryBackend* backend, KvExport exported,
                       IpcReceiverConfig config);
  struct StreamThread {
    std::unique_ptr<ControlChannel> channel;
    std::thread thread;
    bool done = false;
  };
  void StartStreamLocked(std::unique_ptr<ControlChannel> channel)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunStream(ControlChannel* channel);
  // The reaper thread: joins finished stream threads as they finish.
  void Reap();

  KvReceiver* const receiver_;
  engine::KvStorage* const storage_;
  PeerMemoryBackend* const backend_;
  const KvExport export_;
  const IpcReceiverConfig config_;
  mutable absl::Mutex mu_;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  std::list<StreamThread> streams_ ABSL_GUARDED_BY(mu_);
  int finished_ ABSL_GUARDED_BY(mu_) = 0;  // done, not yet joined
  // Refused channels, answered, closed at their deadline (or when more
  // than max_streams wait).
  static constexpr absl::Duration kRefusalGrace = absl::Seconds(1);
  std::deque<std::pair<absl::Time, std::unique_ptr<ControlChannel>>> parked_
      ABSL_GUARDED_BY(mu_);
  int64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread reaper_;
};

}  // namespace pdserve::kv_transfer::ipc
