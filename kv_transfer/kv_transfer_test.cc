#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/metrics.h"
#include "kv_cache/block_manager.h"
#include "kv_transfer/grpc/grpc_transport.h"
#include "kv_transfer/test_blocks.h"
#include "kv_transfer/test_server.h"

namespace pdserve::kv_transfer {
namespace {

using ::testing::HasSubstr;

// A receiving worker in this process: a pool, a block manager standing in for
// the engine's reservations, a KvReceiver and a gRPC server on a free port.
class KvTransferTest : public ::testing::Test {
 protected:
  void StartReceiver(DType dtype) {
    spec_ = testing::TestSpec(dtype);
    pool_ = std::move(*engine::KvPool::Create(spec_, 16));
    blocks_ = std::make_unique<engine::BlockManager>(16);
    metrics_ = std::make_unique<TransferMetrics>(registry_);
    receiver_ = std::make_unique<KvReceiver>(
        pool_.get(), KvLayout::FromSpec(spec_, "test-model"),
        metrics_->ForReceiver());
    service_ = std::make_unique<KvTransferService>(receiver_.get());
    server_ = testing::StartTestServer(service_.get(), &port_);
    ASSERT_NE(port_, 0);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }
  // Starts kv_send_tool; returns its pid.
  pid_t Spawn(uint64_t reservation, const std::string& request, int num_blocks,
              int skip, const std::string& mode, int* stdout_fd = nullptr) {
    int fds[2];
    EXPECT_EQ(pipe(fds), 0);
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(fds[1], 1);
      close(fds[0]);
      const std::string dest = "127.0.0.1:" + std::to_string(port_);
      const std::string res = std::to_string(reservation),
                        nb = std::to_string(num_blocks),
                        sk = std::to_string(skip);
      execl(KV_SEND_TOOL, KV_SEND_TOOL, dest.c_str(), res.c_str(),
            request.c_str(), DTypeName(spec_.dtype), nb.c_str(), sk.c_str(),
            mode.c_str(), "42", static_cast<char*>(nullptr));
      _exit(127);
    }
    close(fds[1]);
    if (stdout_fd) {
      *stdout_fd = fds[0];
    } else {
      close(fds[0]);
    }
    return pid;
  }
  static int ExitCode(pid_t pid) {
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  }
  double Failures(const std::string& reason) {
    const std::string text = registry_.Render();
    const std::string key =
        "pdserve_kv_transfer_failures_total{reason=\"" + reason + "\"} ";
    const size_t at = text.find(key);
    return at == std::string::npos ? -1
                                   : std::stod(text.substr(at + key.size()));
  }

