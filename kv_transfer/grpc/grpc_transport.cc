#include "kv_transfer/grpc/grpc_transport.h"

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"

namespace pdserve::kv_transfer {

v1::KvLayout ToProto(const KvLayout& l) {
  v1::KvLayout p;
  p.set_fingerprint(l.fingerprint);
  p.set_num_layers(l.num_layers);
  p.set_kv_heads(l.kv_heads);
  p.set_head_dim(l.head_dim);
  p.set_block_size(l.block_size);
  p.set_dtype(l.dtype);
  return p;
}

KvLayout FromProto(const v1::KvLayout& p) {
  return {p.fingerprint(),
          static_cast<int32_t>(p.num_layers()),
          static_cast<int32_t>(p.kv_heads()),
          static_cast<int32_t>(p.head_dim()),
          static_cast<int32_t>(p.block_size()),
          p.dtype()};
}

grpc::ChannelArguments InternalChannelArgs() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  return args;
}

namespace {

class GrpcSendSession : public KvSendSession {
 public:
  GrpcSendSession(const SendPlan& plan, engine::KvPool* pool,
                  std::shared_ptr<grpc::Channel> channel,
                  TransferMetrics* metrics, absl::Duration timeout)
      : plan_(plan),
        pool_(pool),
        stub_(v1::KvTransfer::NewStub(channel)),
        metrics_(metrics) {
    context_.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    writer_ = stub_->Push(&context_, &ack_);
    auto* header = message_.mutable_header();
    header->set_request_id(plan.request_id);
    header->set_reservation_id(plan.reservation_id);
    header->set_sender_id(plan.sender_id);
    *header->mutable_layout() = ToProto(plan.layout);
    if (metrics_) metrics_->in_flight->Increment();
  }
  ~GrpcSendSession() override {
    Cancel();
    if (metrics_) metrics_->in_flight->Decrement();
  }

  absl::Status SendLayers(int32_t first, int32_t last) override {
    return SendBlocks(first, last, plan_.blocks);
  }

  absl::Status SendBlocks(int32_t first, int32_t last,
                          std::span<const BlockRef> blocks) override {
    if (done_)
      return absl::FailedPreconditionError("transfer already finished");
    const engine::KvCacheSpec& spec = pool_->spec();
    if (first < 0 || last > spec.num_layers || first > last) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer range [", first, ", ", last, ") is invalid"));
    }
    const size_t bytes = static_cast<size_t>(spec.LayerBlockBytes());
    const size_t scale_bytes =
        spec.dtype == DType::kI8 ? 2 * spec.num_kv_heads * sizeof(float) : 0;
    for (int32_t layer = first; layer < last; ++layer) {
      for (const auto& [index, block] : blocks) {
        if (block < 0 || block >= pool_->num_blocks()) {
          return absl::InvalidArgumentError(
              absl::StrCat("block ", index, " is physical block ", block,
                           ", outside the pool of ", pool_->num_blocks()));
        }
        v1::KvBlockSpan* span = message_.add_spans();
        span->set_layer(layer);
        span->set_block_index(index);
        span->set_data(pool_->LayerBlockData(layer, block), bytes);
        if (scale_bytes)
          span->set_scales(pool_->LayerBlockScales(layer, block), scale_bytes);
        pending_bytes_ += bytes + scale_bytes;
        stats_.bytes += bytes + scale_bytes;
        ++stats_.spans;
        if (pending_bytes_ >= GrpcKvTransport::kMessageBytes) {
          if (absl::Status s = Flush(); !s.ok()) return s;
        }
      }
    }
    // Layers handed over are sent now, so transfer overlaps later compute.
    return Flush();
  }

  absl::StatusOr<SendStats> Finish() override {
    if (done_)
      return absl::FailedPreconditionError("transfer already finished");
    const auto start = absl::Now();
    absl::Status flushed = Flush(/*force=*/true);
    writer_->WritesDone();
    done_ = true;
    const grpc::Status st = writer_->Finish();
    if (!st.ok()) {
      if (metrics_) metrics_->Failure("send_error");
      return FromGrpc(st);
    }
    if (!flushed.ok()) return flushed;
    (void)start;
    return stats_;
  }

