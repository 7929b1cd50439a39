#include "router/worker_registry.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/tls.h"
#include "router/kv_event_applier.h"
#include "wire/channel_args.h"

namespace pdserve::router {
namespace {

engine::ModelFingerprint ParseFingerprint(const std::string& hex) {
  engine::ModelFingerprint fp{0, 0};
  if (hex.size() != 32) return fp;
  uint64_t hi = 0, lo = 0;
  if (!absl::SimpleHexAtoi(hex.substr(0, 16), &hi) ||
      !absl::SimpleHexAtoi(hex.substr(16), &lo))
    return fp;
  return {hi, lo};
}

}  // namespace

absl::Status RegistryConfig::Validate() const {
  if (heartbeat <= absl::ZeroDuration() ||
      status_timeout <= absl::ZeroDuration() || max_missed_polls < 1 ||
      forget_registered_after <= absl::ZeroDuration() ||
      event_stream_idle_timeout <= absl::ZeroDuration() ||
      evict_retired_after < absl::ZeroDuration())
    return absl::InvalidArgumentError(
        "worker registry: --worker-heartbeat-ms, --worker-status-timeout-ms "
        "and --worker-forget-after-ms (and the event stream idle timeout) "
        "must be positive, and --worker-max-missed-polls at least 1");
  return absl::OkStatus();
}

struct WorkerRegistry::Entry {
  WorkerView view;
  bool from_dns = false;
  // Added by RegisterWorker (not a flag or DNS): forgotten when down long.
  bool registered = false;
  // Gone from DNS (a rolled-out pod) or a registered worker down too long:
  // no longer polled, routed to or counted. It keeps its channel (a call in
  // flight must not outlive it) until it is evicted (and its WorkerIndex
  // reused) once nothing refers to it (EvictRetired).
  bool retired = false;
  absl::Time retired_at;
  // When it last answered a poll or registered (for forgetting).
  absl::Time last_seen = absl::Now();
  // Bumped after each heartbeat failure cleared the worker's index entries.
  // The event subscription resyncs when it changes: its stream may outlive
  // the failure (a stalled or overloaded worker), and incremental events on
  // top of a cleared index would leave it short until the next resync.
  uint64_t index_clears = 0;
  // Consecutive polls that ran past their deadline (see max_missed_polls).
  int missed_polls = 0;

