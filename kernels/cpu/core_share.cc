#include "kernels/cpu/core_share.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pdserve::kernels {
namespace {

constexpr uint64_t kMagic = 0x31726873'65726f63;  // "coreshr1"

struct alignas(64) Slot {
  std::atomic<int32_t> pid;      // 0: free
  std::atomic<int32_t> threads;  // the owner's own kernel threads
  std::atomic<int32_t> busy;     // 1 while the owner has work
};
static_assert(std::atomic<int32_t>::is_always_lock_free);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

absl::Status Errno(absl::string_view what, const std::string& path) {
  return absl::InternalError(
      absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

bool Alive(int32_t pid) { return kill(pid, 0) == 0 || errno == EPERM; }

}  // namespace

struct CoreShare::Region {
  alignas(64) std::atomic<uint64_t> magic;
  std::atomic<int32_t> slots_used;  // one past the highest slot ever claimed
  Slot slots[kMaxSlots];
};

absl::StatusOr<int> CoreShare::CreateInheritable() {
  const int fd = memfd_create("pdserve-core-share", 0);
  if (fd < 0) return Errno("memfd_create", "pdserve-core-share");
  if (ftruncate(fd, kFileBytes) != 0) {
    absl::Status s = Errno("ftruncate", "pdserve-core-share");
    close(fd);
    return s;
  }
  return fd;
}

absl::StatusOr<std::unique_ptr<CoreShare>> CoreShare::Join(
    const std::string& path, int threads, int host_cores) {
  if (threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("core share ", path, ": own threads must be >= 1"));
  }
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("open", path);
  struct stat st;
  absl::Status status;
  if (fstat(fd, &st) != 0) {
    status = Errno("fstat", path);
  } else if (!S_ISREG(st.st_mode)) {
    status = absl::InvalidArgumentError(
        absl::StrCat("core share ", path, ": not a regular file"));
  } else if (st.st_size == 0 && ftruncate(fd, kFileBytes) != 0) {
    status = Errno("ftruncate", path);
  } else if (st.st_size != 0 && st.st_size != kFileBytes) {
    status = absl::InvalidArgumentError(
        absl::StrCat("core share ", path, ": ", st.st_size, " bytes, expected ",
                     kFileBytes, " (not a core share file?)"));
  }
  void* mem = MAP_FAILED;
  if (status.ok()) {
    mem = mmap(nullptr, kFileBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (mem == MAP_FAILED) status = Errno("mmap", path);
  }
  close(fd);
  if (!status.ok()) return status;
  auto* region = static_cast<Region*>(mem);
  uint64_t magic = 0;
  if (!region->magic.compare_exchange_strong(magic, kMagic) &&
      magic != kMagic) {
    munmap(mem, kFileBytes);
    return absl::InvalidArgumentError(absl::StrCat(
        "core share ", path, ": not a core share file (bad magic)"));
  }
  const int32_t self = getpid();
  for (int i = 0; i < kMaxSlots; ++i) {
    Slot& s = region->slots[i];
    int32_t owner = s.pid.load(std::memory_order_acquire);
    if (owner != 0 && (owner == self || Alive(owner))) continue;
    // A free slot, or one whose process exited without leaving it.
    if (!s.pid.compare_exchange_strong(owner, self)) continue;
    s.busy.store(0, std::memory_order_relaxed);
    s.threads.store(threads, std::memory_order_release);
    int32_t used = region->slots_used.load();
    while (used < i + 1 &&
           !region->slots_used.compare_exchange_weak(used, i + 1)) {
    }
    if (host_cores <= 0)
      host_cores = static_cast<int>(std::thread::hardware_concurrency());
    return std::unique_ptr<CoreShare>(
        new CoreShare(region, i, threads, host_cores));
  }
  munmap(mem, kFileBytes);
  return absl::ResourceExhaustedError(absl::StrCat(
      "core share ", path, ": all ", kMaxSlots, " slots are taken"));
}

CoreShare::CoreShare(Region* region, int slot, int threads, int host_cores)
    : region_(region),
      slot_(slot),
      threads_(threads),
      max_threads_(std::max(threads, host_cores)) {
  static_assert(sizeof(Region) == kFileBytes);
}

CoreShare::~CoreShare() {
  Slot& s = region_->slots[slot_];
  s.busy.store(0, std::memory_order_relaxed);
  s.threads.store(0, std::memory_order_relaxed);
  int32_t self = getpid();
  s.pid.compare_exchange_strong(self, 0);
  munmap(region_, kFileBytes);
}

void CoreShare::SetBusy(bool busy) {
  if (busy_.exchange(busy, std::memory_order_relaxed) == busy) return;
  region_->slots[slot_].busy.store(busy ? 1 : 0, std::memory_order_release);
}

int CoreShare::Threads() const {
  if (!busy_.load(std::memory_order_relaxed)) return threads_;
  // Every value read here may be anything a peer wrote: clamp each.
  const int used =
      std::clamp(region_->slots_used.load(std::memory_order_acquire), 0,
                 static_cast<int32_t>(kMaxSlots));
  const int64_t now_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::steady_clock::now().time_since_epoch())
          .count();
  const bool check_liveness =
      now_ns >= next_liveness_check_ns_.load(std::memory_order_relaxed);
  if (check_liveness) {
    next_liveness_check_ns_.store(now_ns + kLivenessCheckNs,
                                  std::memory_order_relaxed);
  }
  int idle_threads = 0, busy_slots = 0, rank = 0;
  for (int i = 0; i < used; ++i) {
    const Slot& s = region_->slots[i];
    if (i == slot_) {
      ++busy_slots;
      continue;
    }
    const int32_t pid = s.pid.load(std::memory_order_relaxed);
    if (pid == 0) continue;
    bool busy = s.busy.load(std::memory_order_acquire) != 0;
    if (busy && pid == dead_pid_[i].load(std::memory_order_relaxed)) {
      busy = false;
    } else if (busy && check_liveness && !Alive(pid)) {
      dead_pid_[i].store(pid, std::memory_order_relaxed);
      busy = false;
    }
    if (busy) {
      ++busy_slots;
      rank += i < slot_;
    } else {
      idle_threads += std::clamp(s.threads.load(std::memory_order_relaxed), 0,
                                 max_threads_);
      idle_threads = std::min(idle_threads, max_threads_);
    }
  }
  // The idle slots' threads in equal parts, the remainder to the lowest
  // busy slots.
  const int lent =
      idle_threads / busy_slots + (rank < idle_threads % busy_slots ? 1 : 0);
  return std::clamp(threads_ + lent, 1, max_threads_);
}

}  // namespace pdserve::kernels
