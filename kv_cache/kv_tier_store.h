// Where a KV tier (kv_cache/kv_tier.h) keeps its block records: one interface,
// two backends.
//  - Files in a directory (--kv-offload-dir): one file per block, written by
//    the tier's thread through a temporary and a rename.
//  - A host-memory arena (--kv-offload-memory): fixed slots in one
//    allocation from KvStorage::AllocateStaging, so page-locked (pinned) when
//    the pool is on a GPU and the device copies into and out of a slot run
//    at full speed; plain host memory on CPU.
// A record is one block as the tier lays it out: a header and every layer's
// bytes, record_bytes long. The tier decides what is stored, keeps the LRU
// and checks every record it reads; a store only keeps bytes.
//
// Thread-safety: Allocate/Discard/Remove are called by the tier under its own
// lock or on its writer thread; Write by the writer thread (file store) or
// under the tier's lock (memory store); Read with no tier lock held, from any
// thread (the tier's reader thread, a Load's caller), concurrently. Each
// store is safe for that use; no store holds a lock while `use` runs.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kv_cache/block_manager.h"
#include "kv_cache/kv_storage.h"

namespace pdserve::engine {

class KvTierStore {
 public:
  virtual ~KvTierStore() = default;
  virtual KvTierKind kind() const = 0;
  // True when Write does I/O: the tier then calls it on its own thread, and
  // removes records there too. False: Write and Remove are immediate.
  virtual bool writes_async() const = 0;
  // Records the store can hold at most (the tier's byte cap also applies).
  virtual int64_t max_records() const = 0;
  // A buffer of record_bytes to copy one block into; null when there is no
  // room (memory store: every slot taken). Owned by the store; give it back
  // through Write or Discard.
  virtual unsigned char* Allocate() = 0;
  virtual void Discard(unsigned char* record) = 0;
  // Keeps the finished record under `hash` and returns the handle to read
  // and remove it by: the record itself (memory store), or null (file store:
  // the bytes are in the file and the buffer is freed). A failed write
  // (e.g. ENOSPC) frees the buffer and returns WriteError.
  struct Stored {
    bool ok = false;
    unsigned char* handle = nullptr;
  };
  virtual Stored Write(const BlockHash& hash, unsigned char* record) = 0;
  // Calls `use` with the stored bytes of `hash` (`handle` from Write). The
  // file store reads up to one byte more than record_bytes, so that a long
  // file shows as the wrong size. NOT_FOUND when there is nothing.
  virtual absl::Status Read(
      const BlockHash& hash, const unsigned char* handle,
      absl::FunctionRef<absl::Status(absl::Span<const unsigned char>)> use) = 0;
  virtual void Remove(const BlockHash& hash, unsigned char* handle) = 0;

  // For tests and tools: the file of `hash` (file store), else "".
  virtual std::string PathFor(const BlockHash&) const { return ""; }
};

// Files under `dir/<fingerprint hex>/`. Creates the directory and removes
// every earlier fingerprint directory's block files (a previous process or
// another model: unknown to this process's index).
absl::StatusOr<std::unique_ptr<KvTierStore>> CreateKvFileStore(
    const std::string& dir, const ModelFingerprint& fingerprint,
    int64_t record_bytes);

// `capacity_bytes / record_bytes` slots in one buffer from
// `storage.AllocateStaging` (pinned on a device). FAILED_PRECONDITION when
// not even one record fits.
absl::StatusOr<std::unique_ptr<KvTierStore>> CreateKvMemoryStore(
    KvStorage& storage, int64_t capacity_bytes, int64_t record_bytes);

}  // namespace pdserve::engine
