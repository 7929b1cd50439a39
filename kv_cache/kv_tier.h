// A tier below a worker's KV pool (ARCHITECTURE.md, "Where KV lives"):
// prefix blocks the pool's LRU evicts are kept here, and a later prefix hit
// on them reads them back into free pool blocks instead of recomputing them.
// Where the bytes live is a KvTierStore (kv_cache/kv_tier_store.h):
//  - disk (--kv-offload-dir DIR --kv-offload-bytes N): one file per block;
//  - host memory (--kv-offload-memory N): slots in one arena, pinned when
//    the pool is on a GPU (device <-> host copies through KvStorage).
//
// - Offload never waits on I/O: Offer() copies the block's bytes (every
//   layer, scales included) into a record from the store. The disk store's
//   records are queued and one tier thread writes the files; a memory record
//   is stored at once (the copy is the whole cost).
// - The tier has its own LRU and byte cap. A block queued or being written is
//   not in the LRU, so it is never evicted (or offered) twice; bytes of
//   queued writes count against the cap and against max_pending_bytes.
// - Integrity: each record is a header (magic, model fingerprint, block
//   hash, payload length, XXH3-64 of the payload) and the payload. A missing,
//   short or corrupt record fails Load() with a counted reason; the caller
//   recomputes the block. A failed write (e.g. ENOSPC) or a full cap means no
//   offload, never a failed request.
// - Model change: records carry the fingerprint and files live in
//   `dir/<fingerprint hex>/`; at start-up the disk store removes every
//   fingerprint directory it finds (the index is not persisted). Clear()
//   empties the tier (the pool's `cleared`).
// - KV events: every change of the tier's set of loadable hashes (a write
//   finished: stored; a record dropped: removed) is queued as a KvEvent of
//   this tier's kind, for the engine thread to publish in the worker's event
//   stream (TakeEvents). A block the tier already holds when the pool evicts
//   it is reported by Offer's result instead (the pool publishes `moved`).
// - The tier is inclusive: a block loaded back stays in the tier, so a
//   second eviction of it costs no write.
//
// - Locks: the tier's mutex guards its index only. No checksum, copy or file
//   access runs under it: a Load marks the record it reads (a reader count)
//   under the lock and checks and copies it outside; a record dropped
//   meanwhile (LRU, Clear, a failed load) keeps its memory slot until its
//   last reader is done, so an offer can never reuse a slot being read.
// - Reads (disk tier): the engine thread does no file I/O. ReadAhead() queues
//   the blocks a queued request will want; the tier's reader thread reads
//   each file into a buffer of its own and checks it there (size, header,
//   checksum). The engine admits the request once its reads finished
//   (ReadableAndPin) and only copies the checked bytes into pool blocks
//   (Take). A read that fails is counted and drops the entry, as a failed
//   Load does. Buffers are bounded by max_read_ahead_bytes.
//
// Thread-safety: every public method may be called from any thread; the
// engine thread calls Offer/ReadAhead/ReadableAndPin/Take/Release/Clear/
// TakeEvents. Load() reads on the caller's thread (the peer-pull RPC thread:
// a tier hit replaces work that thread would otherwise wait for).
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kv_cache/block_manager.h"
#include "kv_cache/kv_cache.h"
#include "kv_cache/kv_storage.h"
#include "kv_cache/kv_tier_store.h"

namespace pdserve::engine {

struct KvTierConfig {
  std::string dir;             // disk tier; empty: none
  int64_t capacity_bytes = 0;  // disk tier: header + payload bytes on disk
  int64_t memory_bytes = 0;    // host-memory tier of this many bytes; 0: none
  // Bytes of offered blocks waiting for the tier thread (disk); beyond this
  // a block is not offloaded (failure "queue_full"), so a slow disk costs
  // bounded memory.
  int64_t max_pending_bytes = int64_t{64} << 20;
  // Bytes of disk-tier records read ahead for queued requests and not taken
  // yet (reads in flight included). At least one record is always allowed.
  int64_t max_read_ahead_bytes = int64_t{64} << 20;
  // Test seam: runs on the tier thread before each file write.
  std::function<void()> before_write;
  // Test seam: runs on the thread that reads a file, before it reads.
  std::function<void()> before_read;

