#include "prefill_service/prefill_handler.h"

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "kv_transfer/grpc/grpc_transport.h"
#include "prefill_service/sampling_convert.h"

namespace pdserve::prefill {

grpc::Status PrefillHandler::Prefill(grpc::ServerContext* context,
                                     const v1::PrefillRequest& request,
                                     v1::PrefillResponse* response) {
  // Handshake before any compute (contract): the decode worker's layout.
  if (absl::Status s = kv_transfer::CheckLayouts(
          layout_, kv_transfer::FromProto(request.layout()));
      !s.ok()) {
    return ToGrpc(s);
  }
  engine::EngineRequest req;
  req.id = absl::StrCat("prefill:", request.request_id());
  req.prompt.assign(request.token_ids().begin(), request.token_ids().end());
  req.sampling = SamplingFromProto(request.sampling());
  req.sampling.max_tokens = 1;
  req.sampling.stop.clear();
  req.cache_salt = request.cache_salt();
  req.hold_blocks_on_finish = true;
  auto stream = loop_->Submit(req);
  if (!stream.ok()) return ToGrpc(stream.status());

  engine::StepOutput done;
  while (done.finish == engine::FinishReason::kNone) {
    if (context->IsCancelled()) {
      loop_->Abort(req.id);
      // Drain so that held blocks of a request that finished meanwhile return.
      for (auto& out : (*stream)->Pop(absl::Seconds(1))) {
        if (!out.held_blocks.empty()) {
          loop_->Call([&](engine::Engine& e) {
            e.ReleaseBlocks(out.held_blocks);
            return 0;
          });
        }
      }
      return grpc::Status(grpc::StatusCode::CANCELLED, "prefill cancelled");
    }
    if (absl::Status s = (*stream)->error(); !s.ok()) return ToGrpc(s);
    for (auto& out : (*stream)->Pop(absl::Milliseconds(50))) {
      if (out.finish != engine::FinishReason::kNone) done = std::move(out);
    }
  }
  if (done.new_tokens.empty()) {
    return grpc::Status(grpc::StatusCode::ABORTED,
                        "prefill ended without a token");
  }
  // Send the blocks the decode worker does not hold, then unpin ours.
  kv_transfer::SendPlan plan;
  plan.destination = request.kv_destination();
  plan.request_id = request.request_id();
  plan.reservation_id = request.reservation_id();
  plan.sender_id = worker_id_;
  plan.layout = layout_;
  for (size_t i = request.skip_blocks(); i < done.held_blocks.size(); ++i) {
    plan.blocks.emplace_back(static_cast<int32_t>(i), done.held_blocks[i]);
  }
  absl::Status sent = absl::OkStatus();
  uint64_t bytes = 0;
  {
    auto session = transport_->Open(plan, &loop_->pool_for_transfer());
    if (!session.ok()) {
      sent = session.status();
    } else {
      sent = (*session)->SendLayers(0, layout_.num_layers);
      if (sent.ok()) {
        auto stats = (*session)->Finish();
        sent = stats.status();
        if (stats.ok()) bytes = stats->bytes;
      } else {
        (*session)->Cancel();
      }
    }
  }
  loop_->Call([&](engine::Engine& e) {
    e.ReleaseBlocks(done.held_blocks);
    return 0;
  });
  if (!sent.ok()) return ToGrpc(sent);
  response->set_first_token(static_cast<uint32_t>(done.new_tokens[0]));
  response->set_cached_prompt_tokens(
      static_cast<uint32_t>(done.cached_prompt_tokens));
  response->set_bytes_sent(bytes);
  response->set_worker_id(worker_id_);
  return grpc::Status::OK;
}

}  // namespace pdserve::prefill
