#include "kv_transfer/nccl/fake_communicator.h"

#include <algorithm>
#include <cstring>
#include <deque>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"

namespace pdserve::kv_transfer::nccl {
namespace {

struct P2p {
  bool send = false;
  uint8_t* buffer = nullptr;
  size_t bytes = 0;
};

// One entry of a rank's stream.
struct Op {
  enum Type { kCopy, kGroup, kMarker } type = kCopy;
  uint8_t* dst = nullptr;  // kCopy
  const uint8_t* src = nullptr;
  size_t bytes = 0;
  std::vector<P2p> p2p;  // kGroup
  bool posted = false;
  int unmatched = 0;
  uint64_t ticket = 0;  // kMarker
  uint64_t covers = 0;  // kMarker: operations enqueued up to and including it
};

// A posted send or receive waiting for its peer.
struct Posted {
  uint8_t* buffer;
  size_t bytes;
  Op* group;
};

// The two ranks of one communicator.
struct Fabric {
  int joined = 0;  // bit per rank
  bool aborted[2] = {false, false};
  std::deque<std::unique_ptr<Op>> stream[2];
  std::deque<Posted> sends[2];  // sends[r]: posted by rank r, bound for 1 - r
  std::deque<Posted> recvs[2];  // recvs[r]: posted by rank r
  uint64_t done_ticket[2] = {0, 0};
  // Operations each rank enqueued, and how many of them a polled Completion
  // has confirmed finished. Staging may only move once all are confirmed:
  // a caller cannot know the stream is idle without a completion.
  uint64_t enqueued[2] = {0, 0};
  uint64_t confirmed[2] = {0, 0};
  absl::Status error;  // sticky; fails both ranks
};

}  // namespace

struct FakeCommunicatorFactory::State {
  absl::Mutex mu;
  uint64_t next_id ABSL_GUARDED_BY(mu) = 1;
  absl::flat_hash_map<std::string, std::shared_ptr<Fabric>> fabrics
      ABSL_GUARDED_BY(mu);
  bool paused ABSL_GUARDED_BY(mu) = false;
  std::vector<std::string> group_log ABSL_GUARDED_BY(mu);
  int created ABSL_GUARDED_BY(mu) = 0;
  int alive ABSL_GUARDED_BY(mu) = 0;
  uint64_t bytes_delivered ABSL_GUARDED_BY(mu) = 0;

  // Runs every operation that can run, on both ranks, until nothing moves.
  void Pump(Fabric& f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    bool progress = true;
    while (progress && f.error.ok()) {
      progress = false;
      for (int r = 0; r < 2; ++r) {
        auto& stream = f.stream[r];
        while (!stream.empty()) {
          Op& op = *stream.front();
          if (op.type == Op::kCopy) {
            std::memcpy(op.dst, op.src, op.bytes);
          } else if (op.type == Op::kMarker) {
            f.done_ticket[r] = op.ticket;
          } else {
            if (!op.posted) {
              for (const P2p& p : op.p2p) {
                (p.send ? f.sends[r] : f.recvs[r])
                    .push_back({p.buffer, p.bytes, &op});
              }
              op.posted = true;
              progress = true;
            }
            if (op.unmatched > 0) break;
          }
          stream.pop_front();
          progress = true;
        }
      }
      if (paused) continue;
      for (int r = 0; r < 2; ++r) {
        while (!f.sends[r].empty() && !f.recvs[1 - r].empty()) {
          const Posted send = f.sends[r].front(), recv = f.recvs[1 - r].front();
          if (send.bytes != recv.bytes) {
            f.error = absl::InternalError(
                absl::StrCat("fake NCCL: rank ", r, " sent ", send.bytes,
                             " bytes into a receive of ", recv.bytes));
            return;
          }
          std::memcpy(recv.buffer, send.buffer, send.bytes);
          bytes_delivered += send.bytes;
          --send.group->unmatched;
          --recv.group->unmatched;
          f.sends[r].pop_front();
          f.recvs[1 - r].pop_front();
          progress = true;
        }
      }
    }
  }

  // Drops a rank's stream and posted operations; its peer's never match.
  void Detach(Fabric& f, int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    f.aborted[rank] = true;
    f.stream[rank].clear();
    f.sends[rank].clear();
    f.recvs[rank].clear();
  }
};

namespace {

using State = FakeCommunicatorFactory::State;

class FakeCompletion : public Completion {
 public:
  FakeCompletion(std::shared_ptr<State> state, std::shared_ptr<Fabric> fabric,
                 int rank, uint64_t ticket, uint64_t covers)
      : state_(std::move(state)),
        fabric_(std::move(fabric)),
        rank_(rank),
        ticket_(ticket),
        covers_(covers) {}

