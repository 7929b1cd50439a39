#include "kv_transfer/nccl/nccl_receiver.h"

#include <string_view>
#include <type_traits>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv_transfer/nccl/control_messages.h"

namespace pdserve::kv_transfer::nccl {

absl::Status NcclReceiverConfig::Validate() const {
  if (max_batch_bytes == 0) {
    return absl::InvalidArgumentError(
        "nccl receiver: max_batch_bytes must be positive");
  }
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "nccl receiver: timeout must be positive");
  }
  return absl::OkStatus();
}

namespace {

// One prefill worker's link, served by one thread: the message loop and the
// transfers open on it.
class ReceiveLink {
 public:
  ReceiveLink(ControlChannel* channel, KvReceiver* receiver,
              CommunicatorFactory* comms, const NcclReceiverConfig& config)
      : channel_(channel), receiver_(receiver), comms_(comms), config_(config) {
    const engine::KvCacheSpec spec{
        receiver->layout().num_layers, receiver->layout().kv_heads,
        receiver->layout().head_dim, receiver->layout().block_size,
        receiver->layout().dtype.value_or(DType::kF16)};
    data_bytes_ = static_cast<size_t>(spec.LayerBlockBytes());
    scale_bytes_ =
        DTypeHasScales(spec.dtype)
            ? 2 * static_cast<size_t>(spec.num_kv_heads) * sizeof(float)
            : 0;
  }

  // Serves messages until the channel closes or the link must end.
  void Run() {
    while (true) {
      absl::StatusOr<std::string> bytes =
          channel_->Receive(absl::InfiniteFuture());
      if (!bytes.ok()) break;
      absl::StatusOr<ControlMessage> message = DecodeMessage(*bytes);
      if (!message.ok()) {
        // A peer that sends garbage cannot be trusted with the rest of the
        // link.
        Reply(ReplyFor(message.status()));
        break;
      }
      if (!std::visit([this](auto& m) { return Handle(m); }, *message).ok()) {
        break;
      }
    }
    // Whatever is still open lost its sender.
    for (auto& [id, transfer] : transfers_) {
      if (transfer.status.ok()) {
        receiver_->End(transfer.reservation_id, /*ok=*/false);
      }
    }
    transfers_.clear();
    comm_.reset();
    channel_->Close();
  }

 private:
  struct Transfer {
    uint64_t reservation_id = 0;
    // The first failure; after one, no more receives are posted for it.
    absl::Status status;
  };

  void Reply(const ReplyMessage& reply) {
    channel_->Send(EncodeMessage(reply)).IgnoreError();
  }

  // Each handler replies exactly once and returns non-OK only to end the link.
  absl::Status Handle(const HelloMessage& m) {
    if (comm_) {
      const absl::Status s =
          absl::FailedPreconditionError("KV link: a second Hello");
      Reply(ReplyFor(s));
      return s;
    }
    ReplyMessage reply;
    reply.max_batch_bytes = config_.max_batch_bytes;
    Reply(reply);
    // The sender joins after reading the reply; both block until both joined.
    ASSIGN_OR_RETURN(
        comm_, comms_->Create(m.unique_id, Communicator::kReceiverRank,
                              absl::Now() + config_.timeout, config_.timeout));
    return absl::OkStatus();
  }

  absl::Status Handle(const BeginMessage& m) {
    if (!comm_) {
      const absl::Status s =
          absl::FailedPreconditionError("KV link: Begin before Hello");
      Reply(ReplyFor(s));
      return s;
    }
    if (transfers_.contains(m.transfer_id)) {
      Reply(ReplyFor(absl::InvalidArgumentError(absl::StrCat(
          "KV transfer ", m.transfer_id, " is already open on this link"))));
      return absl::OkStatus();
    }
    const absl::Status s =
        receiver_->Begin(m.reservation_id, m.request_id, m.layout);
    if (s.ok()) {
      transfers_[m.transfer_id] = {m.reservation_id, absl::OkStatus()};
    }
    Reply(ReplyFor(s));
    return absl::OkStatus();
  }