  bool enabled() const { return !dir.empty() || memory_bytes > 0; }
  absl::Status Validate() const;
};

enum class KvTierFailure {
  kWriteError,  // open/write/rename failed (e.g. ENOSPC): not offloaded
  kFull,        // the block did not fit in the cap: not offloaded
  kQueueFull,   // max_pending_bytes reached: not offloaded
  kMissing,     // Load: the record was gone
  kShort,       // Load: the record was shorter (or longer) than its header
  kCorrupt,     // Load: bad magic, fingerprint, hash or checksum
};
inline constexpr int kNumKvTierFailures = 6;
// "write_error", "full", "queue_full", "missing", "short", "corrupt"
const char* KvTierFailureName(KvTierFailure f);

struct KvTierStats {
  KvTierKind kind = KvTierKind::kDisk;
  int64_t blocks_stored = 0;   // loadable
  int64_t blocks_writing = 0;  // queued or being written
  int64_t bytes_used = 0;      // stored + writing, against the cap
  int64_t bytes_written = 0;   // total
  int64_t bytes_read = 0;      // total, loads that succeeded
  int64_t blocks_loaded = 0;   // total
  int64_t hit_tokens = 0;      // total: blocks_loaded x block_size
  double load_seconds = 0;     // total wall time of loads that succeeded
  std::array<int64_t, kNumKvTierFailures> failures{};  // by KvTierFailure
  // Prompt tokens read back per second of loading; 0 before the first load.
  double LoadTokensPerSecond() const {
    return load_seconds > 0 ? static_cast<double>(hit_tokens) / load_seconds
                            : 0;
  }
};

class KvTier {
 public:
  // A disk tier when config.dir is set (creates it, removes earlier
  // fingerprint directories, starts the tier thread), else a memory tier of
  // config.memory_bytes from storage.AllocateStaging. `storage` is the pool
  // the blocks come from; its spec sizes the records.
  static absl::StatusOr<std::unique_ptr<KvTier>> Create(
      const KvTierConfig& config, const ModelFingerprint& fingerprint,
      KvStorage& storage);
  ~KvTier();  // drops queued writes, joins the tier thread
  KvTier(const KvTier&) = delete;
  KvTier& operator=(const KvTier&) = delete;

