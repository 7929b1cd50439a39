// RouterServer: configuration, lifecycle (Create, Serve, Shutdown) and the
// internal RouterControl service (worker registration, ListWorkers). The
// request path is in router_service_generate.cc.
#include "router/router_service.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <map>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "router/router_service_impl.h"
#include "wire/enums.h"

namespace pdserve::router {

absl::Status RouterConfig::Validate() const {
  if (model_dir.empty())
    return absl::InvalidArgumentError(
        "--model is required (the router tokenizes)");
  if (max_retries < 0)
    return absl::InvalidArgumentError("--max-retries must not be negative");
  if (policy_config.w_prefill < 0 || policy_config.w_decode < 0) {
    return absl::InvalidArgumentError("routing weights must not be negative");
  }
  if (request_timeout <= absl::ZeroDuration())
    return absl::InvalidArgumentError("--request-timeout-ms must be positive");
  if (absl::Status s = peer_pull.Validate(); !s.ok()) return s;
  if (tenant_limits.max_concurrent < 0 || tenant_limits.tokens_per_minute < 0)
    return absl::InvalidArgumentError(
        "--tenant-max-concurrent and --tenant-tokens-per-minute must be >= 0 "
        "(0: unlimited)");
  if (limits.max_message_bytes < 1024 || limits.max_message_bytes > INT32_MAX)
    return absl::InvalidArgumentError(
        "--max-message-bytes must be in [1KiB, 2GiB)");
  if (limits.max_prompt_tokens < 0 || limits.max_output_tokens < 0 ||
      limits.max_stop_strings < 0 || limits.max_stop_string_bytes < 1 ||
      limits.max_cache_salt_bytes < 0 || limits.max_request_id_bytes < 0 ||
      limits.max_streams_per_connection < 1 || limits.max_inflight_requests < 0)
    return absl::InvalidArgumentError(
        "request limits must not be negative (streams per connection and "
        "stop string bytes at least 1)");
  RETURN_IF_ERROR(workers.Validate());
  return tls.Validate();
}

grpc::Status RouterServer::Impl::CheckInternalPeer(
    const grpc::ServerContext& ctx) {
  if (config.tls.insecure || tls::PeerHasVerifiedCertificate(ctx))
    return grpc::Status::OK;
  m->AuthFailure("no_client_cert");
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      "RouterControl accepts only mTLS peers: present a "
                      "client certificate issued by the cluster CA");
}

grpc::Status RouterServer::Impl::RegisterWorker(
    grpc::ServerContext* ctx, const v1::RegisterWorkerRequest* req,
    v1::RegisterWorkerResponse*) {
  if (grpc::Status st = CheckInternalPeer(*ctx); !st.ok()) return st;
  if (req->address().empty())
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "address is empty");
  if (!wire::IsKnownRole(req->role())) {
    // Without this a worker with a role we do not know would register and
    // silently never be routed to.
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("unknown worker role #", static_cast<int>(req->role()),
                     " for ", req->address(),
                     ": expected PREFILL, DECODE or BOTH"));
  }
  registry->Register(req->address(), req->role());
  return grpc::Status::OK;
}

grpc::Status RouterServer::Impl::ListWorkers(grpc::ServerContext* ctx,
                                             const v1::ListWorkersRequest*,
                                             v1::ListWorkersResponse* resp) {
  if (grpc::Status st = CheckInternalPeer(*ctx); !st.ok()) return st;
  for (const WorkerView& w : registry->AllWorkers()) {
    v1::WorkerInfo* info = resp->add_workers();
    info->set_id(w.id.empty() ? w.address : w.id);
    info->set_role(wire::RoleName(w.role));
    info->set_address(w.address);
    info->set_state(w.up ? "up" : "down");
    info->set_num_running(w.status.num_running());
    info->set_num_waiting(w.status.num_waiting());
    info->set_free_blocks(w.status.free_blocks());
    info->set_total_blocks(w.status.total_blocks());
    const PrefixIndex::WorkerSummary indexed = index.Summary(w.index);
    info->set_indexed_blocks(static_cast<uint32_t>(indexed.blocks));
    info->set_indexed_digest(indexed.digest.Hex());
    if (w.status.kv_tier() == v1::KV_TIER_HOST_MEMORY ||
        w.status.kv_tier() == v1::KV_TIER_DISK) {
      const auto tier = static_cast<engine::KvTierKind>(w.status.kv_tier());
      const PrefixIndex::WorkerSummary t = index.Summary(w.index, tier);
      info->set_indexed_tier(engine::KvTierKindName(tier));
      info->set_indexed_tier_blocks(static_cast<uint32_t>(t.blocks));
      info->set_indexed_tier_digest(t.digest.Hex());
    }
  }
  return grpc::Status::OK;
}