  absl::Status Handle(const ManifestMessage& m) {
    auto it = transfers_.find(m.transfer_id);
    if (it == transfers_.end()) {
      Reply(ReplyFor(absl::NotFoundError(absl::StrCat(
          "no KV transfer ", m.transfer_id, " is open on this link"))));
      return absl::OkStatus();
    }
    Transfer& t = it->second;
    if (!t.status.ok()) {
      Reply(ReplyFor(t.status));
      return absl::OkStatus();
    }
    const size_t n = m.spans.size();
    const size_t data_total = n * data_bytes_, scale_total = n * scale_bytes_;
    if (n == 0 || data_total + scale_total > config_.max_batch_bytes) {
      t.status = absl::ResourceExhaustedError(absl::StrCat(
          "KV manifest of ", n, " spans (", data_total + scale_total,
          " bytes) is empty or exceeds the staging limit of ",
          config_.max_batch_bytes, " bytes"));
      receiver_->End(t.reservation_id, /*ok=*/false);
      Reply(ReplyFor(t.status));
      return absl::OkStatus();
    }
    // Device storage: the bytes stay in (device) wire staging and are
    // scattered into the reserved blocks by device copies; host storage gets
    // them through host staging and KvReceiver::Write.
    const bool device =
        receiver_->storage_memory().kind == engine::MemoryKind::kDevice;
    absl::StatusOr<std::unique_ptr<Completion>> done =
        PostReceive(data_total, scale_total, /*to_host=*/!device);
    if (!done.ok()) {
      Reply(ReplyFor(done.status()));
      return done.status();
    }
    Reply(ReplyMessage{});  // the receive is posted: the sender may send
    if (absl::Status s = AwaitCompletion(**done, absl::Now() + config_.timeout,
                                         "KV bytes from the sender");
        !s.ok()) {
      comm_->Abort();
      return s;
    }
    if (device) {
      std::vector<KvReceiver::SpanRef> refs;
      refs.reserve(n);
      for (const SpanName& name : m.spans)
        refs.push_back({name.layer, name.block_index});
      t.status = receiver_->WriteSpans(
          t.reservation_id, refs,
          [&](std::span<const engine::KvSpan> targets) -> absl::Status {
            for (size_t i = 0; i < targets.size(); ++i) {
              RETURN_IF_ERROR(comm_->CopyFromWire(
                  i * data_bytes_, targets[i].data, data_bytes_));
              if (scale_bytes_ > 0) {
                RETURN_IF_ERROR(
                    comm_->CopyFromWire(data_total + i * scale_bytes_,
                                        targets[i].scales, scale_bytes_));
              }
            }
            // The blocks must hold the bytes before the claim ends.
            ASSIGN_OR_RETURN(std::unique_ptr<Completion> copied,
                             comm_->Record());
            return AwaitCompletion(*copied, absl::Now() + config_.timeout,
                                   "KV scatter into the reserved blocks");
          });
      return absl::OkStatus();
    }
    const uint8_t* host = comm_->host_staging();
    for (size_t i = 0; i < n && t.status.ok(); ++i) {
      const std::string_view data(
          reinterpret_cast<const char*>(host) + i * data_bytes_, data_bytes_);
      const std::string_view scales(
          reinterpret_cast<const char*>(host) + data_total + i * scale_bytes_,
          scale_bytes_);
      t.status = receiver_->Write(t.reservation_id, m.spans[i].layer,
                                  m.spans[i].block_index, data, scales);
    }
    return absl::OkStatus();
  }

