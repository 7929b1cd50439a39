#include "kv_transfer/ipc/ipc_transport.h"

#include <algorithm>
#include <deque>
#include <iterator>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv_transfer/ipc/ipc_messages.h"

namespace pdserve::kv_transfer::ipc {

absl::Status IpcTransportConfig::Validate() const {
  if (timeout <= absl::ZeroDuration())
    return absl::InvalidArgumentError("ipc transport: timeout must be > 0");
  if (max_batch_bytes == 0) {
    return absl::InvalidArgumentError(
        "ipc transport: max_batch_bytes must be > 0");
  }
  if (max_peers < 1)
    return absl::InvalidArgumentError("ipc transport: max_peers must be >= 1");
  return absl::OkStatus();
}

absl::Status IpcReceiverConfig::Validate() const {
  if (timeout <= absl::ZeroDuration())
    return absl::InvalidArgumentError("ipc receiver: timeout must be > 0");
  if (max_streams < 1) {
    return absl::InvalidArgumentError("ipc receiver: max_streams must be >= 1");
  }
  return absl::OkStatus();
}

namespace {

absl::Status Send(ControlChannel* channel, const IpcMessage& m) {
  return channel->Send(EncodeMessage(m));
}

// The next message, which must be a `T`; anything else is a protocol error.
template <typename T>
absl::StatusOr<T> Expect(ControlChannel* channel, absl::Time deadline) {
  ASSIGN_OR_RETURN(std::string bytes, channel->Receive(deadline));
  ASSIGN_OR_RETURN(IpcMessage m, DecodeMessage(bytes));
  if (T* t = std::get_if<T>(&m)) return std::move(*t);
  if (ReplyMessage* r = std::get_if<ReplyMessage>(&m);
      r && r->code != absl::StatusCode::kOk)
    return StatusOf(*r);
  // A peer that breaks the protocol sent a bad request, not an internal
  // failure of this process.
  return absl::InvalidArgumentError(
      "KV ipc control stream: unexpected message");
}

}  // namespace

struct IpcKvTransport::Peer {
  KvExport exported;
  std::unique_ptr<PeerMapping> mapping;
};

class IpcSendSession : public KvSendSession {
 public:
  IpcSendSession(IpcKvTransport* transport, const SendPlan& plan,
                 engine::KvStorage* storage,
                 std::unique_ptr<ControlChannel> channel,
                 std::shared_ptr<IpcKvTransport::Peer> peer)
      : transport_(transport),
        plan_(plan),
        storage_(storage),
        channel_(std::move(channel)),
        peer_(std::move(peer)),
        started_(absl::Now()) {
    const uint64_t span =
        peer_->exported.data_bytes + peer_->exported.scale_bytes;
    spans_per_batch_ = static_cast<size_t>(
        std::max<uint64_t>(1, transport_->config_.max_batch_bytes / span));
    if (transport_->metrics_) transport_->metrics_->in_flight->Increment();
  }
  ~IpcSendSession() override {
    Cancel();
    if (transport_->metrics_) transport_->metrics_->in_flight->Decrement();
  }

  absl::Status SendLayers(int32_t first, int32_t last) override {
    return SendBlocks(first, last, plan_.blocks);
  }

