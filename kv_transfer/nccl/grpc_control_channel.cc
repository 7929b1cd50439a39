#include "kv_transfer/nccl/grpc_control_channel.h"

#include <deque>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/tls.h"
#include "wire/channel_args.h"

namespace pdserve::kv_transfer::nccl {
namespace {

using Frame = v1::KvControlFrame;

// Messages read from a stream, waiting for Receive, at most `limits` of
// them. `peer_done` once the stream's reads ended (peer closed, cancelled
// or broken); `closed` once this end was closed; `failed` once the peer
// overflowed the inbox (Receive then reports it).
class Inbox {
 public:
  explicit Inbox(const ControlInboxLimits& limits) : limits_(limits) {}

  // Queues `message` once there is room. RESOURCE_EXHAUSTED when none came
  // within limits.full_timeout (the inbox is then failed and emptied);
  // CANCELLED when this end was closed meanwhile.
  absl::Status Push(std::string message, const std::string& peer) {
    absl::MutexLock l(&mu_);
    const size_t size = message.size();
    auto room = [this, size]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return queue_.empty() ||
             (static_cast<int>(queue_.size()) < limits_.max_messages &&
              bytes_ + size <= limits_.max_bytes);
    };
    auto ready = [this, &room]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return closed_ || room();
    };
    mu_.AwaitWithTimeout(absl::Condition(&ready), limits_.full_timeout);
    if (closed_) return absl::CancelledError("KV control channel closed");
    if (!room()) {
      failed_ = absl::ResourceExhaustedError(
          absl::StrCat("KV control stream from ", peer, ": more than ",
                       limits_.max_messages, " messages or ", limits_.max_bytes,
                       " bytes sent ahead of what this end read, for ",
                       absl::FormatDuration(limits_.full_timeout)));
      queue_.clear();
      bytes_ = 0;
      return failed_;
    }
    bytes_ += size;
    queue_.push_back(std::move(message));
    return absl::OkStatus();
  }
  void PeerDone() {
    absl::MutexLock l(&mu_);
    peer_done_ = true;
  }
  // Returns false if this end was already closed.
  bool MarkClosed() {
    absl::MutexLock l(&mu_);
    if (closed_) return false;
    closed_ = true;
    return true;
  }
  bool closed() const {
    absl::MutexLock l(&mu_);
    return closed_;
  }
  absl::StatusOr<std::string> Receive(absl::Time deadline,
                                      const std::string& peer) {
    absl::MutexLock l(&mu_);
    mu_.AwaitWithDeadline(absl::Condition(
                              +[](Inbox* in) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                return in->closed_ || in->peer_done_ ||
                                       !in->failed_.ok() || !in->queue_.empty();
                              },
                              this),
                          deadline);
    if (closed_) {
      return absl::UnavailableError(
          absl::StrCat("KV control channel to ", peer, " is closed"));
    }
    if (!failed_.ok()) return failed_;
    if (!queue_.empty()) {
      std::string out = std::move(queue_.front());
      queue_.pop_front();
      bytes_ -= out.size();
      return out;
    }
    if (peer_done_) {
      return absl::UnavailableError(
          absl::StrCat("KV control channel: ", peer, " closed the stream"));
    }
    return absl::DeadlineExceededError(
        absl::StrCat("no KV control message from ", peer, " in time"));
  }

 private:
  const ControlInboxLimits limits_;
  mutable absl::Mutex mu_;
  std::deque<std::string> queue_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of queue_
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  bool peer_done_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

// The prefill worker's end: a client stream, read by its own thread because
// a blocking gRPC Read has no deadline.
class ClientControlChannel : public ControlChannel {
 public:
  ClientControlChannel(std::shared_ptr<grpc::Channel> channel,
                       std::string destination,
                       const ControlInboxLimits& limits)
      : destination_(std::move(destination)),
        stub_(v1::KvTransfer::NewStub(std::move(channel))),
        inbox_(limits) {
    stream_ = stub_->Control(&context_);
    reader_ = std::thread([this] {
      Frame frame;
      while (stream_->Read(&frame)) {
        if (!inbox_.Push(std::move(*frame.mutable_payload()), destination_)
                 .ok()) {
          // Overflowed (Receive reports it) or closed: end the call.
          context_.TryCancel();
          break;
        }
      }
      inbox_.PeerDone();
    });
  }
  ~ClientControlChannel() override {
    Close();
    reader_.join();
    absl::MutexLock w(&write_mu_);
    stream_->Finish();  // after the cancel: reaps the call, status unused
  }

