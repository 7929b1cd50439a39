#include "kernels/cpu/core_share.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/matmul.h"

namespace pdserve::kernels {
namespace {

constexpr int kCores = 8;  // host_cores for every share in these tests

class CoreShareTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TEST_TMPDIR");
    path_ = absl::StrCat(
        tmp ? tmp : "/tmp", "/core_share_test_", getpid(), "_",
        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    unlink(path_.c_str());
  }
  void TearDown() override { unlink(path_.c_str()); }

  std::unique_ptr<CoreShare> Join(int threads) {
    auto share = CoreShare::Join(path_, threads, kCores);
    EXPECT_TRUE(share.ok()) << share.status();
    return share.ok() ? *std::move(share) : nullptr;
  }
  // The file's 32-bit word at byte `offset`, as a peer maps it.
  int32_t* RawWord(int offset) {
    const int fd = open(path_.c_str(), O_RDWR);
    void* mem = mmap(nullptr, CoreShare::kFileBytes, PROT_READ | PROT_WRITE,
                     MAP_SHARED, fd, 0);
    close(fd);
    EXPECT_NE(mem, MAP_FAILED);
    maps_.push_back(mem);
    return reinterpret_cast<int32_t*>(static_cast<char*>(mem) + offset);
  }
  // Slot i's words: pid, threads, busy (a 64-byte header, 64 bytes a slot).
  int32_t* RawSlot(int i) { return RawWord(64 + 64 * i); }
  ~CoreShareTest() override {
    for (void* m : maps_) munmap(m, CoreShare::kFileBytes);
  }

  std::string path_;
  std::vector<void*> maps_;
};

TEST_F(CoreShareTest, ABusyProcessRunsTheIdleProcessesThreadsToo) {
  auto prefill = Join(1);
  auto decode = Join(1);
  ASSERT_TRUE(prefill && decode);
  EXPECT_NE(prefill->slot(), decode->slot());
  // Neither has work: each keeps its own.
  EXPECT_EQ(prefill->Threads(), 1);
  EXPECT_EQ(decode->Threads(), 1);
  // Only decode has work: it borrows prefill's thread.
  decode->SetBusy(true);
  EXPECT_EQ(decode->Threads(), 2);
  EXPECT_EQ(prefill->Threads(), 1);
  // Prefill gets work: each is back to its own.
  prefill->SetBusy(true);
  EXPECT_EQ(decode->Threads(), 1);
  EXPECT_EQ(prefill->Threads(), 1);
  // Decode runs dry: prefill borrows.
  decode->SetBusy(false);
  EXPECT_EQ(prefill->Threads(), 2);
  EXPECT_EQ(decode->Threads(), 1);
}

TEST_F(CoreShareTest, IdleThreadsAreSplitEvenlyAmongTheBusy) {
  auto a = Join(2);
  auto idle = Join(3);
  auto b = Join(1);
  ASSERT_TRUE(a && idle && b);
  a->SetBusy(true);
  b->SetBusy(true);
  // 3 idle threads over 2 busy slots: the lower slot takes the odd one.
  EXPECT_EQ(a->Threads(), 2 + 2);
  EXPECT_EQ(b->Threads(), 1 + 1);
  // A process that leaves stops lending.
  idle.reset();
  EXPECT_EQ(a->Threads(), 2);
  EXPECT_EQ(b->Threads(), 1);
}

TEST_F(CoreShareTest, ThreadsNeverExceedTheHostsCores) {
  auto a = Join(2);
  auto b = Join(7);
  ASSERT_TRUE(a && b);
  a->SetBusy(true);
  EXPECT_EQ(a->Threads(), kCores);
}

TEST_F(CoreShareTest, NonsenseAPeerWritesIsClamped) {
  auto a = Join(1);
  ASSERT_TRUE(a);
  a->SetBusy(true);
  int32_t* peer = RawSlot(a->slot() + 1);
  peer[0] = getppid();  // a live process
  peer[1] = INT_MAX;
  peer[2] = 0;
  *RawWord(8) = INT_MAX;  // the count of slots ever claimed
  EXPECT_EQ(a->Threads(), kCores);
  peer[1] = INT_MIN;
  EXPECT_EQ(a->Threads(), 1);
  // Its own slot overwritten: still its own threads at least.
  int32_t* own = RawSlot(a->slot());
  own[2] = 0;
  EXPECT_GE(a->Threads(), 1);
}

TEST_F(CoreShareTest, TheSlotOfAProcessThatDiedIsLentThenReclaimed) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Joins with 3 threads and exits without leaving its slot.
    auto share = CoreShare::Join(path_, 3, kCores);
    if (!share.ok()) _exit(1);
    share->release();
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  auto a = Join(1);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->slot(), 0);  // the dead process's slot, claimed again
  auto b = Join(1);
  ASSERT_TRUE(b);
  EXPECT_EQ(b->slot(), 1);
  b->SetBusy(true);
  EXPECT_EQ(b->Threads(), 2);
}