  // The status poll in flight, if any (shared so that Stop can cancel it
  // without holding mu_ while its completion runs).
  std::shared_ptr<StatusPoll> poll;
  // The KV event thread: `wants_events` once a poll succeeded, `subscribed`
  // while the thread runs (it clears it as it exits).
  bool wants_events = false;
  bool subscribed = false;
  std::thread events_thread;
  std::shared_ptr<grpc::ClientContext> events_ctx;  // the open stream's
  absl::Time last_event = absl::InfinitePast();     // its last batch
};

struct WorkerRegistry::StatusPoll {
  grpc::ClientContext ctx;
  v1::WorkerInfoRequest request;
  v1::WorkerStatus status;
};

WorkerRegistry::WorkerRegistry(RegistryConfig config, PrefixIndex* index)
    : config_(std::move(config)), index_(index) {
  absl::MutexLock l(&mu_);
  for (const auto& a : config_.prefill)
    if (a.rfind("dns:", 0) != 0) Add(a, v1::WORKER_ROLE_PREFILL);
  for (const auto& a : config_.decode)
    if (a.rfind("dns:", 0) != 0) Add(a, v1::WORKER_ROLE_DECODE);
  for (const auto& a : config_.both)
    if (a.rfind("dns:", 0) != 0) Add(a, v1::WORKER_ROLE_BOTH);
}

WorkerRegistry::~WorkerRegistry() { Stop(); }

namespace {
std::shared_ptr<v1::Worker::Stub> NewWorkerStub(const std::string& address) {
  return v1::Worker::NewStub(grpc::CreateCustomChannel(
      address, tls::InternalChannelCredentials(), wire::InternalChannelArgs()));
}
}  // namespace

WorkerRegistry::Entry* WorkerRegistry::Add(const std::string& address,
                                           v1::WorkerRole role, bool* added) {
  for (auto& e : entries_) {
    if (e != nullptr && e->view.address == address) return e.get();
  }
  if (added != nullptr) *added = true;
  ViewsChanged();
  auto e = std::make_unique<Entry>();
  if (free_indices_.empty()) {
    e->view.index = static_cast<WorkerIndex>(entries_.size());
    entries_.emplace_back();
  } else {
    e->view.index = free_indices_.back();
    free_indices_.pop_back();
  }
  e->view.address = address;
  e->view.role = role;
  e->view.stub = NewWorkerStub(address);
  Entry* raw = e.get();
  entries_[static_cast<size_t>(raw->view.index)] = std::move(e);
  return raw;
}

void WorkerRegistry::EvictRetired() {
  std::vector<std::unique_ptr<Entry>> evicted;
  const absl::Time now = absl::Now();
  {
    absl::MutexLock l(&mu_);
    if (stop_) return;  // Stop joins every thread itself
    for (auto& e : entries_) {
      // Nothing refers to it: no poll or event stream in flight (the event
      // thread clears `subscribed` as its last step), no routed request
      // still charged to it (so no later AddLoad or ReportFailure names its
      // index).
      if (e == nullptr || !e->retired ||
          now - e->retired_at < config_.evict_retired_after ||
          e->poll != nullptr || e->subscribed || e->events_ctx != nullptr ||
          e->view.routed_requests != 0 || e->view.routed_prefill_tokens != 0)
        continue;
      evicted.push_back(std::move(e));
    }
  }
  if (evicted.empty()) return;
  // The event threads have returned or are returning: join outside mu_.
  // Then no event can name the index any more; a batch applied after the
  // retirement's own clear is dropped with it, before the index is reused.
  for (auto& e : evicted) {
    if (e->events_thread.joinable()) e->events_thread.join();
    index_->ClearWorker(e->view.index);
  }
  absl::MutexLock l(&mu_);
  for (auto& e : evicted) free_indices_.push_back(e->view.index);
}

size_t WorkerRegistry::slots() const {
  absl::MutexLock l(&mu_);
  return entries_.size() - free_indices_.size();
}

void WorkerRegistry::Retire(Entry* e, Retired* out) {
  ViewsChanged();
  e->retired = true;
  e->retired_at = absl::Now();
  e->view.up = false;
  e->wants_events = false;
  out->indices.push_back(e->view.index);
  // A poll in flight would otherwise hold the entry (and its index) until
  // its deadline; its completion sees `retired` and only drops it.
  if (e->poll) out->polls.push_back(e->poll);
  if (e->events_ctx) out->streams.push_back(e->events_ctx);
}

void WorkerRegistry::Release(const Retired& retired) {
  for (auto& p : retired.polls) p->ctx.TryCancel();
  for (auto& c : retired.streams) c->TryCancel();
  for (WorkerIndex w : retired.indices) index_->ClearWorker(w);
}

void WorkerRegistry::Register(const std::string& address, v1::WorkerRole role) {
  std::shared_ptr<v1::Worker::Stub> old;  // dropped once mu_ is released
  absl::MutexLock l(&mu_);
  bool added = false;
  Entry* e = Add(address, role, &added);
  if (added) e->registered = true;
  if (e->registered && e->retired) {
    e->view.role = role;
    old = Revive(e);
    PDSERVE_LOG(INFO) << "forgotten worker " << address << " registered again";
  }
  e->last_seen = absl::Now();
}

std::shared_ptr<v1::Worker::Stub> WorkerRegistry::Revive(Entry* e) {
  ViewsChanged();
  e->retired = false;
  // The old channel may be in reconnect back-off from the failures that
  // retired the entry. A poll still in flight on it (cancelled, completing)
  // keeps it: a callback call must not outlive its channel.
  if (e->poll != nullptr) return nullptr;
  std::shared_ptr<v1::Worker::Stub> old = std::move(e->view.stub);
  e->view.stub = NewWorkerStub(e->view.address);
  return old;
}

void WorkerRegistry::Start() {
  poll_thread_ = std::thread([this] { PollLoop(); });
}

void WorkerRegistry::Stop() {
  std::vector<std::shared_ptr<StatusPoll>> polls;
  std::vector<std::shared_ptr<grpc::ClientContext>> streams;
  {
    absl::MutexLock l(&mu_);
    if (stop_) return;
    stop_ = true;
    for (auto& e : entries_) {
      if (e == nullptr) continue;
      if (e->poll) polls.push_back(e->poll);
      if (e->events_ctx) streams.push_back(e->events_ctx);
    }
  }
  // Outside mu_: a cancelled call's completion may run inline and takes it.
  for (auto& p : polls) p->ctx.TryCancel();
  for (auto& c : streams) c->TryCancel();
  polls.clear();
  streams.clear();
  if (poll_thread_.joinable()) poll_thread_.join();
  std::vector<std::thread> threads;
  {
    absl::MutexLock l(&mu_);
    // No poll or stream starts once stop_ is set; wait out the completions.
    mu_.Await(absl::Condition(
        +[](int* n) { return *n == 0; }, &polls_in_flight_));
    for (auto& e : entries_) {
      if (e != nullptr && e->events_thread.joinable())
        threads.push_back(std::move(e->events_thread));
    }
  }
  for (auto& t : threads) t.join();
}

std::shared_ptr<const std::vector<WorkerView>> WorkerRegistry::UpSnapshot()
    const {
  absl::MutexLock l(&mu_);
  if (up_ == nullptr) {
    up_ = std::make_shared<std::vector<WorkerView>>();
    up_position_.assign(entries_.size(), -1);
    for (const auto& e : entries_) {
      if (e == nullptr || !e->view.up || e->retired) continue;
      up_position_[static_cast<size_t>(e->view.index)] =
          static_cast<int32_t>(up_->size());
      up_->push_back(e->view);
    }
  }
  return up_;
}

std::vector<WorkerView> WorkerRegistry::UpWorkers() const {
  return *UpSnapshot();
}

std::vector<WorkerView> WorkerRegistry::AllWorkers() const {
  absl::MutexLock l(&mu_);
  std::vector<WorkerView> out;
  for (const auto& e : entries_) {
    if (e != nullptr && !e->retired) out.push_back(e->view);
  }
  return out;
}

void WorkerRegistry::ReportFailure(WorkerIndex index) {
  absl::MutexLock l(&mu_);
  if (index < 0 || index >= static_cast<WorkerIndex>(entries_.size()) ||
      entries_[index] == nullptr)
    return;
  ViewsChanged();
  entries_[index]->view.up = false;
}

void WorkerRegistry::AddLoad(WorkerIndex index, int64_t prefill_tokens,
                             int64_t requests) {
  absl::MutexLock l(&mu_);
  if (index < 0 || index >= static_cast<WorkerIndex>(entries_.size()) ||
      entries_[index] == nullptr)
    return;
  entries_[index]->view.routed_prefill_tokens += prefill_tokens;
  entries_[index]->view.routed_requests += requests;
  if (up_ == nullptr) return;
  const size_t at = static_cast<size_t>(index);
  if (at >= up_position_.size() || up_position_[at] < 0) return;
  if (up_.use_count() != 1) {
    // A request is reading it: the next UpSnapshot() builds a new one.
    up_.reset();
    return;
  }
  // Only the registry holds it, and copies are made under mu_ alone; the
  // fence orders the last reader's reads (before it released its copy)
  // before these writes.
  std::atomic_thread_fence(std::memory_order_acquire);
  WorkerView& v = (*up_)[static_cast<size_t>(up_position_[at])];
  v.routed_prefill_tokens += prefill_tokens;
  v.routed_requests += requests;
}

bool WorkerRegistry::WaitForWorkers(size_t n, absl::Duration timeout) const {
  struct Args {
    const std::vector<std::unique_ptr<Entry>>* entries;
    size_t n;
  } args{&entries_, n};
  absl::MutexLock l(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(
                                  +[](Args* a) {
                                    size_t up = 0;
                                    for (const auto& e : *a->entries)
                                      up += e != nullptr && e->view.up &&
                                            !e->retired;
                                    return up >= a->n;
                                  },
                                  &args),
                              timeout);
}

void WorkerRegistry::ResolveDns() {
  std::vector<std::pair<std::string, v1::WorkerRole>> found;  // (address, role)
  bool any_dns = false, all_resolved = true;
  auto resolve = [&](const std::string& entry, v1::WorkerRole role) {
    // dns:NAME:PORT -> every A record of NAME.
    any_dns = true;
    const std::string rest = entry.substr(4);
    const size_t colon = rest.rfind(':');
    if (colon == std::string::npos) return;
    const std::string host = rest.substr(0, colon),
                      port = rest.substr(colon + 1);
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0) {
      all_resolved =
          false;  // keep what we have rather than retire on a DNS hiccup
      return;
    }
    for (addrinfo* p = res; p != nullptr; p = p->ai_next) {
      char ip[INET_ADDRSTRLEN];
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(p->ai_addr)->sin_addr,
                ip, sizeof(ip));
      found.emplace_back(absl::StrCat(ip, ":", port), role);
    }
    freeaddrinfo(res);
  };
  for (const auto& a : config_.prefill)
    if (a.rfind("dns:", 0) == 0) resolve(a, v1::WORKER_ROLE_PREFILL);
  for (const auto& a : config_.decode)
    if (a.rfind("dns:", 0) == 0) resolve(a, v1::WORKER_ROLE_DECODE);
  for (const auto& a : config_.both)
    if (a.rfind("dns:", 0) == 0) resolve(a, v1::WORKER_ROLE_BOTH);
  if (!any_dns) return;
  Retired gone;
  std::vector<std::shared_ptr<v1::Worker::Stub>> old;   // after mu_'s release
  absl::Cleanup release_gone = [&] { Release(gone); };  // after mu_'s release
  absl::MutexLock l(&mu_);
  for (const auto& [address, role] : found) {
    Entry* e = Add(address, role);
    e->from_dns = true;
    if (e->retired) {
      old.push_back(Revive(e));
    }
  }
  if (!all_resolved) return;
  for (auto& e : entries_) {
    if (e == nullptr || !e->from_dns || e->retired) continue;
    const bool listed =
        std::any_of(found.begin(), found.end(),
                    [&](const auto& f) { return f.first == e->view.address; });
    if (!listed) {
      Retire(e.get(), &gone);
      PDSERVE_LOG(INFO) << "worker " << e->view.address
                        << " left DNS; forgotten";
    }
  }
}

