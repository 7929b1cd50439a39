#include "kv_transfer/nccl/nccl_transport.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv_transfer/nccl/control_messages.h"

namespace pdserve::kv_transfer::nccl {

absl::Status NcclTransportConfig::Validate() const {
  if (max_batch_bytes == 0) {
    return absl::InvalidArgumentError(
        "nccl transport: max_batch_bytes must be positive");
  }
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "nccl transport: timeout must be positive");
  }
  if (max_links < 1) {
    return absl::InvalidArgumentError(
        "nccl transport: max_links must be at least 1");
  }
  return absl::OkStatus();
}

// One (this prefill, one decode) pair. Every exchange on it holds `mu` from
// the request until the reply, and from a manifest's acceptance until its
// sends are enqueued, so the receiver sees one request at a time and NCCL
// sends are issued in the order the receiver posted the receives.
class NcclLink {
 public:
  NcclLink(std::string destination, const NcclTransportConfig& config)
      : destination_(std::move(destination)), config_(config) {}
  ~NcclLink() {
    comm_.reset();
    if (channel_) channel_->Close();
  }

  absl::Mutex mu;

  // Readable without `mu`, which a session may hold while it waits.
  bool broken() const { return broken_.load(std::memory_order_acquire); }

  // Connects on first use; later calls return the link's state.
  absl::Status Connect(ControlChannelFactory* control,
                       CommunicatorFactory* comms, const std::string& sender_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (connected_ || !status_.ok()) return status_;
    absl::StatusOr<std::unique_ptr<ControlChannel>> channel =
        control->Connect(destination_);
    if (!channel.ok()) return Break(channel.status());
    channel_ = *std::move(channel);
    absl::StatusOr<std::string> id = comms->NewUniqueId();
    if (!id.ok()) return Break(id.status());
    ASSIGN_OR_RETURN(const ReplyMessage reply,
                     Call(HelloMessage{*id, sender_id}));
    if (!StatusOf(reply).ok() || reply.max_batch_bytes == 0) {
      return Break(absl::UnavailableError(
          absl::StrCat("KV receiver ", destination_,
                       " refused the link: ", StatusOf(reply).ToString())));
    }
    max_batch_bytes_ = std::min(config_.max_batch_bytes, reply.max_batch_bytes);
    absl::StatusOr<std::unique_ptr<Communicator>> comm =
        comms->Create(*id, Communicator::kSenderRank,
                      absl::Now() + config_.timeout, config_.timeout);
    if (!comm.ok()) return Break(comm.status());
    comm_ = *std::move(comm);
    connected_ = true;
    return absl::OkStatus();
  }

  // Sends one request and reads its reply. A transport failure, a timeout or
  // anything but a reply breaks the link: request and reply would no longer
  // pair up.
  absl::StatusOr<ReplyMessage> Call(const ControlMessage& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    RETURN_IF_ERROR(status_);
    if (absl::Status s = channel_->Send(EncodeMessage(request)); !s.ok()) {
      return Break(s);
    }
    absl::StatusOr<std::string> bytes =
        channel_->Receive(absl::Now() + config_.timeout);
    if (!bytes.ok()) {
      return Break(absl::Status(bytes.status().code(),
                                absl::StrCat("KV receiver ", destination_, ": ",
                                             bytes.status().message())));
    }
    absl::StatusOr<ControlMessage> reply = DecodeMessage(*bytes);
    if (!reply.ok()) return Break(reply.status());
    if (!std::holds_alternative<ReplyMessage>(*reply)) {
      return Break(absl::InternalError(
          absl::StrCat("KV receiver ", destination_, " sent a request")));
    }
    return std::get<ReplyMessage>(*std::move(reply));
  }