  absl::Status Send(std::string message) override {
    absl::MutexLock w(&write_mu_);
    if (inbox_.closed()) {
      return absl::UnavailableError(
          absl::StrCat("KV control channel to ", destination_, " is closed"));
    }
    Frame frame;
    frame.set_payload(std::move(message));
    if (!stream_->Write(frame)) {
      return absl::UnavailableError(
          absl::StrCat("KV control stream to ", destination_,
                       " broke (is it up, and started with the same "
                       "--kv-transport as this worker?)"));
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Receive(absl::Time deadline) override {
    return inbox_.Receive(deadline, destination_);
  }
  void Close() override {
    // Cancelling ends the call for both sides and wakes the reader thread.
    if (inbox_.MarkClosed()) context_.TryCancel();
  }

 private:
  const std::string destination_;
  std::unique_ptr<v1::KvTransfer::Stub> stub_;
  grpc::ClientContext context_;
  absl::Mutex write_mu_;  // one Write at a time, never after Finish
  std::unique_ptr<grpc::ClientReaderWriter<Frame, Frame>> stream_;
  Inbox inbox_;
  std::thread reader_;
};

// The decode worker's end of one Control call. The call's handler thread
// reads frames into the inbox; the endpoint's link thread writes replies.
// Shared by the handler and the channel object (owned by the endpoint), so
// either may go first.
struct ServerCall {
  ServerCall(grpc::ServerContext* context,
             grpc::ServerReaderWriter<Frame, Frame>* stream,
             const ControlInboxLimits& limits)
      : context(context), stream(stream), inbox(limits) {}

  // The handler is returning: after this no Write may start, and Close no
  // longer touches the context.
  void HandlerDone() {
    absl::MutexLock w(&write_mu);
    absl::MutexLock l(&mu);
    handler_done = true;
  }
  void Cancel() {
    absl::MutexLock l(&mu);
    if (!handler_done) context->TryCancel();
  }

  grpc::ServerContext* const context;
  grpc::ServerReaderWriter<Frame, Frame>* const stream;
  Inbox inbox;
  absl::Mutex write_mu;  // acquired before mu
  absl::Mutex mu;
  bool handler_done ABSL_GUARDED_BY(mu) = false;
};

class ServerControlChannel : public ControlChannel {
 public:
  explicit ServerControlChannel(std::shared_ptr<ServerCall> call)
      : call_(std::move(call)), peer_(call_->context->peer()) {}
  ~ServerControlChannel() override { Close(); }

  absl::Status Send(std::string message) override {
    absl::MutexLock w(&call_->write_mu);
    bool done;
    {
      absl::MutexLock l(&call_->mu);
      done = call_->handler_done;
    }
    if (done || call_->inbox.closed()) {
      return absl::UnavailableError(
          absl::StrCat("KV control channel to ", peer_, " is closed"));
    }
    Frame frame;
    frame.set_payload(std::move(message));
    if (!call_->stream->Write(frame)) {
      return absl::UnavailableError(
          absl::StrCat("KV control stream to ", peer_, " broke"));
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Receive(absl::Time deadline) override {
    return call_->inbox.Receive(deadline, peer_);
  }
  void Close() override {
    if (call_->inbox.MarkClosed()) call_->Cancel();
  }

 private:
  std::shared_ptr<ServerCall> call_;
  const std::string peer_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ControlChannel>>
GrpcControlChannelFactory::Connect(const std::string& destination) {
  if (destination.empty()) {
    return absl::InvalidArgumentError("KV destination is empty");
  }
  // A fresh channel per link: links are few and long-lived, and a restarted
  // decode worker then gets a new connection.
  return std::unique_ptr<ControlChannel>(new ClientControlChannel(
      grpc::CreateCustomChannel(destination, tls::InternalChannelCredentials(),
                                wire::InternalChannelArgs()),
      destination, limits_));
}

absl::Status ControlInboxLimits::Validate() const {
  if (max_messages < 1 || max_bytes == 0 ||
      full_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "KV control inbox: max_messages, max_bytes and full_timeout must be "
        "positive");
  }
  return absl::OkStatus();
}

grpc::Status ServeControlStream(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<Frame, Frame>* stream,
    absl::FunctionRef<void(std::unique_ptr<ControlChannel>)> serve,
    const ControlInboxLimits& limits) {
  auto call = std::make_shared<ServerCall>(context, stream, limits);
  const std::string peer = context->peer();
  serve(std::make_unique<ServerControlChannel>(call));
  grpc::Status result = grpc::Status::OK;
  Frame frame;
  while (stream->Read(&frame)) {
    absl::Status pushed =
        call->inbox.Push(std::move(*frame.mutable_payload()), peer);
    if (absl::IsResourceExhausted(pushed)) {
      result = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            std::string(pushed.message()));
      break;
    }
    if (!pushed.ok()) break;  // this end closed: the call is cancelled
  }
  call->inbox.PeerDone();
  call->HandlerDone();
  return result;
}

grpc::Status NcclKvTransferService::Control(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<Frame, Frame>* stream) {
  return ServeControlStream(context, stream,
                            [this](std::unique_ptr<ControlChannel> channel) {
                              endpoint_->Serve(std::move(channel));
                            });
}

}  // namespace pdserve::kv_transfer::nccl
