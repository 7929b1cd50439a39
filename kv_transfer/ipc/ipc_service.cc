#include "kv_transfer/ipc/ipc_service.h"

#include <deque>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace pdserve::kv_transfer::ipc {
namespace {

using Frame = v1::KvControlFrame;

// One Control call, shared by the handler thread (which reads frames into
// `queue`) and the channel the endpoint owns (which writes replies), so
// either may finish first.
struct ServerCall {
  ServerCall(grpc::ServerContext* context,
             grpc::ServerReaderWriter<Frame, Frame>* stream)
      : context(context), stream(stream), peer(context->peer()) {}

  grpc::ServerContext* const context;
  grpc::ServerReaderWriter<Frame, Frame>* const stream;
  const std::string peer;
  absl::Mutex write_mu;  // one Write at a time; acquired before mu
  absl::Mutex mu;
  std::deque<std::string> queue ABSL_GUARDED_BY(mu);
  bool peer_done ABSL_GUARDED_BY(mu) = false;  // reads ended
  bool closed ABSL_GUARDED_BY(mu) = false;     // this end closed
  bool handler_done ABSL_GUARDED_BY(mu) = false;
};

class ServerChannel : public ControlChannel {
 public:
  explicit ServerChannel(std::shared_ptr<ServerCall> call)
      : call_(std::move(call)) {}
  ~ServerChannel() override { Close(); }

  absl::Status Send(std::string message) override {
    absl::MutexLock w(&call_->write_mu);
    {
      absl::MutexLock l(&call_->mu);
      if (call_->handler_done || call_->closed) {
        return absl::UnavailableError(
            absl::StrCat("KV control channel to ", call_->peer, " is closed"));
      }
    }
    Frame frame;
    frame.set_payload(std::move(message));
    if (!call_->stream->Write(frame)) {
      return absl::UnavailableError(
          absl::StrCat("KV control stream to ", call_->peer, " broke"));
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Receive(absl::Time deadline) override {
    ServerCall* c = call_.get();
    absl::MutexLock l(&c->mu);
    c->mu.AwaitWithDeadline(
        absl::Condition(
            +[](ServerCall* c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
              return c->closed || c->peer_done || !c->queue.empty();
            },
            c),
        deadline);
    if (c->closed) {
      return absl::UnavailableError(
          absl::StrCat("KV control channel to ", c->peer, " is closed"));
    }
    if (!c->queue.empty()) {
      std::string out = std::move(c->queue.front());
      c->queue.pop_front();
      return out;
    }
    if (c->peer_done) {
      return absl::UnavailableError(
          absl::StrCat("KV control channel: ", c->peer, " closed the stream"));
    }
    return absl::DeadlineExceededError(
        absl::StrCat("no KV control message from ", c->peer, " in time"));
  }
  void Close() override {
    absl::MutexLock l(&call_->mu);
    if (call_->closed) return;
    call_->closed = true;
    // Cancelling ends the call for both sides and wakes the handler's Read.
    if (!call_->handler_done) call_->context->TryCancel();
  }

 private:
  std::shared_ptr<ServerCall> call_;
};

}  // namespace

grpc::Status IpcKvTransferService::Control(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<Frame, Frame>* stream) {
  if (endpoint_ == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "this worker takes no KV over shm/cuda_ipc (it does "
                        "not serve decode)");
  }
  auto call = std::make_shared<ServerCall>(context, stream);
  endpoint_->Serve(std::make_unique<ServerChannel>(call));
  Frame frame;
  while (stream->Read(&frame)) {
    absl::MutexLock l(&call->mu);
    call->queue.push_back(std::move(*frame.mutable_payload()));
  }
  absl::MutexLock w(&call->write_mu);
  absl::MutexLock l(&call->mu);
  call->peer_done = true;
  call->handler_done = true;
  return grpc::Status::OK;
}

}  // namespace pdserve::kv_transfer::ipc
