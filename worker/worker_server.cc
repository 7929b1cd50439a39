#include "worker/worker_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>

#include <array>
#include <atomic>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/metric_handles.h"
#include "common/status_macros.h"
#include "common/tls.h"
#include "decode_service/decode_handler.h"
#include "engine/engine_loop.h"
#include "kernels/cpu/matmul.h"
#include "kv_cache/kv_event_log.h"
#include "kv_transfer/grpc/grpc_transport.h"
#include "kv_transfer/ipc/ipc_service.h"
#include "kv_transfer/ipc/ipc_transport.h"
#include "kv_transfer/nccl/grpc_control_channel.h"
#include "kv_transfer/nccl/nccl_receiver.h"
#include "kv_transfer/nccl/nccl_runtime.h"
#include "kv_transfer/nccl/nccl_transport.h"
#include "kv_transfer/transfer_metrics.h"
#include "model/weights.h"
#include "prefill_service/peer_pull.h"
#include "prefill_service/prefill_handler.h"
#include "structured/token_guide.h"
#include "tokenizer/tokenizer.h"
#include "wire/enums.h"
#include "wire/peer_pull_grant.h"

namespace pdserve::worker {
namespace {

std::string HashBytes(const engine::BlockHash& h) {
  std::string out(16, '\0');
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<char>(h.hi >> (56 - 8 * i));
    out[8 + i] = static_cast<char>(h.lo >> (56 - 8 * i));
  }
  return out;
}

v1::KvEventProto EventToProto(const engine::KvEvent& e) {
  v1::KvEventProto p;
  p.set_seq(e.seq);
  switch (e.type) {
    case engine::KvEvent::Type::kStored:
      p.set_type(v1::KvEventProto::STORED);
      break;
    case engine::KvEvent::Type::kRemoved:
      p.set_type(v1::KvEventProto::REMOVED);
      break;
    case engine::KvEvent::Type::kCleared:
      p.set_type(v1::KvEventProto::CLEARED);
      break;
    case engine::KvEvent::Type::kMoved:
      p.set_type(v1::KvEventProto::MOVED);
      p.set_from_tier(static_cast<v1::KvTier>(e.from_tier));
      break;
  }
  p.set_tier(static_cast<v1::KvTier>(e.tier));
  p.set_parent_hash(HashBytes(e.parent));
  for (const auto& h : e.hashes) p.add_hashes(HashBytes(h));
  return p;
}

}  // namespace

absl::Status WorkerConfig::Validate() const {
  if (!wire::IsKnownRole(role)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--role must be prefill, decode or both, got role #",
                     static_cast<int>(role)));
  }
  if (model_dir.empty())
    return absl::InvalidArgumentError("--model is required");
  // The same-node transports move one memory kind: host pools over shm, GPU
  // pools over cuda_ipc.
  if (kv_transport == kv_transfer::KvTransportKind::kCudaIpc &&
      engine.device != engine::Device::kCuda) {
    return absl::InvalidArgumentError(
        "--kv-transport cuda_ipc moves GPU KV pools and needs --device cuda; "
        "CPU workers on one node use --kv-transport shm");
  }
  if (kv_transport == kv_transfer::KvTransportKind::kShm &&
      engine.device != engine::Device::kCpu) {
    return absl::InvalidArgumentError(
        "--kv-transport shm moves host KV pools (--device cpu); GPU workers "
        "on one node use --kv-transport cuda_ipc");
  }
  if (port < 0 || port > 65535)
    return absl::InvalidArgumentError("--port must be in [0, 65535]");
  if (grpc_memory_quota_bytes < 0 || grpc_max_threads < 0) {
    return absl::InvalidArgumentError(
        "gRPC memory quota and thread cap must be >= 0");
  }
  if (kv_stream_queue_bytes < 0) {
    return absl::InvalidArgumentError("--kv-stream-queue-bytes must be >= 0");
  }
  return engine.Validate();
}

