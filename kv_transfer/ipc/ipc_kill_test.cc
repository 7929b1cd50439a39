// The shm transport across real processes over the production control plane
// (gRPC KvTransfer.Control): this process is the decode side (a memfd pool,
// KvReceiver, IpcKvTransferService on loopback port 0); ipc_send_tool is the
// prefill side, mapping the pool memfd this process passes it over its pool
// socket (SCM_RIGHTS). A sender killed with
// SIGKILL while it holds claimed spans must free the reservation at once
// (well before the stall timeout), with nothing written.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kv_transfer/ipc/ipc_service.h"
#include "kv_transfer/test_blocks.h"

namespace pdserve::kv_transfer::ipc {
namespace {

using testing::ExpectedSpan;
using testing::TestSpec;

class IpcKillTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spec_ = TestSpec(DType::kBF16);
    spec_.host_shared = true;
    pool_ = *engine::KvPool::Create(spec_, 16);
    receiver_ = std::make_unique<KvReceiver>(
        pool_.get(), KvLayout::FromSpec(spec_, "test-model"));
    backend_ = NewShmBackend();
    endpoint_ = *IpcKvReceiveEndpoint::Create(receiver_.get(), pool_.get(),
                                              backend_.get());
    service_ = std::make_unique<IpcKvTransferService>(receiver_.get(),
                                                      endpoint_.get());
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port_);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(port_, 0);
  }
  void TearDown() override {
    server_->Shutdown(std::chrono::system_clock::now());
    endpoint_->Shutdown();
  }

  // Starts the tool; its stdout is returned as a FILE*.
  pid_t Spawn(uint64_t reservation, int blocks, const char* mode, FILE** out) {
    int fds[2];
    EXPECT_EQ(pipe(fds), 0);
    const std::string dest = absl::StrCat("127.0.0.1:", port_);
    const std::string res = std::to_string(reservation);
    const std::string n = std::to_string(blocks);
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(fds[1], 1);
      close(fds[0]);
      execl(IPC_SEND_TOOL, IPC_SEND_TOOL, dest.c_str(), res.c_str(), "bf16",
            n.c_str(), "4", mode, nullptr);
      _exit(127);
    }
    close(fds[1]);
    *out = fdopen(fds[0], "r");
    return pid;
  }
  bool IsZero(int32_t block) {
    for (int l = 0; l < spec_.num_layers; ++l) {
      const uint8_t* p = pool_->LayerBlockData(l, block);
      for (int64_t i = 0; i < spec_.LayerBlockBytes(); ++i)
        if (p[i] != 0) return false;
    }
    return true;
  }

  engine::KvCacheSpec spec_;
  std::unique_ptr<engine::KvPool> pool_;
  std::unique_ptr<KvReceiver> receiver_;
  std::unique_ptr<PeerMemoryBackend> backend_;
  std::unique_ptr<IpcKvReceiveEndpoint> endpoint_;
  std::unique_ptr<IpcKvTransferService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(IpcKillTest, AnotherProcessWritesTheReservedBlocks) {
  const uint64_t res = receiver_->Expect("r", {9, 3, 5}, 0);
  FILE* out = nullptr;
  const pid_t pid = Spawn(res, 3, "all", &out);
  int status = 0;
  waitpid(pid, &status, 0);
  fclose(out);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0);
  ASSERT_TRUE(
      receiver_->Wait(res, absl::Seconds(10), absl::Now() + absl::Seconds(10))
          .ok());
  const int32_t blocks[] = {9, 3, 5};
  for (int i = 0; i < 3; ++i) {
    for (int l = 0; l < spec_.num_layers; ++l) {
      auto want = ExpectedSpan(spec_, 4, l, i, spec_.LayerBlockBytes());
      EXPECT_EQ(std::memcmp(pool_->LayerBlockData(l, blocks[i]), want.data(),
                            want.size()),
                0)
          << "layer " << l << " block " << i;
    }
  }
}

TEST_F(IpcKillTest, SenderKilledWhileHoldingClaimedSpansFreesTheReservation) {
  const uint64_t res = receiver_->Expect("r", {9, 3, 5}, 0);
  FILE* out = nullptr;
  const pid_t pid = Spawn(res, 3, "stall", &out);
  char line[64] = {};
  ASSERT_NE(fgets(line, sizeof line, out), nullptr) << "the tool died early";
  ASSERT_STREQ(line, "claimed\n");
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  fclose(out);
  // The stall timeout is 30 s; the broken stream ends it at once.
  const absl::Time start = absl::Now();
  EXPECT_FALSE(
      receiver_->Wait(res, absl::Seconds(30), absl::Now() + absl::Seconds(30))
          .ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(receiver_->num_reservations(), 0);
  for (int32_t b : {9, 3, 5}) EXPECT_TRUE(IsZero(b)) << b;
  // The stream's thread ends right after the reservation does.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (endpoint_->active_streams() > 0 && absl::Now() < until)
    std::this_thread::yield();
  EXPECT_EQ(endpoint_->active_streams(), 0);
}

}  // namespace
}  // namespace pdserve::kv_transfer::ipc