void WorkerRegistry::PollLoop() {
  int round = 0;
  while (true) {
    if (round++ % 10 == 0) ResolveDns();
    Sweep(absl::Now());
    EvictRetired();
    StartEventStreams();
    std::vector<Entry*> targets;
    {
      absl::MutexLock l(&mu_);
      if (stop_) return;
      for (auto& e : entries_) {
        if (e != nullptr && !e->retired && e->poll == nullptr)
          targets.push_back(e.get());
      }
    }
    // Concurrent: a worker that hangs holds only its own poll.
    for (Entry* e : targets) StartPoll(e);
    absl::MutexLock l(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&stop_), config_.heartbeat);
    if (stop_) return;
  }
}

void WorkerRegistry::StartPoll(Entry* entry) {
  auto poll = std::make_shared<StatusPoll>();
  poll->ctx.set_deadline(
      absl::ToChronoTime(absl::Now() + config_.status_timeout));
  std::shared_ptr<v1::Worker::Stub> stub;
  {
    absl::MutexLock l(&mu_);
    if (stop_ || entry->retired || entry->poll != nullptr) return;
    entry->poll = poll;
    stub = entry->view.stub;
    ++polls_in_flight_;
  }
  StatusPoll* raw = poll.get();
  raw->request.set_peer_pull_key(config_.peer_pull_key);
  stub->async()->GetStatus(
      &raw->ctx, &raw->request, &raw->status,
      [this, entry, raw](grpc::Status st) { OnStatus(entry, raw, st); });
}