  absl::StatusOr<bool> Poll() override {
    absl::MutexLock l(&state_->mu);
    Fabric& f = *fabric_;
    if (f.aborted[rank_]) {
      return absl::FailedPreconditionError("fake NCCL communicator aborted");
    }
    state_->Pump(f);
    if (!f.error.ok()) return f.error;
    if (f.done_ticket[rank_] < ticket_) return false;
    f.confirmed[rank_] = std::max(f.confirmed[rank_], covers_);
    return true;
  }

 private:
  std::shared_ptr<State> state_;
  std::shared_ptr<Fabric> fabric_;
  const int rank_;
  const uint64_t ticket_;
  const uint64_t covers_;
};

class FakeCommunicator : public Communicator {
 public:
  FakeCommunicator(std::shared_ptr<State> state, std::string id,
                   std::shared_ptr<Fabric> fabric, int rank)
      : state_(std::move(state)),
        id_(std::move(id)),
        fabric_(std::move(fabric)),
        rank_(rank) {}

  ~FakeCommunicator() override {
    absl::MutexLock l(&state_->mu);
    state_->Detach(*fabric_, rank_);
    fabric_->joined &= ~(1 << rank_);
    if (fabric_->joined == 0) state_->fabrics.erase(id_);
    --state_->alive;
  }

  int rank() const override { return rank_; }

  absl::Status ReserveStaging(size_t bytes) override {
    absl::MutexLock l(&state_->mu);
    if (absl::Status s = Usable(); !s.ok()) return s;
    if (fabric_->confirmed[rank_] != fabric_->enqueued[rank_] ||
        group_depth_ > 0) {
      return absl::FailedPreconditionError(
          "fake NCCL: staging reserved before a completion confirmed every "
          "operation finished");
    }
    if (bytes > host_.size()) {
      host_.resize(bytes);
      // Garbage, so bytes that were never copied or received are noticed.
      wire_.resize(bytes, 0xEE);
    }
    return absl::OkStatus();
  }

  uint8_t* host_staging() override { return host_.data(); }

  absl::Status CopyHostToWire(size_t offset, size_t bytes) override {
    return EnqueueCopy(wire_.data() + offset, host_.data() + offset, offset,
                       bytes);
  }
  absl::Status CopyWireToHost(size_t offset, size_t bytes) override {
    return EnqueueCopy(host_.data() + offset, wire_.data() + offset, offset,
                       bytes);
  }

  // Host memory stands in for device memory here.
  absl::Status CopyToWire(size_t offset, const void* src,
                          size_t bytes) override {
    return EnqueueCopy(wire_.data() + offset, static_cast<const uint8_t*>(src),
                       offset, bytes);
  }
  absl::Status CopyFromWire(size_t offset, void* dst, size_t bytes) override {
    return EnqueueCopy(static_cast<uint8_t*>(dst), wire_.data() + offset,
                       offset, bytes);
  }

  absl::Status GroupStart() override {
    if (group_depth_++ == 0) group_ = std::make_unique<Op>();
    group_->type = Op::kGroup;
    return absl::OkStatus();
  }

  absl::Status Send(size_t offset, size_t bytes) override {
    return AddP2p(true, offset, bytes);
  }
  absl::Status Recv(size_t offset, size_t bytes) override {
    return AddP2p(false, offset, bytes);
  }

  absl::Status GroupEnd() override {
    if (group_depth_ == 0) {
      return absl::FailedPreconditionError(
          "fake NCCL: GroupEnd without GroupStart");
    }
    if (--group_depth_ > 0) return absl::OkStatus();
    std::unique_ptr<Op> group = std::move(group_);
    group->unmatched = static_cast<int>(group->p2p.size());
    absl::MutexLock l(&state_->mu);
    if (absl::Status s = Usable(); !s.ok()) return s;
    std::vector<std::string> parts = {absl::StrCat("r", rank_)};
    for (const P2p& p : group->p2p) {
      parts.push_back(absl::StrCat(p.send ? "send:" : "recv:", p.bytes));
    }
    state_->group_log.push_back(absl::StrJoin(parts, " "));
    fabric_->stream[rank_].push_back(std::move(group));
    ++fabric_->enqueued[rank_];
    state_->Pump(*fabric_);
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Completion>> Record() override {
    absl::MutexLock l(&state_->mu);
    if (absl::Status s = Usable(); !s.ok()) return s;
    auto marker = std::make_unique<Op>();
    marker->type = Op::kMarker;
    marker->ticket = ++next_ticket_;
    marker->covers = ++fabric_->enqueued[rank_];
    const uint64_t covers = marker->covers;
    fabric_->stream[rank_].push_back(std::move(marker));
    state_->Pump(*fabric_);
    return std::unique_ptr<Completion>(
        new FakeCompletion(state_, fabric_, rank_, next_ticket_, covers));
  }

  void Abort() override {
    absl::MutexLock l(&state_->mu);
    state_->Detach(*fabric_, rank_);
  }

 private:
  absl::Status Usable() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    if (fabric_->aborted[rank_]) {
      return absl::FailedPreconditionError("fake NCCL communicator aborted");
    }
    return fabric_->error;
  }

