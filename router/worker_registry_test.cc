#include "router/worker_registry.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "pdserve/v1/internal.grpc.pb.h"
#include "router/prefix_index.h"

namespace pdserve::router {
namespace {

// A worker whose heartbeat can be made to fail while its KV event stream
// stays open, as when it is stalled or overloaded for a moment.
class FakeWorker final : public v1::Worker::Service {
 public:
  std::atomic<bool> fail_status{false};

  grpc::Status GetStatus(grpc::ServerContext*, const v1::WorkerInfoRequest*,
                         v1::WorkerStatus* status) override {
    if (fail_status) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "");
    status->set_id("fake");
    status->set_role(v1::WORKER_ROLE_DECODE);
    return grpc::Status::OK;
  }

  grpc::Status SubscribeKvEvents(
      grpc::ServerContext* ctx, const v1::SubscribeKvEventsRequest*,
      grpc::ServerWriter<v1::KvEventBatch>* writer) override {
    v1::KvEventBatch snapshot;
    snapshot.set_snapshot(true);
    v1::KvEventProto* e = snapshot.add_events();
    e->set_seq(1);
    e->add_hashes(std::string(15, '\0') + "\x01");
    e->add_hashes(std::string(15, '\0') + "\x02");
    if (!writer->Write(snapshot)) return grpc::Status::OK;
    while (!ctx->IsCancelled()) {  // idle: an empty batch now and then
      absl::SleepFor(absl::Milliseconds(100));
      if (!writer->Write(v1::KvEventBatch())) break;
    }
    return grpc::Status::OK;
  }
};

bool WaitFor(const std::function<bool()>& done, int tries = 100) {
  for (int i = 0; i < tries; ++i) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

// Found by the fault soak (tests/soak): a heartbeat failure cleared the
// worker's index entries while its event stream stayed open, so the index
// stayed empty (or short) for that worker until some later resync.
TEST(WorkerRegistryTest, IndexRecoversAfterAHeartbeatFailureClearedIt) {
  FakeWorker worker;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&worker);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(port, 0);

  PrefixIndex index;
  RegistryConfig config;
  config.decode = {absl::StrCat("127.0.0.1:", port)};
  config.heartbeat = absl::Milliseconds(50);
  WorkerRegistry registry(config, &index);
  registry.Start();
  const WorkerIndex w = registry.AllWorkers().at(0).index;
  ASSERT_TRUE(WaitFor([&] { return index.Summary(w).blocks == 2; }));

  worker.fail_status = true;
  ASSERT_TRUE(WaitFor([&] { return index.Summary(w).blocks == 0; }));
  worker.fail_status = false;
  EXPECT_TRUE(WaitFor([&] { return index.Summary(w).blocks == 2; }))
      << "the index was not resynced after the worker came back";
  registry.Stop();
  server->Shutdown();
}

// A worker that answers its first status poll and then, on demand, hangs:
// status polls and KV event streams block (never answering) until the call
// is cancelled or the test releases them.
class HangingWorker final : public v1::Worker::Service {
 public:
  std::atomic<bool> hang_status{false};
  std::atomic<int> status_calls{0};
  std::atomic<int> hung_status_calls{0};  // blocked right now
  std::atomic<int> subscribe_calls{0};
  absl::Notification release;

  grpc::Status GetStatus(grpc::ServerContext* ctx, const v1::WorkerInfoRequest*,
                         v1::WorkerStatus* status) override {
    ++status_calls;
    if (hang_status) {
      ++hung_status_calls;
      Block(ctx);
      --hung_status_calls;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "hung");
    }
    status->set_id("hanging");
    status->set_role(v1::WORKER_ROLE_DECODE);
    return grpc::Status::OK;
  }

  grpc::Status SubscribeKvEvents(
      grpc::ServerContext* ctx, const v1::SubscribeKvEventsRequest*,
      grpc::ServerWriter<v1::KvEventBatch>*) override {
    ++subscribe_calls;
    Block(ctx);  // never sends anything, not even the snapshot
    return grpc::Status::OK;
  }