  // Waits until the link's latest batch has left, so staging may be reused.
  absl::Status Drain() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    RETURN_IF_ERROR(status_);
    if (!last_) return absl::OkStatus();
    if (absl::Status s =
            AwaitCompletion(*last_, absl::Now() + config_.timeout,
                            "the previous KV batch to reach the receiver");
        !s.ok()) {
      return Break(s);
    }
    last_.reset();
    return absl::OkStatus();
  }

  // Marks the link broken for good: aborts the communicator, closes the
  // channel. Returns `why` for convenience.
  absl::Status Break(absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (status_.ok()) {
      status_ = why;
      broken_.store(true, std::memory_order_release);
      if (comm_) comm_->Abort();
      if (channel_) channel_->Close();
    }
    return why;
  }

  const std::string& destination() const { return destination_; }
  Communicator* comm() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return comm_.get(); }
  uint64_t max_batch_bytes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return max_batch_bytes_;
  }
  uint64_t NextTransferId() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return next_transfer_id_++;
  }
  void SetLast(std::unique_ptr<Completion> last)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    last_ = std::move(last);
  }

 private:
  const std::string destination_;
  const NcclTransportConfig config_;
  std::atomic<bool> broken_{false};
  bool connected_ ABSL_GUARDED_BY(mu) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu);  // why the link broke
  std::unique_ptr<ControlChannel> channel_ ABSL_GUARDED_BY(mu);
  std::unique_ptr<Communicator> comm_ ABSL_GUARDED_BY(mu);
  std::unique_ptr<Completion> last_ ABSL_GUARDED_BY(mu);
  uint64_t max_batch_bytes_ ABSL_GUARDED_BY(mu) = 0;
  uint64_t next_transfer_id_ ABSL_GUARDED_BY(mu) = 1;
};

namespace {

// A (layer, block) span: where it is named for the receiver and where it is
// read from in the sending pool.
struct PlannedSpan {
  SpanName name;
  int32_t physical = 0;
};

class NcclSendSession : public KvSendSession {
 public:
  NcclSendSession(const SendPlan& plan, engine::KvStorage* pool,
                  std::shared_ptr<NcclLink> link, uint64_t transfer_id,
                  size_t spans_per_batch, TransferMetrics* metrics)
      : plan_(plan),
        pool_(pool),
        link_(std::move(link)),
        transfer_id_(transfer_id),
        spans_per_batch_(spans_per_batch),
        metrics_(metrics),
        data_bytes_(static_cast<size_t>(pool->spec().LayerBlockBytes())),
        scale_bytes_(DTypeHasScales(pool->spec().dtype)
                         ? 2 * static_cast<size_t>(pool->spec().num_kv_heads) *
                               sizeof(float)
                         : 0) {
    if (metrics_) metrics_->in_flight->Increment();
  }
  ~NcclSendSession() override {
    Cancel();
    if (metrics_) metrics_->in_flight->Decrement();
  }

  absl::Status SendLayers(int32_t first, int32_t last) override {
    return SendBlocks(first, last, plan_.blocks);
  }

  absl::Status SendBlocks(int32_t first, int32_t last,
                          std::span<const BlockRef> blocks) override {
    if (done_) {
      return absl::FailedPreconditionError("transfer already finished");
    }
    RETURN_IF_ERROR(status_);
    if (first < 0 || last > pool_->spec().num_layers || first > last) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer range [", first, ", ", last, ") is invalid"));
    }
    std::vector<PlannedSpan> batch;
    batch.reserve(std::min(spans_per_batch_,
                           static_cast<size_t>(last - first) * blocks.size()));
    for (int32_t layer = first; layer < last; ++layer) {
      for (const auto& [index, physical] : blocks) {
        if (physical < 0 || physical >= pool_->num_blocks()) {
          return absl::InvalidArgumentError(
              absl::StrCat("block ", index, " is physical block ", physical,
                           ", outside the pool of ", pool_->num_blocks()));
        }
        batch.push_back({{layer, index}, physical});
        if (batch.size() == spans_per_batch_) {
          RETURN_IF_ERROR(SendBatch(batch));
          batch.clear();
        }
      }
    }
    if (!batch.empty()) RETURN_IF_ERROR(SendBatch(batch));
    return absl::OkStatus();
  }

  absl::StatusOr<SendStats> Finish() override {
    if (done_) {
      return absl::FailedPreconditionError("transfer already finished");
    }
    if (!status_.ok()) {
      Cancel();
      return status_;
    }
    done_ = true;
    absl::MutexLock l(&link_->mu);
    absl::Status s = link_->Drain();
    absl::StatusOr<ReplyMessage> reply;
    if (s.ok()) reply = link_->Call(EndMessage{transfer_id_, /*ok=*/true});
    if (s.ok()) s = reply.ok() ? StatusOf(*reply) : reply.status();
    if (!s.ok()) {
      if (metrics_) metrics_->Failure("send_error");
      return s;
    }
    return stats_;
  }

  void Cancel() override {
    if (done_) return;
    done_ = true;
    absl::MutexLock l(&link_->mu);
    // Best effort: on a broken link the receiver ends the transfer itself.
    if (!link_->broken()) {
      link_->Call(EndMessage{transfer_id_, /*ok=*/false}).IgnoreError();
    }
  }

