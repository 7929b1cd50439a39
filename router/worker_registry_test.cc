#include "router/worker_registry.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
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

bool WaitFor(const std::function<bool()>& done) {
  for (int i = 0; i < 100; ++i) {
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

}  // namespace
}  // namespace pdserve::router
