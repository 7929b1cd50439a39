#include "decode_service/decode_handler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/status_cause.h"
#include "common/tls.h"
#include "kv_transfer/grpc/grpc_transport.h"
#include "wire/channel_args.h"
#include "wire/sampling_convert.h"

namespace pdserve::decode {
namespace {

absl::Time DeadlineOf(grpc::ServerContext* context) {
  const auto d = context->deadline();
  if (d == std::chrono::system_clock::time_point::max())
    return absl::InfiniteFuture();
  return absl::FromChrono(d);
}

v1::FinishReason FinishToProto(engine::FinishReason r) {
  switch (r) {
    case engine::FinishReason::kNone:
      return v1::FINISH_REASON_NONE;
    case engine::FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case engine::FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case engine::FinishReason::kEos:
      return v1::FINISH_REASON_EOS;
    case engine::FinishReason::kCancelled:
      return v1::FINISH_REASON_CANCELLED;
  }
  return v1::FINISH_REASON_NONE;
}

}  // namespace

std::shared_ptr<v1::Worker::Stub> PrefillStubCache::Get(
    const std::string& address) {
  absl::MutexLock l(&mu_);
  auto it = stubs_.find(address);
  if (it != stubs_.end()) {
    lru_.splice(lru_.begin(), lru_, it->second.lru);
    return it->second.stub;
  }
  if (stubs_.size() >= capacity_ && !lru_.empty()) {
    stubs_.erase(lru_.back());
    lru_.pop_back();
  }
  lru_.push_front(address);
  std::shared_ptr<v1::Worker::Stub> stub = v1::Worker::NewStub(
      grpc::CreateCustomChannel(address, tls::InternalChannelCredentials(),
                                wire::InternalChannelArgs()));
  stubs_[address] = Cached{stub, lru_.begin()};
  return stub;
}

void PrefillStubCache::Forget(const std::string& address,
                              const std::shared_ptr<v1::Worker::Stub>& stub) {
  absl::MutexLock l(&mu_);
  auto it = stubs_.find(address);
  if (it == stubs_.end() || it->second.stub != stub) return;
  lru_.erase(it->second.lru);
  stubs_.erase(it);
}

size_t PrefillStubCache::size() const {
  absl::MutexLock l(&mu_);
  return stubs_.size();
}

grpc::Status DecodeHandler::Generate(
    grpc::ServerContext* context, const v1::WorkerGenerateRequest& request,
    grpc::ServerWriter<v1::WorkerGenerateResponse>* writer) {
  // Untrusted input: the salt is hashed into every block.
  if (absl::Status s = engine::CheckRequestFieldCaps(request.request_id(),
                                                     request.cache_salt());
      !s.ok()) {
    return ToGrpc(s);
  }
  engine::EngineRequest req;
  req.id = request.request_id().empty() ? "anonymous" : request.request_id();
  req.prompt.assign(request.token_ids().begin(), request.token_ids().end());
  req.sampling = SamplingFromProto(request.sampling());
  req.sampling.stop.clear();  // stop strings are applied on text, by the router
  req.cache_salt = request.cache_salt();
  const absl::Time deadline = DeadlineOf(context);

  v1::WorkerGenerateResponse base;
  base.set_decode_worker(options_.worker_id);

  if (request.prefill_address().empty()) {
    // Local prefill (colocated, or conditional disaggregation).
    auto stream = loop_->Submit(req);
    if (!stream.ok()) return ToGrpc(stream.status());
    base.set_prefill_worker(options_.worker_id);
    return StreamOutputs(context, req.id, *stream, base, writer);
  }

  // 1. Reserve the prompt's blocks here before any prefill compute. If they
  // are busy the request waits on the engine side, first come first served,
  // and is retried as blocks are released; one that can never fit is refused
  // at once (StatusCause::kNeverFits).
  const absl::Time admit_by =
      std::min(deadline, absl::Now() + options_.admission_timeout);
  absl::StatusOr<engine::Reservation> reservation = loop_->Reserve(
      req, admit_by, [context] { return context->IsCancelled(); });
  if (!reservation.ok()) {
    if (CauseOf(reservation.status()) == StatusCause::kPoolBusy &&
        absl::Now() >= deadline) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          "deadline passed while waiting for KV blocks");
    }
    return ToGrpc(reservation.status());
  }
  const uint64_t reservation_id = receiver_->Expect(req.id, reservation->blocks,
                                                    reservation->cached_blocks);
  auto release = [&] {
    receiver_->Cancel(reservation_id);
    loop_->Abort(req.id);
  };

  // 2. The prefill worker computes what it lacks and pushes what we lack.
  v1::PrefillRequest prefill;
  prefill.set_request_id(req.id);
  *prefill.mutable_token_ids() = request.token_ids();
  *prefill.mutable_sampling() = request.sampling();
  prefill.set_cache_salt(req.cache_salt);
  prefill.set_kv_destination(options_.kv_address);
  prefill.set_reservation_id(reservation_id);
  prefill.set_skip_blocks(static_cast<uint32_t>(reservation->cached_blocks));
  *prefill.mutable_layout() = kv_transfer::ToProto(receiver_->layout());
  // The router's peer-pull instruction is the prefill worker's to follow.
  if (request.has_peer_pull())
    *prefill.mutable_peer_pull() = request.peer_pull();
  v1::PrefillResponse prefilled;
  // A child call: the client's deadline and its cancellation pass on to the
  // prefill worker, which then stops computing for a request nobody awaits.
  std::unique_ptr<grpc::ClientContext> pctx =
      grpc::ClientContext::FromServerContext(*context);
  const std::shared_ptr<v1::Worker::Stub> prefill_stub =
      stubs_.Get(request.prefill_address());
  const grpc::Status pst =
      prefill_stub->Prefill(pctx.get(), prefill, &prefilled);
  if (!pst.ok()) {
    release();
    // Unreachable (a gone pod): its channel is not kept for an address that
    // may never come back. Its next request makes a fresh one.
    if (pst.error_code() == grpc::StatusCode::UNAVAILABLE)
      stubs_.Forget(request.prefill_address(), prefill_stub);
    // Name the prefill worker as the culprit (StatusCause::kPrefillFailed), so
    // the router retries with another prefill worker rather than dropping us.
    // Transport-level failures become UNAVAILABLE (retryable); request errors
    // such as a layout mismatch keep their code.
    grpc::StatusCode code = pst.error_code();
    if (code == grpc::StatusCode::INTERNAL ||
        code == grpc::StatusCode::UNKNOWN ||
        code == grpc::StatusCode::CANCELLED) {
      code = grpc::StatusCode::UNAVAILABLE;
    }
    // The cause, not the message, tells the router which worker failed.
    return WithCause(
        grpc::Status(code, absl::StrCat("prefill worker failed at ",
                                        request.prefill_address(), ": ",
                                        pst.error_message())),
        StatusCause::kPrefillFailed);
  }
  if (absl::Status s =
          receiver_->Wait(reservation_id, options_.kv_stall_timeout, deadline,
                          [context] { return context->IsCancelled(); });
      !s.ok()) {
    // Wait has ended the reservation: nothing writes into its blocks now.
    loop_->Abort(req.id);
    // The request's own deadline and cancel keep their codes; a failed or
    // stalled transfer is UNAVAILABLE (the router may retry it elsewhere).
    grpc::StatusCode code = grpc::StatusCode::UNAVAILABLE;
    if (s.code() == absl::StatusCode::kDeadlineExceeded)
      code = grpc::StatusCode::DEADLINE_EXCEEDED;
    if (s.code() == absl::StatusCode::kCancelled)
      code = grpc::StatusCode::CANCELLED;
    return grpc::Status(code, std::string(s.message()));
  }

  // 3. First token to the client at once, then decode here.
  const int32_t first = static_cast<int32_t>(prefilled.first_token());
  base.set_prefill_worker(prefilled.worker_id());
  // How the prefill's peer pull ended, for the router's holder backoff.
  base.set_peer_pull_outcome(prefilled.peer_pull_outcome());
  const uint32_t cached = std::max<uint32_t>(
      prefilled.cached_prompt_tokens(),
      reservation->cached_blocks * loop_->kv_spec().block_size);
  base.set_cached_prompt_tokens(std::min<uint32_t>(cached, req.prompt.size()));
  struct Started {
    absl::StatusOr<engine::FinishReason> finish;
    std::shared_ptr<engine::RequestStream> stream;
  };
  absl::StatusOr<Started> call = loop_->Call([&](engine::Engine& e) {
    Started s{engine::FinishReason::kNone, loop_->AttachStream(req.id)};
    s.finish = e.CompleteReservation(req.id, first);
    return s;
  });
  if (!call.ok()) return ToGrpc(call.status());  // the engine loop stopped
  Started& started = *call;
  if (!started.finish.ok()) return ToGrpc(started.finish.status());
  v1::WorkerGenerateResponse msg = base;
  msg.add_token_ids(static_cast<uint32_t>(first));
  // The prefill worker sampled the first token: its logprobs come from there.
  if (prefilled.has_first_token_logprobs())
    *msg.add_logprobs() = prefilled.first_token_logprobs();
  if (*started.finish != engine::FinishReason::kNone) {
    msg.set_finish_reason(FinishToProto(*started.finish));
    writer->Write(msg);
    return grpc::Status::OK;
  }
  if (!writer->Write(msg)) {
    loop_->Abort(req.id);
    return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
  }
  return StreamOutputs(context, req.id, started.stream, base, writer);
}