 private:
  // Stages, announces and sends one batch. A failure sticks to the session.
  absl::Status SendBatch(const std::vector<PlannedSpan>& batch) {
    status_ = SendBatchOnLink(batch);
    if (!status_.ok() && metrics_) metrics_->Failure("send_error");
    return status_;
  }

  absl::Status SendBatchOnLink(const std::vector<PlannedSpan>& batch) {
    const size_t n = batch.size();
    const size_t data_total = n * data_bytes_, scale_total = n * scale_bytes_;
    absl::MutexLock l(&link_->mu);
    // The previous batch's bytes must have left host staging before it is
    // overwritten (the copy to wire staging runs asynchronously).
    RETURN_IF_ERROR(link_->Drain());
    Communicator* comm = link_->comm();
    if (absl::Status s = comm->ReserveStaging(data_total + scale_total);
        !s.ok()) {
      return link_->Break(s);
    }
    // Device storage: the spans are gathered straight into (device) wire
    // staging after the receiver accepted; host storage goes through host
    // staging first.
    const bool device = pool_->memory().kind == engine::MemoryKind::kDevice;
    uint8_t* host = comm->host_staging();
    ManifestMessage manifest{transfer_id_, {}};
    manifest.spans.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      const PlannedSpan& span = batch[i];
      if (!device) {
        RETURN_IF_ERROR(pool_->CopyToHost(
            span.name.layer, span.physical, host + i * data_bytes_,
            scale_bytes_ > 0 ? host + data_total + i * scale_bytes_ : nullptr));
      }
      manifest.spans.push_back(span.name);
    }
    ASSIGN_OR_RETURN(const ReplyMessage reply, link_->Call(manifest));
    // Refused: the receiver posted nothing, so nothing is sent; the link is
    // fine.
    RETURN_IF_ERROR(StatusOf(reply));
    absl::Status s;
    if (device) {
      for (size_t i = 0; i < n && s.ok(); ++i) {
        const engine::KvSpan src =
            pool_->Span(batch[i].name.layer, batch[i].physical);
        s = comm->CopyToWire(i * data_bytes_, src.data, data_bytes_);
        if (s.ok() && scale_bytes_ > 0) {
          s = comm->CopyToWire(data_total + i * scale_bytes_, src.scales,
                               scale_bytes_);
        }
      }
    } else {
      s = comm->CopyHostToWire(0, data_total + scale_total);
    }
    if (s.ok()) s = comm->GroupStart();
    if (s.ok()) {
      s = comm->Send(0, data_total);
      if (s.ok() && scale_total > 0) s = comm->Send(data_total, scale_total);
      const absl::Status ended = comm->GroupEnd();
      if (s.ok()) s = ended;
    }
    absl::StatusOr<std::unique_ptr<Completion>> done =
        s.ok() ? comm->Record()
               : absl::StatusOr<std::unique_ptr<Completion>>(s);
    if (!done.ok()) return link_->Break(done.status());
    link_->SetLast(*std::move(done));
    stats_.bytes += data_total + scale_total;
    stats_.spans += n;
    if (metrics_) {
      metrics_->bytes_sent->Increment(
          static_cast<double>(data_total + scale_total));
    }
    return absl::OkStatus();
  }

  const SendPlan plan_;
  engine::KvStorage* const pool_;
  const std::shared_ptr<NcclLink> link_;
  const uint64_t transfer_id_;
  const size_t spans_per_batch_;
  TransferMetrics* const metrics_;
  const size_t data_bytes_;   // one span's KV bytes
  const size_t scale_bytes_;  // its int8 scales, 0 otherwise
  SendStats stats_;
  absl::Status status_;  // the first failure; the session is unusable after it
  bool done_ = false;
};

}  // namespace

NcclKvTransport::NcclKvTransport(ControlChannelFactory* control,
                                 CommunicatorFactory* comms,
                                 TransferMetrics* metrics,
                                 NcclTransportConfig config)
    : control_(control), comms_(comms), metrics_(metrics), config_(config) {}

NcclKvTransport::~NcclKvTransport() = default;

