// RouterRegistration against an in-process RouterControl on port 0.
#include "worker/registration.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace pdserve::worker {
namespace {

class FakeRouterControl final : public v1::RouterControl::Service {
 public:
  grpc::Status RegisterWorker(grpc::ServerContext* ctx,
                              const v1::RegisterWorkerRequest* req,
                              v1::RegisterWorkerResponse*) override {
    bool hang;
    {
      absl::MutexLock l(&mu_);
      ++calls_;
      last_ = *req;
      hang = hang_;
    }
    if (hang) {
      // Holds the call until the client cancels it (or 30 s pass).
      const absl::Time until = absl::Now() + absl::Seconds(30);
      while (!ctx->IsCancelled() && absl::Now() < until)
        absl::SleepFor(absl::Milliseconds(5));
      return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    }
    return grpc::Status::OK;
  }
  int calls() {
    absl::MutexLock l(&mu_);
    return calls_;
  }
  bool WaitForCalls(int n, absl::Duration timeout) {
    absl::MutexLock l(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return calls_ >= n;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
  }
  v1::RegisterWorkerRequest last() {
    absl::MutexLock l(&mu_);
    return last_;
  }
  void set_hang(bool h) {
    absl::MutexLock l(&mu_);
    hang_ = h;
  }

 private:
  absl::Mutex mu_;
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
  bool hang_ ABSL_GUARDED_BY(mu_) = false;
  v1::RegisterWorkerRequest last_ ABSL_GUARDED_BY(mu_);
};

class RouterRegistrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                       &port_);
    b.RegisterService(&router_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override {
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(100));
  }
  RegistrationConfig Config() {
    RegistrationConfig c;
    c.router = absl::StrCat("127.0.0.1:", port_);
    c.address = "10.0.0.7:4000";
    c.role = v1::WORKER_ROLE_DECODE;
    c.interval = absl::Milliseconds(20);
    return c;
  }
  FakeRouterControl router_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(RouterRegistrationTest, RegistersAtOnceAndRepeatsAsHeartbeat) {
  auto r =
      RouterRegistration::Start(Config(), grpc::InsecureChannelCredentials());
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(router_.WaitForCalls(3, absl::Seconds(20)));
  EXPECT_EQ(router_.last().address(), "10.0.0.7:4000");
  EXPECT_EQ(router_.last().role(), v1::WORKER_ROLE_DECODE);
  // The worker side saw them accepted (bounded wait: replies are async).
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while ((*r)->accepted() < 3 && absl::Now() < until)
    absl::SleepFor(absl::Milliseconds(5));
  EXPECT_GE((*r)->accepted(), 3);
  EXPECT_TRUE((*r)->last_status().ok()) << (*r)->last_status();
  (*r)->Stop();
  const int after_stop = router_.calls();
  // No heartbeat after Stop returned.
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(router_.calls(), after_stop);
}

TEST_F(RouterRegistrationTest, StopDoesNotWaitForTheIntervalOrAHungRouter) {
  RegistrationConfig c = Config();
  c.interval = absl::Hours(1);
  c.rpc_timeout = absl::Hours(1);
  router_.set_hang(true);
  auto r = RouterRegistration::Start(c, grpc::InsecureChannelCredentials());
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(router_.WaitForCalls(1, absl::Seconds(20)));
  const absl::Time t0 = absl::Now();
  (*r)->Stop();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  EXPECT_FALSE((*r)->last_status().ok());
}

TEST_F(RouterRegistrationTest, InvalidConfigIsRefused) {
  RegistrationConfig c = Config();
  c.role = v1::WORKER_ROLE_UNSPECIFIED;
  EXPECT_EQ(RouterRegistration::Start(c, grpc::InsecureChannelCredentials())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  c = Config();
  c.router.clear();
  EXPECT_FALSE(
      RouterRegistration::Start(c, grpc::InsecureChannelCredentials()).ok());
}

}  // namespace
}  // namespace pdserve::worker
