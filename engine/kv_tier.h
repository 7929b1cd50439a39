// A local-file tier below a CPU worker's KV pool (ARCHITECTURE.md, "Where KV
// lives"): prefix blocks the pool's LRU evicts are written to files in a
// directory, and a later prefix hit on them reads them back into free pool
// blocks instead of recomputing them.
//
// - Offload is asynchronous: Offer() copies the block's bytes (every layer,
//   scales included) into a buffer and queues it; one tier thread writes the
//   files. The engine thread never waits on file I/O for offload.
// - The tier has its own LRU and byte cap (capacity_bytes). A block queued or
//   being written is not in the LRU, so it is never evicted (or offered)
//   twice; bytes of queued writes count against the cap and against
//   max_pending_bytes (the memory the queue may hold).
// - Integrity: each file is a header (magic, model fingerprint, block hash,
//   payload length, XXH3-64 of the payload) and the payload. A missing,
//   short or corrupt file fails Load() with a counted reason; the caller
//   recomputes the block. A failed write (e.g. ENOSPC) or a full cap means no
//   offload, never a failed request.
// - Files live in `dir/<model fingerprint hex>/`; at start-up the tier
//   removes every fingerprint directory it finds there (a model change, or a
//   previous process: the index is not persisted), and Clear() empties it.
//   One directory per worker process.
//
// Thread-safety: every public method may be called from any thread; the
// engine thread calls Offer/Match/Load/Clear. Load() reads the file on the
// caller's thread (a tier hit replaces a prefill the caller would otherwise
// compute on the same thread).
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/block_manager.h"
#include "engine/kv_cache.h"
#include "engine/kv_storage.h"

namespace pdserve::engine {

struct KvTierConfig {
  std::string dir;             // empty: no tier
  int64_t capacity_bytes = 0;  // payload + header bytes on disk
  // Bytes of offered blocks waiting for the tier thread; beyond this a block
  // is not offloaded (failure "queue_full"), so a slow disk costs bounded
  // memory.
  int64_t max_pending_bytes = int64_t{64} << 20;
  // Test seam: runs on the tier thread before each file write.
  std::function<void()> before_write;

  absl::Status Validate() const;
};

enum class KvTierFailure {
  kWriteError,  // open/write/rename failed (e.g. ENOSPC): not offloaded
  kFull,        // the block did not fit in capacity_bytes: not offloaded
  kQueueFull,   // max_pending_bytes reached: not offloaded
  kMissing,     // Load: the file was gone
  kShort,       // Load: the file was shorter (or longer) than its header says
  kCorrupt,     // Load: bad magic, fingerprint, hash or checksum
};
inline constexpr int kNumKvTierFailures = 6;
// "write_error", "full", "queue_full", "missing", "short", "corrupt"
const char* KvTierFailureName(KvTierFailure f);

struct KvTierStats {
  int64_t blocks_stored = 0;   // on disk and loadable
  int64_t blocks_writing = 0;  // queued or being written
  int64_t bytes_used = 0;      // stored + writing, against capacity_bytes
  int64_t bytes_written = 0;   // total
  int64_t bytes_read = 0;      // total, loads that succeeded
  int64_t blocks_loaded = 0;   // total
  int64_t hit_tokens = 0;      // total: blocks_loaded x block_size
  std::array<int64_t, kNumKvTierFailures> failures{};  // by KvTierFailure
};

class KvFileTier {
 public:
  // Creates `config.dir` if needed and empties it of earlier fingerprint
  // directories; starts the tier thread.
  static absl::StatusOr<std::unique_ptr<KvFileTier>> Create(
      const KvTierConfig& config, const ModelFingerprint& fingerprint,
      const KvCacheSpec& spec);
  ~KvFileTier();  // drops queued writes, joins the tier thread
  KvFileTier(const KvFileTier&) = delete;
  KvFileTier& operator=(const KvFileTier&) = delete;

  // Copies pool block `block` (every layer) out of `storage` and queues it
  // for writing under `hash`. Does nothing if `hash` is already stored or
  // being written. Never waits on I/O.
  void Offer(const BlockHash& hash, KvStorage& storage, int64_t block)
      ABSL_LOCKS_EXCLUDED(mu_);
  // How many leading `hashes` the tier holds (written, loadable). They become
  // the most recently used, so that offers made while the caller makes room
  // in the pool for them do not push them out first.
  int64_t Match(std::span<const BlockHash> hashes) ABSL_LOCKS_EXCLUDED(mu_);
  // Reads the block stored under `hash` into pool block `block`. Any error
  // (counted by reason) drops the entry; the caller then recomputes. The
  // pool block may hold partial data on error.
  absl::Status Load(const BlockHash& hash, KvStorage& storage, int64_t block)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets every block; files are removed by the tier thread.
  void Clear() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until no write is queued or running (tests, benchmarks).
  bool WaitForWrites(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);

  KvTierStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);
  // The file that holds (or will hold) `hash`: for tests and tools.
  std::string PathFor(const BlockHash& hash) const;
  int64_t file_bytes() const { return file_bytes_; }

 private:
  enum class State { kWriting, kStored };
  struct Entry {
    State state = State::kWriting;
    std::list<BlockHash>::iterator lru_pos;  // valid when kStored
  };
  struct Task {
    BlockHash hash;
    // file_bytes_ bytes, header checksum not yet set; null: delete `path`.
    std::unique_ptr<unsigned char[]> file;
    std::string path;
  };

  KvFileTier(const KvTierConfig& config, const ModelFingerprint& fingerprint,
             const KvCacheSpec& spec, std::string subdir);
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  void Fail(KvTierFailure f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ++stats_.failures[static_cast<int>(f)];
  }
  // Drops a stored entry; its file is removed by the tier thread.
  void DropStored(const BlockHash& hash) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool HasTaskOrStop() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || !tasks_.empty();
  }
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return tasks_.empty() && !busy_;
  }

  const KvTierConfig config_;
  const ModelFingerprint fingerprint_;
  const KvCacheSpec spec_;
  const std::string subdir_;
  const int64_t layer_data_bytes_;   // one (layer, block) span, no scales
  const int64_t layer_scale_bytes_;  // its scales, 0 unless int8
  const int64_t payload_bytes_;      // every layer of one block
  const int64_t file_bytes_;         // header + payload

  mutable absl::Mutex mu_;
  absl::flat_hash_map<BlockHash, Entry, BlockHashHasher> entries_
      ABSL_GUARDED_BY(mu_);
  std::list<BlockHash> lru_ ABSL_GUARDED_BY(mu_);  // stored, oldest first
  std::deque<Task> tasks_ ABSL_GUARDED_BY(mu_);
  int64_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // file bytes in tasks_
  bool busy_ ABSL_GUARDED_BY(mu_) = false;          // the thread holds a task
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  KvTierStats stats_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace pdserve::engine
