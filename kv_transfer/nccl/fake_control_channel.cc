#include "kv_transfer/nccl/fake_control_channel.h"

#include <deque>

#include "absl/strings/str_cat.h"

namespace pdserve::kv_transfer::nccl {
namespace {

// The state both ends share: one queue per direction and a closed flag.
struct FakeLink {
  absl::Mutex mu;
  std::deque<std::string> queues[2] ABSL_GUARDED_BY(
      mu);  // queues[i]: messages to end i
  bool closed ABSL_GUARDED_BY(mu) = false;
};

class FakeControlChannel : public ControlChannel {
 public:
  FakeControlChannel(std::shared_ptr<FakeLink> link, int end)
      : link_(std::move(link)), end_(end) {}
  ~FakeControlChannel() override { Close(); }

  absl::Status Send(std::string message) override {
    absl::MutexLock l(&link_->mu);
    if (link_->closed) {
      return absl::UnavailableError("KV control channel is closed");
    }
    link_->queues[1 - end_].push_back(std::move(message));
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> Receive(absl::Time deadline) override {
    FakeLink* link = link_.get();
    const int end = end_;
    absl::MutexLock l(&link->mu);
    auto ready = [link, end]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(link->mu) {
      return link->closed || !link->queues[end].empty();
    };
    link->mu.AwaitWithDeadline(absl::Condition(&ready), deadline);
    // Messages sent before the close are still delivered, as on a stream.
    if (!link->queues[end].empty()) {
      std::string message = std::move(link->queues[end].front());
      link->queues[end].pop_front();
      return message;
    }
    if (link->closed) {
      return absl::UnavailableError("KV control channel is closed");
    }
    return absl::DeadlineExceededError(
        "no KV control message before the deadline");
  }

  void Close() override {
    absl::MutexLock l(&link_->mu);
    link_->closed = true;
  }

 private:
  std::shared_ptr<FakeLink> link_;
  const int end_;
};

}  // namespace

std::pair<std::unique_ptr<ControlChannel>, std::unique_ptr<ControlChannel>>
MakeFakeControlChannelPair() {
  auto link = std::make_shared<FakeLink>();
  return {std::make_unique<FakeControlChannel>(link, 0),
          std::make_unique<FakeControlChannel>(link, 1)};
}

void FakeControlNetwork::Listen(const std::string& destination,
                                Acceptor accept) {
  absl::MutexLock l(&mu_);
  listeners_[destination] = std::move(accept);
}

void FakeControlNetwork::StopListening(const std::string& destination) {
  absl::MutexLock l(&mu_);
  listeners_.erase(destination);
}

absl::StatusOr<std::unique_ptr<ControlChannel>> FakeControlNetwork::Connect(
    const std::string& destination) {
  Acceptor accept;
  {
    absl::MutexLock l(&mu_);
    auto it = listeners_.find(destination);
    if (it == listeners_.end()) {
      return absl::UnavailableError(
          absl::StrCat("no KV receiver listens on ", destination));
    }
    accept = it->second;
    ++connections_;
  }
  auto [near, far] = MakeFakeControlChannelPair();
  accept(std::move(far));
  return std::move(near);
}

int FakeControlNetwork::connections() const {
  absl::MutexLock l(&mu_);
  return connections_;
}

}  // namespace pdserve::kv_transfer::nccl
