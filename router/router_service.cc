#include "router/router_service.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <atomic>
#include <functional>
#include <map>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/metric_handles.h"
#include "common/status_macros.h"
#include "wire/enums.h"
#include "wire/sampling_convert.h"
#include "router/tenant_limiter.h"

namespace pdserve::router {
namespace {

bool Retryable(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAVAILABLE ||
         code == grpc::StatusCode::ABORTED ||
         code == grpc::StatusCode::INTERNAL ||
         code == grpc::StatusCode::UNKNOWN ||
         code == grpc::StatusCode::CANCELLED;
}

}  // namespace

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
  if (tenant_limits.max_concurrent < 0 || tenant_limits.tokens_per_minute < 0)
    return absl::InvalidArgumentError(
        "--tenant-max-concurrent and --tenant-tokens-per-minute must be >= 0 "
        "(0: unlimited)");
  if (limits.max_message_bytes < 1024 || limits.max_message_bytes > INT32_MAX)
    return absl::InvalidArgumentError(
        "--max-message-bytes must be in [1KiB, 2GiB)");
  if (limits.max_prompt_tokens < 0 || limits.max_output_tokens < 0 ||
      limits.max_stop_strings < 0 || limits.max_stop_string_bytes < 1 ||
      limits.max_streams_per_connection < 1 || limits.max_inflight_requests < 0)
    return absl::InvalidArgumentError(
        "request limits must not be negative (streams per connection and "
        "stop string bytes at least 1)");
  RETURN_IF_ERROR(workers.Validate());
  return tls.Validate();
}

struct RouterMetrics {
  explicit RouterMetrics(metrics::Registry& r)
      : requests(metrics::Must(r.AddCounter(
            "pdserve_requests_total", "Finished requests by finish reason",
            {"finish_reason"}))),
        ttft(metrics::HistogramChild(
            r, "pdserve_time_to_first_token_seconds",
            "Time from request arrival to its first token",
            metrics::DefaultLatencyBuckets())),
        itl(metrics::HistogramChild(
            r, "pdserve_inter_token_latency_seconds",
            "Time between consecutive tokens",
            metrics::ExponentialBuckets(0.001, 1.6, 20))),
        duration(metrics::HistogramChild(r, "pdserve_request_duration_seconds",
                                         "End-to-end request time",
                                         metrics::DefaultLatencyBuckets())),
        prompt_tokens(metrics::CounterChild(r, "pdserve_prompt_tokens_total",
                                            "Prompt tokens received")),
        generation_tokens(metrics::CounterChild(
            r, "pdserve_generation_tokens_total", "Tokens generated")),
        decisions(metrics::Must(r.AddCounter(
            "pdserve_prefill_decisions_total",
            "Where prompts were prefilled: remote (prefill worker) or local",
            {"mode"}))),
        retries(metrics::CounterChild(
            r, "pdserve_request_retries_total",
            "Requests re-sent to another worker (retry or migration)")),
        workers(metrics::Must(r.AddGauge("pdserve_workers",
                                         "Known workers by role and state",
                                         {"role", "state"}))),
        auth_failures(metrics::Must(r.AddCounter(
            "pdserve_auth_failures_total",
            "Public API calls refused for a missing or invalid bearer token, "
            "and RouterControl calls without a verified client certificate",
            {"reason"}))),
        tenant_rejections(metrics::Must(r.AddCounter(
            "pdserve_tenant_rejections_total",
            "Requests refused with RESOURCE_EXHAUSTED by a per-tenant limit",
            {"tenant", "limit"}))),
        limit_rejections(metrics::Must(r.AddCounter(
            "pdserve_limit_rejections_total",
            "Requests refused by a router-wide limit (overload is load "
            "shedding; the others are per-request bounds)",
            {"limit"}))) {
    for (const char* reason : {"missing", "invalid", "no_client_cert"})
      metrics::Must(auth_failures->WithLabels({reason}));
    for (const char* limit : {"overload", "prompt_tokens", "max_tokens",
                              "stop_strings", "stop_string_bytes", "deadline"})
      metrics::Must(limit_rejections->WithLabels({limit}));
    for (const char* reason : {"length", "stop", "eos", "cancelled", "error"}) {
      metrics::Must(requests->WithLabels({reason}));
    }
    remote = metrics::Must(decisions->WithLabels({"remote"}));
    local = metrics::Must(decisions->WithLabels({"local"}));
  }
  metrics::CounterFamily* requests;
  metrics::Histogram* ttft;
  metrics::Histogram* itl;
  metrics::Histogram* duration;
  metrics::Counter* prompt_tokens;
  metrics::Counter* generation_tokens;
  metrics::CounterFamily* decisions;
  metrics::Counter* remote;
  metrics::Counter* local;
  metrics::Counter* retries;
  metrics::GaugeFamily* workers;
  metrics::CounterFamily* auth_failures;
  metrics::CounterFamily* tenant_rejections;
  metrics::CounterFamily* limit_rejections;
  void AuthFailure(const char* reason) {
    metrics::Must(auth_failures->WithLabels({reason}))->Increment();
  }
  void LimitRejection(const char* limit) {
    metrics::Must(limit_rejections->WithLabels({limit}))->Increment();
  }
};

