#include "router/router_service.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <array>
#include <atomic>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <string_view>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/metric_handles.h"
#include "common/status_macros.h"
#include "router/tenant_limiter.h"
#include "wire/enums.h"
#include "wire/sampling_convert.h"
#include "wire/structured_convert.h"

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
            {"limit"}))),
        peer_pulls(metrics::Must(r.AddCounter(
            "pdserve_router_peer_pull_decisions_total",
            "With --peer-pull: remote prefills told to pull their prefix from "
            "a peer (pull), or not (no_holder: no live peer holds more; "
            "not_faster: recompute estimated faster)",
            {"decision"}))) {
    for (const char* d : {"pull", "no_holder", "not_faster"})
      metrics::Must(peer_pulls->WithLabels({d}));
    for (const char* reason : {"missing", "invalid", "no_client_cert"})
      metrics::Must(auth_failures->WithLabels({reason}));
    for (const char* limit :
         {"overload", "prompt_tokens", "max_tokens", "stop_strings",
          "stop_string_bytes", "cache_salt_bytes", "request_id_bytes",
          "deadline"})
      metrics::Must(limit_rejections->WithLabels({limit}));
    for (size_t i = 0; i < kFinishReasons.size(); ++i)
      finished[i] = metrics::Must(requests->WithLabels({kFinishReasons[i]}));
    remote = metrics::Must(decisions->WithLabels({"remote"}));
    local = metrics::Must(decisions->WithLabels({"local"}));
  }
  metrics::CounterFamily* requests;
  // Every finish_reason label value; "error" (the last) also stands for any
  // reason not listed, so no input can make a new label or fail a lookup.
  static constexpr std::array<const char*, 5> kFinishReasons = {
      "length", "stop", "eos", "cancelled", "error"};
  std::array<metrics::Counter*, kFinishReasons.size()> finished{};
  metrics::Counter* Finished(std::string_view reason) {
    for (size_t i = 0; i < kFinishReasons.size(); ++i) {
      if (reason == kFinishReasons[i]) return finished[i];
    }
    return finished.back();
  }
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
  metrics::CounterFamily* peer_pulls;
  // `decision`: "pull" or a PeerPullDecision::reason.
  void CountPeerPull(const std::string& decision) {
    metrics::Must(peer_pulls->WithLabels({decision}))->Increment();
  }
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
  // Compiled constraints by text, to refuse bad ones before routing.
  structured::ConstraintCache constraints{structured::ConstraintConfig{}, 256};
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

  void Finish(const std::string& reason, absl::Time start) {
    m->Finished(reason)->Increment();
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

  // One Generate call's state across its attempts (retries before the first
  // token, migrations after it). Lives on the stack of the gRPC thread that
  // serves the call; nothing else touches it.
  struct Call {
    grpc::ServerContext* ctx = nullptr;
    grpc::ServerWriter<v1::GenerateResponse>* writer = nullptr;
    const v1::GenerateRequest* req = nullptr;
    const Tenant* tenant = nullptr;
    absl::Time start;
    // Fixed at intake.
    std::string id;               // the client's, or req-N
    std::vector<int32_t> prompt;  // token ids
    engine::SamplingParams sampling;
    std::string cache_salt;  // with the tenant folded in
    absl::Time deadline;     // the client's, capped by --request-timeout-ms
    // Progress, kept across attempts so a migration continues the stream.
    std::vector<int32_t> generated;  // tokens already sent to the client
    std::optional<engine::TextStream> text;
    std::vector<WorkerIndex> exclude;  // workers that failed this call
    std::string prefill_worker, decode_worker;
    uint32_t cached = 0;  // prompt tokens the first attempt found cached
    bool cached_known = false;
    absl::Time last_token;
  };

  // Where one attempt runs. The views are copies taken at routing time.
  struct Route {
    WorkerView decode;
    std::optional<WorkerView> prefill;  // none: the decode worker prefills
    std::vector<int32_t> tokens;        // prompt + tokens generated so far
    int64_t uncached = 0;    // prefill tokens charged to the prefill side
    v1::PeerPull peer_pull;  // blocks == 0: no pull
  };

  // How one attempt ended.
  struct Attempt {
    enum Outcome {
      kFinished,         // a finish reason: `final` is the last message
      kClientCancelled,  // the client went away
      kWorkerFailed,     // the stream ended early with `status`
    } outcome = kWorkerFailed;
    std::string finish;  // kFinished: the public finish reason
    v1::GenerateResponse final;
    grpc::Status status;
  };

  // Tokenizes the prompt (or checks the token ids) and validates sampling
  // and the request limits into `call`. INVALID_ARGUMENT (or the limit's
  // code) on bad input; touches no worker.
  grpc::Status TokenizeAndValidate(const v1::GenerateRequest& req, Call& call) {
    // Bounded before anything hashes or logs them.
    const RequestLimits& l = config.limits;
    if (req.cache_salt().size() > static_cast<size_t>(l.max_cache_salt_bytes))
      return OverLimit(
          "cache_salt_bytes",
          absl::StrCat("cache_salt has ", req.cache_salt().size(),
                       " bytes; at most ", l.max_cache_salt_bytes, " allowed"));
    if (req.request_id().size() > static_cast<size_t>(l.max_request_id_bytes))
      return OverLimit(
          "request_id_bytes",
          absl::StrCat("request_id has ", req.request_id().size(),
                       " bytes; at most ", l.max_request_id_bytes, " allowed"));
    std::vector<int32_t>& prompt = call.prompt;
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
    call.sampling = SamplingFromProto(req.sampling());
    if (absl::Status s = call.sampling.Validate(); !s.ok()) return ToGrpc(s);
    // A constraint that cannot compile is refused here, before routing; the
    // automaton is cached, and workers compile the same text again.
    if (const structured::ConstraintSpec spec =
            ConstraintFromProto(req.sampling());
        spec.active()) {
      if (auto dfa = constraints.Get(spec); !dfa.ok())
        return ToGrpc(dfa.status());
    }
    return CheckRequestLimits(call.sampling, prompt.size());
  }

  // Fills the call's fixed fields that follow admission: salt, id, deadline.
  void StartCall(Call& call) {
    const v1::GenerateRequest& req = *call.req;
    const Tenant& tenant = *call.tenant;
    // Tenants never share prefix blocks (nor prefix-hit timing) unless the
    // router is told they may: the tenant is part of every block hash.
    call.cache_salt = tenant.name.empty() || config.shared_prefix_cache
                          ? req.cache_salt()
                          : absl::StrCat("tenant:", tenant.name.size(), ":",
                                         tenant.name, "|", req.cache_salt());
    call.id = req.request_id().empty() ? absl::StrCat("req-", next_id++)
                                       : req.request_id();
    call.deadline = std::min(
        call.start + config.request_timeout,
        call.ctx->deadline() == std::chrono::system_clock::time_point::max()
            ? absl::InfiniteFuture()
            : absl::FromChrono(call.ctx->deadline()));
    call.last_token = call.start;
    call.text.emplace(tokenizer.get(), call.sampling.stop);
  }

  // Picks the workers for the next attempt from the up, non-draining ones,
  // minus those excluded, and records speculative index entries for them.
  // INVALID_ARGUMENT when the request cannot fit any decode worker's
  // max_model_len; else the policy's status (UNAVAILABLE: nobody can decode).
  absl::StatusOr<Route> ChooseWorkers(const Call& call) {
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
    if (max_len > 0 &&
        call.prompt.size() + call.sampling.max_tokens > max_len) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt (", call.prompt.size(), " tokens) + max_tokens (",
          call.sampling.max_tokens, ") exceeds max_model_len ", max_len));
    }
    Route route;
    // The sequence so far: prompt, plus tokens already streamed (migration).
    route.tokens = call.prompt;
    route.tokens.insert(route.tokens.end(), call.generated.begin(),
                        call.generated.end());
    // Hashed once here, for the decision and the speculative entries.
    PromptHashes hashes(&route.tokens, call.cache_salt);
    RouteRequest request{static_cast<int64_t>(route.tokens.size()),
                         call.cache_salt, &route.tokens, call.exclude, &hashes};
    ASSIGN_OR_RETURN(RouteDecision decision, policy->Choose(request, workers));
    route.decode = *decision.decode;
    if (decision.prefill != nullptr) route.prefill = *decision.prefill;
    route.uncached = request.num_tokens - decision.prefill_cached_tokens;
    (route.prefill ? m->remote : m->local)->Increment();
    auto hashes_for = [&](const WorkerView& w) {
      return hashes.For(w.fingerprint,
                        static_cast<int32_t>(w.status.layout().block_size()));
    };
    // Peer pull: asked before the speculative entries below, which would
    // credit the prefill worker with the whole prompt.
    if (route.prefill && config.peer_pull.enabled) {
      route.peer_pull =
          PeerPullFor(*route.prefill, hashes_for(*route.prefill), workers);
    }
    if (route.prefill) {
      index.Speculate(route.prefill->index, hashes_for(*route.prefill),
                      config.speculative_ttl);
    }
    index.Speculate(route.decode.index, hashes_for(route.decode),
                    config.speculative_ttl);
    return route;
  }

  // Whether the prefill worker `p` should pull the prompt's prefix from
  // another worker (router/peer_pull.h), from the index and measured rates.
  v1::PeerPull PeerPullFor(const WorkerView& p,
                           const std::vector<engine::BlockHash>& chain,
                           const std::vector<WorkerView>& workers) {
    // Per tier: the pool's counts, and the pool's plus the lower tiers' (a
    // holder reads its tier's blocks back for the pull).
    std::vector<int32_t> counts, all_counts;
    index.LeadingBlocksOfPrompt(
        chain.size(), [&](size_t i) { return chain[i]; }, &counts);
    index.LeadingBlocksOfPrompt(
        chain.size(), [&](size_t i) { return chain[i]; }, &all_counts,
        kAllTiers);
    auto held = [&](WorkerIndex w) {
      return w >= 0 && static_cast<size_t>(w) < counts.size() ? counts[w] : 0;
    };
    auto held_all = [&](WorkerIndex w) {
      return std::max(held(w),
                      w >= 0 && static_cast<size_t>(w) < all_counts.size()
                          ? all_counts[w]
                          : 0);
    };
    PeerPullInput in;
    in.prefill = p.index;
    in.prefill_cached_blocks = held(p.index);
    in.prefill_tier_blocks = held_all(p.index);
    in.prefill_tier_load_tokens_per_second =
        p.status.kv_tier_load_tokens_per_second();
    in.prompt_blocks = static_cast<int32_t>(chain.size());
    in.block_size = static_cast<int32_t>(p.status.layout().block_size());
    in.bytes_per_block = BytesPerBlock(p.status.layout());
    in.prefill_tokens_per_second = p.status.prefill_tokens_per_second();
    in.prefill_transfer_bytes_per_second =
        p.status.kv_transfer_bytes_per_second();
    const std::string p_layout = p.status.layout().SerializeAsString();
    for (const WorkerView& w : workers) {
      if (held_all(w.index) <= in.prefill_cached_blocks) continue;
      PeerPullCandidate c;
      c.index = w.index;
      c.address = w.address;
      c.id = w.id;
      c.up = w.up;
      c.same_cache = w.fingerprint == p.fingerprint &&
                     w.status.layout().SerializeAsString() == p_layout;
      c.leading_blocks = held_all(w.index);
      c.tier_blocks = c.leading_blocks - held(w.index);
      c.transfer_bytes_per_second = w.status.kv_transfer_bytes_per_second();
      c.tier_load_tokens_per_second = w.status.kv_tier_load_tokens_per_second();
      in.candidates.push_back(std::move(c));
    }
    const PeerPullDecision d = DecidePeerPull(config.peer_pull, in);
    m->CountPeerPull(d.pull ? "pull" : d.reason);
    v1::PeerPull out;
    if (d.pull) {
      out.set_holder_address(d.holder_address);
      out.set_holder_id(d.holder_id);
      out.set_blocks(static_cast<uint32_t>(d.blocks));
    }
    return out;
  }

  // The decode worker's request for this attempt: the sequence so far, the
  // tokens still owed, and where to prefill. Stop strings stay here (the
  // router applies them to the text it streams).
  v1::WorkerGenerateRequest WorkerRequest(const Call& call,
                                          const Route& route) {
    v1::WorkerGenerateRequest wreq;
    wreq.set_request_id(
        absl::StrCat(call.id, "@", instance, ".", next_attempt++));
    for (int32_t t : route.tokens) wreq.add_token_ids(static_cast<uint32_t>(t));
    *wreq.mutable_sampling() = call.req->sampling();
    // RunAttempt finishes a call once it has max_tokens, so this is >= 1.
    const size_t owed =
        call.sampling.max_tokens -
        std::min<size_t>(call.generated.size(), call.sampling.max_tokens);
    wreq.mutable_sampling()->set_max_tokens(static_cast<uint32_t>(owed));
    wreq.mutable_sampling()->clear_stop();
    // A migrated stream resumes the constraint after the tokens streamed.
    if (wreq.sampling().has_structured()) {
      wreq.mutable_sampling()->mutable_structured()->set_resume_tokens(
          static_cast<uint32_t>(call.generated.size()));
    }
    wreq.set_cache_salt(call.cache_salt);
    if (route.prefill) wreq.set_prefill_address(route.prefill->address);
    if (route.prefill && route.peer_pull.blocks() > 0)
      *wreq.mutable_peer_pull() = route.peer_pull;
    wreq.set_original_prompt_len(static_cast<uint32_t>(call.prompt.size()));
    return wreq;
  }

  // Runs one attempt on `route`, streaming tokens to the client as they
  // arrive (every message but the last is written here; the last one is
  // returned in Attempt::final). Router-side load is charged while it runs
  // and undone however it ends.
  Attempt RunAttempt(Call& call, const Route& route) {
    const WorkerIndex prefill_at =
        route.prefill ? route.prefill->index : route.decode.index;
    registry->AddLoad(prefill_at, route.uncached, 0);
    registry->AddLoad(route.decode.index, 0, 1);
    // Undone when the first token arrives (prefill done) and when the
    // stream ends (decode done), whichever way it ends.
    bool prefill_pending = true;
    auto prefill_done = [&] {
      if (prefill_pending) registry->AddLoad(prefill_at, -route.uncached, 0);
      prefill_pending = false;
    };
    absl::Cleanup decode_done = [&] {
      prefill_done();
      registry->AddLoad(route.decode.index, 0, -1);
    };

    // Propagates the client's cancellation to the worker call.
    std::unique_ptr<grpc::ClientContext> wctx_owner =
        grpc::ClientContext::FromServerContext(*call.ctx);
    grpc::ClientContext& wctx = *wctx_owner;
    if (call.deadline != absl::InfiniteFuture())
      wctx.set_deadline(absl::ToChronoTime(call.deadline));
    auto reader =
        route.decode.stub->Generate(&wctx, WorkerRequest(call, route));
    Attempt a;
    v1::WorkerGenerateResponse resp;
    v1::GenerateResponse& out = a.final;
    while (reader->Read(&resp)) {
      if (call.ctx->IsCancelled()) {
        wctx.TryCancel();
        break;
      }
      prefill_done();
      if (!call.cached_known) {
        call.cached = resp.cached_prompt_tokens();
        call.cached_known = true;
      }
      call.prefill_worker = resp.prefill_worker();
      call.decode_worker = resp.decode_worker();
      out.Clear();
      out.set_request_id(call.id);
      const absl::Time now = absl::Now();
      // A worker that sends more than it was asked for is cut off at
      // max_tokens: the client never sees more, and the tokens still owed
      // (WorkerRequest) never go below zero.
      bool reached_max = false;
      for (uint32_t t : resp.token_ids()) {
        if (call.generated.size() >= call.sampling.max_tokens) {
          reached_max = true;
          break;
        }
        if (call.generated.empty()) {
          m->ttft->Observe(absl::ToDoubleSeconds(now - call.start));
        } else {
          m->itl->Observe(absl::ToDoubleSeconds(now - call.last_token));
        }
        call.last_token = now;
        call.generated.push_back(static_cast<int32_t>(t));
        out.add_token_ids(t);
      }
      // Logprobs travel with their tokens (those past max_tokens dropped).
      for (int i = 0; i < out.token_ids_size() && i < resp.logprobs_size(); ++i)
        *out.add_logprobs() = resp.logprobs(i);
      reached_max |= call.generated.size() >= call.sampling.max_tokens;
      m->generation_tokens->Increment(out.token_ids_size());
      limiter.Charge(*call.tenant, out.token_ids_size(), now);
      auto delta =
          call.text->Push({out.token_ids().begin(), out.token_ids().end()});
      std::string piece = delta.text;
      if (delta.stopped) {
        a.finish = "stop";
        wctx.TryCancel();
      } else if (resp.finish_reason() != v1::FINISH_REASON_NONE) {
        a.finish = wire::FinishReasonName(resp.finish_reason());
        if (a.finish.empty()) a.finish = "error";  // a number we do not know
        piece += call.text->Finish().text;
      } else if (reached_max) {
        a.finish = "length";
        wctx.TryCancel();
        piece += call.text->Finish().text;
      }
      out.set_text(piece);
      if (!a.finish.empty()) break;
      if (!call.writer->Write(out)) {
        wctx.TryCancel();
        break;
      }
    }
    if (call.ctx->IsCancelled()) {
      reader->Finish();
      a.outcome = Attempt::kClientCancelled;
    } else if (!a.finish.empty()) {
      wctx.TryCancel();
      reader->Finish();
      a.outcome = Attempt::kFinished;
    } else {
      a.outcome = Attempt::kWorkerFailed;
      a.status = reader->Finish();
      if (a.status.ok()) {
        a.status = grpc::Status(
            grpc::StatusCode::INTERNAL,
            "decode worker ended the stream without a finish reason");
      }
    }
    return a;
  }

  // Sends the last message (the last tokens, their text and the usage) and
  // counts the request as finished with `finish`.
  grpc::Status FinishCall(Call& call, const std::string& finish,
                          v1::GenerateResponse& last) {
    last.set_request_id(call.id);
    last.set_finish_reason(finish);
    last.set_prefill_worker(call.prefill_worker);
    last.set_decode_worker(call.decode_worker);
    auto* usage = last.mutable_usage();
    usage->set_prompt_tokens(static_cast<uint32_t>(call.prompt.size()));
    usage->set_completion_tokens(static_cast<uint32_t>(call.generated.size()));
    usage->set_cached_prompt_tokens(call.cached);
    call.writer->Write(last);
    Finish(finish, call.start);
    return grpc::Status::OK;
  }

  // After a failed attempt: OK to try again elsewhere (the failed worker is
  // excluded and marked down), or the status that ends the call.
  grpc::Status DecideRetry(Call& call, const Route& route,
                           const grpc::Status& failure) {
    // Past the call's deadline, whatever the worker answered is the deadline's
    // doing, not the worker's: a worker whose propagated deadline fired a
    // moment before ours answers CANCELLED ("request cancelled"), which must
    // neither be retried nor mark the worker down.
    const bool past_deadline =
        failure.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
        absl::Now() >= call.deadline;
    if (past_deadline && call.deadline < call.start + config.request_timeout) {
      if (failure.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
        return failure;
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          absl::StrCat("request deadline exceeded after ",
                                       call.generated.size(), " tokens"));
    }
    if (past_deadline && call.deadline == call.start + config.request_timeout) {
      m->LimitRejection("deadline");
      return grpc::Status(
          grpc::StatusCode::DEADLINE_EXCEEDED,
          absl::StrCat("request ran past the router's ceiling of ",
                       absl::FormatDuration(config.request_timeout),
                       " (--request-timeout-ms) after ", call.generated.size(),
                       " tokens"));
    }
    if (!Retryable(failure.error_code())) return failure;
    PDSERVE_LOG(WARNING) << "request " << call.id << " on "
                         << route.decode.address << " failed after "
                         << call.generated.size()
                         << " tokens: " << failure.error_message()
                         << "; retrying elsewhere";
    // A prefill failure is the prefill worker's fault, not the decode's.
    const bool prefill_failed =
        route.prefill && CauseOf(failure) == StatusCause::kPrefillFailed;
    const WorkerIndex failed =
        prefill_failed ? route.prefill->index : route.decode.index;
    call.exclude.push_back(failed);
    registry->ReportFailure(failed);
    return grpc::Status::OK;
  }

  // Validate, admit, then attempt on chosen workers until one finishes the
  // stream, the client leaves, a failure is final, or max_retries runs out.
  grpc::Status GenerateImpl(grpc::ServerContext* ctx,
                            const v1::GenerateRequest& req,
                            grpc::ServerWriter<v1::GenerateResponse>* writer,
                            absl::Time start, const Tenant& tenant) {
    Call call;
    call.ctx = ctx;
    call.writer = writer;
    call.req = &req;
    call.tenant = &tenant;
    call.start = start;
    if (grpc::Status st = TokenizeAndValidate(req, call); !st.ok()) return st;
    // Per-tenant admission; the lease ends with this call, however it ends.
    if (auto no = limiter.Admit(
            tenant, static_cast<int64_t>(call.prompt.size()), absl::Now())) {
      metrics::Must(m->tenant_rejections->WithLabels({tenant.name, no->limit}))
          ->Increment();
      return RetryLater(ctx, no->retry_after, no->message);
    }
    absl::Cleanup lease = [&] { limiter.Release(tenant); };
    StartCall(call);
    m->prompt_tokens->Increment(static_cast<double>(call.prompt.size()));

    grpc::Status last_error(grpc::StatusCode::UNAVAILABLE,
                            "no worker could serve the request");
    for (int attempts = 0;; ++attempts) {
      if (attempts > config.max_retries) return last_error;
      if (attempts > 0) m->retries->Increment();
      absl::StatusOr<Route> route = ChooseWorkers(call);
      if (!route.ok()) {
        // Bad input, or nobody to try (again): the first error is the
        // policy's; after failures, the last worker's is more telling.
        if (absl::IsInvalidArgument(route.status()) || attempts == 0 ||
            call.exclude.empty())
          return ToGrpc(route.status());
        return last_error;
      }
      Attempt a = RunAttempt(call, *route);
      switch (a.outcome) {
        case Attempt::kClientCancelled:
          return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled");
        case Attempt::kFinished:
          return FinishCall(call, a.finish, a.final);
        case Attempt::kWorkerFailed:
          last_error = a.status;
          if (grpc::Status st = DecideRetry(call, *route, a.status); !st.ok())
            return st;
          break;
      }
    }
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