TEST_F(CoreShareTest, APeerThatDiedWhileBusyLendsItsThreads) {
  auto a = Join(1);
  ASSERT_TRUE(a);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Joins with 3 threads, has work, and stays until killed.
    auto share = CoreShare::Join(path_, 3, kCores);
    if (!share.ok()) _exit(1);
    (*share)->SetBusy(true);
    const char byte = 1;
    if (write(ready[1], &byte, 1) != 1) _exit(1);
    for (;;) pause();
  }
  close(ready[1]);
  char byte = 0;
  ASSERT_EQ(read(ready[0], &byte, 1), 1);
  close(ready[0]);
  a->SetBusy(true);
  EXPECT_EQ(a->Threads(), 1);  // both busy: nothing to lend
  ASSERT_EQ(kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  // Within a liveness period (and some slack), the dead peer's 3 threads are
  // lent, though its slot still says busy.
  EXPECT_EQ(RawSlot(1)[2], 1);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::nanoseconds(CoreShare::kLivenessCheckNs) +
                        std::chrono::seconds(2);
  int threads = a->Threads();
  while (threads != 4 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    threads = a->Threads();
  }
  EXPECT_EQ(threads, 4);
  // A new process that claims the slot has its own say again.
  auto b = Join(2);
  ASSERT_TRUE(b);
  EXPECT_EQ(b->slot(), 1);
  b->SetBusy(true);
  EXPECT_EQ(a->Threads(), 1);
  b->SetBusy(false);
  EXPECT_EQ(a->Threads(), 3);
}

TEST_F(CoreShareTest, AFileOfAnotherSizeOrKindIsRefused) {
  std::ofstream(path_) << "not a core share";
  auto share = CoreShare::Join(path_, 1, kCores);
  EXPECT_EQ(share.status().code(), absl::StatusCode::kInvalidArgument);
  unlink(path_.c_str());
  std::ofstream(path_) << std::string(CoreShare::kFileBytes, 'x');
  share = CoreShare::Join(path_, 1, kCores);
  EXPECT_EQ(share.status().code(), absl::StatusCode::kInvalidArgument);
  share = CoreShare::Join("/tmp", 1, kCores);
  EXPECT_FALSE(share.ok());
  share = CoreShare::Join(path_ + "/no/such/dir", 1, kCores);
  EXPECT_FALSE(share.ok());
  share = CoreShare::Join(path_, 0, kCores);
  EXPECT_EQ(share.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CoreShareTest, AllSlotsTakenIsResourceExhausted) {
  std::vector<std::unique_ptr<CoreShare>> shares;
  for (int i = 0; i < CoreShare::kMaxSlots; ++i) shares.push_back(Join(1));
  auto one_more = CoreShare::Join(path_, 1, kCores);
  EXPECT_EQ(one_more.status().code(), absl::StatusCode::kResourceExhausted);
  shares.pop_back();  // leaving frees a slot
  EXPECT_TRUE(CoreShare::Join(path_, 1, kCores).ok());
}

TEST_F(CoreShareTest, AnInheritableShareIsJoinedThroughProcSelfFd) {
  auto fd = CoreShare::CreateInheritable();
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_EQ(fcntl(*fd, F_GETFD) & FD_CLOEXEC, 0);  // survives exec
  const std::string path = absl::StrCat("/proc/self/fd/", *fd);
  auto a = CoreShare::Join(path, 1, kCores);
  auto b = CoreShare::Join(path, 1, kCores);
  ASSERT_TRUE(a.ok() && b.ok());
  (*a)->SetBusy(true);
  EXPECT_EQ((*a)->Threads(), 2);
  close(*fd);
}

TEST_F(CoreShareTest, KernelThreadsFollowTheSource) {
  auto a = Join(1);
  auto b = Join(1);
  ASSERT_TRUE(a && b);
  const int before = KernelThreads();
  SetKernelThreadSource(a.get());
  EXPECT_EQ(KernelThreads(), 1);
  a->SetBusy(true);
  EXPECT_EQ(KernelThreads(), 2);
  b->SetBusy(true);
  EXPECT_EQ(KernelThreads(), 1);
  SetKernelThreadSource(nullptr);
  EXPECT_EQ(KernelThreads(), before);
}

}  // namespace
}  // namespace pdserve::kernels