  engine::KvCacheSpec spec_;
  std::unique_ptr<engine::KvPool> pool_;
  std::unique_ptr<engine::BlockManager> blocks_;
  metrics::Registry registry_;
  std::unique_ptr<TransferMetrics> metrics_;
  std::unique_ptr<KvReceiver> receiver_;
  std::unique_ptr<KvTransferService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(KvTransferTest,
       EveryDtypeArrivesByteIdenticalWithAndWithoutLayerwiseStreaming) {
  for (DType dtype :
       {DType::kF32, DType::kF16, DType::kBF16, DType::kI8, DType::kFp8E4M3}) {
    for (const char* mode : {"all", "layerwise"}) {
      StartReceiver(dtype);
      const int num_blocks = 5,
                skip = 2;  // two leading blocks are already cached here
      std::vector<int32_t> reserved;
      ASSERT_TRUE(blocks_->Allocate(num_blocks, &reserved));
      std::reverse(reserved.begin(),
                   reserved.end());  // physical order differs from the sender's
      // Mark the skipped blocks so we can check they are untouched.
      for (int i = 0; i < skip; ++i)
        std::memset(pool_->LayerBlockData(0, reserved[i]), 0x5A,
                    spec_.LayerBlockBytes());
      const uint64_t id = receiver_->Expect("req-1", reserved, skip);
      const pid_t child = Spawn(id, "req-1", num_blocks, skip, mode);
      ASSERT_TRUE(
          receiver_
              ->Wait(id, absl::Seconds(20), absl::Now() + absl::Seconds(30))
              .ok())
          << DTypeName(dtype) << " " << mode;
      EXPECT_EQ(ExitCode(child), 0);
      for (int i = skip; i < num_blocks; ++i) {
        for (int l = 0; l < spec_.num_layers; ++l) {
          auto want =
              testing::ExpectedSpan(spec_, 42, l, i, spec_.LayerBlockBytes());
          ASSERT_EQ(0, std::memcmp(pool_->LayerBlockData(l, reserved[i]),
                                   want.data(), want.size()))
              << DTypeName(dtype) << " " << mode << " layer " << l << " block "
              << i;
          if (testing::ScaleBytes(spec_)) {
            auto scales = testing::ExpectedSpan(spec_, 43, l, i,
                                                testing::ScaleBytes(spec_));
            ASSERT_EQ(0, std::memcmp(pool_->LayerBlockScales(l, reserved[i]),
                                     scales.data(), scales.size()));
          }
        }
      }
      for (int i = 0; i < skip; ++i)
        EXPECT_EQ(pool_->LayerBlockData(0, reserved[i])[0], 0x5A);
      EXPECT_EQ(receiver_->num_reservations(), 0);
      server_->Shutdown(std::chrono::system_clock::now());
      server_.reset();
    }
  }
}

TEST_F(KvTransferTest, MismatchedHandshakeIsRefusedWithBothValues) {
  StartReceiver(DType::kF16);
  std::vector<int32_t> reserved;
  ASSERT_TRUE(blocks_->Allocate(3, &reserved));
  const uint64_t id = receiver_->Expect("req-2", reserved, 0);
  const pid_t child = Spawn(id, "req-2", 3, 0, "mismatch");
  const absl::Status s =
      receiver_->Wait(id, absl::Seconds(20), absl::Now() + absl::Seconds(30));
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("block_size: sender 32 vs receiver 4"));
  EXPECT_EQ(ExitCode(child),
            10 + static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(Failures("handshake"), 1);
}

TEST_F(KvTransferTest, ChunksOutsideTheReservationAreRejectedAndCounted) {
  StartReceiver(DType::kF32);
  std::vector<int32_t> reserved;
  ASSERT_TRUE(blocks_->Allocate(2, &reserved));
  const uint64_t id = receiver_->Expect("req-3", reserved, 1);
  ASSERT_TRUE(receiver_->Begin(id, "req-3", receiver_->layout()).ok());
  const std::string good(spec_.LayerBlockBytes(), '\1');
  EXPECT_EQ(receiver_->Write(id, 0, 2, good, "").code(),
            absl::StatusCode::kInvalidArgument);  // past the end
  EXPECT_EQ(Failures("out_of_range"), 1);
  EXPECT_EQ(receiver_->Write(id, 0, 0, good, "").code(),
            absl::StatusCode::kAborted);  // reservation failed
  const uint64_t id2 = receiver_->Expect("req-4", reserved, 1);
  EXPECT_EQ(receiver_->Write(id2, 0, 0, good, "").code(),
            absl::StatusCode::kInvalidArgument);  // a skipped block
  const uint64_t id3 = receiver_->Expect("req-5", reserved, 0);
  EXPECT_EQ(receiver_->Write(id3, 3, 0, good, "").code(),
            absl::StatusCode::kInvalidArgument);  // no layer 3
  const uint64_t id4 = receiver_->Expect("req-6", reserved, 0);
  EXPECT_EQ(receiver_->Write(id4, 0, 0, good.substr(1), "").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Failures("bad_length"), 1);
  EXPECT_EQ(receiver_->Write(999, 0, 0, good, "").code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(receiver_->Begin(id4, "someone-else", receiver_->layout()).code(),
            absl::StatusCode::kNotFound);
  for (uint64_t r : {id, id2, id3, id4}) {
    receiver_->Cancel(r);
    receiver_->Cancel(r);  // idempotent
  }
  EXPECT_EQ(receiver_->num_reservations(), 0);
}

TEST_F(KvTransferTest, KilledSenderFreesTheReservationWithinTheTimeout) {
  StartReceiver(DType::kBF16);
  std::vector<int32_t> reserved;
  ASSERT_TRUE(blocks_->Allocate(4, &reserved));
  const uint64_t id = receiver_->Expect("req-7", reserved, 0);
  int out = -1;
  const pid_t child = Spawn(id, "req-7", 4, 0, "stall", &out);
  char buf[64] = {0};
  ASSERT_GT(read(out, buf, sizeof(buf) - 1), 0);  // first layer is on the wire
  close(out);
  kill(child, SIGKILL);
  ExitCode(child);
  const absl::Time start = absl::Now();
  const absl::Status s = receiver_->Wait(id, absl::Milliseconds(500),
                                         absl::Now() + absl::Seconds(30));
  EXPECT_FALSE(s.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // What the receiver owes the engine before it may free the blocks (the
  // decode service does that: decode_handler_test checks it ends with 0
  // active blocks): the reservation is gone, and nothing can write into its
  // blocks any more.
  EXPECT_EQ(receiver_->num_reservations(), 0);
  const std::string late(spec_.LayerBlockBytes(), '\7');
  std::memset(pool_->LayerBlockData(1, reserved[3]), 0x3C,
              spec_.LayerBlockBytes());
  EXPECT_EQ(receiver_->Write(id, 1, 3, late, "").code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(pool_->LayerBlockData(1, reserved[3])[0], 0x3C);
  EXPECT_GE(Failures("sender_aborted") + Failures("timeout"), 1);
}

// A receiver without a network: transfers are driven by direct Write calls,
// and on_bytes (which runs while a span counts as being written) can hold one
// copy in the middle.
class KvReceiverConcurrencyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spec_ = testing::TestSpec(DType::kF32);
    pool_ = std::move(*engine::KvPool::Create(spec_, 8));
    ReceiverCounters counters;
    counters.on_bytes = [this](uint64_t) {
      if (hold_next_copy_.exchange(false)) {
        copy_held_.Notify();
        release_copy_.WaitForNotification();
      }
    };
    receiver_ = std::make_unique<KvReceiver>(
        pool_.get(), KvLayout::FromSpec(spec_, "test-model"), counters);
  }
  void TearDown() override {
    if (!release_copy_.HasBeenNotified()) release_copy_.Notify();
    for (auto& t : threads_) t.join();
  }

  engine::KvCacheSpec spec_;
  std::unique_ptr<engine::KvPool> pool_;
  std::unique_ptr<KvReceiver> receiver_;
  std::atomic<bool> hold_next_copy_{false};
  absl::Notification copy_held_, release_copy_;
  std::vector<std::thread> threads_;
};

TEST_F(KvReceiverConcurrencyTest, ACopyHeldMidwayDoesNotBlockAnotherTransfer) {
  const uint64_t a = receiver_->Expect("a", {0, 1}, 0);
  const uint64_t b = receiver_->Expect("b", {2, 3}, 0);
  const std::string span(spec_.LayerBlockBytes(), '\1');
  hold_next_copy_ = true;
  absl::Status a_written;
  threads_.emplace_back(
      [&] { a_written = receiver_->Write(a, 0, 0, span, ""); });
  ASSERT_TRUE(copy_held_.WaitForNotificationWithTimeout(absl::Seconds(10)));

  // Transfer b writes, completes and ends while a's copy is still held.
  absl::Notification b_done;
  absl::Status b_status;
  threads_.emplace_back([&] {
    for (int l = 0; l < spec_.num_layers && b_status.ok(); ++l) {
      for (int i = 0; i < 2 && b_status.ok(); ++i)
        b_status = receiver_->Write(b, l, i, span, "");
    }
    if (b_status.ok())
      b_status = receiver_->Wait(b, absl::Seconds(10),
                                 absl::Now() + absl::Seconds(10));
    b_done.Notify();
  });
  EXPECT_TRUE(b_done.WaitForNotificationWithTimeout(absl::Seconds(10)))
      << "a transfer blocked mid-copy held up another reservation";
  release_copy_.Notify();
  for (auto& t : threads_) t.join();
  threads_.clear();
  EXPECT_TRUE(a_written.ok()) << a_written;
  EXPECT_TRUE(b_status.ok()) << b_status;
  EXPECT_EQ(receiver_->num_reservations(), 1);  // a still expects spans
  receiver_->Cancel(a);
  EXPECT_EQ(receiver_->num_reservations(), 0);
}

TEST_F(KvReceiverConcurrencyTest,
       CancelWaitsForACopyInProgressThenRefusesMore) {
  const uint64_t a = receiver_->Expect("a", {4, 5}, 0);
  const std::string span(spec_.LayerBlockBytes(), '\2');
  hold_next_copy_ = true;
  absl::Status a_written;
  threads_.emplace_back(
      [&] { a_written = receiver_->Write(a, 2, 1, span, ""); });
  ASSERT_TRUE(copy_held_.WaitForNotificationWithTimeout(absl::Seconds(10)));
  absl::Notification cancelled;
  threads_.emplace_back([&] {
    receiver_->Cancel(a);
    cancelled.Notify();
  });
  // The engine frees the blocks as soon as Cancel returns, so Cancel must
  // not return while bytes are still being copied into them.
  EXPECT_FALSE(
      cancelled.WaitForNotificationWithTimeout(absl::Milliseconds(200)));
  release_copy_.Notify();
  EXPECT_TRUE(cancelled.WaitForNotificationWithTimeout(absl::Seconds(10)));
  for (auto& t : threads_) t.join();
  threads_.clear();
  EXPECT_TRUE(a_written.ok()) << a_written;
  EXPECT_EQ(receiver_->num_reservations(), 0);
  std::memset(pool_->LayerBlockData(0, 4), 0x3C, spec_.LayerBlockBytes());
  EXPECT_EQ(receiver_->Write(a, 0, 0, span, "").code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(pool_->LayerBlockData(0, 4)[0], 0x3C);
}

TEST_F(KvReceiverConcurrencyTest, TwoCopiesIntoOneSpanAtOnceFailTheTransfer) {
  const uint64_t a = receiver_->Expect("a", {6, 7}, 0);
  const std::string span(spec_.LayerBlockBytes(), '\3');
  hold_next_copy_ = true;
  absl::Status first;
  threads_.emplace_back([&] { first = receiver_->Write(a, 0, 1, span, ""); });
  ASSERT_TRUE(copy_held_.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(receiver_->Write(a, 0, 1, span, "").code(),
            absl::StatusCode::kInvalidArgument);
  release_copy_.Notify();
  for (auto& t : threads_) t.join();
  threads_.clear();
  EXPECT_EQ(
      receiver_->Wait(a, absl::Seconds(10), absl::Now() + absl::Seconds(10))
          .code(),
      absl::StatusCode::kAborted);
  EXPECT_EQ(receiver_->num_reservations(), 0);
}

TEST(KvLayoutTest, CheckNamesEveryDifference) {
  KvLayout a{"fp-a", 2, 4, 8, 16, DType::kF16};
  KvLayout b = a;
  EXPECT_TRUE(CheckLayouts(a, b).ok());
  b.dtype = DType::kI8;
  b.fingerprint = "fp-b";
  const absl::Status s = CheckLayouts(a, b);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("kv dtype: sender fp16 vs receiver int8"));
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("model fingerprint: sender fp-a vs receiver fp-b"));
}

}  // namespace
}  // namespace pdserve::kv_transfer