RouterServer::RouterServer(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}
RouterServer::~RouterServer() {
  Shutdown();
  impl_->registry->Stop();
}
WorkerRegistry& RouterServer::workers() { return *impl_->registry; }

std::shared_ptr<grpc::Channel> RouterServer::InProcessChannel() {
  if (!impl_->server) return nullptr;
  return impl_->server->InProcessChannel(grpc::ChannelArguments());
}

absl::Status RouterServer::CheckAuthorization(absl::string_view authorization) {
  if (impl_->auth == nullptr) return absl::OkStatus();
  return impl_->auth->Authenticate(authorization).status();
}

absl::StatusOr<std::unique_ptr<RouterServer>> RouterServer::Create(
    const RouterConfig& config, metrics::Registry* registry) {
  RETURN_IF_ERROR(config.Validate());
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  ASSIGN_OR_RETURN(impl->tokenizer, engine::Tokenizer::Load(config.model_dir));
  RegistryConfig workers = config.workers;
  // Workers learn the key of this router's peer-pull grants from its polls.
  if (config.peer_pull.enabled) workers.peer_pull_key = impl->peer_pull_key;
  impl->registry = std::make_unique<WorkerRegistry>(workers, &impl->index);
  impl->peer_pull_backoff =
      std::make_unique<PeerPullBackoff>(config.peer_pull.backoff);
  ASSIGN_OR_RETURN(
      impl->policy,
      Policy::Create(config.policy, config.policy_config, &impl->index));
  impl->m = std::make_unique<RouterMetrics>(*registry);
  if (!config.auth_tokens_file.empty()) {
    ASSIGN_OR_RETURN(impl->auth, Authenticator::Create(config.auth_tokens_file,
                                                       config.tenant_limits));
  }
  Impl* raw = impl.get();
  impl->collector = registry->AddCollector([raw] {
    std::map<std::pair<std::string, std::string>, int> counts;
    for (const char* role : {"prefill", "decode", "both"}) {
      for (const char* state : {"up", "down"}) counts[{role, state}] = 0;
    }
    for (const WorkerView& w : raw->registry->AllWorkers()) {
      if (!wire::IsKnownRole(w.role)) continue;
      ++counts[{wire::RoleName(w.role), w.up ? "up" : "down"}];
    }
    for (const auto& [key, n] : counts) {
      auto child = raw->m->workers->WithLabels({key.first, key.second});
      if (child.ok()) (*child)->Set(n);
    }
  });
  impl->registry->Start();
  return std::unique_ptr<RouterServer>(new RouterServer(std::move(impl)));
}

absl::StatusOr<int> RouterServer::Serve(const std::string& host, int port) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int bound = 0;
  ASSIGN_OR_RETURN(
      std::shared_ptr<grpc::ServerCredentials> creds,
      tls::ServerCredentials(impl_->config.tls, tls::ClientAuth::kOptional));
  builder.AddListeningPort(absl::StrCat(host, ":", port), creds, &bound);
  const RequestLimits& limits = impl_->config.limits;
  builder.SetMaxReceiveMessageSize(static_cast<int>(limits.max_message_bytes));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             limits.max_streams_per_connection);
  // A hard bound under the in-flight limit: each sync call holds a thread,
  // and past this many gRPC itself answers RESOURCE_EXHAUSTED.
  if (limits.max_inflight_requests > 0) {
    grpc::ResourceQuota quota("pdserve-router");
    quota.SetMaxThreads(limits.max_inflight_requests + 64);
    builder.SetResourceQuota(quota);
  }
  builder.RegisterService(static_cast<v1::Router::Service*>(impl_.get()));
  builder.RegisterService(
      static_cast<v1::RouterControl::Service*>(impl_.get()));
  impl_->server = builder.BuildAndStart();
  if (!impl_->server || bound == 0)
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", host, ":", port));
  return bound;
}

void RouterServer::Shutdown() {
  if (impl_->server)
    impl_->server->Shutdown(std::chrono::system_clock::now() +
                            std::chrono::milliseconds(500));
}

void RouterServer::Wait() {
  if (impl_->server) impl_->server->Wait();
}

}  // namespace pdserve::router