  absl::Status CheckRange(size_t offset, size_t bytes) const {
    if (offset > host_.size() || bytes > host_.size() - offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("fake NCCL: [", offset, ", ", offset + bytes,
                       ") exceeds the ", host_.size(), " staged bytes"));
    }
    return absl::OkStatus();
  }

  absl::Status EnqueueCopy(uint8_t* dst, const uint8_t* src, size_t offset,
                           size_t bytes) {
    if (absl::Status s = CheckRange(offset, bytes); !s.ok()) return s;
    auto op = std::make_unique<Op>();
    op->type = Op::kCopy;
    op->dst = dst;
    op->src = src;
    op->bytes = bytes;
    absl::MutexLock l(&state_->mu);
    if (absl::Status s = Usable(); !s.ok()) return s;
    fabric_->stream[rank_].push_back(std::move(op));
    ++fabric_->enqueued[rank_];
    state_->Pump(*fabric_);
    return absl::OkStatus();
  }

  absl::Status AddP2p(bool send, size_t offset, size_t bytes) {
    if (absl::Status s = CheckRange(offset, bytes); !s.ok()) return s;
    const bool implicit =
        group_depth_ == 0;  // a lone operation is its own group
    if (implicit) GroupStart().IgnoreError();
    group_->p2p.push_back({send, wire_.data() + offset, bytes});
    return implicit ? GroupEnd() : absl::OkStatus();
  }

  std::shared_ptr<State> state_;
  const std::string id_;
  std::shared_ptr<Fabric> fabric_;
  const int rank_;
  std::vector<uint8_t> host_, wire_;
  int group_depth_ = 0;
  std::unique_ptr<Op> group_;
  uint64_t next_ticket_ = 0;
};

}  // namespace

FakeCommunicatorFactory::FakeCommunicatorFactory()
    : state_(std::make_shared<State>()) {}
FakeCommunicatorFactory::~FakeCommunicatorFactory() = default;

absl::StatusOr<std::string> FakeCommunicatorFactory::NewUniqueId() {
  absl::MutexLock l(&state_->mu);
  return absl::StrCat("fake-nccl-", state_->next_id++);
}

absl::StatusOr<std::unique_ptr<Communicator>> FakeCommunicatorFactory::Create(
    const std::string& unique_id, int rank, absl::Time deadline,
    absl::Duration /*op_timeout*/) {
  if (rank != Communicator::kSenderRank &&
      rank != Communicator::kReceiverRank) {
    return absl::InvalidArgumentError(
        absl::StrCat("fake NCCL: rank ", rank, " of a 2-rank communicator"));
  }
  const std::shared_ptr<State> state = state_;  // alive while this call waits
  absl::MutexLock l(&state->mu);
  std::shared_ptr<Fabric>& slot = state->fabrics[unique_id];
  if (!slot) slot = std::make_shared<Fabric>();
  std::shared_ptr<Fabric> fabric = slot;
  if (fabric->joined & (1 << rank)) {
    return absl::InvalidArgumentError(
        absl::StrCat("fake NCCL: rank ", rank, " already joined ", unique_id));
  }
  fabric->joined |= 1 << rank;
  Fabric* f = fabric.get();
  auto both = [f]() { return f->joined == 3; };
  if (!state->mu.AwaitWithDeadline(absl::Condition(&both), deadline)) {
    fabric->joined &= ~(1 << rank);
    if (fabric->joined == 0) state->fabrics.erase(unique_id);
    return absl::DeadlineExceededError(absl::StrCat(
        "fake NCCL: the peer of rank ", rank, " never joined ", unique_id));
  }
  ++state->created;
  ++state->alive;
  return std::unique_ptr<Communicator>(
      new FakeCommunicator(state_, unique_id, fabric, rank));
}

void FakeCommunicatorFactory::SetDeliveryPaused(bool paused) {
  absl::MutexLock l(&state_->mu);
  state_->paused = paused;
}

std::vector<std::string> FakeCommunicatorFactory::group_log() const {
  absl::MutexLock l(&state_->mu);
  return state_->group_log;
}

int FakeCommunicatorFactory::communicators_created() const {
  absl::MutexLock l(&state_->mu);
  return state_->created;
}

int FakeCommunicatorFactory::communicators_alive() const {
  absl::MutexLock l(&state_->mu);
  return state_->alive;
}

uint64_t FakeCommunicatorFactory::bytes_delivered() const {
  absl::MutexLock l(&state_->mu);
  return state_->bytes_delivered;
}

}  // namespace pdserve::kv_transfer::nccl