struct WorkerServer::Impl final : public v1::Worker::Service {
  WorkerConfig config;
  // Written by Start before `ready` is set (release), read by RPCs only
  // after they saw `ready` (acquire): the server starts listening before the
  // port, and so the address and id, are known.
  std::string address, id;
  std::atomic<bool> ready{false};
  engine::KvEventLog events;
  std::unique_ptr<engine::EngineLoop> loop;
  kv_transfer::KvLayout layout;
  std::string cache_fingerprint;
  std::unique_ptr<kv_transfer::TransferMetrics> transfer_metrics;
  // --kv-transport nccl: communicators and control plane. Declared before
  // what uses them, so they are destroyed after it.
  std::unique_ptr<kv_transfer::nccl::CommunicatorFactory> nccl_comms;
  std::unique_ptr<kv_transfer::nccl::GrpcControlChannelFactory> nccl_control;
  // --kv-transport shm|cuda_ipc: the peer-memory backend (its control plane
  // is nccl_control's KvTransfer.Control stream).
  std::unique_ptr<kv_transfer::ipc::PeerMemoryBackend> ipc_backend;
  std::unique_ptr<kv_transfer::KvReceiver> receiver;
  std::unique_ptr<kv_transfer::nccl::NcclKvReceiveEndpoint> nccl_endpoint;
  std::unique_ptr<kv_transfer::ipc::IpcKvReceiveEndpoint> ipc_endpoint;
  std::unique_ptr<kv_transfer::KvTransport> transport;
  std::unique_ptr<kv_transfer::KvTransferService> kv_service;
  // Peer pull (prefill_service/peer_pull.h): every role can hold blocks for
  // a puller; prefill-serving roles pull. Rates exported in WorkerStatus.
  // The keys of the routers' pull grants come with their status polls.
  prefill::RateMeter prefill_rate, transfer_rate;
  wire::PeerPullKeys peer_pull_keys;
  std::unique_ptr<prefill::PeerPullMetrics> peer_pull_metrics;
  std::unique_ptr<prefill::PeerPuller> puller;
  std::unique_ptr<prefill::PeerBlockHolder> holder;
  std::unique_ptr<prefill::PrefillHandler> prefill;
  std::unique_ptr<decode::DecodeHandler> decode;
  std::unique_ptr<grpc::Server> server;
  metrics::Registry::CollectorHandle collector;
  bool serves_prefill = false, serves_decode = false;
  std::atomic<bool> draining{false};
  std::atomic<int> in_flight{0};

  // Counts a handler as in flight for the drain.
  struct InFlight {
    explicit InFlight(std::atomic<int>* n) : n_(n) { ++*n_; }
    ~InFlight() { --*n_; }
    std::atomic<int>* n_;
  };

  static grpc::Status Starting() {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker is starting");
  }
  bool Ready() const { return ready.load(std::memory_order_acquire); }

  grpc::Status GetStatus(grpc::ServerContext*, const v1::WorkerInfoRequest* req,
                         v1::WorkerStatus* out) override {
    if (!Ready()) return Starting();
    if (!req->peer_pull_key().empty()) peer_pull_keys.Add(req->peer_pull_key());
    const engine::EngineStats s = loop->stats();
    out->set_id(id);
    out->set_role(config.role);
    out->set_address(address);
    *out->mutable_layout() = kv_transfer::ToProto(layout);
    out->set_max_model_len(static_cast<uint32_t>(loop->max_model_len()));
    out->set_num_running(static_cast<uint32_t>(s.num_running));
    out->set_num_waiting(static_cast<uint32_t>(s.num_waiting));
    out->set_free_blocks(
        static_cast<uint32_t>(s.blocks_free + s.blocks_cached));
    out->set_total_blocks(static_cast<uint32_t>(loop->num_blocks()));
    out->set_queued_prefill_tokens(
        static_cast<uint64_t>(s.queued_prefill_tokens));
    out->set_cache_fingerprint(cache_fingerprint);
    out->set_draining(draining);
    out->set_prefill_tokens_per_second(prefill_rate.rate());
    out->set_kv_transfer_bytes_per_second(transfer_rate.rate());
    out->set_peer_pull_max_blocks(
        static_cast<uint32_t>(holder->max_blocks_per_pull()));
    if (s.has_kv_tier) {
      out->set_kv_tier(static_cast<v1::KvTier>(s.kv_tier.kind));
      out->set_kv_tier_blocks(static_cast<uint64_t>(s.kv_tier.blocks_stored));
      out->set_kv_tier_load_tokens_per_second(s.kv_tier.LoadTokensPerSecond());
    }
    return grpc::Status::OK;
  }