grpc::Status DecodeHandler::StreamOutputs(
    grpc::ServerContext* context, const std::string& id,
    const std::shared_ptr<engine::RequestStream>& stream,
    v1::WorkerGenerateResponse base,
    grpc::ServerWriter<v1::WorkerGenerateResponse>* writer) {
  const absl::Time deadline = DeadlineOf(context);
  const absl::Time admit_by = absl::Now() + options_.admission_timeout;
  bool admitted = false;
  while (true) {
    if (!admitted && absl::Now() >= admit_by) {
      absl::StatusOr<bool> waiting =
          loop_->Call([&](engine::Engine& e) { return e.IsWaiting(id); });
      if (!waiting.ok()) return ToGrpc(waiting.status());
      admitted = !*waiting;
      if (!admitted) {
        loop_->Abort(id);
        return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            "KV cache full: the request was not admitted "
                            "within the admission timeout");
      }
    }
    if (context->IsCancelled()) {
      loop_->Abort(id);
      return grpc::Status(grpc::StatusCode::CANCELLED, "request cancelled");
    }
    if (absl::Now() >= deadline) {
      loop_->Abort(id);
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          "request deadline exceeded");
    }
    if (absl::Status s = stream->error(); !s.ok()) return ToGrpc(s);
    for (const auto& out : stream->Pop(absl::Milliseconds(50))) {
      admitted = true;
      v1::WorkerGenerateResponse msg = base;
      for (int32_t t : out.new_tokens)
        msg.add_token_ids(static_cast<uint32_t>(t));
      for (const engine::TokenLogprobs& lp : out.logprobs)
        LogprobsToProto(lp, msg.add_logprobs());
      if (out.cached_prompt_tokens > 0 && base.cached_prompt_tokens() == 0) {
        msg.set_cached_prompt_tokens(
            static_cast<uint32_t>(out.cached_prompt_tokens));
      }
      msg.set_finish_reason(FinishToProto(out.finish));
      if (!writer->Write(msg)) {
        loop_->Abort(id);
        return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
      }
      if (out.finish != engine::FinishReason::kNone) return grpc::Status::OK;
    }
  }
}

}  // namespace pdserve::decode
