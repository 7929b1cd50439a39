#include "kv_transfer/grpc/grpc_transport.h"

#include <grpcpp/generic/generic_stub.h>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/tls.h"
#include "kv_transfer/grpc/chunk_codec.h"
#include "wire/channel_args.h"
#include "wire/enums.h"

namespace pdserve::kv_transfer {

v1::KvLayout ToProto(const KvLayout& l) {
  v1::KvLayout p;
  p.set_fingerprint(l.fingerprint);
  p.set_num_layers(l.num_layers);
  p.set_kv_heads(l.kv_heads);
  p.set_head_dim(l.head_dim);
  p.set_block_size(l.block_size);
  p.set_dtype(l.dtype ? wire::DTypeToProto(*l.dtype)
                      : v1::KV_DTYPE_UNSPECIFIED);
  p.set_kv_lora_rank(l.kv_lora_rank);
  p.set_qk_rope_head_dim(l.qk_rope_head_dim);
  return p;
}

KvLayout FromProto(const v1::KvLayout& p) {
  return {p.fingerprint(),
          static_cast<int32_t>(p.num_layers()),
          static_cast<int32_t>(p.kv_heads()),
          static_cast<int32_t>(p.head_dim()),
          static_cast<int32_t>(p.block_size()),
          wire::DTypeFromProto(p.dtype()),
          static_cast<int32_t>(p.kv_lora_rank()),
          static_cast<int32_t>(p.qk_rope_head_dim())};
}

void ConfigureInternalServer(grpc::ServerBuilder* builder) {
  builder->SetMaxReceiveMessageSize(64 << 20);
  // Fewer, larger DATA frames and a stream window that need not first grow
  // through BDP probing; reads of up to 4 MiB per syscall.
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, (1 << 24) - 1);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 16 << 20);
  builder->AddChannelArgument(GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, 256 << 10);
  builder->AddChannelArgument(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, 4 << 20);
}

namespace {

constexpr char kPushMethod[] = "/pdserve.v1.KvTransfer/Push";

// One request's stream. Spans go out as KvChunk messages (chunk_codec.h).
// From host storage their KV bytes are slices over the storage itself: gRPC
// writes them to the socket from there, so user space copies nothing on this
// side. From device storage each span is first copied to host staging
// (pinned, two buffers of one message each): while gRPC still holds one
// buffer's slices, the next message's spans are copied into the other, and a
// buffer is refilled only once gRPC released it. The call is driven one
// operation at a time on a private completion queue.
class GrpcSendSession : public KvSendSession {
 public:
  GrpcSendSession(const SendPlan& plan, engine::KvStorage* storage,
                  const std::shared_ptr<grpc::Channel>& channel,
                  TransferMetrics* metrics, absl::Duration timeout)
      : plan_(plan),
        storage_(storage),
        stub_(channel),
        metrics_(metrics),
        timeout_(timeout),
        tracker_(new SliceTracker) {
    if (storage_->memory().kind != engine::MemoryKind::kHost) {
      const engine::KvSpan one = storage_->Span(0, 0);
      const size_t bytes =
          GrpcKvTransport::kMessageBytes + one.data_bytes + one.scale_bytes;
      for (Staging& s : staging_) {
        s.buffer = storage_->AllocateStaging(bytes);
        s.tracker = new SliceTracker;
      }
    }
    v1::KvTransferHeader header;
    header.set_request_id(plan.request_id);
    header.set_reservation_id(plan.reservation_id);
    header.set_sender_id(plan.sender_id);
    *header.mutable_layout() = ToProto(plan.layout);
    encoder_.SetHeader(header);
    if (metrics_) metrics_->in_flight->Increment();
  }
  ~GrpcSendSession() override {
    Cancel();
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
    if (tracker_->AwaitReleased(absl::Now() + absl::Seconds(10))) {
      delete tracker_;
    } else {
      // Never free a tracker a late slice release would still touch.
      PDSERVE_LOG(ERROR) << "KV stream to " << plan_.destination
                         << " still references " << tracker_->outstanding()
                         << " KV slices";
    }
    for (Staging& s : staging_) {
      if (s.tracker == nullptr) continue;
      if (s.tracker->AwaitReleased(absl::Now() + absl::Seconds(10))) {
        delete s.tracker;
      } else {
        // gRPC may still read the buffer: leak it rather than free it.
        PDSERVE_LOG(ERROR) << "KV stream to " << plan_.destination
                           << " still references staged KV slices";
        s.buffer.release();
      }
    }
    if (metrics_) metrics_->in_flight->Decrement();
  }

  absl::Status SendLayers(int32_t first, int32_t last) override {
    return SendBlocks(first, last, plan_.blocks);
  }