 private:
  void Block(grpc::ServerContext* ctx) {
    while (!ctx->IsCancelled() &&
           !release.WaitForNotificationWithTimeout(absl::Milliseconds(5))) {
    }
  }
};

// A worker that always answers and counts its polls.
class CountingWorker final : public v1::Worker::Service {
 public:
  std::atomic<int> status_calls{0};
  grpc::Status GetStatus(grpc::ServerContext*, const v1::WorkerInfoRequest*,
                         v1::WorkerStatus* status) override {
    ++status_calls;
    status->set_id("counting");
    status->set_role(v1::WORKER_ROLE_DECODE);
    return grpc::Status::OK;
  }
};

struct TestServer {
  // On `fixed_port`, or on a free one when 0.
  explicit TestServer(grpc::Service* service, int fixed_port = 0) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(absl::StrCat("127.0.0.1:", fixed_port),
                             grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service);
    server = builder.BuildAndStart();
  }
  ~TestServer() {
    server->Shutdown(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(100));
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port); }
  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

// A registry config listing one decode worker: the one `server` serves.
RegistryConfig OneDecodeWorker(const TestServer& server) {
  RegistryConfig config;
  config.decode = {server.address()};
  return config;
}

// Routing reads the up workers once per request; the registry hands out one
// shared snapshot and copies it only when a view changes.
TEST(WorkerRegistryTest, UpSnapshotIsSharedUntilAViewChanges) {
  PrefixIndex index;
  FakeWorker worker;
  TestServer server(&worker);
  ASSERT_NE(server.port, 0);
  RegistryConfig config = OneDecodeWorker(server);
  config.heartbeat = absl::Hours(1);  // one poll: the views then stay put
  WorkerRegistry registry(config, &index);
  registry.Start();
  ASSERT_TRUE(WaitFor([&] { return registry.UpWorkers().size() == 1; }));

  std::shared_ptr<const std::vector<WorkerView>> a = registry.UpSnapshot();
  EXPECT_EQ(registry.UpSnapshot(), a) << "rebuilt with nothing changed";
  const WorkerIndex w = a->at(0).index;

  // Load accounting while a request holds the snapshot: a new one carries
  // it, and the held one is left as it was.
  registry.AddLoad(w, 100, 1);
  std::shared_ptr<const std::vector<WorkerView>> b = registry.UpSnapshot();
  EXPECT_NE(b, a);
  EXPECT_EQ(a->at(0).routed_prefill_tokens, 0);
  EXPECT_EQ(a->at(0).routed_requests, 0);
  EXPECT_EQ(b->at(0).routed_prefill_tokens, 100);
  EXPECT_EQ(b->at(0).routed_requests, 1);

  // Held by nobody else: updated in place.
  const std::vector<WorkerView>* held_by_registry = b.get();
  a.reset();
  b.reset();
  registry.AddLoad(w, -40, 0);
  std::shared_ptr<const std::vector<WorkerView>> c = registry.UpSnapshot();
  EXPECT_EQ(c.get(), held_by_registry);
  EXPECT_EQ(c->at(0).routed_prefill_tokens, 60);
  EXPECT_EQ(c->at(0).routed_requests, 1);

  // A view change: the next snapshot is new and leaves the worker out.
  registry.ReportFailure(w);
  EXPECT_TRUE(registry.UpSnapshot()->empty());
  EXPECT_TRUE(registry.UpWorkers().empty());
  EXPECT_EQ(c->size(), 1u) << "a reader's snapshot changed under it";
  registry.Stop();
}

