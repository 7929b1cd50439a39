// The request path of RouterServer::Impl: Generate's admission and
// validation, the choice of workers (and of a peer pull), one attempt's
// token stream, and retries before the first token or migration after it.
#include <algorithm>
#include <string_view>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "router/router_service_impl.h"
#include "wire/enums.h"
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

void RouterServer::Impl::Finish(const std::string& reason, absl::Time start) {
  m->Finished(reason)->Increment();
  m->duration->Observe(absl::ToDoubleSeconds(absl::Now() - start));
}

grpc::Status RouterServer::Impl::Generate(
    grpc::ServerContext* ctx, const v1::GenerateRequest* req,
    grpc::ServerWriter<v1::GenerateResponse>* writer) {
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
    Finish(
        st.error_code() == grpc::StatusCode::CANCELLED ? "cancelled" : "error",
        start);
  return st;
}

grpc::Status RouterServer::Impl::RetryLater(grpc::ServerContext* ctx,
                                            absl::Duration after,
                                            const std::string& why) {
  const int64_t ms = std::max<int64_t>(1, absl::ToInt64Milliseconds(after));
  ctx->AddTrailingMetadata("retry-after-ms", std::to_string(ms));
  return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                      absl::StrCat(why, "; retry after ", ms, " ms"));
}

grpc::Status RouterServer::Impl::Authenticate(grpc::ServerContext* ctx,
                                              Tenant* tenant) {
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

grpc::Status RouterServer::Impl::OverLimit(const char* limit,
                                           const std::string& why) {
  m->LimitRejection(limit);
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, why);
}

grpc::Status RouterServer::Impl::CheckRequestLimits(
    const engine::SamplingParams& sampling, size_t prompt_tokens) {
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
      return OverLimit("stop_string_bytes",
                       absl::StrCat("a stop string has ", s.size(),
                                    " bytes; at most ", l.max_stop_string_bytes,
                                    " allowed (--max-stop-string-bytes)"));
  }
  return grpc::Status::OK;
}