  absl::Status SendBlocks(int32_t first, int32_t last,
                          std::span<const BlockRef> blocks) override {
    if (done_)
      return absl::FailedPreconditionError("transfer already finished");
    const engine::KvCacheSpec& spec = storage_->spec();
    if (first < 0 || last > spec.num_layers || first > last) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer range [", first, ", ", last, ") is invalid"));
    }
    const bool staged = storage_->memory().kind != engine::MemoryKind::kHost;
    for (int32_t layer = first; layer < last; ++layer) {
      for (const auto& [index, block] : blocks) {
        if (block < 0 || block >= storage_->num_blocks()) {
          return absl::InvalidArgumentError(
              absl::StrCat("block ", index, " is physical block ", block,
                           ", outside the pool of ", storage_->num_blocks()));
        }
        const engine::KvSpan span = storage_->Span(layer, block);
        const size_t bytes = span.data_bytes, scale_bytes = span.scale_bytes;
        if (staged) {
          ASSIGN_OR_RETURN(uint8_t * at, StageSpan(layer, block, span));
          encoder_.AddSpan(static_cast<uint32_t>(layer),
                           static_cast<uint32_t>(index), at, bytes,
                           scale_bytes ? at + bytes : nullptr, scale_bytes,
                           staging_[current_].tracker);
        } else {
          encoder_.AddSpan(static_cast<uint32_t>(layer),
                           static_cast<uint32_t>(index),
                           static_cast<const uint8_t*>(span.data), bytes,
                           reinterpret_cast<const uint8_t*>(span.scales),
                           scale_bytes, tracker_);
        }
        stats_.bytes += bytes + scale_bytes;
        ++stats_.spans;
        if (encoder_.payload_bytes() >= GrpcKvTransport::kMessageBytes) {
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
    const absl::Status flushed = Flush(/*force=*/true);
    if (done_) return flushed;  // the stream broke, and Flush ended it
    done_ = true;
    const grpc::Status st = EndCall(/*cancel=*/false);
    if (!st.ok()) {
      if (metrics_) metrics_->Failure("send_error");
      return FromGrpc(st);
    }
    if (!flushed.ok()) return flushed;
    return stats_;
  }

  void Cancel() override {
    if (done_) return;
    done_ = true;
    EndCall(/*cancel=*/true);
  }

 private:
  // One host staging buffer for spans read from device memory, and the
  // tracker of the slices gRPC holds over it.
  struct Staging {
    std::unique_ptr<engine::HostStagingBuffer> buffer;
    SliceTracker* tracker = nullptr;  // heap, like tracker_
    size_t used = 0;
  };

  // Copies `span` (device memory) into the current staging buffer, switching
  // to the other buffer when this one is full (the full one is sent first,
  // and the other is reused only once gRPC released its slices).
  absl::StatusOr<uint8_t*> StageSpan(int32_t layer, int64_t block,
                                     const engine::KvSpan& span) {
    const size_t need = span.data_bytes + span.scale_bytes;
    Staging* s = &staging_[current_];
    if (s->used + need > s->buffer->size()) {
      RETURN_IF_ERROR(Flush(/*force=*/false));
      current_ ^= 1;
      s = &staging_[current_];
      if (!s->tracker->AwaitReleased(absl::Now() + timeout_)) {
        return absl::DeadlineExceededError(
            absl::StrCat("KV stream to ", plan_.destination,
                         ": gRPC did not release a staging buffer within ",
                         absl::FormatDuration(timeout_)));
      }
      s->used = 0;
    }
    uint8_t* at = static_cast<uint8_t*>(s->buffer->data()) + s->used;
    RETURN_IF_ERROR(storage_->CopyToHost(
        layer, block, at, span.scale_bytes ? at + span.data_bytes : nullptr));
    s->used += need;
    return at;
  }

  // Runs one started operation to completion; false if it failed.
  bool Await(void* tag) {
    void* got = nullptr;
    bool ok = false;
    if (!cq_.Next(&got, &ok)) return false;
    return ok && got == tag;
  }

  absl::Status Flush(bool force = false) {
    if (!force && encoder_.payload_bytes() == 0) return absl::OkStatus();
    if (!started_) {
      // The deadline runs from the first bytes, not from Open: a layer-wise
      // sender opens before the prefill computes anything.
      started_ = true;
      context_.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
      call_ = stub_.PrepareCall(&context_, kPushMethod, &cq_);
      call_->StartCall(this);
      broken_ = !Await(this);
    }
    const size_t payload = encoder_.payload_bytes();
    grpc::ByteBuffer message = encoder_.Take();
    if (!broken_) {
      call_->Write(message, this);
      broken_ = !Await(this);
    }
    if (broken_) {
      if (metrics_) metrics_->Failure("send_error");
      // The call is over; its status says why (the receiver's refusal, a
      // deadline, a lost connection).
      if (!done_) {
        done_ = true;
        end_status_ = EndCall(/*cancel=*/false);
      }
      return absl::Status(
          end_status_.ok()
              ? absl::StatusCode::kUnavailable
              : static_cast<absl::StatusCode>(end_status_.error_code()),
          absl::StrCat("KV stream to ", plan_.destination,
                       " broke: ", end_status_.error_message()));
    }
    if (metrics_) metrics_->bytes_sent->Increment(static_cast<double>(payload));
    return absl::OkStatus();
  }

  // Half-closes (or cancels) the call, reads the receiver's ack and its
  // status. Every operation has completed when it returns.
  // Returns only once gRPC let go of every slice over the pool, so the
  // caller may unpin the blocks.
  grpc::Status EndCall(bool cancel) {
    encoder_.Take();  // spans never handed to gRPC
    if (!started_) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "never started");
    }
    if (cancel) context_.TryCancel();
    if (!cancel && !broken_) {
      call_->WritesDone(this);
      if (Await(this)) {
        grpc::ByteBuffer ack;
        call_->Read(&ack, this);
        Await(this);
      }
    }
    grpc::Status status;
    call_->Finish(&status, this);
    Await(this);
    // gRPC may drop its last references just after the call completes.
    if (!tracker_->AwaitReleased(absl::Now() + absl::Seconds(10))) {
      PDSERVE_LOG(ERROR) << "gRPC still holds KV slices of a finished stream";
    }
    return status;
  }

