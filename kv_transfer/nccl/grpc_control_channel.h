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

class GrpcControlChannelFactory : public ControlChannelFactory {
 public:
  // A stream that cannot reach `destination` fails its first Send or Receive
  // with UNAVAILABLE, so NcclKvTransport::Open fails instead of hanging.
  absl::StatusOr<std::unique_ptr<ControlChannel>> Connect(
      const std::string& destination) override;
};

// The server end of one KvTransfer.Control call, for every transport whose
// control plane rides that stream (nccl, shm, cuda_ipc): hands a
// ControlChannel over the stream to `serve` (which keeps it, e.g. an
// endpoint serving it on a link's thread), then reads the stream's frames
// into that channel until the peer ends it or the channel is closed, and
// returns OK. The channel stays valid after this returns: its Send and
// Receive then fail with UNAVAILABLE.
grpc::Status ServeControlStream(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::KvControlFrame, v1::KvControlFrame>* stream,
    absl::FunctionRef<void(std::unique_ptr<ControlChannel>)> serve);

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