// Stop() on a registry whose worker hangs mid-stream and mid-poll: it used
// to block for good on the event stream's Read (no deadline, nothing to
// cancel it).
TEST(WorkerRegistryTest, StopReturnsPromptlyWhileAWorkerHangs) {
  HangingWorker worker;
  TestServer server(&worker);
  ASSERT_NE(server.port, 0);
  PrefixIndex index;
  RegistryConfig config = OneDecodeWorker(server);
  config.heartbeat = absl::Milliseconds(20);
  config.status_timeout = absl::Minutes(5);
  config.event_stream_idle_timeout = absl::Minutes(5);
  WorkerRegistry registry(config, &index);
  registry.Start();
  ASSERT_TRUE(WaitFor([&] { return worker.subscribe_calls >= 1; }));
  worker.hang_status = true;
  ASSERT_TRUE(WaitFor([&] { return worker.hung_status_calls >= 1; }));

  auto stopped = std::async(std::launch::async, [&] { registry.Stop(); });
  const bool prompt =
      stopped.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  if (!prompt) worker.release.Notify();  // let the test end
  stopped.get();
  EXPECT_TRUE(prompt) << "Stop() waited on a hung worker";
  if (!worker.release.HasBeenNotified()) worker.release.Notify();
}

// Status polls used to run one after another with a 1 s deadline each, so a
// worker that hangs delayed every other worker's status (and up state) by
// the whole deadline, every round.
TEST(WorkerRegistryTest, AHungWorkerDoesNotDelayAnothersStatus) {
  HangingWorker hung;
  hung.hang_status = true;
  CountingWorker good;
  TestServer hung_server(&hung), good_server(&good);
  PrefixIndex index;
  RegistryConfig config;
  config.decode = {hung_server.address(), good_server.address()};
  config.heartbeat = absl::Milliseconds(20);
  config.status_timeout = absl::Minutes(5);
  WorkerRegistry registry(config, &index);
  registry.Start();
  EXPECT_TRUE(WaitFor([&] { return good.status_calls >= 5; }));
  EXPECT_EQ(hung.status_calls, 1) << "the hung poll should still be in flight";
  EXPECT_EQ(registry.UpWorkers().size(), 1u);
  registry.Stop();
  hung.release.Notify();
}

// A worker that registered itself and then went away for good (its pod was
// deleted) stayed listed, counted as down, forever.
TEST(WorkerRegistryTest, ForgetsARegisteredWorkerThatStaysDown) {
  CountingWorker alive;
  TestServer server(&alive);
  PrefixIndex index;
  RegistryConfig config;
  const std::string dead_static = "127.0.0.1:1";  // nothing listens there
  config.decode = {dead_static};
  config.heartbeat = absl::Milliseconds(20);
  config.forget_registered_after = absl::Milliseconds(300);
  WorkerRegistry registry(config, &index);
  registry.Register(server.address(), v1::WORKER_ROLE_DECODE);
  registry.Register("127.0.0.1:2", v1::WORKER_ROLE_DECODE);  // dead
  registry.Start();
  auto listed = [&](const std::string& address) {
    for (const WorkerView& w : registry.AllWorkers())
      if (w.address == address) return true;
    return false;
  };
  ASSERT_TRUE(WaitFor([&] { return !listed("127.0.0.1:2"); }))
      << "a dead registered worker was never forgotten";
  EXPECT_TRUE(listed(dead_static)) << "static entries stay";
  EXPECT_TRUE(listed(server.address())) << "a live registered worker stays";
  EXPECT_TRUE(registry.WaitForWorkers(1, absl::Seconds(5)));
  // Registering again brings it back.
  registry.Register("127.0.0.1:2", v1::WORKER_ROLE_DECODE);
  EXPECT_TRUE(listed("127.0.0.1:2"));
  registry.Stop();
}