  absl::Status SendBlocks(int32_t first, int32_t last,
                          std::span<const BlockRef> blocks) override {
    if (done_) return absl::FailedPreconditionError("transfer already ended");
    RETURN_IF_ERROR(status_);
    if (first < 0 || last > storage_->spec().num_layers || first > last) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer range [", first, ", ", last, ") is invalid"));
    }
    for (const BlockRef& b : blocks) {
      if (b.second < 0 || b.second >= storage_->num_blocks()) {
        return absl::InvalidArgumentError(
            absl::StrCat("sender block ", b.second, " is outside this pool of ",
                         storage_->num_blocks(), " blocks"));
      }
    }
    std::vector<std::pair<SpanName, int32_t>> batch;
    batch.reserve(std::min(spans_per_batch_,
                           blocks.size() * static_cast<size_t>(last - first)));
    for (int32_t l = first; l < last; ++l) {
      for (const BlockRef& b : blocks) {
        batch.push_back({SpanName{l, b.first}, b.second});
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
    if (done_) return absl::FailedPreconditionError("transfer already ended");
    RETURN_IF_ERROR(status_);
    done_ = true;
    absl::Status s = Send(channel_.get(), EndMessage{true});
    if (s.ok()) {
      absl::StatusOr<ReplyMessage> reply =
          Expect<ReplyMessage>(channel_.get(), Deadline());
      s = reply.ok() ? StatusOf(*reply) : reply.status();
    }
    channel_->Close();
    if (!s.ok()) return Fail(s);
    if (transport_->metrics_) {
      transport_->metrics_->duration->Observe(
          absl::ToDoubleSeconds(absl::Now() - started_));
    }
    return stats_;
  }

  void Cancel() override {
    if (done_) return;
    done_ = true;
    // Best effort: a receiver that hears nothing ends the transfer when the
    // stream closes.
    (void)Send(channel_.get(), EndMessage{false});
    channel_->Close();
  }

 private:
  absl::Time Deadline() const {
    return absl::Now() + transport_->config_.timeout;
  }

  // Records the first failure, ends the stream (the receiver frees the
  // reservation) and forgets a peer that stopped answering.
  absl::Status Fail(absl::Status s) {
    if (status_.ok()) status_ = s;
    if (transport_->metrics_) transport_->metrics_->Failure("send_error");
    if (s.code() == absl::StatusCode::kUnavailable ||
        s.code() == absl::StatusCode::kDeadlineExceeded) {
      transport_->Forget(plan_.destination, peer_.get());
    }
    done_ = true;
    channel_->Close();
    return s;
  }

  absl::Status SendBatch(
      const std::vector<std::pair<SpanName, int32_t>>& batch) {
    ManifestMessage manifest;
    manifest.spans.reserve(batch.size());
    for (const auto& [name, physical] : batch) manifest.spans.push_back(name);
    if (absl::Status s = Send(channel_.get(), manifest); !s.ok())
      return Fail(s);
    absl::StatusOr<ReplyMessage> reply =
        Expect<ReplyMessage>(channel_.get(), Deadline());
    // The receiver holds these spans claimed for its timeout from the moment
    // it replied; copies must be over well within it (see CopyDeadline).
    const absl::Time replied = absl::Now();
    if (!reply.ok()) return Fail(reply.status());
    if (absl::Status s = StatusOf(*reply); !s.ok()) return Fail(s);
    const KvExport& e = peer_->exported;
    if (reply->blocks.size() != batch.size()) {
      return Fail(absl::InternalError(
          absl::StrCat("decode worker named ", reply->blocks.size(),
                       " blocks for ", batch.size(), " spans")));
    }
    std::vector<CopyOp> ops;
    ops.reserve(batch.size() * (e.scale_bytes > 0 ? 2 : 1));
    for (size_t i = 0; i < batch.size(); ++i) {
      const int32_t layer = batch[i].first.layer;
      const int32_t block = reply->blocks[i];
      // The only addresses written: inside [0, num_blocks) of the layer's
      // exported range, which Validate proved lies inside its region.
      if (block < 0 || block >= e.num_blocks) {
        return Fail(absl::InternalError(
            absl::StrCat("decode worker named block ", block,
                         " outside its pool of ", e.num_blocks, " blocks")));
      }
      const LayerPlacement& p = e.layers[layer];
      const engine::KvSpan src = storage_->Span(layer, batch[i].second);
      ops.push_back({peer_->mapping->base(p.data_region) + p.data_offset +
                         static_cast<uint64_t>(block) * e.data_bytes,
                     src.data, e.data_bytes});
      if (e.scale_bytes > 0) {
        ops.push_back({peer_->mapping->base(p.scale_region) + p.scale_offset +
                           static_cast<uint64_t>(block) * e.scale_bytes,
                       src.scales, e.scale_bytes});
      }
    }
    if (transport_->config_.before_copy_for_test)
      transport_->config_.before_copy_for_test();
    // Never start writing once the receiver may have given up on this batch
    // and freed its blocks: a copy starts only within half the timeout of
    // the reply (the receiver waits the whole timeout, and both ends use
    // the same one), and must complete by then.
    const absl::Time copy_deadline = replied + transport_->config_.timeout / 2;
    if (absl::Now() >= copy_deadline) {
      (void)Send(channel_.get(), CopiedMessage{false});
      return Fail(absl::DeadlineExceededError(
          "KV ipc: the batch's copy could not start in time; not writing "
          "into blocks whose reservation may have lapsed"));
    }
    const absl::Status copied = peer_->mapping->Copy(ops, copy_deadline);
    const absl::Status reported =
        Send(channel_.get(), CopiedMessage{copied.ok()});
    if (!copied.ok()) return Fail(copied);
    if (!reported.ok()) return Fail(reported);
    const uint64_t bytes = batch.size() * (e.data_bytes + e.scale_bytes);
    stats_.bytes += bytes;
    stats_.spans += batch.size();
    if (transport_->metrics_)
      transport_->metrics_->bytes_sent->Increment(static_cast<double>(bytes));
    return absl::OkStatus();
  }

  IpcKvTransport* const transport_;
  const SendPlan plan_;
  engine::KvStorage* const storage_;
  const std::unique_ptr<ControlChannel> channel_;
  const std::shared_ptr<IpcKvTransport::Peer> peer_;
  const absl::Time started_;
  size_t spans_per_batch_ = 1;
  absl::Status status_;
  bool done_ = false;
  SendStats stats_;
};

IpcKvTransport::IpcKvTransport(ControlChannelFactory* control,
                               PeerMemoryBackend* backend,
                               TransferMetrics* metrics,
                               IpcTransportConfig config)
    : control_(control),
      backend_(backend),
      metrics_(metrics),
      config_(std::move(config)) {}

IpcKvTransport::~IpcKvTransport() = default;

absl::StatusOr<std::unique_ptr<KvSendSession>> IpcKvTransport::Open(
    const SendPlan& plan, engine::KvStorage* storage) {
  auto fail = [this](absl::Status s) {
    if (metrics_) metrics_->Failure("send_error");
    return s;
  };
  if (storage->memory().kind != backend_->memory_kind()) {
    return fail(absl::FailedPreconditionError(absl::StrCat(
        "--kv-transport ", name(), " sends from ",
        backend_->memory_kind() == engine::MemoryKind::kHost ? "host" : "GPU",
        " KV pools, but this worker's pool is in ",
        engine::KvMemoryName(storage->memory()))));
  }
  absl::StatusOr<std::unique_ptr<ControlChannel>> channel =
      control_->Connect(plan.destination);
  if (!channel.ok()) return fail(channel.status());
  OpenMessage open{backend_->kind(), plan.sender_id, plan.reservation_id,
                   plan.request_id, plan.layout};
  absl::Status s = Send(channel->get(), open);
  absl::StatusOr<ReplyMessage> reply =
      s.ok()
          ? Expect<ReplyMessage>(channel->get(), absl::Now() + config_.timeout)
          : absl::StatusOr<ReplyMessage>(s);
  if (reply.ok()) s = StatusOf(*reply);
  if (!reply.ok()) s = reply.status();
  if (s.ok() && !reply->exported) {
    s = absl::InternalError("decode worker's handshake reply has no export");
  }
  std::shared_ptr<Peer> peer;
  if (s.ok()) {
    absl::StatusOr<std::shared_ptr<Peer>> p =
        PeerFor(plan.destination, *reply->exported, storage);
    if (p.ok())
      peer = *std::move(p);
    else
      s = p.status();
  }
  if (!s.ok()) {
    (*channel)->Close();
    return fail(s);
  }
  return std::unique_ptr<KvSendSession>(new IpcSendSession(
      this, plan, storage, *std::move(channel), std::move(peer)));
}

absl::StatusOr<std::shared_ptr<IpcKvTransport::Peer>> IpcKvTransport::PeerFor(
    const std::string& destination, const KvExport& exported,
    engine::KvStorage* own) {
  {
    absl::MutexLock l(&mu_);
    auto it = peers_.find(destination);
    if (it != peers_.end() &&
        it->second.peer->exported.export_id == exported.export_id) {
      it->second.last_used = ++clock_;
      return it->second.peer;
    }
  }
  // A new peer, or one that restarted (new export): validate its geometry,
  // then map it outside the lock (mapping may take milliseconds).
  RETURN_IF_ERROR(exported.Validate(own->spec()));
  auto peer = std::make_shared<Peer>();
  peer->exported = exported;
  ASSIGN_OR_RETURN(peer->mapping, backend_->MapPeer(exported, own));
  std::shared_ptr<Peer> dropped;  // unmapped after the lock is released
  std::vector<std::shared_ptr<Peer>> evicted;
  absl::MutexLock l(&mu_);
  // Unmap idle peers whose storage is gone (a decode worker that died and
  // never came back at its address), so their memory is released.
  for (auto p = peers_.begin(); p != peers_.end();) {
    if (p->first != destination && p->second.peer.use_count() == 1 &&
        !p->second.peer->mapping->PeerAlive()) {
      evicted.push_back(std::move(p->second.peer));
      peers_.erase(p++);
    } else {
      ++p;
    }
  }
  auto it = peers_.find(destination);
  if (it != peers_.end()) {
    if (it->second.peer->exported.export_id == exported.export_id) {
      it->second.last_used = ++clock_;  // a racing Open mapped it first
      return it->second.peer;
    }
    dropped = std::move(it->second.peer);
    peers_.erase(it);
  }
  while (static_cast<int>(peers_.size()) >= config_.max_peers) {
    auto lru = peers_.end();
    for (auto p = peers_.begin(); p != peers_.end(); ++p) {
      if (p->second.peer.use_count() == 1 &&
          (lru == peers_.end() || p->second.last_used < lru->second.last_used))
        lru = p;
    }
    if (lru == peers_.end()) break;  // every mapping is in use: exceed the cap
    evicted.push_back(std::move(lru->second.peer));
    peers_.erase(lru);
  }
  ++maps_;
  peers_[destination] = PeerSlot{peer, ++clock_};
  return peer;
}

void IpcKvTransport::Forget(const std::string& destination, const Peer* peer) {
  std::shared_ptr<Peer> dropped;
  absl::MutexLock l(&mu_);
  auto it = peers_.find(destination);
  if (it != peers_.end() && it->second.peer.get() == peer) {
    dropped = std::move(it->second.peer);
    peers_.erase(it);
  }
}

int IpcKvTransport::num_mappings() const {
  absl::MutexLock l(&mu_);
  return static_cast<int>(peers_.size());
}

int64_t IpcKvTransport::num_maps() const {
  absl::MutexLock l(&mu_);
  return maps_;
}

// ---- receiving side ----

absl::StatusOr<std::unique_ptr<IpcKvReceiveEndpoint>>
IpcKvReceiveEndpoint::Create(KvReceiver* receiver, engine::KvStorage* storage,
                             PeerMemoryBackend* backend,
                             IpcReceiverConfig config) {
  RETURN_IF_ERROR(config.Validate());
  ASSIGN_OR_RETURN(KvExport exported, ExportStorage(storage, backend));
  return std::unique_ptr<IpcKvReceiveEndpoint>(new IpcKvReceiveEndpoint(
      receiver, storage, backend, std::move(exported), config));
}

IpcKvReceiveEndpoint::IpcKvReceiveEndpoint(KvReceiver* receiver,
                                           engine::KvStorage* storage,
                                           PeerMemoryBackend* backend,
                                           KvExport exported,
                                           IpcReceiverConfig config)
    : receiver_(receiver),
      storage_(storage),
      backend_(backend),
      export_(std::move(exported)),
      config_(config) {
  reaper_ = std::thread([this] { Reap(); });
}

IpcKvReceiveEndpoint::~IpcKvReceiveEndpoint() {
  Shutdown();
  for (const ExportedRegion& r : export_.regions) backend_->Unexport(r.handle);
}

void IpcKvReceiveEndpoint::Serve(std::unique_ptr<ControlChannel> channel) {
  {
    absl::MutexLock l(&mu_);
    if (shutdown_) {
      channel->Close();
      return;
    }
    if (static_cast<int>(streams_.size()) - finished_ < config_.max_streams) {
      StartStreamLocked(std::move(channel));
      return;
    }
    ++refused_;
  }
  // Answered in place of the Open reply the sender waits for, without
  // reading anything from the stream (and outside the lock: the peer may
  // be slow to read). Closing at once could cancel the call before the
  // answer leaves, so the channel is parked (no thread) and closed by the
  // reaper after kRefusalGrace; a sender closes it sooner itself.
  (void)Send(channel.get(), ReplyFor(absl::ResourceExhaustedError(absl::StrCat(
                                "KV ipc: the decode worker already serves ",
                                config_.max_streams, " control streams"))));
  std::unique_ptr<ControlChannel> oldest;
  absl::MutexLock l(&mu_);
  if (shutdown_) {
    channel->Close();
    return;
  }
  if (static_cast<int>(parked_.size()) >= config_.max_streams) {
    oldest = std::move(parked_.front().second);
    parked_.pop_front();
  }
  parked_.emplace_back(absl::Now() + kRefusalGrace, std::move(channel));
}

void IpcKvReceiveEndpoint::StartStreamLocked(
    std::unique_ptr<ControlChannel> channel) {
  StreamThread& stream = streams_.emplace_back();
  stream.channel = std::move(channel);
  stream.thread = std::thread([this, &stream] {
    RunStream(stream.channel.get());
    absl::MutexLock done(&mu_);
    stream.done = true;
    ++finished_;
  });
}

void IpcKvReceiveEndpoint::Reap() {
  while (true) {
    std::list<StreamThread> done;
    std::vector<std::unique_ptr<ControlChannel>> expired;
    {
      absl::MutexLock l(&mu_);
      mu_.AwaitWithDeadline(
          absl::Condition(
              +[](IpcKvReceiveEndpoint* e) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                return e->shutdown_ || e->finished_ > 0 ||
                       (!e->parked_.empty() &&
                        e->parked_.front().first <= absl::Now());
              },
              this),
          parked_.empty() ? absl::InfiniteFuture() : parked_.front().first);
      if (shutdown_) return;  // Shutdown joins and closes the rest
      while (!parked_.empty() && parked_.front().first <= absl::Now()) {
        expired.push_back(std::move(parked_.front().second));
        parked_.pop_front();
      }
      for (auto it = streams_.begin(); it != streams_.end();) {
        auto next = std::next(it);
        if (it->done) done.splice(done.end(), streams_, it);
        it = next;
      }
      finished_ = 0;
    }
    // A thread marks itself done under the lock as its last step, so each
    // join returns at once; its channel (and what its inbox holds) is freed
    // with it.
    for (StreamThread& s : done) s.thread.join();
    for (auto& c : expired) c->Close();
  }
}

void IpcKvReceiveEndpoint::RunStream(ControlChannel* channel) {
  const absl::Duration timeout = config_.timeout;
  absl::StatusOr<OpenMessage> open =
      Expect<OpenMessage>(channel, absl::Now() + timeout);
  if (!open.ok()) {
    (void)Send(channel, ReplyFor(open.status()));
    channel->Close();
    return;
  }
  absl::Status begun =
      open->kind != backend_->kind()
          ? absl::FailedPreconditionError(absl::StrCat(
                "KV transport mismatch: sender ", PeerMemoryName(open->kind),
                " vs receiver ", PeerMemoryName(backend_->kind())))
          : receiver_->Begin(open->reservation_id, open->request_id,
                             open->layout);
  ReplyMessage hello = ReplyFor(begun);
  if (begun.ok()) hello.exported = export_;
  if (!Send(channel, hello).ok() || !begun.ok()) {
    if (begun.ok()) receiver_->End(open->reservation_id, /*ok=*/false);
    channel->Close();
    return;
  }
  const uint64_t reservation = open->reservation_id;
  const engine::KvCacheSpec& spec = storage_->spec();
  bool ended = false;
  while (!ended) {
    absl::StatusOr<std::string> bytes = channel->Receive(absl::Now() + timeout);
    if (!bytes.ok()) break;  // the sender died, stalled or closed
    absl::StatusOr<IpcMessage> message = DecodeMessage(*bytes);
    if (!message.ok()) {
      (void)Send(channel, ReplyFor(message.status()));
      break;
    }
    if (auto* end = std::get_if<EndMessage>(&*message)) {
      receiver_->End(reservation, end->ok);
      ended = true;
      (void)Send(channel, ReplyFor(absl::OkStatus()));
      break;
    }
    auto* manifest = std::get_if<ManifestMessage>(&*message);
    if (manifest == nullptr) {
      (void)Send(channel, ReplyFor(absl::InvalidArgumentError(
                              "KV ipc: expected a manifest or an end")));
      break;
    }
    std::vector<KvReceiver::SpanRef> refs;
    refs.reserve(manifest->spans.size());
    for (const SpanName& s : manifest->spans)
      refs.push_back({s.layer, s.block_index});
    bool replied = false;
    const absl::Status written = receiver_->WriteSpans(
        reservation, refs,
        [&](std::span<const engine::KvSpan> targets) -> absl::Status {
          // The spans are claimed: tell the sender where they are, then
          // hold the claim until it reports its copies done.
          ReplyMessage where;
          where.blocks.reserve(targets.size());
          const uint64_t stride = static_cast<uint64_t>(spec.LayerBlockBytes());
          for (size_t i = 0; i < targets.size(); ++i) {
            const auto* base = static_cast<const uint8_t*>(
                storage_->Span(refs[i].layer, 0).data);
            const uint64_t offset = static_cast<uint64_t>(
                static_cast<const uint8_t*>(targets[i].data) - base);
            where.blocks.push_back(static_cast<int32_t>(offset / stride));
          }
          RETURN_IF_ERROR(Send(channel, where));
          replied = true;
          ASSIGN_OR_RETURN(
              CopiedMessage copied,
              Expect<CopiedMessage>(channel, absl::Now() + timeout));
          if (!copied.ok) {
            return absl::DataLossError(
                "the prefill worker's copy into the reserved blocks failed");
          }
          return absl::OkStatus();
        });
    if (!replied) (void)Send(channel, ReplyFor(written));
    // A refused or failed batch failed the reservation (KvReceiver); the
    // stream has nothing more to carry.
    if (!written.ok()) break;
  }
  if (!ended) receiver_->End(reservation, /*ok=*/false);
  channel->Close();
}

void IpcKvReceiveEndpoint::Shutdown() {
  std::list<StreamThread> streams;
  {
    absl::MutexLock l(&mu_);
    shutdown_ = true;
    for (StreamThread& s : streams_) s.channel->Close();
  }
  // The reaper returns on shutdown_; then every stream left is this one's
  // to join.
  if (reaper_.joinable()) reaper_.join();
  std::deque<std::pair<absl::Time, std::unique_ptr<ControlChannel>>> parked;
  {
    absl::MutexLock l(&mu_);
    streams.splice(streams.end(), streams_);
    finished_ = 0;
    parked.swap(parked_);
  }
  for (StreamThread& s : streams) s.thread.join();
  for (auto& [deadline, c] : parked) c->Close();
}

int IpcKvReceiveEndpoint::active_streams() const {
  absl::MutexLock l(&mu_);
  int n = 0;
  for (const StreamThread& s : streams_) n += s.done ? 0 : 1;
  return n;
}

int IpcKvReceiveEndpoint::held_streams() const {
  absl::MutexLock l(&mu_);
  return static_cast<int>(streams_.size());
}

int64_t IpcKvReceiveEndpoint::refused_streams() const {
  absl::MutexLock l(&mu_);
  return refused_;
}

}  // namespace pdserve::kv_transfer::ipc
