#include "prefill_service/prefill_handler.h"

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "kv_transfer/grpc/grpc_transport.h"
#include "prefill_service/layer_streamer.h"
#include "wire/sampling_convert.h"

namespace pdserve::prefill {

grpc::Status PrefillHandler::Prefill(grpc::ServerContext* context,
                                     const v1::PrefillRequest& request,
                                     v1::PrefillResponse* response) {
  // Untrusted input: the salt is hashed into every block.
  if (absl::Status s = engine::CheckRequestFieldCaps(request.request_id(),
                                                     request.cache_salt());
      !s.ok()) {
    return ToGrpc(s);
  }
  // Handshake before any compute (contract): the decode worker's layout.
  if (absl::Status s = kv_transfer::CheckLayouts(
          layout_, kv_transfer::FromProto(request.layout()));
      !s.ok()) {
    return ToGrpc(s);
  }
  // Peer pull first: blocks pulled from the holder become a prefix hit of the
  // prefill below; a failed pull leaves nothing behind and they are
  // recomputed. They stay referenced until the prefill ended.
  PeerPuller::Pulled pulled;
  if (options_.puller != nullptr && request.has_peer_pull())
    pulled = options_.puller->Pull(context, request);
  absl::Cleanup release_pulled = [&] {
    if (options_.puller != nullptr) options_.puller->Release(pulled);
  };
  // Open the transfer before computing too: a transport that talks to the
  // receiver at Open (nccl) refuses a bad reservation without a prefill.
  kv_transfer::SendPlan plan;
  plan.destination = request.kv_destination();
  plan.request_id = request.request_id();
  plan.reservation_id = request.reservation_id();
  plan.sender_id = worker_id_;
  plan.layout = layout_;
  absl::StatusOr<std::unique_ptr<kv_transfer::KvSendSession>> opened =
      transport_->Open(plan, &loop_->kv_storage_for_transfer());
  if (!opened.ok()) return ToGrpc(opened.status());
  kv_transfer::KvSendSession& session = **opened;
  const int32_t skip = static_cast<int32_t>(request.skip_blocks());

  engine::EngineRequest req;
  req.id = absl::StrCat("prefill:", request.request_id());
  req.prompt.assign(request.token_ids().begin(), request.token_ids().end());
  req.sampling = SamplingFromProto(request.sampling());
  req.sampling.max_tokens = 1;
  req.sampling.stop.clear();
  req.cache_salt = request.cache_salt();
  req.hold_blocks_on_finish = true;
  const engine::KvCacheSpec& spec = loop_->kv_spec();
  const int64_t span_bytes =
      spec.LayerBlockBytes() +
      (DTypeHasScales(spec.dtype) ? 2 * spec.num_kv_heads * sizeof(float) : 0);
  std::shared_ptr<LayerStreamer> streamer;
  if (options_.layerwise) {
    streamer =
        std::make_shared<LayerStreamer>(spec.num_layers, spec.block_size, skip,
                                        span_bytes, options_.max_queued_bytes);
    req.on_layer_written = [streamer](const engine::LayerWritten& w,
                                      engine::BlockManager& blocks) {
      streamer->OnLayerWritten(w, blocks);
    };
  }
  const absl::Time submitted = absl::Now();
  auto stream = loop_->Submit(req);
  if (!stream.ok()) {
    session.Cancel();
    return ToGrpc(stream.status());
  }
  // Ends this request's hold on the engine: no more layer reports, and the
  // pinned and held blocks go back. Only once the session no longer reads.
  // (If the loop has stopped, so has the engine: nothing is left to free.)
  auto release = [&](const std::vector<int32_t>& held) {
    loop_
        ->Call([&](engine::Engine& e) {
          if (streamer) e.ReleaseBlocks(streamer->Close());
          e.ReleaseBlocks(held);
        })
        .IgnoreError();
  };
  // Gives up on the request at any point. The release runs on the engine
  // thread, between steps: the request is aborted if still live, and if it
  // finished meanwhile (however long its last step took) the blocks its
  // unread final output holds go back with the streamer's pins.
  auto abandon = [&](grpc::Status why) {
    session.Cancel();
    loop_
        ->Call([&](engine::Engine& e) {
          loop_->DetachStream(req.id, stream->get());
          if (streamer) e.ReleaseBlocks(streamer->Close());
        })
        .IgnoreError();
    return why;
  };

  engine::StepOutput done;
  while (done.finish == engine::FinishReason::kNone) {
    if (context->IsCancelled()) {
      return abandon(
          grpc::Status(grpc::StatusCode::CANCELLED, "prefill cancelled"));
    }
    if (absl::Status s = (*stream)->error(); !s.ok()) {
      session.Cancel();  // before unpinning: the session may still read
      release({});
      return ToGrpc(s);
    }
    absl::Duration wait = absl::Milliseconds(50);
    if (streamer && !streamer->forward_done()) {
      // Send what the forward pass has written so far; wakes for new layers.
      if (absl::Status s = streamer->SendQueued(&session, wait); !s.ok()) {
        return abandon(ToGrpc(s));
      }
      wait = absl::ZeroDuration();
    }
    for (auto& out : (*stream)->Pop(wait)) {
      if (out.finish != engine::FinishReason::kNone) done = std::move(out);
    }
  }
  if (done.new_tokens.empty()) {
    session.Cancel();
    release(done.held_blocks);
    return grpc::Status(grpc::StatusCode::ABORTED,
                        "prefill ended without a token");
  }
  if (options_.prefill_rate != nullptr) {
    options_.prefill_rate->Add(
        static_cast<double>(done.prompt_tokens - done.cached_prompt_tokens),
        absl::ToDoubleSeconds(absl::Now() - submitted));
  }
  // Send the blocks the decode worker does not hold and that were not
  // streamed yet, then unpin ours.
  const absl::Time send_start = absl::Now();
  absl::Status sent;
  if (streamer) {
    sent = streamer->SendRest(&session, done.held_blocks);
  } else {
    std::vector<kv_transfer::BlockRef> refs;
    for (size_t i = skip; i < done.held_blocks.size(); ++i) {
      refs.emplace_back(static_cast<int32_t>(i), done.held_blocks[i]);
    }
    sent = session.SendBlocks(0, layout_.num_layers, refs);
  }
  uint64_t bytes = 0;
  if (sent.ok()) {
    absl::StatusOr<kv_transfer::SendStats> stats = session.Finish();
    sent = stats.status();
    if (stats.ok()) bytes = stats->bytes;
    // The rate of what was sent after the forward pass (streamed spans
    // overlapped compute and say nothing about the link).
    const uint64_t streamed =
        streamer ? static_cast<uint64_t>(
                       streamer->stats().spans_before_forward_end * span_bytes)
                 : 0;
    if (options_.transfer_rate != nullptr && bytes > streamed &&
        bytes - streamed >= (uint64_t{256} << 10)) {
      options_.transfer_rate->Add(
          static_cast<double>(bytes - streamed),
          absl::ToDoubleSeconds(absl::Now() - send_start));
    }
  } else {
    session.Cancel();
  }
  if (streamer && options_.metrics) {
    options_.metrics->overlapped_bytes->Increment(static_cast<double>(
        streamer->stats().spans_before_forward_end * span_bytes));
  }
  release(done.held_blocks);
  if (!sent.ok()) return ToGrpc(sent);
  response->set_first_token(static_cast<uint32_t>(done.new_tokens[0]));
  if (!done.logprobs.empty())
    LogprobsToProto(done.logprobs[0], response->mutable_first_token_logprobs());
  response->set_cached_prompt_tokens(
      static_cast<uint32_t>(done.cached_prompt_tokens));
  response->set_bytes_sent(bytes);
  response->set_pulled_blocks(static_cast<uint32_t>(pulled.pulled_blocks));
  response->set_peer_pull_outcome(pulled.report);
  response->set_worker_id(worker_id_);
  return grpc::Status::OK;
}

}  // namespace pdserve::prefill