// A registered worker that was down long enough to be forgotten comes back
// on the same address and registers again: it is polled on a new channel,
// not one still backing off from the failures that retired it (gRPC's first
// back-off is 1 s, the next ones 1.6x longer).
TEST(WorkerRegistryTest, AForgottenWorkerThatComesBackIsUpPromptly) {
  CountingWorker worker;
  int port = 0;
  {
    TestServer probe(&worker);  // finds a free port, then frees it
    port = probe.port;
  }
  ASSERT_GT(port, 0);
  const std::string address = absl::StrCat("127.0.0.1:", port);
  PrefixIndex index;
  RegistryConfig config;
  config.heartbeat = absl::Milliseconds(20);
  config.forget_registered_after = absl::Milliseconds(2500);
  WorkerRegistry registry(config, &index);
  registry.Start();
  registry.Register(address, v1::WORKER_ROLE_DECODE);
  ASSERT_TRUE(WaitFor([&] { return registry.AllWorkers().empty(); }))
      << "the down worker was never forgotten";
  TestServer server(&worker, port);
  ASSERT_EQ(server.port, port);
  const absl::Time back = absl::Now();
  registry.Register(address, v1::WORKER_ROLE_DECODE);
  ASSERT_TRUE(registry.WaitForWorkers(1, absl::Seconds(5)));
  EXPECT_LT(absl::Now() - back, absl::Milliseconds(1500))
      << "the worker came up only after its old channel's back-off";
  registry.Stop();
}

// A stream that connects but never delivers (not even the snapshot) is
// cancelled after the idle timeout and opened again.
TEST(WorkerRegistryTest, ReopensAnEventStreamThatStaysSilent) {
  HangingWorker worker;
  TestServer server(&worker);
  PrefixIndex index;
  RegistryConfig config = OneDecodeWorker(server);
  config.heartbeat = absl::Milliseconds(20);
  config.event_stream_idle_timeout = absl::Milliseconds(200);
  WorkerRegistry registry(config, &index);
  registry.Start();
  EXPECT_TRUE(WaitFor([&] { return worker.subscribe_calls >= 2; }));
  registry.Stop();
  worker.release.Notify();
}

// A worker busy with long engine steps on a loaded machine answers its
// status polls late: found by the slow soak, the router marked such workers
// down (and cleared their index entries) on a single late poll.
class LateWorker final : public v1::Worker::Service {
 public:
  std::atomic<int> late_from{1000000}, late_until{0}, calls{0};
  grpc::Status GetStatus(grpc::ServerContext* ctx, const v1::WorkerInfoRequest*,
                         v1::WorkerStatus* status) override {
    const int n = calls++;
    if (n >= late_from && n < late_until) {
      // Until the caller's deadline has passed (the call is cancelled then),
      // then answer anyway: late by construction, however loaded the
      // machine, rather than by a fixed delay racing a short deadline.
      while (!ctx->IsCancelled()) absl::SleepFor(absl::Milliseconds(1));
    }
    status->set_id("late");
    status->set_role(v1::WORKER_ROLE_DECODE);
    return grpc::Status::OK;
  }
};

TEST(WorkerRegistryTest, AFewLatePollsDoNotMarkAWorkerDownButManyDo) {
  for (const int late : {2, 6}) {
    LateWorker worker;
    worker.late_from = 3;
    worker.late_until = 3 + late;
    TestServer server(&worker);
    PrefixIndex index;
    RegistryConfig config;
    config.decode = {server.address()};
    config.heartbeat = absl::Milliseconds(10);
    // Wide enough that a poll answered at once is never late on a loaded
    // machine; the late ones wait out whatever the deadline is.
    config.status_timeout = absl::Milliseconds(500);
    config.max_missed_polls = 3;
    WorkerRegistry registry(config, &index);
    registry.Start();
    ASSERT_TRUE(WaitFor([&] { return worker.calls >= 3; }));
    bool went_down = false;
    ASSERT_TRUE(WaitFor(
        [&] {
          if (registry.UpWorkers().empty()) went_down = true;
          return worker.calls >= 3 + late + 2;
        },
        400));
    EXPECT_EQ(went_down, late >= 3) << late << " late polls in a row";
    // Once it answers in time again it is (or stays) up.
    EXPECT_TRUE(WaitFor([&] { return registry.UpWorkers().size() == 1; }));
    registry.Stop();
  }
}