absl::StatusOr<std::shared_ptr<NcclLink>> NcclKvTransport::LinkTo(
    const std::string& destination, const std::string& sender_id) {
  std::shared_ptr<NcclLink> link;
  std::vector<std::shared_ptr<NcclLink>> dropped;  // destroyed outside mu_
  {
    absl::MutexLock l(&mu_);
    auto it = links_.find(destination);
    if (it == links_.end() || it->second.link->broken()) {
      if (it == links_.end()) {
        dropped = EvictForNewLink(destination);
      } else {
        dropped.push_back(std::move(it->second.link));
      }
      it = links_.insert_or_assign(destination, LinkSlot{}).first;
      it->second.link = std::make_shared<NcclLink>(destination, config_);
    }
    it->second.last_used = ++use_clock_;
    link = it->second.link;
  }
  // Evicted links tear their communicators down here, without mu_.
  dropped.clear();
  // Connecting waits on the peer, so it holds only this link's lock: other
  // destinations are not held up, and concurrent Opens to this one wait for
  // the same connection.
  absl::MutexLock l(&link->mu);
  RETURN_IF_ERROR(link->Connect(control_, comms_, sender_id));
  return link;
}

absl::StatusOr<std::unique_ptr<KvSendSession>> NcclKvTransport::Open(
    const SendPlan& plan, engine::KvStorage* pool) {
  if (plan.destination.empty()) {
    return absl::InvalidArgumentError("KV destination is empty");
  }
  // Both ends size every span from the layout the handshake compares, so the
  // plan must describe the pool the bytes are read from.
  if (absl::Status s = CheckLayouts(
          KvLayout::FromSpec(pool->spec(), plan.layout.fingerprint),
          plan.layout);
      !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the send plan's layout is not the pool's (sender = pool, "
                     "receiver = plan): ",
                     s.message()));
  }
  for (const auto& [index, physical] : plan.blocks) {
    if (physical < 0 || physical >= pool->num_blocks()) {
      return absl::InvalidArgumentError(
          absl::StrCat("planned block ", index, " is physical block ", physical,
                       ", outside the pool of ", pool->num_blocks()));
    }
  }
  absl::StatusOr<std::shared_ptr<NcclLink>> link =
      LinkTo(plan.destination, plan.sender_id);
  if (!link.ok()) {
    if (metrics_) metrics_->Failure("send_error");
    return link.status();
  }
  const engine::KvCacheSpec& spec = pool->spec();
  const uint64_t span_bytes =
      static_cast<uint64_t>(spec.LayerBlockBytes()) +
      (DTypeHasScales(spec.dtype)
           ? 2 * static_cast<uint64_t>(spec.num_kv_heads) * sizeof(float)
           : 0);
  absl::MutexLock l(&(*link)->mu);
  const uint64_t max_batch = (*link)->max_batch_bytes();
  if (span_bytes > max_batch) {
    return absl::FailedPreconditionError(absl::StrCat(
        "one KV span is ", span_bytes,
        " bytes, more than the staging limit of ", max_batch, " bytes"));
  }
  const uint64_t transfer_id = (*link)->NextTransferId();
  ASSIGN_OR_RETURN(const ReplyMessage reply,
                   (*link)->Call(BeginMessage{transfer_id, plan.reservation_id,
                                              plan.request_id, plan.layout}));
  RETURN_IF_ERROR(StatusOf(reply));
  return std::unique_ptr<KvSendSession>(new NcclSendSession(
      plan, pool, *link, transfer_id,
      static_cast<size_t>(max_batch / span_bytes), metrics_));
}

std::vector<std::shared_ptr<NcclLink>> NcclKvTransport::EvictForNewLink(
    const std::string& keep) {
  std::vector<std::shared_ptr<NcclLink>> evicted;
  while (static_cast<int>(links_.size()) >= config_.max_links) {
    // The idle link (held only by this map) used least recently, or a
    // broken one first.
    auto victim = links_.end();
    for (auto it = links_.begin(); it != links_.end(); ++it) {
      if (it->first == keep || it->second.link.use_count() > 1) continue;
      const bool better =
          victim == links_.end() ||
          (it->second.link->broken() && !victim->second.link->broken()) ||
          (it->second.link->broken() == victim->second.link->broken() &&
           it->second.last_used < victim->second.last_used);
      if (better) victim = it;
    }
    if (victim == links_.end()) break;  // every link is in use
    ++evicted_;
    // Destroying the link (by the caller) destroys its communicator and
    // closes its control channel: the receiver ends whatever was open on it
    // (nothing, as it was idle) and forgets the link.
    evicted.push_back(std::move(victim->second.link));
    links_.erase(victim);
  }
  return evicted;
}

int NcclKvTransport::num_links() const {
  absl::MutexLock l(&mu_);
  int n = 0;
  for (const auto& [destination, slot] : links_)
    n += slot.link->broken() ? 0 : 1;
  return n;
}

int64_t NcclKvTransport::num_evicted_links() const {
  absl::MutexLock l(&mu_);
  return evicted_;
}

}  // namespace pdserve::kv_transfer::nccl
