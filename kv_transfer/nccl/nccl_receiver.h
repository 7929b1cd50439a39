// The receiving side of the `nccl` KV transport on a decode worker: serves
// the control channel of each prefill worker that connects (one link per
// (prefill, decode) pair), joins that pair's communicator, and for every
// manifest posts one grouped receive into staging and, once its completion
// fires, hands each span to the worker's KvReceiver.
//
// KvReceiver stays the only place that validates and writes (receiver.h):
// every span is checked against its reservation (layer, logical block
// index, skipped blocks, exact lengths) and copied into the reserved block
// under the receiver's mutex, so no block is written after its reservation
// ended. Bytes for a span that fails the check were only ever in staging.
// Sizes are fixed before the receive is posted: both ends derive the span
// size from the layout the handshake compared, and a manifest larger than
// max_batch_bytes is refused without receiving anything.
//
// A link that closes, times out or speaks garbage ends every transfer still
// open on it as aborted, so the decode side's KvReceiver::Wait returns and
// the engine frees the blocks.
//
// Thread-safe. Each link runs on its own thread.
#pragma once

#include <list>
#include <memory>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv_transfer/nccl/communicator.h"
#include "kv_transfer/nccl/control_channel.h"
#include "kv_transfer/receiver.h"

namespace pdserve::kv_transfer::nccl {

struct NcclReceiverConfig {
  // Largest batch staged at once (data + scales, bytes). Advertised to
  // senders, which split larger SendLayers calls into batches that fit.
  uint64_t max_batch_bytes = uint64_t{256} << 20;
  // Bound on each wait for a sender: joining the communicator, and the bytes
  // of a manifest arriving after its receive was posted.
  absl::Duration timeout = absl::Seconds(60);

  absl::Status Validate() const;
};

class NcclKvReceiveEndpoint {
 public:
  // `receiver` and `comms` must outlive the endpoint. `config` must be valid.
  NcclKvReceiveEndpoint(KvReceiver* receiver, CommunicatorFactory* comms,
                        NcclReceiverConfig config = {});
  ~NcclKvReceiveEndpoint();  // Shutdown()

  // Serves one prefill worker's control channel until it closes. Returns at
  // once; the link runs on its own thread. After Shutdown the channel is
  // closed immediately.
  void Serve(std::unique_ptr<ControlChannel> channel);
  // Closes every link and waits for their threads; transfers still open end
  // as aborted. Idempotent.
  void Shutdown();
  int active_links() const;

 private:
  struct LinkThread {
    std::unique_ptr<ControlChannel> channel;
    std::thread thread;
    bool done = false;
  };
  void RunLink(LinkThread* link);
  void ReapFinishedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  KvReceiver* const receiver_;
  CommunicatorFactory* const comms_;
  const NcclReceiverConfig config_;
  mutable absl::Mutex mu_;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  std::list<LinkThread> links_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::kv_transfer::nccl
