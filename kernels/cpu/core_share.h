// Cores shared by the worker processes of one host (the workers of one
// `pdserve up`), through a one-page file in shared memory.
//
// Each process holds a slot with its own kernel threads and whether its
// engine has work. A process with work runs its own threads plus an equal
// part of the threads of the processes that have none; the kernels ask
// before every parallel kernel (SetKernelThreadSource), so a lender that
// gets work back has its cores back at its neighbour's next kernel, well
// within a millisecond. On a 2-core host with one prefill and one decode
// worker of one thread each, the decode worker thus reads memory with both
// cores while no prompt waits, and the prefill worker computes on both while
// no sequence decodes.
//
// The file is trusted no further than its size: a peer that writes nonsense
// into it can change how many threads this process runs (clamped to the
// host's cores), nothing else.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/cpu/matmul.h"

namespace pdserve::kernels {

class CoreShare final : public KernelThreadSource {
 public:
  // Slots in one file: processes beyond them are refused at Join.
  static constexpr int kMaxSlots = 63;
  // The file's size in bytes.
  static constexpr int64_t kFileBytes = 4096;

  // A new anonymous share (memfd) for child processes: the returned file
  // descriptor is inherited across exec, and a child joins it through
  // /proc/self/fd/FD. The caller closes it when its children are gone.
  static absl::StatusOr<int> CreateInheritable();

  // Maps the share at `path` and claims a free slot (or one whose process
  // has exited) for this process with `threads` of its own. A missing file
  // is created (mode 0600); an existing one must be kFileBytes long.
  // host_cores bounds Threads() (0: the host's hardware threads).
  static absl::StatusOr<std::unique_ptr<CoreShare>> Join(
      const std::string& path, int threads, int host_cores = 0);

  ~CoreShare() override;
  CoreShare(const CoreShare&) = delete;
  CoreShare& operator=(const CoreShare&) = delete;

  // This process has work (true) or waits for some (false). Cheap when
  // nothing changes; safe from any thread.
  void SetBusy(bool busy);

  // Own threads, plus, while busy, this slot's part of the idle slots'
  // threads: what the next parallel kernel may use (at least 1, at most the
  // host's cores or own threads, whichever is more). A slot whose process
  // died counts as idle: a busy slot's process is checked at most every
  // kLivenessCheckNs, so a peer that crashed while busy lends its cores
  // within that time instead of holding them until the next Join.
  int Threads() const override;

  static constexpr int64_t kLivenessCheckNs = 100'000'000;

  int slot() const { return slot_; }
  int own_threads() const { return threads_; }

 private:
  struct Region;
  CoreShare(Region* region, int slot, int threads, int host_cores);

  Region* region_;
  int slot_;
  int threads_;
  int max_threads_;
  std::atomic<bool> busy_{false};
  // Per slot, the pid of a busy owner found dead (0: none), and when
  // Threads() next checks the busy owners.
  mutable std::array<std::atomic<int32_t>, kMaxSlots> dead_pid_{};
  mutable std::atomic<int64_t> next_liveness_check_ns_{0};
};

}  // namespace pdserve::kernels