  void Cancel() override {
    if (done_) return;
    done_ = true;
    context_.TryCancel();
    writer_->Finish();
  }

 private:
  absl::Status Flush(bool force = false) {
    if (!force && message_.spans_size() == 0) return absl::OkStatus();
    if (message_.spans_size() == 0 && !message_.has_header())
      return absl::OkStatus();
    if (!writer_->Write(message_)) {
      if (metrics_) metrics_->Failure("send_error");
      return absl::UnavailableError(
          absl::StrCat("KV stream to ", plan_.destination, " broke"));
    }
    if (metrics_)
      metrics_->bytes_sent->Increment(static_cast<double>(pending_bytes_));
    message_.Clear();
    pending_bytes_ = 0;
    return absl::OkStatus();
  }

  SendPlan plan_;
  engine::KvPool* pool_;
  std::unique_ptr<v1::KvTransfer::Stub> stub_;
  TransferMetrics* metrics_;
  grpc::ClientContext context_;
  v1::KvTransferAck ack_;
  std::unique_ptr<grpc::ClientWriter<v1::KvChunk>> writer_;
  v1::KvChunk message_;
  size_t pending_bytes_ = 0;
  SendStats stats_;
  bool done_ = false;
};

}  // namespace

GrpcKvTransport::GrpcKvTransport(TransferMetrics* metrics,
                                 absl::Duration timeout)
    : metrics_(metrics), timeout_(timeout) {}

std::shared_ptr<grpc::Channel> GrpcKvTransport::ChannelFor(
    const std::string& destination) {
  absl::MutexLock l(&mu_);
  auto& ch = channels_[destination];
  if (!ch) {
    ch = grpc::CreateCustomChannel(
        destination, grpc::InsecureChannelCredentials(), InternalChannelArgs());
  }
  return ch;
}

absl::StatusOr<std::unique_ptr<KvSendSession>> GrpcKvTransport::Open(
    const SendPlan& plan, engine::KvPool* pool) {
  if (plan.destination.empty())
    return absl::InvalidArgumentError("KV destination is empty");
  return std::unique_ptr<KvSendSession>(new GrpcSendSession(
      plan, pool, ChannelFor(plan.destination), metrics_, timeout_));
}

grpc::Status KvTransferService::Push(grpc::ServerContext* context,
                                     grpc::ServerReader<v1::KvChunk>* reader,
                                     v1::KvTransferAck* ack) {
  v1::KvChunk chunk;
  if (!reader->Read(&chunk))
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "empty KV stream");
  if (!chunk.has_header()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "the first KV chunk must carry the header");
  }
  const uint64_t id = chunk.header().reservation_id();
  if (absl::Status s = receiver_->Begin(id, chunk.header().request_id(),
                                        FromProto(chunk.header().layout()));
      !s.ok()) {
    return ToGrpc(s);
  }
  uint64_t chunks = 0, bytes = 0;
  do {
    for (const v1::KvBlockSpan& span : chunk.spans()) {
      absl::Status s = receiver_->Write(
          id, static_cast<int32_t>(span.layer()),
          static_cast<int32_t>(span.block_index()), span.data(), span.scales());
      if (!s.ok()) return ToGrpc(s);
      ++chunks;
      bytes += span.data().size() + span.scales().size();
    }
  } while (reader->Read(&chunk));
  receiver_->End(id, !context->IsCancelled());
  ack->set_chunks(chunks);
  ack->set_bytes(bytes);
  return grpc::Status::OK;
}

grpc::Status KvTransferService::Control(
    grpc::ServerContext*,
    grpc::ServerReaderWriter<v1::KvControlFrame, v1::KvControlFrame>*) {
  return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                      "this worker does not serve the nccl KV transport "
                      "(start it with --kv-transport nccl)");
}

}  // namespace pdserve::kv_transfer