  KvTierKind kind() const { return store_->kind(); }
  // Copies pool block `block` (every layer) out of `storage` and keeps it
  // under `hash` (memory: at once; disk: queued for writing). Returns true
  // when the block is loadable from the tier on return: it was stored before
  // (the caller then reports the pool's eviction as a move), or the memory
  // store took it. Never waits on I/O.
  bool Offer(const BlockHash& hash, KvStorage& storage, int64_t block)
      ABSL_LOCKS_EXCLUDED(mu_);
  // How many leading `hashes` the tier holds (loadable). They become the
  // most recently used, the first of them last, so that offers made while
  // the caller makes room in the pool do not push them out first and the
  // tier drops a chain's tail before its head.
  int64_t Match(std::span<const BlockHash> hashes) ABSL_LOCKS_EXCLUDED(mu_);
  // Match, and pins the matched blocks: making room for offers skips them
  // (an offer finds the tier full instead), so the pool blocks allocated to
  // read them into cannot push them out first. Each pinned hash is unpinned
  // by its Load or by Unpin.
  int64_t MatchAndPin(std::span<const BlockHash> hashes)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Unpin(std::span<const BlockHash> hashes) ABSL_LOCKS_EXCLUDED(mu_);
  // Reads the block stored under `hash` into pool block `block`, on the
  // caller's thread (disk: the file; memory: the record in place, with no
  // tier lock held during the check and the copy). Any error (counted by
  // reason) drops the entry; the caller then recomputes. The pool block may
  // hold partial data on error.
  absl::Status Load(const BlockHash& hash, KvStorage& storage, int64_t block)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Disk tier: queues reads (on the tier's reader thread) of the leading
  // `hashes` the tier holds that are neither read nor being read, while
  // max_read_ahead_bytes allows; with `make_room`, reads nobody took (other
  // than of `hashes`) are dropped, oldest first, to make room. Memory tier:
  // nothing to do (the records are in memory). Never waits.
  void ReadAhead(std::span<const BlockHash> hashes, bool make_room)
      ABSL_LOCKS_EXCLUDED(mu_);
  // How many leading `hashes` Take can copy now, without I/O: disk, finished
  // reads; memory, stored records, pinned as by MatchAndPin. -1 while a read
  // of one of them is still in flight (nothing is pinned then; the read
  // listener fires when a read ends). Never waits.
  int64_t ReadableAndPin(std::span<const BlockHash> hashes)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Gives back what ReadableAndPin returned and Take did not use (memory:
  // unpins; disk: the reads stay for a later admission, within the cap).
  void Release(std::span<const BlockHash> hashes) ABSL_LOCKS_EXCLUDED(mu_);
  // Copies a readable block (see ReadableAndPin) into pool block `block`:
  // disk, from its finished read (then dropped); memory, Load. No file I/O.
  // NOT_FOUND when there is nothing readable under `hash`.
  absl::Status Take(const BlockHash& hash, KvStorage& storage, int64_t block)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Called (on the reader thread, no tier lock held) each time a read ends,
  // so that the engine thread can admit what waited for it. Setting it (or
  // null) waits for a call in progress.
  void SetReadListener(std::function<void()> listener)
      ABSL_LOCKS_EXCLUDED(listener_mu_);
  // Waits until no read-ahead is queued or running (tests, benchmarks).
  bool WaitForReads(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets every block (and the events not taken yet: the pool's `cleared`
  // covers them); files are removed by the tier thread.
  void Clear() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until no write is queued or running (tests, benchmarks).
  bool WaitForWrites(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);

  // The tier's changes since the last call, oldest first (seq unset).
  std::vector<KvEvent> TakeEvents() ABSL_LOCKS_EXCLUDED(mu_);
  // Every loadable hash, and (taken at the same instant) the events not
  // taken yet: publishing those, then the list, is a consistent snapshot.
  std::vector<BlockHash> Snapshot(std::vector<KvEvent>* pending)
      ABSL_LOCKS_EXCLUDED(mu_);

  KvTierStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);
  // The file that holds (or will hold) `hash` (disk tier): tests and tools.
  std::string PathFor(const BlockHash& hash) const {
    return store_->PathFor(hash);
  }
  // Test seam (memory tier): the stored record of `hash`, or empty.
  std::span<unsigned char> RecordForTest(const BlockHash& hash)
      ABSL_LOCKS_EXCLUDED(mu_);
  int64_t record_bytes() const { return record_bytes_; }

 private:
  enum class State { kWriting, kStored };
  struct Entry {
    State state = State::kWriting;
    std::list<BlockHash>::iterator lru_pos;  // valid when kStored
    unsigned char* handle = nullptr;         // the store's, when kStored
    int32_t pins = 0;                        // MatchAndPin without Load
  };
  // A disk-tier record read ahead: in flight until `done`, then `payload`
  // holds its checked payload (payload_bytes_).
  struct ReadAheadBuffer {
    uint64_t id = 0;  // tells a read from a later one of the same hash
    bool done = false;
    std::unique_ptr<unsigned char[]> payload;
    double seconds = 0;                    // the read and the check
    std::list<BlockHash>::iterator order;  // in read_order_
  };
  struct Task {
    BlockHash hash;
    // A record from the store to write, or null: remove `hash`'s record.
    unsigned char* record = nullptr;
  };

  KvTier(const KvTierConfig& config, const ModelFingerprint& fingerprint,
         const KvCacheSpec& spec, std::unique_ptr<KvTierStore> store);
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  // The reader thread (disk tier): serves read_tasks_.
  void RunReads() ABSL_LOCKS_EXCLUDED(mu_);
  // Checks a whole record of `hash` (size, header, checksum); sets `why`.
  absl::Status CheckRecord(const BlockHash& hash,
                           absl::Span<const unsigned char> rec,
                           std::optional<KvTierFailure>* why) const;
  // Copies a checked payload into pool block `block`, layer by layer.
  absl::Status CopyPayload(const unsigned char* payload, KvStorage& storage,
                           int64_t block) const;
  // Counts one block loaded into the pool.
  void CountLoad(double seconds) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees a memory slot, or defers that to its last reader.
  void RemoveRecord(const BlockHash& hash, unsigned char* handle)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropRead(const BlockHash& hash) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Keeps a payload buffer for the next read, if spare and used buffers stay
  // within max_read_ahead_bytes; else frees it.
  void RecycleBuffer(std::unique_ptr<unsigned char[]> buffer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool HasReadOrStop() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || !read_tasks_.empty();
  }
  bool ReadsIdle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return read_tasks_.empty() && !reading_;
  }
  int64_t MatchLocked(std::span<const BlockHash> hashes, bool pin)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Fail(KvTierFailure f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ++stats_.failures[static_cast<int>(f)];
  }
  // Queues a change of the loadable set for TakeEvents.
  void Note(KvEvent::Type type, const BlockHash& hash)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops a stored entry; a file is removed by the tier thread.
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
  const std::unique_ptr<KvTierStore> store_;
  const bool async_;                 // store_->writes_async()
  const int64_t layer_data_bytes_;   // one (layer, block) span, no scales
  const int64_t layer_scale_bytes_;  // its scales, 0 unless int8
  const int64_t payload_bytes_;      // every layer of one block
  const int64_t record_bytes_;       // header + payload
  const int64_t capacity_bytes_;     // the cap the LRU keeps to

  mutable absl::Mutex mu_;
  absl::flat_hash_map<BlockHash, Entry, BlockHashHasher> entries_
      ABSL_GUARDED_BY(mu_);
  std::list<BlockHash> lru_ ABSL_GUARDED_BY(mu_);  // stored, oldest first
  std::deque<Task> tasks_ ABSL_GUARDED_BY(mu_);
  int64_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // record bytes in tasks_
  bool busy_ ABSL_GUARDED_BY(mu_) = false;          // the thread holds a task
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  KvTierStats stats_ ABSL_GUARDED_BY(mu_);
  std::vector<KvEvent> events_ ABSL_GUARDED_BY(mu_);
  // Memory records being read outside the lock (Load), by handle: how many
  // readers. A record dropped while it has readers is freed by the last.
  absl::flat_hash_map<unsigned char*, int32_t> readers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<unsigned char*, BlockHash> retired_ ABSL_GUARDED_BY(mu_);
  // Disk read-ahead: buffers by hash (in flight or done), their order (oldest
  // first, for making room), the queue of the reader thread, and the bytes
  // they count against max_read_ahead_bytes.
  absl::flat_hash_map<BlockHash, ReadAheadBuffer, BlockHashHasher> reads_
      ABSL_GUARDED_BY(mu_);
  std::list<BlockHash> read_order_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<BlockHash, uint64_t>> read_tasks_ ABSL_GUARDED_BY(mu_);
  int64_t read_ahead_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_read_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool reading_ ABSL_GUARDED_BY(mu_) = false;  // the reader holds a task
  std::vector<std::unique_ptr<unsigned char[]>> spare_buffers_
      ABSL_GUARDED_BY(mu_);
  absl::Mutex listener_mu_;  // never held with mu_
  std::function<void()> listener_ ABSL_GUARDED_BY(listener_mu_);
  std::thread thread_;       // disk tier only: writes and removals
  std::thread read_thread_;  // disk tier only: read-ahead
};

}  // namespace pdserve::engine
