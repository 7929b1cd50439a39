// The production control plane of the `nccl` KV transport: a ControlChannel
// (control_channel.h) over the internal KvTransfer.Control bidirectional
// gRPC stream, one stream per (prefill, decode) link. Each control message
// travels as one KvControlFrame; gRPC gives the order and reliability the
// protocol needs. KV bytes never travel here (they go over the
// Communicator).
//
// GrpcControlChannelFactory is the sending side's (prefill worker's)
// factory: Connect opens a stream to the decode worker's gRPC server.
// NcclKvTransferService is the decode worker's KvTransfer service: Push as
// KvTransferService, and Control handing each stream to an
// NcclKvReceiveEndpoint.
//
// Thread-safety: as ControlChannel (Send and Receive from different threads,
// Close from any); the factory and the service are thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/time/time.h"
#include "kv_transfer/grpc/grpc_transport.h"
#include "kv_transfer/nccl/control_channel.h"
#include "kv_transfer/nccl/nccl_receiver.h"
#include "pdserve/v1/internal.grpc.pb.h"

namespace pdserve::kv_transfer::nccl {

// Bounds on the frames either end of a control stream reads ahead of
// Receive. A stream's reader thread queues each frame it reads; once the
// queue holds max_messages frames or max_bytes bytes it stops reading
// (backpressure: gRPC flow control then stalls the peer's writes) until
// Receive makes room. If no room comes within full_timeout, the stream
// fails with RESOURCE_EXHAUSTED (a peer that floods a stream nobody reads
// costs bounded memory, not all of it). A single frame larger than
// max_bytes is still taken when the queue is empty. The control protocols
// (nccl, shm, cuda_ipc) keep at most a few messages in flight per stream.
struct ControlInboxLimits {
  int max_messages = 64;
  size_t max_bytes = size_t{16} << 20;
  absl::Duration full_timeout = absl::Seconds(10);
  absl::Status Validate() const;
};

class GrpcControlChannelFactory : public ControlChannelFactory {
 public:
  // `limits` must be valid.
  explicit GrpcControlChannelFactory(ControlInboxLimits limits = {})
      : limits_(limits) {}
  // A stream that cannot reach `destination` fails its first Send or Receive
  // with UNAVAILABLE, so NcclKvTransport::Open fails instead of hanging.
  absl::StatusOr<std::unique_ptr<ControlChannel>> Connect(
      const std::string& destination) override;

 private:
  const ControlInboxLimits limits_;
};

// The server end of one KvTransfer.Control call, for every transport whose
// control plane rides that stream (nccl, shm, cuda_ipc): hands a
// ControlChannel over the stream to `serve` (which keeps it, e.g. an
// endpoint serving it on a link's thread), then reads the stream's frames
// into that channel until the peer ends it or the channel is closed, and
// returns OK; RESOURCE_EXHAUSTED when the peer's frames overflowed
// `limits` (the channel then fails with that code too). The channel stays
// valid after this returns: its Send and Receive then fail.
grpc::Status ServeControlStream(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::KvControlFrame, v1::KvControlFrame>* stream,
    absl::FunctionRef<void(std::unique_ptr<ControlChannel>)> serve,
    const ControlInboxLimits& limits = {});

class NcclKvTransferService : public KvTransferService {
 public:
  // `receiver` and `endpoint` must outlive the service.
  NcclKvTransferService(KvReceiver* receiver, NcclKvReceiveEndpoint* endpoint)
      : KvTransferService(receiver), endpoint_(endpoint) {}

  // Hands the stream to the endpoint (which serves it on the link's thread)
  // and reads its frames until the peer ends it or the endpoint closes it.
  grpc::Status Control(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::KvControlFrame, v1::KvControlFrame>* stream)
      override;

 private:
  NcclKvReceiveEndpoint* const endpoint_;
};

}  // namespace pdserve::kv_transfer::nccl