struct RouterServer::Impl final : public v1::Router::Service,
                                  public v1::RouterControl::Service {
  RouterConfig config;
  std::unique_ptr<engine::Tokenizer> tokenizer;
  PrefixIndex index;
  std::unique_ptr<WorkerRegistry> registry;
  std::unique_ptr<Policy> policy;
  std::unique_ptr<RouterMetrics> m;
  metrics::Registry::CollectorHandle collector;
  std::unique_ptr<grpc::Server> server;
  std::atomic<uint64_t> next_id{1};
  std::unique_ptr<Authenticator> auth;  // null: no --auth-tokens
  TenantLimiter limiter;
  std::atomic<int32_t> in_flight{0};  // Generate calls, for load shedding
  // Workers know a request by an id unique to this router process and
  // attempt. `request_id` is not: it is client-chosen, or req-N, which starts
  // again at 1 when the router restarts; and a worker aborts by id, so a
  // stale handler of an earlier request with the same id (its router died,
  // the worker has not noticed yet) would cancel the new one.
  const std::string instance = [] {
    std::random_device rd;
    return absl::StrFormat("%08x%08x", rd(), rd());
  }();
  std::atomic<uint64_t> next_attempt{1};

  // RouterControl is internal: with TLS on, only mTLS peers (a client
  // certificate from the cluster CA) may register workers or list them.
  grpc::Status CheckInternalPeer(const grpc::ServerContext& ctx) {
    if (config.tls.insecure || tls::PeerHasVerifiedCertificate(ctx))
      return grpc::Status::OK;
    m->AuthFailure("no_client_cert");
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "RouterControl accepts only mTLS peers: present a "
                        "client certificate issued by the cluster CA");
  }

  grpc::Status RegisterWorker(grpc::ServerContext* ctx,
                              const v1::RegisterWorkerRequest* req,
                              v1::RegisterWorkerResponse*) override {
    if (grpc::Status st = CheckInternalPeer(*ctx); !st.ok()) return st;
    if (req->address().empty())
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "address is empty");
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

  grpc::Status ListWorkers(grpc::ServerContext* ctx,
                           const v1::ListWorkersRequest*,
                           v1::ListWorkersResponse* resp) override {
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
    }
    return grpc::Status::OK;
  }

  void Finish(const std::string& reason, absl::Time start) {
    metrics::Must(m->requests->WithLabels({reason}))->Increment();
    m->duration->Observe(absl::ToDoubleSeconds(absl::Now() - start));
  }

  grpc::Status Generate(
      grpc::ServerContext* ctx, const v1::GenerateRequest* req,
      grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    const absl::Time start = absl::Now();
    // Load shedding: the router never queues a request it cannot start.
    struct InFlight {
      std::atomic<int32_t>* n;
      ~InFlight() { --*n; }
    } in_flight_guard{&in_flight};
    const int32_t now_in_flight = ++in_flight;
    grpc::Status st;
    if (config.limits.max_inflight_requests > 0 &&
        now_in_flight > config.limits.max_inflight_requests) {
      m->LimitRejection("overload");
      st = RetryLater(ctx, absl::Seconds(1),
                      absl::StrCat("router overloaded: ", now_in_flight - 1,
                                   " requests in flight (limit ",
                                   config.limits.max_inflight_requests, ")"));
    } else {
      Tenant tenant;
      st = Authenticate(ctx, &tenant);
      if (st.ok()) st = GenerateImpl(ctx, *req, writer, start, tenant);
    }
    if (!st.ok())
      Finish(st.error_code() == grpc::StatusCode::CANCELLED ? "cancelled"
                                                            : "error",
             start);
    return st;
  }

  // RESOURCE_EXHAUSTED with the retry hint in the message and in the
  // `retry-after-ms` trailing metadata.
  static grpc::Status RetryLater(grpc::ServerContext* ctx, absl::Duration after,
                                 const std::string& why) {
    const int64_t ms = std::max<int64_t>(1, absl::ToInt64Milliseconds(after));
    ctx->AddTrailingMetadata("retry-after-ms", std::to_string(ms));
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat(why, "; retry after ", ms, " ms"));
  }

  grpc::Status Authenticate(grpc::ServerContext* ctx, Tenant* tenant) {
    if (auth == nullptr) return grpc::Status::OK;
    const auto& md = ctx->client_metadata();
    auto it = md.find("authorization");
    const std::string value =
        it == md.end() ? "" : std::string(it->second.data(), it->second.size());
    absl::StatusOr<Tenant> t = auth->Authenticate(value);
    if (!t.ok()) {
      m->AuthFailure(value.empty() ? "missing" : "invalid");
      return ToGrpc(t.status());
    }
    *tenant = *std::move(t);
    return grpc::Status::OK;
  }

  // INVALID_ARGUMENT naming the limit, counted in limit_rejections.
  grpc::Status OverLimit(const char* limit, const std::string& why) {
    m->LimitRejection(limit);
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, why);
  }

  grpc::Status CheckRequestLimits(const engine::SamplingParams& sampling,
                                  size_t prompt_tokens) {
    const RequestLimits& l = config.limits;
    if (l.max_prompt_tokens > 0 &&
        prompt_tokens > static_cast<size_t>(l.max_prompt_tokens))
      return OverLimit(
          "prompt_tokens",
          absl::StrCat("prompt has ", prompt_tokens,
                       " tokens; this router accepts at most ",
                       l.max_prompt_tokens, " (--max-prompt-tokens)"));
    if (l.max_output_tokens > 0 &&
        sampling.max_tokens > static_cast<uint32_t>(l.max_output_tokens))
      return OverLimit(
          "max_tokens",
          absl::StrCat("max_tokens ", sampling.max_tokens,
                       " is above this router's limit of ", l.max_output_tokens,
                       " (--max-output-tokens)"));
    if (sampling.stop.size() > static_cast<size_t>(l.max_stop_strings))
      return OverLimit(
          "stop_strings",
          absl::StrCat(sampling.stop.size(), " stop strings; at most ",
                       l.max_stop_strings, " allowed (--max-stop-strings)"));
    for (const std::string& s : sampling.stop) {
      if (s.size() > static_cast<size_t>(l.max_stop_string_bytes))
        return OverLimit(
            "stop_string_bytes",
            absl::StrCat("a stop string has ", s.size(), " bytes; at most ",
                         l.max_stop_string_bytes,
                         " allowed (--max-stop-string-bytes)"));
    }
    return grpc::Status::OK;
  }

  grpc::Status GenerateImpl(grpc::ServerContext* ctx,
                            const v1::GenerateRequest& req,
                            grpc::ServerWriter<v1::GenerateResponse>* writer,
                            absl::Time start, const Tenant& tenant) {
    // Validate and tokenize.
    std::vector<int32_t> prompt;
    if (req.input_case() == v1::GenerateRequest::kPrompt) {
      if (req.prompt().empty())
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "prompt is empty");
      prompt = tokenizer->Encode(req.prompt());
    } else if (req.input_case() == v1::GenerateRequest::kTokenIds) {
      for (uint32_t t : req.token_ids().ids()) {
        if (t >= static_cast<uint32_t>(tokenizer->vocab_size())) {
          return grpc::Status(
              grpc::StatusCode::INVALID_ARGUMENT,
              absl::StrCat("token id ", t, " is outside the vocabulary"));
        }
        prompt.push_back(static_cast<int32_t>(t));
      }
      if (prompt.empty())
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "token_ids is empty");
    } else {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "set prompt or token_ids");
    }
    engine::SamplingParams sampling = SamplingFromProto(req.sampling());
    if (absl::Status s = sampling.Validate(); !s.ok()) return ToGrpc(s);
    if (grpc::Status st = CheckRequestLimits(sampling, prompt.size()); !st.ok())
      return st;
    // Per-tenant admission; the lease ends with this call, however it ends.
    if (auto no = limiter.Admit(tenant, static_cast<int64_t>(prompt.size()),
                                absl::Now())) {
      metrics::Must(m->tenant_rejections->WithLabels({tenant.name, no->limit}))
          ->Increment();
      return RetryLater(ctx, no->retry_after, no->message);
    }
    struct Lease {
      TenantLimiter* l;
      const Tenant& t;
      ~Lease() { l->Release(t); }
    } lease{&limiter, tenant};
    // Tenants never share prefix blocks (nor prefix-hit timing) unless the
    // router is told they may: the tenant is part of every block hash.
    const std::string cache_salt =
        tenant.name.empty() || config.shared_prefix_cache
            ? req.cache_salt()
            : absl::StrCat("tenant:", tenant.name.size(), ":", tenant.name, "|",
                           req.cache_salt());
    const std::string id = req.request_id().empty()
                               ? absl::StrCat("req-", next_id++)
                               : req.request_id();
    const absl::Time deadline =
        std::min(start + config.request_timeout,
                 ctx->deadline() == std::chrono::system_clock::time_point::max()
                     ? absl::InfiniteFuture()
                     : absl::FromChrono(ctx->deadline()));
    m->prompt_tokens->Increment(static_cast<double>(prompt.size()));

    engine::TextStream text(tokenizer.get(), sampling.stop);
    std::vector<int32_t> generated;
    std::vector<WorkerIndex> exclude;
    std::string finish, prefill_worker, decode_worker;
    uint32_t cached = 0;
    bool cached_known = false;
    absl::Time last_token = start;
    int attempts = 0;
    grpc::Status last_error(grpc::StatusCode::UNAVAILABLE,
                            "no worker could serve the request");

    while (finish.empty()) {
      if (attempts > config.max_retries) return last_error;
      if (attempts > 0) m->retries->Increment();
      ++attempts;
      std::vector<WorkerView> workers = registry->UpWorkers();
      // A draining worker finishes what it has but takes nothing new.
      std::erase_if(workers,
                    [](const WorkerView& w) { return w.status.draining(); });
      uint32_t max_len = 0;
      for (const auto& w : workers) {
        if (w.role != v1::WORKER_ROLE_PREFILL)
          max_len = max_len ? std::min(max_len, w.status.max_model_len())
                            : w.status.max_model_len();
      }
      if (max_len > 0 && prompt.size() + sampling.max_tokens > max_len) {
        return grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("prompt (", prompt.size(), " tokens) + max_tokens (",
                         sampling.max_tokens, ") exceeds max_model_len ",
                         max_len));
      }
      // The sequence so far: prompt, plus tokens already streamed (migration).
      std::vector<int32_t> tokens = prompt;
      tokens.insert(tokens.end(), generated.begin(), generated.end());
      // Hashed once here, for the decision and the speculative entries.
      PromptHashes hashes(&tokens, cache_salt);
      RouteRequest route{static_cast<int64_t>(tokens.size()), cache_salt,
                         &tokens, exclude, &hashes};
      auto decision = policy->Choose(route, workers);
      if (!decision.ok()) {
        if (attempts == 1 || exclude.empty()) return ToGrpc(decision.status());
        return last_error;
      }
      const WorkerView* dec = decision->decode;
      const WorkerView* pre = decision->prefill;
      (pre ? m->remote : m->local)->Increment();
      const int64_t uncached =
          route.num_tokens - decision->prefill_cached_tokens;
      const WorkerIndex prefill_at = pre ? pre->index : dec->index;
      registry->AddLoad(prefill_at, uncached, 0);
      registry->AddLoad(dec->index, 0, 1);
      // Undone when the first token arrives (prefill done) and when the
      // stream ends (decode done), whichever way it ends.
      bool prefill_pending = true;
      auto prefill_done = [&] {
        if (prefill_pending) registry->AddLoad(prefill_at, -uncached, 0);
        prefill_pending = false;
      };
      struct DecodeDone {
        WorkerRegistry* r;
        WorkerIndex i;
        std::function<void()> prefill_done;
        ~DecodeDone() {
          prefill_done();
          r->AddLoad(i, 0, -1);
        }
      } decode_done{registry.get(), dec->index, prefill_done};
      auto hashes_for = [&](const WorkerView& w) {
        return hashes.For(w.fingerprint,
                          static_cast<int32_t>(w.status.layout().block_size()));
      };
      if (pre) {
        index.Speculate(pre->index, hashes_for(*pre), config.speculative_ttl);
      }
      index.Speculate(dec->index, hashes_for(*dec), config.speculative_ttl);

      v1::WorkerGenerateRequest wreq;
      wreq.set_request_id(absl::StrCat(id, "@", instance, ".", next_attempt++));
      for (int32_t t : tokens) wreq.add_token_ids(static_cast<uint32_t>(t));
      *wreq.mutable_sampling() = req.sampling();
      wreq.mutable_sampling()->set_max_tokens(
          sampling.max_tokens - static_cast<uint32_t>(generated.size()));
      wreq.mutable_sampling()->clear_stop();
      wreq.set_cache_salt(cache_salt);
      if (pre) wreq.set_prefill_address(pre->address);
      wreq.set_original_prompt_len(static_cast<uint32_t>(prompt.size()));

      // Propagates the client's cancellation to the worker call.
      std::unique_ptr<grpc::ClientContext> wctx_owner =
          grpc::ClientContext::FromServerContext(*ctx);
      grpc::ClientContext& wctx = *wctx_owner;
      if (deadline != absl::InfiniteFuture())
        wctx.set_deadline(absl::ToChronoTime(deadline));
      auto reader = dec->stub->Generate(&wctx, wreq);
      v1::WorkerGenerateResponse resp;
      v1::GenerateResponse out;
      while (reader->Read(&resp)) {
        if (ctx->IsCancelled()) {
          wctx.TryCancel();
          break;
        }
        prefill_done();
        if (!cached_known) {
          cached = resp.cached_prompt_tokens();
          cached_known = true;
        }
        prefill_worker = resp.prefill_worker();
        decode_worker = resp.decode_worker();
        out.Clear();
        out.set_request_id(id);
        const absl::Time now = absl::Now();
        for (uint32_t t : resp.token_ids()) {
          if (generated.empty()) {
            m->ttft->Observe(absl::ToDoubleSeconds(now - start));
          } else {
            m->itl->Observe(absl::ToDoubleSeconds(now - last_token));
          }
          last_token = now;
          generated.push_back(static_cast<int32_t>(t));
          out.add_token_ids(t);
        }
        m->generation_tokens->Increment(resp.token_ids_size());
        limiter.Charge(tenant, resp.token_ids_size(), now);
        auto delta =
            text.Push({out.token_ids().begin(), out.token_ids().end()});
        std::string piece = delta.text;
        if (delta.stopped) {
          finish = "stop";
          wctx.TryCancel();
        } else if (resp.finish_reason() != v1::FINISH_REASON_NONE) {
          finish = wire::FinishReasonName(resp.finish_reason());
          if (finish.empty()) finish = "error";  // a number we do not know
          piece += text.Finish().text;
        }
        out.set_text(piece);
        if (!finish.empty()) break;
        if (!writer->Write(out)) {
          wctx.TryCancel();
          break;
        }
      }
      if (ctx->IsCancelled()) {
        reader->Finish();
        return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled");
      }
      if (!finish.empty()) {
        wctx.TryCancel();
        reader->Finish();
        // The final message carries the last tokens, their text and the usage.
        v1::GenerateResponse& last = out;
        last.set_request_id(id);
        last.set_finish_reason(finish);
        last.set_prefill_worker(prefill_worker);
        last.set_decode_worker(decode_worker);
        auto* usage = last.mutable_usage();
        usage->set_prompt_tokens(static_cast<uint32_t>(prompt.size()));
        usage->set_completion_tokens(static_cast<uint32_t>(generated.size()));
        usage->set_cached_prompt_tokens(cached);
        writer->Write(last);
        Finish(finish, start);
        return grpc::Status::OK;
      }
      const grpc::Status wst = reader->Finish();
      if (wst.ok()) {
        last_error = grpc::Status(
            grpc::StatusCode::INTERNAL,
            "decode worker ended the stream without a finish reason");
      } else if (wst.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
                 deadline == start + config.request_timeout) {
        m->LimitRejection("deadline");
        return grpc::Status(
            grpc::StatusCode::DEADLINE_EXCEEDED,
            absl::StrCat("request ran past the router's ceiling of ",
                         absl::FormatDuration(config.request_timeout),
                         " (--request-timeout-ms) after ", generated.size(),
                         " tokens"));
      } else {
        last_error = wst;
      }
      if (!Retryable(last_error.error_code())) return last_error;
      PDSERVE_LOG(WARNING) << "request " << id << " on " << dec->address
                           << " failed after " << generated.size()
                           << " tokens: " << last_error.error_message()
                           << "; retrying elsewhere";
      const bool prefill_failed =
          pre && CauseOf(last_error) == StatusCause::kPrefillFailed;
      const WorkerIndex failed = prefill_failed ? pre->index : dec->index;
      exclude.push_back(failed);
      registry->ReportFailure(failed);
    }
    return last_error;
  }
};

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

absl::Status RouterServer::CheckAuthorization(
    absl::string_view authorization) {
  if (impl_->auth == nullptr) return absl::OkStatus();
  return impl_->auth->Authenticate(authorization).status();
}

absl::StatusOr<std::unique_ptr<RouterServer>> RouterServer::Create(
    const RouterConfig& config, metrics::Registry* registry) {
  RETURN_IF_ERROR(config.Validate());
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  ASSIGN_OR_RETURN(impl->tokenizer, engine::Tokenizer::Load(config.model_dir));
  impl->registry =
      std::make_unique<WorkerRegistry>(config.workers, &impl->index);
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