void WorkerRegistry::OnStatus(Entry* entry, StatusPoll* poll,
                              const grpc::Status& st) {
  std::shared_ptr<StatusPoll> done;  // freed last, after mu_ is released
  bool clear = false;
  {
    absl::MutexLock l(&mu_);
    WorkerView& v = entry->view;
    if (!entry->retired && !stop_) {
      const bool was_up = v.up;
      const bool late = st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
      entry->missed_polls = late ? entry->missed_polls + 1 : 0;
      if (was_up && late && entry->missed_polls < config_.max_missed_polls) {
        // Late, not gone: keep it up (and its index) until it misses more.
        done = std::move(entry->poll);
        --polls_in_flight_;
        return;
      }
      ViewsChanged();
      v.up = st.ok();
      if (st.ok()) {
        v.status = poll->status;
        v.id = poll->status.id();
        v.role = poll->status.role();
        v.fingerprint = ParseFingerprint(poll->status.cache_fingerprint());
        v.block_size = static_cast<int32_t>(v.status.layout().block_size());
        entry->last_seen = absl::Now();
        entry->wants_events = true;
        if (!was_up) {
          PDSERVE_LOG(INFO) << "worker up: " << v.id;
        }
      } else {
        if (was_up) {
          PDSERVE_LOG(WARNING)
              << "worker down: " << v.address << ": " << st.error_message();
        }
        clear = true;
      }
    }
    if (!clear) {
      done = std::move(entry->poll);
      --polls_in_flight_;  // last touch of `this` on this path: Stop waits
      return;
    }
  }
  // Clear first, then bump: a subscription that read the old count before
  // this clear resyncs after it. The index is fixed at creation.
  index_->ClearWorker(entry->view.index);
  absl::MutexLock l(&mu_);
  ++entry->index_clears;
  done = std::move(entry->poll);
  --polls_in_flight_;
}