  grpc::Status PullBlocks(grpc::ServerContext* ctx,
                          const v1::PullBlocksRequest* req,
                          v1::PullBlocksResponse* resp) override {
    if (!Ready()) return Starting();
    InFlight guard(&in_flight);
    return holder->PullBlocks(ctx, *req, resp);
  }

  grpc::Status Generate(
      grpc::ServerContext* ctx, const v1::WorkerGenerateRequest* req,
      grpc::ServerWriter<v1::WorkerGenerateResponse>* writer) override {
    if (!Ready()) return Starting();
    if (!serves_decode)
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          "this is a prefill-only worker");
    InFlight guard(&in_flight);
    if (draining)
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker is draining");
    return decode->Generate(ctx, *req, writer);
  }

  grpc::Status Prefill(grpc::ServerContext* ctx, const v1::PrefillRequest* req,
                       v1::PrefillResponse* resp) override {
    if (!Ready()) return Starting();
    if (!serves_prefill)
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          "this is a decode-only worker");

    InFlight guard(&in_flight);
    if (draining)
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker is draining");
    return prefill->Prefill(ctx, *req, resp);
  }

  grpc::Status SubscribeKvEvents(
      grpc::ServerContext* ctx, const v1::SubscribeKvEventsRequest*,
      grpc::ServerWriter<v1::KvEventBatch>* writer) override {
    if (!Ready()) return Starting();
    // Snapshot on the engine thread: every hash of the pool and of the tier
    // below it as of a sequence number.
    absl::StatusOr<engine::Engine::KvSnapshot> taken =
        loop->Call([](engine::Engine& e) { return e.TakeKvSnapshot(); });
    if (!taken.ok()) return ToGrpc(taken.status());
    engine::Engine::KvSnapshot& snap = *taken;
    v1::KvEventBatch first;
    first.set_worker_id(id);
    first.set_snapshot(true);
    engine::KvEvent all{
        snap.seq, engine::KvEvent::Type::kStored, {}, std::move(snap.pool)};
    *first.add_events() = EventToProto(all);
    if (snap.has_tier) {
      engine::KvEvent tier{
          snap.seq, engine::KvEvent::Type::kStored, {}, std::move(snap.tier)};
      tier.tier = snap.tier_kind;
      *first.add_events() = EventToProto(tier);
    }
    if (!writer->Write(first)) return grpc::Status::OK;
    uint64_t after = snap.seq;
    int idle = 0;
    while (!ctx->IsCancelled()) {
      auto batch = events.ReadAfter(after, absl::Milliseconds(200));
      if (!batch.ok()) return ToGrpc(batch.status());  // subscriber resyncs
      v1::KvEventBatch msg;
      msg.set_worker_id(id);
      if (batch->empty()) {
        // An empty batch now and then lets the subscriber notice shutdown.
        if (++idle % 5 == 0 && !writer->Write(msg)) break;
        continue;
      }
      for (const auto& e : *batch) *msg.add_events() = EventToProto(e);
      after = batch->back().seq;
      if (!writer->Write(msg)) break;
    }
    return grpc::Status::OK;
  }

  void RegisterMetrics(metrics::Registry& r) {
    auto* running = metrics::GaugeChild(r, "pdserve_num_requests_running",
                                        "Sequences in the running batch");
    auto* waiting = metrics::GaugeChild(r, "pdserve_num_requests_waiting",
                                        "Sequences waiting for admission");
    auto* blocks = metrics::Must(r.AddGauge(
        "pdserve_kv_cache_blocks", "KV cache blocks by state", {"state"}));
    auto* free_b = metrics::Must(blocks->WithLabels({"free"}));
    auto* active_b = metrics::Must(blocks->WithLabels({"active"}));
    auto* cached_b = metrics::Must(blocks->WithLabels({"cached"}));
    auto* queried =
        metrics::CounterChild(r, "pdserve_prefix_cache_queried_tokens_total",
                              "Prompt tokens looked up in the prefix cache");
    auto* hit =
        metrics::CounterChild(r, "pdserve_prefix_cache_hit_tokens_total",
                              "Prompt tokens served from the prefix cache");
    auto* preempt = metrics::CounterChild(
        r, "pdserve_preemptions_total",
        "Sequences preempted (recomputed later) for lack of KV blocks");
    // The file tier below the pool (kv_cache/kv_tier.h); zero when it is off.
    auto* tier_hit = metrics::CounterChild(
        r, "pdserve_kv_tier_hit_tokens_total",
        "Prompt tokens read back from the KV tier instead of recomputed");
    auto* tier_blocks = metrics::Must(r.AddGauge(
        "pdserve_kv_tier_blocks", "KV tier blocks by state", {"state"}));
    auto* tier_stored = metrics::Must(tier_blocks->WithLabels({"stored"}));
    auto* tier_writing = metrics::Must(tier_blocks->WithLabels({"writing"}));
    auto* tier_bytes = metrics::Must(r.AddCounter(
        "pdserve_kv_tier_bytes_total",
        "Bytes written to and read from the KV tier", {"direction"}));
    auto* tier_written = metrics::Must(tier_bytes->WithLabels({"written"}));
    auto* tier_read = metrics::Must(tier_bytes->WithLabels({"read"}));
    auto* tier_load_s = metrics::CounterChild(
        r, "pdserve_kv_tier_load_seconds_total",
        "Engine-thread seconds spent reading KV tier blocks back");
    auto* tier_failures_family = metrics::Must(r.AddCounter(
        "pdserve_kv_tier_failures_total",
        "KV tier blocks not offloaded or not loaded (then recomputed)",
        {"reason"}));
    std::array<metrics::Counter*, engine::kNumKvTierFailures> tier_failures;
    for (int f = 0; f < engine::kNumKvTierFailures; ++f) {
      tier_failures[f] = metrics::Must(tier_failures_family->WithLabels(
          {engine::KvTierFailureName(static_cast<engine::KvTierFailure>(f))}));
    }
    auto* constrained_rows = metrics::CounterChild(
        r, "pdserve_structured_masked_rows_total",
        "Logits rows masked for structured output before sampling");
    auto* constraint_s = metrics::CounterChild(
        r, "pdserve_structured_mask_seconds_total",
        "Engine-thread seconds spent masking logits and advancing matchers "
        "for structured output");
    // Engine steps: with the step seconds, busy time and mean step time
    // (rate(step_seconds) / rate(steps)); with the tokens, the batch mix.
    auto* steps = metrics::CounterChild(r, "pdserve_engine_steps_total",
                                        "Engine steps (forward passes) run");
    auto* step_s = metrics::CounterChild(
        r, "pdserve_engine_step_seconds_total",
        "Wall seconds the engine thread spent in steps: the worker's busy "
        "time");
    auto* step_tokens = metrics::Must(r.AddCounter(
        "pdserve_engine_tokens_total",
        "Tokens computed by engine steps: prompt passes (prefill) and "
        "one-token decode steps",
        {"kind"}));
    auto* prefill_tokens = metrics::Must(step_tokens->WithLabels({"prefill"}));
    auto* decode_tokens = metrics::Must(step_tokens->WithLabels({"decode"}));
    auto* kernel_threads = metrics::GaugeChild(
        r, "pdserve_kernel_threads",
        "Threads the next parallel CPU kernel may use: --threads plus those "
        "lent by idle workers through --core-share");
    auto last = std::make_shared<engine::EngineStats>();
    collector = r.AddCollector([=, this] {
      kernel_threads->Set(static_cast<double>(kernels::KernelThreads()));
      const engine::EngineStats s = loop->stats();
      running->Set(static_cast<double>(s.num_running));
      waiting->Set(static_cast<double>(s.num_waiting));
      free_b->Set(static_cast<double>(s.blocks_free));
      active_b->Set(static_cast<double>(s.blocks_active));
      cached_b->Set(static_cast<double>(s.blocks_cached));
      queried->Increment(static_cast<double>(s.prefix_queried_tokens -
                                             last->prefix_queried_tokens));
      hit->Increment(
          static_cast<double>(s.prefix_hit_tokens - last->prefix_hit_tokens));
      preempt->Increment(
          static_cast<double>(s.preemptions - last->preemptions));
      tier_hit->Increment(
          static_cast<double>(s.kv_tier.hit_tokens - last->kv_tier.hit_tokens));
      tier_stored->Set(static_cast<double>(s.kv_tier.blocks_stored));
      tier_writing->Set(static_cast<double>(s.kv_tier.blocks_writing));
      tier_written->Increment(static_cast<double>(s.kv_tier.bytes_written -
                                                  last->kv_tier.bytes_written));
      tier_read->Increment(
          static_cast<double>(s.kv_tier.bytes_read - last->kv_tier.bytes_read));
      tier_load_s->Increment(s.kv_tier.load_seconds -
                             last->kv_tier.load_seconds);
      for (int f = 0; f < engine::kNumKvTierFailures; ++f) {
        tier_failures[f]->Increment(static_cast<double>(
            s.kv_tier.failures[f] - last->kv_tier.failures[f]));
      }
      constrained_rows->Increment(
          static_cast<double>(s.constrained_rows - last->constrained_rows));
      constraint_s->Increment(s.constraint_seconds - last->constraint_seconds);
      steps->Increment(static_cast<double>(s.steps - last->steps));
      step_s->Increment(s.step_seconds - last->step_seconds);
      prefill_tokens->Increment(
          static_cast<double>(s.prefill_tokens - last->prefill_tokens));
      decode_tokens->Increment(
          static_cast<double>(s.decode_tokens - last->decode_tokens));
      *last = s;
    });
  }
};

