#include "kv_transfer/ipc/ipc_service.h"

#include <memory>
#include <utility>

#include "kv_transfer/nccl/grpc_control_channel.h"

namespace pdserve::kv_transfer::ipc {

grpc::Status IpcKvTransferService::Control(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::KvControlFrame, v1::KvControlFrame>* stream) {
  if (endpoint_ == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "this worker takes no KV over shm/cuda_ipc (it does "
                        "not serve decode)");
  }
  return nccl::ServeControlStream(
      context, stream, [this](std::unique_ptr<ControlChannel> channel) {
        endpoint_->Serve(std::move(channel));
      });
}

}  // namespace pdserve::kv_transfer::ipc
