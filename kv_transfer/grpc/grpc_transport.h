// The `grpc` KV transport: client-streaming Push over the internal KvTransfer
// service. Works between any two hosts and on CPU pools. Spans are batched
// into messages of about kMessageBytes so per-message overhead stays small.
// No KV byte is copied in user space on the sending side: each message is a
// KvChunk laid out as gRPC slices pointing into the pool (chunk_codec.h). The
// receiving side parses messages from the slices gRPC read them into and
// copies each span once, into its reserved block.
//
// GrpcKvTransport is thread-safe (channels are shared); sessions are not.
// KvTransferService is a gRPC service feeding a KvReceiver; thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "kv_transfer/receiver.h"
#include "kv_transfer/transfer_metrics.h"
#include "kv_transfer/transport.h"
#include "pdserve/v1/internal.grpc.pb.h"

namespace pdserve::kv_transfer {

class GrpcKvTransport : public KvTransport {
 public:
  static constexpr size_t kMessageBytes = 1 << 20;
  // `metrics` may be null.
  explicit GrpcKvTransport(TransferMetrics* metrics,
                           absl::Duration timeout = absl::Seconds(60));
  const char* name() const override { return "grpc"; }
  absl::StatusOr<std::unique_ptr<KvSendSession>> Open(
      const SendPlan& plan, engine::KvStorage* storage) override;

 private:
  std::shared_ptr<grpc::Channel> ChannelFor(const std::string& destination);

  TransferMetrics* metrics_;
  absl::Duration timeout_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<grpc::Channel>> channels_
      ABSL_GUARDED_BY(mu_);
};

// Serves Push into a KvReceiver. Control (the `nccl` transport's control
// plane) answers FAILED_PRECONDITION here; nccl::NcclKvTransferService
// serves it on workers started with --kv-transport nccl.
class KvTransferService : public v1::KvTransfer::WithRawCallbackMethod_Push<
                              v1::KvTransfer::Service> {
 public:
  explicit KvTransferService(KvReceiver* receiver) : receiver_(receiver) {}
  // Raw (ByteBuffer) so chunks are parsed without flattening (chunk_codec.h).
  grpc::ServerReadReactor<grpc::ByteBuffer>* Push(
      grpc::CallbackServerContext* context,
      grpc::ByteBuffer* response) override;
  grpc::Status Control(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::KvControlFrame, v1::KvControlFrame>* stream)
      override;

 private:
  KvReceiver* receiver_;
};

v1::KvLayout ToProto(const KvLayout& layout);
KvLayout FromProto(const v1::KvLayout& layout);

// Channel arguments for internal channels: wire::InternalChannelArgs().
// For a server receiving KV (workers, the transfer bench): large
// messages, HTTP/2 frames and windows sized for bulk KV instead of RPCs, and
// large socket reads.
void ConfigureInternalServer(grpc::ServerBuilder* builder);

}  // namespace pdserve::kv_transfer