WorkerServer::WorkerServer(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}
WorkerServer::~WorkerServer() { Shutdown(); }
const std::string& WorkerServer::address() const { return impl_->address; }
const std::string& WorkerServer::id() const { return impl_->id; }

void WorkerServer::Drain(absl::Duration grace) {
  impl_->draining = true;
  if (auto* health = impl_->server->GetHealthCheckService())
    health->SetServingStatus(false);
  PDSERVE_LOG(INFO) << "draining: " << impl_->in_flight
                    << " request(s) in flight";
  const absl::Time until = absl::Now() + grace;
  while (impl_->in_flight > 0 && absl::Now() < until)
    absl::SleepFor(absl::Milliseconds(50));
  if (impl_->in_flight > 0) {
    PDSERVE_LOG(WARNING) << "drain grace period over with " << impl_->in_flight
                         << " request(s) in flight; they migrate";
  }
}

void WorkerServer::Shutdown() {
  // The engine stops first: handlers waiting on it (queued calls,
  // reservations, token streams) fail with UNAVAILABLE at once, and the
  // router migrates their requests, instead of keeping the gRPC server's
  // shutdown waiting for them.
  if (impl_->loop) impl_->loop->Stop();
  if (impl_->server)
    impl_->server->Shutdown(std::chrono::system_clock::now() +
                            std::chrono::milliseconds(500));
}
void WorkerServer::Wait() { impl_->server->Wait(); }