void WorkerRegistry::StartEventStreams() {
  std::vector<std::pair<Entry*, std::thread>> finished;
  {
    absl::MutexLock l(&mu_);
    if (stop_) return;
    for (auto& e : entries_) {
      if (e != nullptr && e->wants_events && !e->subscribed && !e->retired)
        finished.emplace_back(e.get(), std::move(e->events_thread));
    }
  }
  for (auto& [entry, old] : finished) {
    if (old.joinable()) old.join();  // it has cleared `subscribed`: ending
    absl::MutexLock l(&mu_);
    if (stop_) return;
    entry->subscribed = true;
    entry->events_thread =
        std::thread([this, entry = entry] { EventLoop(entry); });
  }
}

void WorkerRegistry::Sweep(absl::Time now) {
  Retired forgotten;
  {
    absl::MutexLock l(&mu_);
    for (auto& e : entries_) {
      if (e == nullptr || e->retired) continue;
      if (e->events_ctx != nullptr &&
          now - e->last_event > config_.event_stream_idle_timeout) {
        forgotten.streams.push_back(e->events_ctx);  // idle: cancelled
        e->last_event = now;                         // once per timeout
      }
      if (e->registered && !e->view.up &&
          now - e->last_seen > config_.forget_registered_after) {
        PDSERVE_LOG(INFO) << "registered worker " << e->view.address
                          << " down for "
                          << absl::FormatDuration(now - e->last_seen)
                          << "; forgotten";
        Retire(e.get(), &forgotten);
      }
    }
  }
  Release(forgotten);
}

void WorkerRegistry::EventLoop(Entry* entry) {
  const WorkerIndex index = entry->view.index;  // fixed at creation
  while (true) {
    auto ctx = std::make_shared<grpc::ClientContext>();
    std::shared_ptr<v1::Worker::Stub> stub;
    uint64_t clears;
    {
      absl::MutexLock l(&mu_);
      if (stop_ || entry->retired) break;
      stub = entry->view.stub;
      clears = entry->index_clears;
      entry->events_ctx = ctx;
      entry->last_event = absl::Now();
    }
    auto reader =
        stub->SubscribeKvEvents(ctx.get(), v1::SubscribeKvEventsRequest());
    v1::KvEventBatch batch;
    KvEventApplier applier(index_, index);
    while (reader->Read(&batch)) {
      // Lost or malformed events, or the index was cleared under the stream
      // (workers send a batch at least every second): resubscribe for a
      // fresh snapshot.
      if (!applier.ApplyBatch(batch)) break;
      absl::MutexLock l(&mu_);
      entry->last_event = absl::Now();
      if (entry->index_clears != clears || stop_) break;
    }
    ctx->TryCancel();
    reader->Finish();
    // Back off; the poll loop marks the worker down if it is gone.
    absl::MutexLock l(&mu_);
    entry->events_ctx.reset();
    mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(500));
  }
  absl::MutexLock l(&mu_);
  entry->events_ctx.reset();
  entry->subscribed = false;
}

}  // namespace pdserve::router