grpc::Status RouterServer::Impl::TokenizeAndValidate(
    const v1::GenerateRequest& req, Call& call) {
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

void RouterServer::Impl::StartCall(Call& call) {
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

absl::StatusOr<RouterServer::Impl::Route> RouterServer::Impl::ChooseWorkers(
    const Call& call) {
  const absl::Time route_start = absl::Now();
  // Shared with concurrent requests, not copied. A draining worker finishes
  // what it has but takes nothing new: the policies skip it, and so does
  // everything below.
  const std::shared_ptr<const std::vector<WorkerView>> snapshot =
      registry->UpSnapshot();
  const std::vector<WorkerView>& workers = *snapshot;
  uint32_t max_len = 0;
  for (const auto& w : workers) {
    if (w.role != v1::WORKER_ROLE_PREFILL && !w.status.draining())
      max_len = max_len ? std::min(max_len, w.status.max_model_len())
                        : w.status.max_model_len();
  }
  if (max_len > 0 && call.prompt.size() + call.sampling.max_tokens > max_len) {
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
  m->route_time->Observe(absl::ToDoubleSeconds(absl::Now() - route_start));
  route.decode = *decision.decode;
  if (decision.prefill != nullptr) route.prefill = *decision.prefill;
  route.uncached = request.num_tokens - decision.prefill_cached_tokens;
  (route.prefill ? m->remote : m->local)->Increment();
  auto hashes_for = [&](const WorkerView& w) {
    return hashes.For(w.fingerprint, w.block_size);
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

v1::PeerPull RouterServer::Impl::PeerPullFor(
    const WorkerView& p, const std::vector<engine::BlockHash>& chain,
    const std::vector<WorkerView>& workers) {
  // Per tier: the pool's counts, and the pool's plus the lower tiers' (a
  // holder reads its tier's blocks back for the pull).
  std::vector<int32_t> counts, all_counts;
  index.LeadingBlocksOfPrompt(chain, &counts);
  index.LeadingBlocksOfPrompt(chain, &all_counts, kAllTiers);
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
  in.block_size = p.block_size;
  in.bytes_per_block = BytesPerBlock(p.status.layout());
  in.prefill_tokens_per_second = p.status.prefill_tokens_per_second();
  in.prefill_transfer_bytes_per_second =
      p.status.kv_transfer_bytes_per_second();
  const std::string p_layout = p.status.layout().SerializeAsString();
  const absl::Time now = absl::Now();
  for (const WorkerView& w : workers) {
    if (w.status.draining() || held_all(w.index) <= in.prefill_cached_blocks)
      continue;
    PeerPullCandidate c;
    c.index = w.index;
    c.address = w.address;
    c.id = w.id;
    c.up = w.up;
    c.backed_off = peer_pull_backoff->BackedOff(w.address, now);
    c.same_cache = w.fingerprint == p.fingerprint &&
                   w.status.layout().SerializeAsString() == p_layout;
    c.leading_blocks = held_all(w.index);
    c.tier_blocks = c.leading_blocks - held(w.index);
    // Never more than the holder serves in one pull: the leading part of
    // what it holds (its tier part is the tail, so cut from there).
    if (const uint32_t cap = w.status.peer_pull_max_blocks();
        cap > 0 && static_cast<uint32_t>(c.leading_blocks) > cap) {
      c.tier_blocks = std::max<int32_t>(
          0, c.tier_blocks - (c.leading_blocks - static_cast<int32_t>(cap)));
      c.leading_blocks = static_cast<int32_t>(cap);
    }
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

v1::WorkerGenerateRequest RouterServer::Impl::WorkerRequest(
    const Call& call, const Route& route) {
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
  if (route.prefill && route.peer_pull.blocks() > 0) {
    *wreq.mutable_peer_pull() = route.peer_pull;
    SignPeerPull(route, wreq.request_id(), wreq.mutable_peer_pull());
  }
  wreq.set_original_prompt_len(static_cast<uint32_t>(call.prompt.size()));
  return wreq;
}

void RouterServer::Impl::SignPeerPull(const Route& route,
                                      const std::string& request_id,
                                      v1::PeerPull* pull) {
  pull->set_puller_kv_address(route.prefill->address);
  pull->set_request_id(request_id);
  // Long enough for the prefill to be admitted and start (it pulls first),
  // short enough that a grant seen in transit is soon worthless.
  pull->set_expires_unix_ms(absl::ToUnixMillis(absl::Now() + absl::Minutes(1)));
  wire::SignPeerPullGrant(peer_pull_key, pull);
}

void RouterServer::Impl::NotePeerPullOutcome(const Route& route,
                                             v1::PeerPullOutcome outcome) {
  if (route.peer_pull.blocks() == 0) return;
  const std::string& holder = route.peer_pull.holder_address();
  const char* reason = nullptr;
  bool holder_at_fault = false;
  switch (outcome) {
    case v1::PEER_PULL_OUTCOME_PULLED:
    case v1::PEER_PULL_OUTCOME_PARTIAL:
      peer_pull_backoff->Succeeded(holder);
      return;
    case v1::PEER_PULL_OUTCOME_EVICTED:
      // The index was behind the holder's evictions; its events catch up.
      reason = "evicted";
      break;
    case v1::PEER_PULL_OUTCOME_FAILED:
      reason = "failed";
      holder_at_fault = true;
      break;
    case v1::PEER_PULL_OUTCOME_REFUSED:
      reason = "refused";
      holder_at_fault = true;
      break;
    case v1::PEER_PULL_OUTCOME_BUSY:
      reason = "busy";
      holder_at_fault = true;
      break;
    case v1::PEER_PULL_OUTCOME_NO_BLOCKS:
      reason = "no_blocks";  // the puller's pool was full, not the holder
      break;
    default:
      return;  // none reported (an older worker), or the prefix was local
  }
  m->PeerPullFailure(reason);
  if (!holder_at_fault) return;
  const absl::Duration off = peer_pull_backoff->Failed(holder, absl::Now());
  m->peer_pull_backoffs->Increment();
  PDSERVE_LOG(WARNING) << "peer pull from " << holder << " " << reason
                       << "; not pulling from it for "
                       << absl::FormatDuration(off);
}

RouterServer::Impl::Attempt RouterServer::Impl::RunAttempt(Call& call,
                                                           const Route& route) {
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
  auto reader = route.decode.stub->Generate(&wctx, WorkerRequest(call, route));
  Attempt a;
  bool outcome_noted = false;  // the pull's outcome comes with the first reply
  v1::WorkerGenerateResponse resp;
  v1::GenerateResponse& out = a.final;
  // A write to the client failed: it is gone, whether or not the call
  // already reads as cancelled (that flag can trail the failed write).
  bool client_gone = false;
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
    if (!outcome_noted) {
      NotePeerPullOutcome(route, resp.peer_pull_outcome());
      outcome_noted = true;
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
      client_gone = true;
      wctx.TryCancel();
      break;
    }
  }
  if (client_gone || call.ctx->IsCancelled()) {
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

grpc::Status RouterServer::Impl::FinishCall(Call& call,
                                            const std::string& finish,
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

grpc::Status RouterServer::Impl::DecideRetry(Call& call, const Route& route,
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
  // The client's cancellation reaches the worker call (FromServerContext)
  // and can end it a moment before this call reads as cancelled.
  if (call.ctx->IsCancelled())
    return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled");
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
  // CANCELLED says this call was cancelled (a client that went away, a
  // worker shutting down), not that the worker is unreachable: the call
  // goes elsewhere, and only a heartbeat marks the worker down (marking it
  // down here would refuse every request until the next poll).
  if (failure.error_code() != grpc::StatusCode::CANCELLED)
    registry->ReportFailure(failed);
  return grpc::Status::OK;
}

grpc::Status RouterServer::Impl::GenerateImpl(
    grpc::ServerContext* ctx, const v1::GenerateRequest& req,
    grpc::ServerWriter<v1::GenerateResponse>* writer, absl::Time start,
    const Tenant& tenant) {
  Call call;
  call.ctx = ctx;
  call.writer = writer;
  call.req = &req;
  call.tenant = &tenant;
  call.start = start;
  if (grpc::Status st = TokenizeAndValidate(req, call); !st.ok()) return st;
  // Per-tenant admission; the lease ends with this call, however it ends.
  if (auto no = limiter.Admit(tenant, static_cast<int64_t>(call.prompt.size()),
                              absl::Now())) {
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

}  // namespace pdserve::router
