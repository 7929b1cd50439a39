#include "router/worker_registry.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/tls.h"
#include "wire/channel_args.h"
#include "router/kv_event_applier.h"

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

struct WorkerRegistry::Entry {
  WorkerView view;
  bool subscribed = false;  // an event thread runs for it
  bool from_dns = false;
  // Gone from DNS (a rolled-out pod): no longer polled, routed to or counted.
  // Entries are never erased, so WorkerIndex values stay valid.
  bool retired = false;
  // Bumped after each heartbeat failure cleared the worker's index entries.
  // The event subscription resyncs when it changes: its stream may outlive
  // the failure (a stalled or overloaded worker), and incremental events on
  // top of a cleared index would leave it short until the next resync.
  uint64_t index_clears = 0;
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

WorkerRegistry::Entry* WorkerRegistry::Add(const std::string& address,
                                           v1::WorkerRole role) {
  for (auto& e : entries_) {
    if (e->view.address == address) return e.get();
  }
  auto e = std::make_unique<Entry>();
  e->view.index = static_cast<WorkerIndex>(entries_.size());
  e->view.address = address;
  e->view.role = role;
  e->view.stub = v1::Worker::NewStub(
      grpc::CreateCustomChannel(address, tls::InternalChannelCredentials(),
                                wire::InternalChannelArgs()));
  entries_.push_back(std::move(e));
  return entries_.back().get();
}

void WorkerRegistry::Register(const std::string& address,
                              v1::WorkerRole role) {
  absl::MutexLock l(&mu_);
  Add(address, role);
}

void WorkerRegistry::Start() {
  threads_.emplace_back([this] { PollLoop(); });
}

void WorkerRegistry::Stop() {
  if (stop_.exchange(true)) return;
  for (auto& t : threads_) t.join();
  threads_.clear();
}

std::vector<WorkerView> WorkerRegistry::UpWorkers() const {
  absl::MutexLock l(&mu_);
  std::vector<WorkerView> out;
  for (const auto& e : entries_) {
    if (e->view.up && !e->retired) out.push_back(e->view);
  }
  return out;
}

std::vector<WorkerView> WorkerRegistry::AllWorkers() const {
  absl::MutexLock l(&mu_);
  std::vector<WorkerView> out;
  for (const auto& e : entries_) {
    if (!e->retired) out.push_back(e->view);
  }
  return out;
}

void WorkerRegistry::ReportFailure(WorkerIndex index) {
  absl::MutexLock l(&mu_);
  if (index < 0 || index >= static_cast<WorkerIndex>(entries_.size())) return;
  entries_[index]->view.up = false;
}

void WorkerRegistry::AddLoad(WorkerIndex index, int64_t prefill_tokens,
                             int64_t requests) {
  absl::MutexLock l(&mu_);
  if (index < 0 || index >= static_cast<WorkerIndex>(entries_.size())) return;
  entries_[index]->view.routed_prefill_tokens += prefill_tokens;
  entries_[index]->view.routed_requests += requests;
}

bool WorkerRegistry::WaitForWorkers(size_t n, absl::Duration timeout) const {
  const absl::Time until = absl::Now() + timeout;
  while (absl::Now() < until) {
    if (UpWorkers().size() >= n) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return UpWorkers().size() >= n;
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
  absl::MutexLock l(&mu_);
  for (const auto& [address, role] : found) {
    Entry* e = Add(address, role);
    e->from_dns = true;
    e->retired = false;
  }
  if (!all_resolved) return;
  for (auto& e : entries_) {
    if (!e->from_dns || e->retired) continue;
    const bool listed =
        std::any_of(found.begin(), found.end(),
                    [&](const auto& f) { return f.first == e->view.address; });
    if (!listed) {
      e->retired = true;
      e->view.up = false;
      index_->ClearWorker(e->view.index);
      PDSERVE_LOG(INFO) << "worker " << e->view.address
                        << " left DNS; forgotten";
    }
  }
}

void WorkerRegistry::PollLoop() {
  int round = 0;
  while (!stop_) {
    if (round++ % 10 == 0) ResolveDns();
    std::vector<std::pair<Entry*, std::shared_ptr<v1::Worker::Stub>>> targets;
    {
      absl::MutexLock l(&mu_);
      for (auto& e : entries_) {
        if (!e->retired) targets.emplace_back(e.get(), e->view.stub);
      }
    }
    for (auto& [entry, stub] : targets) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(1));
      v1::WorkerStatus status;
      const grpc::Status st =
          stub->GetStatus(&ctx, v1::WorkerInfoRequest(), &status);
      bool start_events = false;
      {
        absl::MutexLock l(&mu_);
        WorkerView& v = entry->view;
        const bool was_up = v.up;
        v.up = st.ok();
        if (st.ok()) {
          v.status = status;
          v.id = status.id();
          v.role = status.role();
          v.fingerprint = ParseFingerprint(status.cache_fingerprint());
          if (!entry->subscribed) {
            entry->subscribed = true;
            start_events = true;
          }
          if (!was_up) PDSERVE_LOG(INFO) << "worker up: " << v.id;
        } else if (was_up) {
          PDSERVE_LOG(WARNING)
              << "worker down: " << v.address << ": " << st.error_message();
        }
      }
      if (!st.ok()) {
        // Clear first, then bump: a subscription that read the old count
        // before this clear resyncs after it.
        index_->ClearWorker(entry->view.index);
        absl::MutexLock l(&mu_);
        ++entry->index_clears;
      }
      if (start_events) {
        absl::MutexLock l(&mu_);
        threads_.emplace_back([this, entry] { EventLoop(entry); });
      }
    }
    absl::SleepFor(config_.heartbeat);
  }
}

void WorkerRegistry::EventLoop(Entry* entry) {
  std::shared_ptr<v1::Worker::Stub> stub;
  WorkerIndex index;
  {
    absl::MutexLock l(&mu_);
    stub = entry->view.stub;
    index = entry->view.index;
  }
  auto retired = [&] {
    absl::MutexLock l(&mu_);
    return entry->retired;
  };
  auto index_clears = [&] {
    absl::MutexLock l(&mu_);
    return entry->index_clears;
  };
  while (!stop_ && !retired()) {
    const uint64_t clears = index_clears();
    grpc::ClientContext ctx;
    auto reader = stub->SubscribeKvEvents(&ctx, v1::SubscribeKvEventsRequest());
    v1::KvEventBatch batch;
    KvEventApplier applier(index_, index);
    while (!stop_ && reader->Read(&batch)) {
      // Lost or malformed events, or the index was cleared under the stream
      // (workers send a batch at least every second): resubscribe for a
      // fresh snapshot.
      if (!applier.ApplyBatch(batch) || index_clears() != clears || stop_)
        break;
    }
    ctx.TryCancel();
    reader->Finish();
    // Back off; the poll loop marks the worker down if it is gone.
    for (int i = 0; i < 5 && !stop_; ++i)
      absl::SleepFor(absl::Milliseconds(100));
  }
}

}  // namespace pdserve::router