absl::StatusOr<std::unique_ptr<WorkerServer>> WorkerServer::Start(
    const WorkerConfig& config, metrics::Registry* registry) {
  RETURN_IF_ERROR(config.Validate());
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->serves_prefill = wire::ServesPrefill(config.role);
  impl->serves_decode = wire::ServesDecode(config.role);
  ASSIGN_OR_RETURN(
      engine::ModelWeights loaded,
      engine::ModelWeights::Load(config.model_dir, config.engine.weight_dtype,
                                 config.engine.matmul));
  auto weights =
      std::make_shared<const engine::ModelWeights>(std::move(loaded));
  const std::string fingerprint =
      engine::BlockHash{weights->fingerprint[0], weights->fingerprint[1]}.Hex();
  Impl* raw = impl.get();
  engine::EngineConfig engine_config = config.engine;
  // One device for the backend, its KV pool and the KV transports.
  engine_config.cuda_device = config.kv_cuda_device;
  // shm: every pool must be mappable by its peers: a decode worker's by the
  // prefill workers that push into it, a prefill worker's by the holders it
  // pulls prefixes from (peer pull).
  engine_config.kv_host_shared =
      config.kv_transport == kv_transfer::KvTransportKind::kShm;
  ASSIGN_OR_RETURN(auto eng,
                   engine::Engine::Create(weights, engine_config,
                                          [raw](const engine::KvEvent& e) {
                                            raw->events.Append(e);
                                          }));
  // Structured output masks logits over the model's own vocabulary; a model
  // directory without a tokenizer serves unconstrained requests only.
  if (auto tokenizer = engine::Tokenizer::Load(config.model_dir);
      tokenizer.ok()) {
    eng->set_guide_cache(std::make_shared<structured::GuideCache>(
        structured::GuideCacheConfig{},
        structured::TokenTrie::Build(**tokenizer)));
  } else {
    PDSERVE_LOG(WARNING) << "no tokenizer in " << config.model_dir
                         << ", structured output is off: "
                         << tokenizer.status();
  }
  impl->layout = kv_transfer::KvLayout::FromSpec(eng->kv_spec(), fingerprint);
  impl->cache_fingerprint = engine::BlockHash{eng->cache_fingerprint()[0],
                                              eng->cache_fingerprint()[1]}
                                .Hex();
  impl->loop = std::make_unique<engine::EngineLoop>(std::move(eng),
                                                    config.on_engine_busy);
  impl->transfer_metrics =
      std::make_unique<kv_transfer::TransferMetrics>(*registry);
  // Received KV goes straight into the backend's storage (host or device).
  impl->receiver = std::make_unique<kv_transfer::KvReceiver>(
      &impl->loop->kv_storage_for_transfer(), impl->layout,
      impl->transfer_metrics->ForReceiver());
  if (config.kv_transport == kv_transfer::KvTransportKind::kNccl) {
    kv_transfer::nccl::CommunicatorFactory* comms = config.kv_communicators;
    if (comms == nullptr) {
      ASSIGN_OR_RETURN(
          impl->nccl_comms,
          kv_transfer::nccl::OpenNcclCommunicators(config.kv_cuda_device));
      comms = impl->nccl_comms.get();
    }
    kv_transfer::nccl::NcclReceiverConfig receive;
    receive.timeout = config.kv_stall_timeout;
    impl->nccl_endpoint =
        std::make_unique<kv_transfer::nccl::NcclKvReceiveEndpoint>(
            impl->receiver.get(), comms, receive);
    impl->kv_service =
        std::make_unique<kv_transfer::nccl::NcclKvTransferService>(
            impl->receiver.get(), impl->nccl_endpoint.get());
    impl->nccl_control =
        std::make_unique<kv_transfer::nccl::GrpcControlChannelFactory>();
    kv_transfer::nccl::NcclTransportConfig send;
    send.timeout = config.kv_stall_timeout;
    impl->transport = std::make_unique<kv_transfer::nccl::NcclKvTransport>(
        impl->nccl_control.get(), comms, impl->transfer_metrics.get(), send);
  } else if (config.kv_transport == kv_transfer::KvTransportKind::kShm ||
             config.kv_transport == kv_transfer::KvTransportKind::kCudaIpc) {
    engine::KvStorage* storage = &impl->loop->kv_storage_for_transfer();
    if (config.kv_transport == kv_transfer::KvTransportKind::kShm) {
      impl->ipc_backend = kv_transfer::ipc::NewShmBackend();
    } else {
      ASSIGN_OR_RETURN(impl->ipc_backend, kv_transfer::ipc::NewCudaIpcBackend(
                                              storage->memory().device));
    }
    // Every role receives: decode workers the prefills' KV, prefill workers
    // the blocks a peer pull asks of a holder.
    kv_transfer::ipc::IpcReceiverConfig receive;
    receive.timeout = config.kv_stall_timeout;
    ASSIGN_OR_RETURN(
        impl->ipc_endpoint,
        kv_transfer::ipc::IpcKvReceiveEndpoint::Create(
            impl->receiver.get(), storage, impl->ipc_backend.get(), receive));
    impl->kv_service = std::make_unique<kv_transfer::ipc::IpcKvTransferService>(
        impl->receiver.get(), impl->ipc_endpoint.get());
    impl->nccl_control =
        std::make_unique<kv_transfer::nccl::GrpcControlChannelFactory>();
    kv_transfer::ipc::IpcTransportConfig send;
    send.timeout = config.kv_stall_timeout;
    impl->transport = std::make_unique<kv_transfer::ipc::IpcKvTransport>(
        impl->nccl_control.get(), impl->ipc_backend.get(),
        impl->transfer_metrics.get(), send);
  } else {
    // The stream of a layer-wise sender stays open for the whole prefill;
    // dead or stalled peers are caught by the receiver's stall timeout and
    // by failed writes, so this only bounds a wedged stream.
    impl->transport = std::make_unique<kv_transfer::GrpcKvTransport>(
        impl->transfer_metrics.get(), absl::Minutes(10));
    impl->kv_service =
        std::make_unique<kv_transfer::KvTransferService>(impl->receiver.get());
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                   tls::InternalServerCredentials());
  builder.AddListeningPort(absl::StrCat(config.listen_host, ":", config.port),
                           credentials, &port);
  kv_transfer::ConfigureInternalServer(&builder);
  if (config.grpc_memory_quota_bytes > 0) {
    grpc::ResourceQuota quota("pdserve-worker");
    quota.Resize(static_cast<size_t>(config.grpc_memory_quota_bytes));
    if (config.grpc_max_threads > 0)
      quota.SetMaxThreads(config.grpc_max_threads);
    builder.SetResourceQuota(quota);
  }
  builder.RegisterService(impl.get());
  builder.RegisterService(impl->kv_service.get());
  impl->server = builder.BuildAndStart();
  if (!impl->server || port == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", config.listen_host, ":", config.port));
  }
  if (config.after_listen_for_test) config.after_listen_for_test(port);
  const std::string host =
      config.advertise_host.empty()
          ? (config.listen_host == "0.0.0.0" ? "127.0.0.1" : config.listen_host)
          : config.advertise_host;
  impl->address = absl::StrCat(host, ":", port);
  impl->id = config.id.empty()
                 ? absl::StrCat(wire::RoleName(config.role), "@", impl->address)
                 : config.id;
  prefill::PrefillOptions prefill_options;
  prefill_options.layerwise = config.kv_layerwise;
  prefill_options.max_queued_bytes = config.kv_stream_queue_bytes;
  prefill_options.metrics = impl->transfer_metrics.get();
  impl->peer_pull_metrics =
      std::make_unique<prefill::PeerPullMetrics>(*registry);
  prefill::PeerBlockHolderConfig holder_config;
  holder_config.address = impl->address;
  holder_config.keys = &impl->peer_pull_keys;
  RETURN_IF_ERROR(holder_config.Validate());
  impl->holder = std::make_unique<prefill::PeerBlockHolder>(
      impl->loop.get(), impl->transport.get(), impl->layout, impl->id,
      &impl->transfer_rate, impl->peer_pull_metrics.get(), holder_config);
  impl->puller = std::make_unique<prefill::PeerPuller>(
      impl->loop.get(), impl->receiver.get(), impl->layout,
      prefill::PeerPullerOptions{
          impl->address, std::min(config.kv_stall_timeout, absl::Seconds(5)),
          impl->peer_pull_metrics.get()});
  prefill_options.puller = impl->puller.get();
  prefill_options.prefill_rate = &impl->prefill_rate;
  prefill_options.transfer_rate = &impl->transfer_rate;
  impl->prefill = std::make_unique<prefill::PrefillHandler>(
      impl->loop.get(), impl->transport.get(), impl->layout, impl->id,
      prefill_options);
  impl->decode = std::make_unique<decode::DecodeHandler>(
      impl->loop.get(), impl->receiver.get(),
      decode::DecodeOptions{impl->id, impl->address, config.admission_timeout,
                            config.kv_stall_timeout});
  impl->RegisterMetrics(*registry);
  impl->ready.store(true, std::memory_order_release);
  return std::unique_ptr<WorkerServer>(new WorkerServer(std::move(impl)));
}

}  // namespace pdserve::worker