  absl::Status Handle(const EndMessage& m) {
    auto it = transfers_.find(m.transfer_id);
    if (it == transfers_.end()) {
      Reply(ReplyFor(absl::NotFoundError(absl::StrCat(
          "no KV transfer ", m.transfer_id, " is open on this link"))));
      return absl::OkStatus();
    }
    const Transfer t = it->second;
    transfers_.erase(it);
    // A transfer that already failed was ended by KvReceiver itself.
    if (t.status.ok()) receiver_->End(t.reservation_id, m.ok);
    Reply(ReplyFor(m.ok ? t.status : absl::OkStatus()));
    return absl::OkStatus();
  }

  absl::Status Handle(const ReplyMessage&) {
    const absl::Status s =
        absl::InvalidArgumentError("KV link: the sender sent a reply");
    Reply(ReplyFor(s));
    return s;
  }

  // One grouped receive of every span's data then every span's scales into
  // wire staging, then one copy to host staging, then the completion.
  absl::StatusOr<std::unique_ptr<Completion>> PostReceive(size_t data_total,
                                                          size_t scale_total,
                                                          bool to_host) {
    RETURN_IF_ERROR(comm_->ReserveStaging(data_total + scale_total));
    RETURN_IF_ERROR(comm_->GroupStart());
    absl::Status s = comm_->Recv(0, data_total);
    if (s.ok() && scale_total > 0) s = comm_->Recv(data_total, scale_total);
    const absl::Status ended = comm_->GroupEnd();
    RETURN_IF_ERROR(s);
    RETURN_IF_ERROR(ended);
    if (to_host)
      RETURN_IF_ERROR(comm_->CopyWireToHost(0, data_total + scale_total));
    return comm_->Record();
  }

  ControlChannel* const channel_;
  KvReceiver* const receiver_;
  CommunicatorFactory* const comms_;
  const NcclReceiverConfig config_;
  size_t data_bytes_ = 0;   // one (layer, block) span's KV bytes
  size_t scale_bytes_ = 0;  // its int8 scales, 0 otherwise
  std::unique_ptr<Communicator> comm_;
  absl::flat_hash_map<uint64_t, Transfer> transfers_;
};

}  // namespace

NcclKvReceiveEndpoint::NcclKvReceiveEndpoint(KvReceiver* receiver,
                                             CommunicatorFactory* comms,
                                             NcclReceiverConfig config)
    : receiver_(receiver), comms_(comms), config_(config) {}

NcclKvReceiveEndpoint::~NcclKvReceiveEndpoint() { Shutdown(); }

void NcclKvReceiveEndpoint::Serve(std::unique_ptr<ControlChannel> channel) {
  absl::MutexLock l(&mu_);
  ReapFinishedLocked();
  if (shutdown_) {
    channel->Close();
    return;
  }
  LinkThread& link = links_.emplace_back();
  link.channel = std::move(channel);
  link.thread = std::thread([this, &link] { RunLink(&link); });
}

void NcclKvReceiveEndpoint::RunLink(LinkThread* link) {
  ReceiveLink(link->channel.get(), receiver_, comms_, config_).Run();
  absl::MutexLock l(&mu_);
  link->done = true;
}

void NcclKvReceiveEndpoint::ReapFinishedLocked() {
  for (auto it = links_.begin(); it != links_.end();) {
    if (it->done) {
      it->thread.join();  // it only had to return after marking itself done
      it = links_.erase(it);
    } else {
      ++it;
    }
  }
}

void NcclKvReceiveEndpoint::Shutdown() {
  std::list<LinkThread> links;
  {
    absl::MutexLock l(&mu_);
    shutdown_ = true;
    for (LinkThread& link : links_) link.channel->Close();
    links.splice(links.end(), links_);  // nodes keep their addresses
  }
  // Joined without the lock: a finishing link takes it to mark itself done.
  for (LinkThread& link : links) link.thread.join();
}

int NcclKvReceiveEndpoint::active_links() const {
  absl::MutexLock l(&mu_);
  int n = 0;
  for (const LinkThread& link : links_) n += link.done ? 0 : 1;
  return n;
}

}  // namespace pdserve::kv_transfer::nccl