  SendPlan plan_;
  engine::KvStorage* storage_;
  Staging staging_[2];
  int current_ = 0;
  grpc::GenericStub stub_;
  TransferMetrics* metrics_;
  const absl::Duration timeout_;
  SliceTracker* const tracker_;  // heap: may outlive the session (see dtor)
  grpc::CompletionQueue cq_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  ChunkEncoder encoder_;
  SendStats stats_;
  grpc::Status end_status_;  // once a broken call was ended
  bool started_ = false, broken_ = false, done_ = false;
};

// Receives one Push stream: parses each message from the slices gRPC read
// it into (chunk_codec.h) and lets KvReceiver copy every span straight from
// them into its reserved block, the only copy on this side.
class PushReactor : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  PushReactor(grpc::CallbackServerContext* context, grpc::ByteBuffer* response,
              KvReceiver* receiver)
      : context_(context), response_(response), receiver_(receiver) {
    StartRead(&message_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the sender half-closed, or the call ended
      if (!begun_) {
        Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "empty KV stream"));
        return;
      }
      receiver_->End(id_, !context_->IsCancelled());
      v1::KvTransferAck ack;
      ack.set_chunks(chunks_);
      ack.set_bytes(bytes_);
      grpc::Slice slice(ack.SerializeAsString());
      *response_ = grpc::ByteBuffer(&slice, 1);
      Finish(grpc::Status::OK);
      return;
    }
    absl::Status s = Consume();
    message_.Clear();
    slices_.clear();
    if (!s.ok()) {
      Finish(ToGrpc(s));
      return;
    }
    StartRead(&message_);
  }
  void OnDone() override { delete this; }

 private:
  absl::Status Consume() {
    if (!message_.Dump(&slices_).ok()) {
      return absl::InvalidArgumentError("unreadable KV chunk");
    }
    bool first = !begun_;
    return DecodeChunk(
        slices_,
        [&](const v1::KvTransferHeader& header) -> absl::Status {
          if (!first) return absl::OkStatus();  // only the first one counts
          first = false;
          id_ = header.reservation_id();
          RETURN_IF_ERROR(receiver_->Begin(id_, header.request_id(),
                                           FromProto(header.layout())));
          begun_ = true;
          return absl::OkStatus();
        },
        [&](const DecodedSpan& span) -> absl::Status {
          if (!begun_) {
            return absl::InvalidArgumentError(
                "the first KV chunk must carry the header");
          }
          RETURN_IF_ERROR(
              receiver_->Write(id_, static_cast<int32_t>(span.layer),
                               static_cast<int32_t>(span.block_index),
                               std::span<const std::string_view>(
                                   span.data.data(), span.data.size()),
                               std::span<const std::string_view>(
                                   span.scales.data(), span.scales.size())));
          ++chunks_;
          for (std::string_view p : span.data) bytes_ += p.size();
          for (std::string_view p : span.scales) bytes_ += p.size();
          return absl::OkStatus();
        });
  }

  grpc::CallbackServerContext* const context_;
  grpc::ByteBuffer* const response_;
  KvReceiver* const receiver_;
  grpc::ByteBuffer message_;
  std::vector<grpc::Slice> slices_;
  bool begun_ = false;
  uint64_t id_ = 0, chunks_ = 0, bytes_ = 0;
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
    ch = grpc::CreateCustomChannel(destination,
                                   tls::InternalChannelCredentials(),
                                   wire::InternalChannelArgs());
  }
  return ch;
}

absl::StatusOr<std::unique_ptr<KvSendSession>> GrpcKvTransport::Open(
    const SendPlan& plan, engine::KvStorage* pool) {
  if (plan.destination.empty())
    return absl::InvalidArgumentError("KV destination is empty");
  return std::unique_ptr<KvSendSession>(new GrpcSendSession(
      plan, pool, ChannelFor(plan.destination), metrics_, timeout_));
}

grpc::ServerReadReactor<grpc::ByteBuffer>* KvTransferService::Push(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response) {
  return new PushReactor(context, response, receiver_);
}

grpc::Status KvTransferService::Control(
    grpc::ServerContext*,
    grpc::ServerReaderWriter<v1::KvControlFrame, v1::KvControlFrame>*) {
  return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                      "this worker serves only the grpc KV transport, not "
                      "nccl, shm or cuda_ipc: start prefill and decode "
                      "workers with the same --kv-transport");
}

}  // namespace pdserve::kv_transfer