// Pod-IP churn: workers register from ever new addresses and then go away
// for good. Their entries (each with a channel), their WorkerIndex values and
// the index state under them used to stay forever; now they are evicted and
// the indices reused, so 10,000 register/forget cycles stay within one
// batch's worth of slots.
TEST(WorkerRegistryTest, AddressChurnKeepsTheRegistryAndIndexBounded) {
  PrefixIndex index;
  RegistryConfig config;
  config.heartbeat = absl::Milliseconds(20);
  // Long enough for the test to store each worker's hashes first.
  config.forget_registered_after = absl::Milliseconds(100);
  config.evict_retired_after = absl::ZeroDuration();
  WorkerRegistry registry(config, &index);
  registry.Start();
  constexpr int kBatch = 100, kRounds = 100;
  const std::vector<engine::BlockHash> hashes = {{1, 2}, {3, 4}, {5, 6}};
  WorkerIndex highest = -1;
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < kBatch; ++i) {
      const int n = round * kBatch + i;
      // Nothing listens on port 1: each is down at its first poll.
      registry.Register(
          absl::StrCat("127.0.", 1 + n / 250, ".", 1 + n % 250, ":1"),
          v1::WORKER_ROLE_DECODE);
    }
    for (const WorkerView& w : registry.AllWorkers()) {
      highest = std::max(highest, w.index);
      index.Stored(w.index, hashes);  // as its event stream would
    }
    ASSERT_LT(highest, 2 * kBatch) << "round " << round;
    ASSERT_TRUE(WaitFor([&] { return registry.slots() == 0; }, 200))
        << "round " << round << ": " << registry.slots() << " slots";
    ASSERT_LE(index.Memory().workers, static_cast<size_t>(2 * kBatch));
  }
  EXPECT_EQ(index.num_hashes(), 0u);
  EXPECT_EQ(index.Memory().reverse_entries, 0u);
  registry.Stop();
}

// A listener that never accepts: the kernel completes the TCP handshake but
// no HTTP/2 settings ever arrive, so a status poll stays queued in its
// channel until the channel goes away.
class SilentListener {
 public:
  SilentListener() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (fd_ < 0 || bind(fd_, reinterpret_cast<sockaddr*>(&a), len) != 0 ||
        listen(fd_, 64) != 0 ||
        getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      port_ = -1;
      return;
    }
    port_ = ntohs(a.sin_port);
  }
  ~SilentListener() {
    if (fd_ >= 0) close(fd_);
  }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = -1;
};

// Forgetting a worker drops its channel while its status poll is still
// queued there; the poll's completion (which takes the registry's lock) must
// not run under that lock.
TEST(WorkerRegistryTest, ForgettingAWorkerWithAPollInFlightCompletesIt) {
  SilentListener silent;
  ASSERT_GT(silent.port(), 0);
  PrefixIndex index;
  RegistryConfig config;
  config.heartbeat = absl::Milliseconds(10);
  config.status_timeout = absl::Seconds(30);
  config.forget_registered_after = absl::Milliseconds(50);
  config.evict_retired_after = absl::ZeroDuration();
  WorkerRegistry registry(config, &index);
  registry.Start();
  for (int round = 0; round < 20; ++round) {
    registry.Register(absl::StrCat("127.0.0.1:", silent.port()),
                      v1::WORKER_ROLE_DECODE);
    // The poll completes with the channel's end, well before its deadline.
    ASSERT_TRUE(WaitFor([&] { return registry.slots() == 0; }, 100))
        << "round " << round << ": " << registry.slots() << " slots";
  }
  registry.Stop();
}

TEST(WorkerRegistryTest, MaxMissedPollsMustBePositive) {
  RegistryConfig config;
  config.max_missed_polls = 0;
  EXPECT_FALSE(config.Validate().ok());
}

}  // namespace
}  // namespace pdserve::router
