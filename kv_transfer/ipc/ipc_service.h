// The decode worker's KvTransfer service for --kv-transport shm|cuda_ipc:
// Push as KvTransferService (so a grpc sender still works), and Control
// handing each stream, one per transfer, to an IpcKvReceiveEndpoint. The
// sending side's channels come from nccl::GrpcControlChannelFactory (the
// same KvTransfer.Control stream; the protocol on it is ipc_messages.h).
// The server end of each stream is nccl::ServeControlStream's, as for the
// nccl transport.
//
// Thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include "kv_transfer/grpc/grpc_transport.h"
#include "kv_transfer/ipc/ipc_transport.h"
#include "pdserve/v1/internal.grpc.pb.h"

namespace pdserve::kv_transfer::ipc {

class IpcKvTransferService : public KvTransferService {
 public:
  // `receiver` must outlive the service. `endpoint` may be null (a worker
  // that does not serve decode): Control is then FAILED_PRECONDITION.
  IpcKvTransferService(KvReceiver* receiver, IpcKvReceiveEndpoint* endpoint)
      : KvTransferService(receiver), endpoint_(endpoint) {}

  grpc::Status Control(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::KvControlFrame, v1::KvControlFrame>* stream)
      override;

 private:
  IpcKvReceiveEndpoint* const endpoint_;
};

}  // namespace pdserve::kv_transfer::ipc
