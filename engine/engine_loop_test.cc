#include "engine/engine_loop.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <time.h>

#include <atomic>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/status_cause.h"
#include "engine/test_util.h"

namespace pdserve::engine {
namespace {

// Polls `done` until it holds or `timeout` passes (a bounded wait on state
// that has no notification of its own, such as a queue length).
bool WaitUntil(const std::function<bool()>& done,
               absl::Duration timeout = absl::Seconds(20)) {
  const absl::Time until = absl::Now() + timeout;
  while (!done()) {
    if (absl::Now() >= until) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

class EngineLoopTest : public ::testing::Test {
 protected:
  // block_size 4 over the tiny model (fp32): `blocks` blocks in the pool.
  static std::unique_ptr<EngineLoop> MakeLoop(
      int64_t blocks, EngineConfig config = {},
      std::function<void(bool)> on_busy = nullptr) {
    config.block_size = 4;
    const auto weights = testing::TinyWeights();
    const KvCacheSpec spec{static_cast<int32_t>(weights->config.num_layers),
                           static_cast<int32_t>(weights->config.num_kv_heads),
                           static_cast<int32_t>(weights->config.head_dim),
                           config.block_size, config.kv_dtype};
    config.kv_cache_bytes = spec.BytesPerBlock() * blocks;
    auto e = Engine::Create(weights, config);
    EXPECT_TRUE(e.ok()) << e.status();
    return std::make_unique<EngineLoop>(std::move(*e), std::move(on_busy));
  }
  // A request whose prompt takes `blocks` blocks of 4 tokens.
  static EngineRequest Req(const std::string& id, int blocks,
                           uint32_t max_tokens = 1) {
    EngineRequest r;
    r.id = id;
    for (int i = 0; i < 4 * blocks; ++i)
      r.prompt.push_back((i * 31 + static_cast<int>(id.size()) * 17 + 3) % 256);
    r.sampling.max_tokens = max_tokens;
    r.sampling.ignore_eos = true;
    return r;
  }
  static EngineStats Stats(EngineLoop& loop) {
    auto s = loop.Call([](Engine& e) { return e.Stats(); });
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : EngineStats{};
  }
};

TEST_F(EngineLoopTest, StopFailsQueuedCallsAndRefusesLaterOnes) {
  auto loop = MakeLoop(64);
  absl::Notification running, release;
  std::thread busy([&] {
    // Holds the engine thread so that the next call stays queued.
    absl::Status s = loop->Call([&](Engine&) {
      running.Notify();
      release.WaitForNotification();
    });
    EXPECT_TRUE(s.ok()) << s;
  });
  ASSERT_TRUE(running.WaitForNotificationWithTimeout(absl::Seconds(20)));
  auto queued = std::async(std::launch::async, [&] {
    return loop->Call([](Engine&) { return 7; });
  });
  ASSERT_TRUE(WaitUntil([&] { return loop->num_queued_calls() == 1; }));
  loop->Stop();
  release.Notify();
  ASSERT_EQ(queued.wait_for(std::chrono::seconds(20)),
            std::future_status::ready)
      << "a call queued at shutdown was left waiting";
  const absl::StatusOr<int> got = queued.get();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable);
  busy.join();

  EXPECT_EQ(loop->Call([](Engine&) { return 1; }).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(loop->Submit(Req("late", 2)).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(
      loop->Reserve(Req("late", 2), absl::InfiniteFuture()).status().code(),
      absl::StatusCode::kUnavailable);
  loop->Abort("late");  // harmless after Stop
}

TEST_F(EngineLoopTest, DestructionFailsLiveStreamsAndWaitingReservations) {
  auto loop = MakeLoop(8);
  // Every block reserved: the request below waits for admission with a live
  // stream, and "big" waits for blocks that never come.
  auto holder = loop->Reserve(Req("holder", 7), absl::InfiniteFuture());
  ASSERT_TRUE(holder.ok()) << holder.status();
  auto stream = loop->Submit(Req("long", 2));
  ASSERT_TRUE(stream.ok()) << stream.status();
  auto waiting = std::async(std::launch::async, [&] {
    return loop->Reserve(Req("big", 2), absl::InfiniteFuture());
  });
  ASSERT_TRUE(WaitUntil([&] { return loop->num_pending_reservations() == 1; }));
  loop.reset();
  ASSERT_EQ(waiting.wait_for(std::chrono::seconds(20)),
            std::future_status::ready);
  EXPECT_EQ(waiting.get().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*stream)->error().code(), absl::StatusCode::kUnavailable);
}

TEST_F(EngineLoopTest, DetachReturnsBlocksHeldByAnOutputNobodyRead) {
  auto loop = MakeLoop(16);
  EngineRequest req = Req("held", 3);
  req.hold_blocks_on_finish = true;
  auto stream = loop->Submit(req);
  ASSERT_TRUE(stream.ok()) << stream.status();
  // The request finishes (one step); its output, holding 3 blocks, waits in
  // the stream unread, as when a prefill handler gave up on it.
  ASSERT_TRUE(WaitUntil(
      [&] { return !*loop->Call([](Engine& e) { return e.Has("held"); }); }));
  EXPECT_EQ(Stats(*loop).blocks_active, 3);
  ASSERT_TRUE(
      loop->Call([&](Engine&) { loop->DetachStream("held", stream->get()); })
          .ok());
  EXPECT_EQ(Stats(*loop).blocks_active, 0);
}

TEST_F(EngineLoopTest, TheBusyListenerHearsWhenWorkStartsAndRunsOut) {
  absl::Mutex mu;
  std::vector<bool> heard;
  auto loop = MakeLoop(64, {}, [&](bool busy) {
    absl::MutexLock l(&mu);
    heard.push_back(busy);
  });
  auto heard_now = [&] {
    absl::MutexLock l(&mu);
    return heard;
  };
  // No work yet: nothing to say (the loop starts idle).
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_TRUE(heard_now().empty());
  for (int round = 1; round <= 2; ++round) {
    auto stream = loop->Submit(Req(absl::StrCat("r", round), 2, 8));
    ASSERT_TRUE(stream.ok()) << stream.status();
    bool finished = false;
    ASSERT_TRUE(WaitUntil([&] {
      for (const StepOutput& out : (*stream)->Pop(absl::Milliseconds(1)))
        finished |= out.finish != FinishReason::kNone;
      return finished;
    }));
    // Once per stretch of work, however many steps it took.
    ASSERT_TRUE(WaitUntil([&] { return heard_now().size() == 2u * round; }));
    EXPECT_EQ(heard_now().back(), false);
    EXPECT_EQ(heard_now()[2 * round - 2], true);
  }
  EXPECT_GE(Stats(*loop).steps, 2 * 8);
}

TEST_F(EngineLoopTest, DetachAbortsALiveRequestAndItsBlocksReturn) {
  auto loop = MakeLoop(64);
  EngineRequest req = Req("live", 3, /*max_tokens=*/100);
  req.hold_blocks_on_finish = true;
  auto stream = loop->Submit(req);
  ASSERT_TRUE(stream.ok()) << stream.status();
  ASSERT_TRUE(
      loop->Call([&](Engine&) { loop->DetachStream("live", stream->get()); })
          .ok());
  ASSERT_TRUE(WaitUntil([&] { return Stats(*loop).blocks_active == 0; }));
  EXPECT_FALSE(*loop->Call([](Engine& e) { return e.Has("live"); }));
}

TEST_F(EngineLoopTest, ReservationsWaitInFifoOrderAndWakeWhenBlocksReturn) {
  auto loop = MakeLoop(8);
  auto holder = loop->Reserve(Req("holder", 6), absl::InfiniteFuture());
  ASSERT_TRUE(holder.ok()) << holder.status();
  // Two free blocks: "a" (3) must wait; "b" (1) would fit now but queues
  // behind "a".
  auto a = std::async(std::launch::async, [&] {
    return loop->Reserve(Req("a", 3), absl::InfiniteFuture());
  });
  ASSERT_TRUE(WaitUntil([&] { return loop->num_pending_reservations() == 1; }));
  auto b = std::async(std::launch::async, [&] {
    return loop->Reserve(Req("bb", 1), absl::InfiniteFuture());
  });
  ASSERT_TRUE(WaitUntil([&] { return loop->num_pending_reservations() == 2; }))
      << "a request that fits jumped the queue";
  EXPECT_EQ(b.wait_for(std::chrono::milliseconds(0)),
            std::future_status::timeout);
  loop->Abort("holder");  // releases 6 blocks: both fit now, in order
  ASSERT_EQ(a.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  ASSERT_EQ(b.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  const auto ra = a.get();
  const auto rb = b.get();
  ASSERT_TRUE(ra.ok()) << ra.status();
  ASSERT_TRUE(rb.ok()) << rb.status();
  EXPECT_EQ(ra->blocks.size(), 3u);
  EXPECT_EQ(rb->blocks.size(), 1u);
  EXPECT_EQ(loop->num_pending_reservations(), 0);
  loop->Abort("a");
  loop->Abort("bb");
  ASSERT_TRUE(WaitUntil([&] { return Stats(*loop).blocks_active == 0; }));
}

// A request waiting for blocks while nothing runs used to spin the engine
// thread on empty steps (a full core); now it sleeps until a task arrives.
TEST_F(EngineLoopTest, ARequestWaitingForBlocksDoesNotSpinTheEngineThread) {
  auto loop = MakeLoop(8);
  auto holder = loop->Reserve(Req("holder", 6), absl::InfiniteFuture());
  ASSERT_TRUE(holder.ok()) << holder.status();
  auto stream = loop->Submit(Req("waits", 3, /*max_tokens=*/2));
  ASSERT_TRUE(stream.ok()) << stream.status();
  ASSERT_TRUE(WaitUntil([&] { return Stats(*loop).num_waiting == 1; }));
  // The engine thread's own CPU clock: other threads of the process (an
  // OpenMP pool still spin-waiting after weight packing) do not count.
  auto engine_thread = loop->Call([](Engine&) { return pthread_self(); });
  ASSERT_TRUE(engine_thread.ok()) << engine_thread.status();
  clockid_t clock;
  ASSERT_EQ(pthread_getcpuclockid(*engine_thread, &clock), 0);
  timespec t0, t1;
  clock_gettime(clock, &t0);
  absl::SleepFor(absl::Milliseconds(400));
  clock_gettime(clock, &t1);
  const double cpu_s =
      (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
  // Spinning costs about 0.4 s of CPU here; sleeping a few milliseconds.
  EXPECT_LT(cpu_s, 0.1) << "the engine thread spins while a request waits: "
                        << cpu_s << " s of CPU in 0.4 s";
  // Releasing the blocks still admits it at once.
  loop->Abort("holder");
  ASSERT_TRUE(WaitUntil([&] {
    return Stats(*loop).num_waiting == 0 && Stats(*loop).num_running == 0;
  }));
  ASSERT_TRUE(WaitUntil([&] { return Stats(*loop).blocks_active == 0; }));
}

TEST_F(EngineLoopTest, AReservationThatCanNeverFitIsRefusedAtOnce) {
  auto loop = MakeLoop(8);
  auto holder = loop->Reserve(Req("holder", 7), absl::InfiniteFuture());
  ASSERT_TRUE(holder.ok()) << holder.status();
  auto queued = std::async(std::launch::async, [&] {
    return loop->Reserve(Req("q", 2), absl::InfiniteFuture());
  });
  ASSERT_TRUE(WaitUntil([&] { return loop->num_pending_reservations() == 1; }));
  // Even behind a waiting one, and with no time limit: waiting cannot help.
  const auto never = loop->Reserve(Req("huge", 9), absl::InfiniteFuture());
  EXPECT_EQ(never.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(CauseOf(never.status()), StatusCause::kNeverFits);
  loop->Abort("holder");
  ASSERT_TRUE(queued.get().ok());
  loop->Abort("q");
}

TEST_F(EngineLoopTest, AWaiterThatTimesOutOrIsCancelledLeavesTheQueue) {
  auto loop = MakeLoop(8);
  auto holder = loop->Reserve(Req("holder", 7), absl::InfiniteFuture());
  ASSERT_TRUE(holder.ok()) << holder.status();
  const auto late =
      loop->Reserve(Req("late", 2), absl::Now() + absl::Milliseconds(100));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(CauseOf(late.status()), StatusCause::kPoolBusy);
  std::atomic<bool> cancel{false};
  auto cancelled = std::async(std::launch::async, [&] {
    return loop->Reserve(Req("gone", 2), absl::InfiniteFuture(),
                         [&] { return cancel.load(); });
  });
  ASSERT_TRUE(WaitUntil([&] { return loop->num_pending_reservations() == 1; }));
  cancel = true;
  EXPECT_EQ(cancelled.get().status().code(), absl::StatusCode::kCancelled);
  ASSERT_TRUE(WaitUntil([&] { return loop->num_pending_reservations() == 0; }));
  loop->Abort("holder");
  // Nobody took the released blocks on behalf of a waiter that left.
  ASSERT_TRUE(WaitUntil([&] { return Stats(*loop).blocks_active == 0; }));
  EXPECT_EQ(Stats(*loop).num_reserved, 0);
}

TEST_F(EngineLoopTest, NewWorkBeyondTheQueueCapsIsRefused) {
  EngineConfig config;
  config.max_queued_calls = 1;
  config.max_pending_reservations = 1;
  auto loop = MakeLoop(8, config);
  auto holder = loop->Reserve(Req("holder", 7), absl::InfiniteFuture());
  ASSERT_TRUE(holder.ok()) << holder.status();
  auto first = std::async(std::launch::async, [&] {
    return loop->Reserve(Req("first", 2), absl::InfiniteFuture());
  });
  ASSERT_TRUE(WaitUntil([&] { return loop->num_pending_reservations() == 1; }));
  const auto second = loop->Reserve(Req("second", 2), absl::InfiniteFuture());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(second.status().message()),
              ::testing::HasSubstr("max_pending_reservations"));

  // Hold the engine thread; one Submit may queue, the next is refused.
  absl::Notification running, release;
  std::thread busy([&] {
    EXPECT_TRUE(loop->Call([&](Engine&) {
                      running.Notify();
                      release.WaitForNotification();
                    })
                    .ok());
  });
  ASSERT_TRUE(running.WaitForNotificationWithTimeout(absl::Seconds(20)));
  auto queued = std::async(std::launch::async,
                           [&] { return loop->Submit(Req("s1", 1)); });
  ASSERT_TRUE(WaitUntil([&] { return loop->num_queued_calls() == 1; }));
  const auto refused = loop->Submit(Req("s2", 1));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::HasSubstr("max_queued_calls"));
  // Clean-up is never refused, however full the queue.
  loop->Abort("holder");
  release.Notify();
  busy.join();
  EXPECT_TRUE(queued.get().ok());
  ASSERT_TRUE(first.get().ok());
  loop->Abort("first");
}

TEST(EngineQueueCapTest, AddRequestBeyondMaxWaitingRequestsIsRefused) {
  EngineConfig config;
  config.max_waiting_requests = 2;
  auto e = Engine::Create(testing::TinyWeights(), config);
  ASSERT_TRUE(e.ok()) << e.status();
  auto req = [](const std::string& id) {
    EngineRequest r;
    r.id = id;
    r.prompt = {1, 2, 3};
    r.sampling.max_tokens = 1;
    return r;
  };
  ASSERT_TRUE((*e)->AddRequest(req("a")).ok());
  ASSERT_TRUE((*e)->AddRequest(req("b")).ok());
  const absl::Status s = (*e)->AddRequest(req("c"));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()),
              ::testing::HasSubstr("max_waiting_requests"));
  // Once admitted they stop counting: room again.
  ASSERT_TRUE((*e)->Step().ok());
  EXPECT_TRUE((*e)->AddRequest(req("c")).ok());

  config.max_waiting_requests = 0;
  EXPECT_EQ(config.Validate().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve::engine
