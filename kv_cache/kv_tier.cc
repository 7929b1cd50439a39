#include "kv_cache/kv_tier.h"

#include <xxhash.h>

#include <cstddef>
#include <cstring>
#include <optional>
#include <tuple>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace pdserve::engine {
namespace {

constexpr char kMagic[8] = {'P', 'D', 'K', 'V', 'B', 'L', 'K', '1'};

// Header of one block record, little-endian as the host writes it (records
// never leave the machine that wrote them).
struct RecordHeader {
  char magic[8];
  uint64_t fingerprint[2];
  uint64_t hash_hi, hash_lo;
  uint64_t payload_bytes;
  uint64_t checksum;  // XXH3-64 of the payload
};
static_assert(sizeof(RecordHeader) == 56);

}  // namespace

const char* KvTierFailureName(KvTierFailure f) {
  switch (f) {
    case KvTierFailure::kWriteError:
      return "write_error";
    case KvTierFailure::kFull:
      return "full";
    case KvTierFailure::kQueueFull:
      return "queue_full";
    case KvTierFailure::kMissing:
      return "missing";
    case KvTierFailure::kShort:
      return "short";
    case KvTierFailure::kCorrupt:
      return "corrupt";
  }
  return "";
}

absl::Status KvTierConfig::Validate() const {
  if (!dir.empty() && memory_bytes > 0) {
    return absl::InvalidArgumentError(
        "--kv-offload-dir and --kv-offload-memory: one KV tier per worker");
  }
  if (memory_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-offload-memory must not be negative, got ", memory_bytes));
  }
  if (!dir.empty() && capacity_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-offload-bytes must be positive with --kv-offload-dir, got ",
        capacity_bytes));
  }
  if (max_pending_bytes <= 0) {
    return absl::InvalidArgumentError(
        "kv tier max_pending_bytes must be positive");
  }
  if (max_read_ahead_bytes <= 0) {
    return absl::InvalidArgumentError(
        "kv tier max_read_ahead_bytes must be positive");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<KvTier>> KvTier::Create(
    const KvTierConfig& config, const ModelFingerprint& fingerprint,
    KvStorage& storage) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  if (!config.enabled())
    return absl::InvalidArgumentError("kv tier needs a directory or memory");
  const KvCacheSpec& spec = storage.spec();
  const int64_t payload =
      (spec.LayerBlockBytes() + spec.ScaleBytesPerBlock() / spec.num_layers) *
      spec.num_layers;
  const int64_t record = static_cast<int64_t>(sizeof(RecordHeader)) + payload;
  std::unique_ptr<KvTierStore> store;
  if (!config.dir.empty()) {
    auto s = CreateKvFileStore(config.dir, fingerprint, record);
    if (!s.ok()) return s.status();
    store = std::move(*s);
  } else {
    auto s = CreateKvMemoryStore(storage, config.memory_bytes, record);
    if (!s.ok()) return s.status();
    store = std::move(*s);
  }
  return std::unique_ptr<KvTier>(
      new KvTier(config, fingerprint, spec, std::move(store)));
}

KvTier::KvTier(const KvTierConfig& config, const ModelFingerprint& fingerprint,
               const KvCacheSpec& spec, std::unique_ptr<KvTierStore> store)
    : config_(config),
      fingerprint_(fingerprint),
      spec_(spec),
      store_(std::move(store)),
      async_(store_->writes_async()),
      layer_data_bytes_(spec.LayerBlockBytes()),
      layer_scale_bytes_(spec.ScaleBytesPerBlock() / spec.num_layers),
      payload_bytes_((layer_data_bytes_ + layer_scale_bytes_) *
                     spec.num_layers),
      record_bytes_(static_cast<int64_t>(sizeof(RecordHeader)) +
                    payload_bytes_),
      capacity_bytes_(async_
                          ? config.capacity_bytes
                          : std::min(config.memory_bytes,
                                     store_->max_records() * record_bytes_)) {
  stats_.kind = store_->kind();
  if (async_) {
    thread_ = std::thread([this] { Run(); });
    read_thread_ = std::thread([this] { RunReads(); });
  }
}

KvTier::~KvTier() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
    for (Task& t : tasks_) {
      if (t.record) store_->Discard(t.record);
    }
    tasks_.clear();
  }
  if (thread_.joinable()) thread_.join();
  if (read_thread_.joinable()) read_thread_.join();
}

void KvTier::Note(KvEvent::Type type, const BlockHash& hash) {
  if (events_.empty() || events_.back().type != type) {
    KvEvent e;
    e.type = type;
    e.tier = store_->kind();
    events_.push_back(std::move(e));
  }
  events_.back().hashes.push_back(hash);
}

bool KvTier::Offer(const BlockHash& hash, KvStorage& storage, int64_t block) {
  unsigned char* record = nullptr;
  {
    absl::MutexLock l(&mu_);
    if (auto it = entries_.find(hash); it != entries_.end())
      return it->second.state == State::kStored;  // stored or being written
    if (async_ && pending_bytes_ + record_bytes_ > config_.max_pending_bytes) {
      Fail(KvTierFailure::kQueueFull);
      return false;
    }
    // Make room in LRU order; blocks being written are not in the LRU,
    // pinned ones are skipped.
    auto victim = lru_.begin();
    while (static_cast<int64_t>(entries_.size() + 1) * record_bytes_ >
           capacity_bytes_) {
      while (victim != lru_.end() && entries_.find(*victim)->second.pins > 0)
        ++victim;
      if (victim == lru_.end()) break;
      const BlockHash drop = *victim++;
      DropStored(drop);
    }
    if (static_cast<int64_t>(entries_.size() + 1) * record_bytes_ >
            capacity_bytes_ ||
        (record = store_->Allocate()) == nullptr) {
      Fail(KvTierFailure::kFull);
      return false;
    }
    entries_[hash] = Entry{State::kWriting, {}, nullptr};
    if (async_) pending_bytes_ += record_bytes_;
  }
  // The copy runs outside the lock: only this thread touches the pool and
  // the record. Only the copy runs on the caller's (engine) thread for the
  // disk tier: no zero-fill, and the checksum is left to the tier thread.
  unsigned char* payload = record + sizeof(RecordHeader);
  bool copied = true;
  for (int32_t layer = 0; layer < spec_.num_layers && copied; ++layer) {
    unsigned char* p =
        payload + layer * (layer_data_bytes_ + layer_scale_bytes_);
    copied =
        storage
            .CopyToHost(layer, block, p,
                        layer_scale_bytes_ ? p + layer_data_bytes_ : nullptr)
            .ok();
  }
  RecordHeader h;
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.fingerprint[0] = fingerprint_[0];
  h.fingerprint[1] = fingerprint_[1];
  h.hash_hi = hash.hi;
  h.hash_lo = hash.lo;
  h.payload_bytes = static_cast<uint64_t>(payload_bytes_);
  // The disk tier's thread sets it; a memory record is final now.
  h.checksum = async_ ? 0 : XXH3_64bits(payload, payload_bytes_);
  std::memcpy(record, &h, sizeof(h));
  absl::MutexLock l(&mu_);
  auto it = entries_.find(hash);
  if (it == entries_.end() || it->second.state != State::kWriting) {
    store_->Discard(record);
    return false;  // cleared meanwhile (Clear() also dropped its bytes)
  }
  if (!copied) {
    entries_.erase(it);
    if (async_) pending_bytes_ -= record_bytes_;
    store_->Discard(record);
    Fail(KvTierFailure::kWriteError);
    return false;
  }
  if (async_) {
    tasks_.push_back(Task{hash, record});
    return false;
  }
  // Memory: stored now. No `stored` event: the caller reports the pool's
  // eviction of this block as a move into this tier.
  it->second.state = State::kStored;
  it->second.handle = store_->Write(hash, record).handle;
  it->second.lru_pos = lru_.insert(lru_.end(), hash);
  stats_.bytes_written += record_bytes_;
  return true;
}

void KvTier::DropStored(const BlockHash& hash) {
  auto it = entries_.find(hash);
  if (it == entries_.end() || it->second.state != State::kStored) return;
  lru_.erase(it->second.lru_pos);
  unsigned char* handle = it->second.handle;
  entries_.erase(it);
  Note(KvEvent::Type::kRemoved, hash);
  if (async_) {
    tasks_.push_back(Task{hash, nullptr});
  } else {
    RemoveRecord(hash, handle);
  }
}

void KvTier::RemoveRecord(const BlockHash& hash, unsigned char* handle) {
  if (readers_.contains(handle)) {
    retired_[handle] = hash;  // its last reader frees it
  } else {
    store_->Remove(hash, handle);
  }
}

int64_t KvTier::Match(std::span<const BlockHash> hashes) {
  absl::MutexLock l(&mu_);
  return MatchLocked(hashes, false);
}

int64_t KvTier::MatchAndPin(std::span<const BlockHash> hashes) {
  absl::MutexLock l(&mu_);
  return MatchLocked(hashes, true);
}

void KvTier::Unpin(std::span<const BlockHash> hashes) {
  absl::MutexLock l(&mu_);
  for (const BlockHash& h : hashes) {
    auto it = entries_.find(h);
    if (it != entries_.end() && it->second.pins > 0) --it->second.pins;
  }
}

int64_t KvTier::MatchLocked(std::span<const BlockHash> hashes, bool pin) {
  size_t n = 0;
  while (n < hashes.size()) {
    auto it = entries_.find(hashes[n]);
    if (it == entries_.end() || it->second.state != State::kStored) break;
    ++n;
  }
  // Most recent last: the chain's head ends up the last to be dropped.
  for (size_t i = n; i-- > 0;) {
    Entry& e = entries_.find(hashes[i])->second;
    lru_.splice(lru_.end(), lru_, e.lru_pos);
    if (pin) ++e.pins;
  }
  return static_cast<int64_t>(n);
}

absl::Status KvTier::CheckRecord(const BlockHash& hash,
                                 absl::Span<const unsigned char> rec,
                                 std::optional<KvTierFailure>* why) const {
  if (static_cast<int64_t>(rec.size()) != record_bytes_) {
    *why = KvTierFailure::kShort;
    return absl::DataLossError(
        absl::StrCat("kv tier record of ", hash.Hex(), " has ", rec.size(),
                     " bytes, expected ", record_bytes_));
  }
  RecordHeader h;
  std::memcpy(&h, rec.data(), sizeof(h));
  const unsigned char* payload = rec.data() + sizeof(RecordHeader);
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0 ||
      h.fingerprint[0] != fingerprint_[0] ||
      h.fingerprint[1] != fingerprint_[1] || h.hash_hi != hash.hi ||
      h.hash_lo != hash.lo ||
      h.payload_bytes != static_cast<uint64_t>(payload_bytes_) ||
      h.checksum != XXH3_64bits(payload, payload_bytes_)) {
    *why = KvTierFailure::kCorrupt;
    return absl::DataLossError(
        absl::StrCat("kv tier record of ", hash.Hex(), " is corrupt"));
  }
  return absl::OkStatus();
}

absl::Status KvTier::CopyPayload(const unsigned char* payload,
                                 KvStorage& storage, int64_t block) const {
  for (int32_t layer = 0; layer < spec_.num_layers; ++layer) {
    const unsigned char* p =
        payload + layer * (layer_data_bytes_ + layer_scale_bytes_);
    absl::Status s = storage.CopyFromHost(
        layer, block, p, layer_scale_bytes_ ? p + layer_data_bytes_ : nullptr);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

void KvTier::CountLoad(double seconds) {
  stats_.bytes_read += record_bytes_;
  ++stats_.blocks_loaded;
  stats_.hit_tokens += spec_.block_size;
  stats_.load_seconds += seconds;
}

absl::Status KvTier::Load(const BlockHash& hash, KvStorage& storage,
                          int64_t block) {
  unsigned char* handle = nullptr;
  {
    absl::MutexLock l(&mu_);
    auto it = entries_.find(hash);
    if (it == entries_.end() || it->second.state != State::kStored)
      return absl::NotFoundError("block is not in the kv tier");
    handle = it->second.handle;
    if (it->second.pins > 0) --it->second.pins;
    // A memory record is read in place with the lock released: as long as
    // it has a reader, dropping it does not free (and so reuse) its slot.
    if (!async_) ++readers_[handle];
  }
  std::optional<KvTierFailure> why;
  auto check_and_copy =
      [&](absl::Span<const unsigned char> rec) -> absl::Status {
    if (absl::Status s = CheckRecord(hash, rec, &why); !s.ok()) return s;
    absl::Status s =
        CopyPayload(rec.data() + sizeof(RecordHeader), storage, block);
    if (!s.ok()) why = KvTierFailure::kCorrupt;
    return s;
  };
  const absl::Time start = absl::Now();
  if (async_ && config_.before_read) config_.before_read();
  const absl::Status s = store_->Read(hash, handle, check_and_copy);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  absl::MutexLock l(&mu_);
  if (!async_) {
    auto r = readers_.find(handle);
    if (--r->second == 0) {
      readers_.erase(r);
      if (auto d = retired_.find(handle); d != retired_.end()) {
        store_->Remove(d->second, handle);
        retired_.erase(d);
      }
    }
  }
  if (!s.ok()) {
    Fail(why.value_or(KvTierFailure::kMissing));
    // Only the entry this load read: the hash may have been dropped and
    // stored again (in another slot) meanwhile.
    auto it = entries_.find(hash);
    if (it != entries_.end() && it->second.state == State::kStored &&
        it->second.handle == handle)
      DropStored(hash);
    return s;
  }
  CountLoad(seconds);
  return absl::OkStatus();
}

void KvTier::DropRead(const BlockHash& hash) {
  auto r = reads_.find(hash);
  if (r == reads_.end()) return;
  read_order_.erase(r->second.order);
  read_ahead_bytes_ -= payload_bytes_;
  if (r->second.payload) RecycleBuffer(std::move(r->second.payload));
  reads_.erase(r);
}

void KvTier::RecycleBuffer(std::unique_ptr<unsigned char[]> buffer) {
  // Spare and used buffers together stay within the cap.
  if (read_ahead_bytes_ +
          static_cast<int64_t>(spare_buffers_.size() + 1) * payload_bytes_ <=
      config_.max_read_ahead_bytes)
    spare_buffers_.push_back(std::move(buffer));
}

void KvTier::ReadAhead(std::span<const BlockHash> hashes, bool make_room) {
  if (!async_) return;
  absl::MutexLock l(&mu_);
  std::optional<absl::flat_hash_set<BlockHash, BlockHashHasher>> wanted;
  for (const BlockHash& h : hashes) {
    if (reads_.contains(h)) continue;  // read, or being read
    auto it = entries_.find(h);
    if (it == entries_.end() || it->second.state != State::kStored) break;
    while (read_ahead_bytes_ > 0 &&
           read_ahead_bytes_ + payload_bytes_ > config_.max_read_ahead_bytes) {
      if (!make_room) return;
      if (!wanted) wanted.emplace(hashes.begin(), hashes.end());
      auto victim = read_order_.begin();
      while (victim != read_order_.end() &&
             (!reads_.find(*victim)->second.done || wanted->contains(*victim)))
        ++victim;
      if (victim == read_order_.end()) return;  // the rest is in flight
      DropRead(*victim);
    }
    ReadAheadBuffer& r = reads_[h];
    r.id = next_read_id_++;
    r.order = read_order_.insert(read_order_.end(), h);
    read_ahead_bytes_ += payload_bytes_;
    read_tasks_.emplace_back(h, r.id);
  }
}

int64_t KvTier::ReadableAndPin(std::span<const BlockHash> hashes) {
  absl::MutexLock l(&mu_);
  if (!async_) return MatchLocked(hashes, true);
  int64_t n = 0;
  for (const BlockHash& h : hashes) {
    auto r = reads_.find(h);
    if (r == reads_.end()) {
      // Stored but not read yet: reads in flight hold the room it needs, so
      // waiting for them beats recomputing it.
      auto it = entries_.find(h);
      if (it != entries_.end() && it->second.state == State::kStored &&
          !ReadsIdle())
        return -1;
      break;
    }
    if (!r->second.done) return -1;
    ++n;
  }
  return n;
}

void KvTier::Release(std::span<const BlockHash> hashes) {
  if (!async_) Unpin(hashes);
}

absl::Status KvTier::Take(const BlockHash& hash, KvStorage& storage,
                          int64_t block) {
  if (!async_) return Load(hash, storage, block);
  std::unique_ptr<unsigned char[]> payload;
  double seconds = 0;
  {
    absl::MutexLock l(&mu_);
    auto r = reads_.find(hash);
    if (r == reads_.end() || !r->second.done)
      return absl::NotFoundError("block was not read ahead from the kv tier");
    payload = std::move(r->second.payload);
    seconds = r->second.seconds;
    DropRead(hash);
  }
  const absl::Time start = absl::Now();
  const absl::Status s = CopyPayload(payload.get(), storage, block);
  seconds += absl::ToDoubleSeconds(absl::Now() - start);
  absl::MutexLock l(&mu_);
  RecycleBuffer(std::move(payload));
  if (!s.ok()) {
    Fail(KvTierFailure::kCorrupt);
    return s;
  }
  CountLoad(seconds);
  return absl::OkStatus();
}

void KvTier::SetReadListener(std::function<void()> listener) {
  absl::MutexLock l(&listener_mu_);
  listener_ = std::move(listener);
}

bool KvTier::WaitForReads(absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(this, &KvTier::ReadsIdle),
                              timeout);
}

void KvTier::RunReads() {
  for (;;) {
    BlockHash hash;
    uint64_t id = 0;
    std::unique_ptr<unsigned char[]> payload;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(this, &KvTier::HasReadOrStop));
      if (stop_) return;
      std::tie(hash, id) = read_tasks_.front();
      read_tasks_.pop_front();
      reading_ = true;
      // Buffers are reused: a fresh large allocation per block would be
      // mapped and faulted in each time.
      if (!spare_buffers_.empty()) {
        payload = std::move(spare_buffers_.back());
        spare_buffers_.pop_back();
      }
    }
    if (config_.before_read) config_.before_read();
    // Not zero-filled: every byte is copied in before it is used.
    if (!payload)
      payload.reset(new unsigned char[static_cast<size_t>(payload_bytes_)]);
    std::optional<KvTierFailure> why;
    const absl::Time start = absl::Now();
    const absl::Status s =
        store_->Read(hash, nullptr, [&](absl::Span<const unsigned char> rec) {
          absl::Status c = CheckRecord(hash, rec, &why);
          if (c.ok())
            std::memcpy(payload.get(), rec.data() + sizeof(RecordHeader),
                        static_cast<size_t>(payload_bytes_));
          return c;
        });
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    {
      absl::MutexLock l(&mu_);
      reading_ = false;
      auto r = reads_.find(hash);
      if (r != reads_.end() && r->second.id == id) {  // not cleared meanwhile
        if (s.ok()) {
          r->second.done = true;
          r->second.payload = std::move(payload);
          r->second.seconds = seconds;
        } else {
          DropRead(hash);
          // As a failed Load: counted, and the entry dropped. An entry gone
          // already (dropped while its file was read) is no failure.
          auto it = entries_.find(hash);
          if (it != entries_.end() && it->second.state == State::kStored) {
            Fail(why.value_or(KvTierFailure::kMissing));
            DropStored(hash);
          }
        }
      }
      if (payload) RecycleBuffer(std::move(payload));  // failed, or unwanted
    }
    absl::MutexLock l(&listener_mu_);
    if (listener_) listener_();
  }
}

void KvTier::Clear() {
  absl::MutexLock l(&mu_);
  // Queued writes are dropped; a write in progress finds no entry when it
  // ends and removes its file.
  std::deque<Task> kept;
  for (Task& t : tasks_) {
    if (t.record) {
      store_->Discard(t.record);
    } else {
      kept.push_back(t);
    }
  }
  tasks_ = std::move(kept);
  pending_bytes_ = 0;
  while (!lru_.empty()) DropStored(lru_.front());
  entries_.clear();
  // Reads ahead are dropped; one in flight finds no buffer when it ends.
  reads_.clear();
  read_order_.clear();
  read_tasks_.clear();
  read_ahead_bytes_ = 0;
  events_.clear();  // the pool's `cleared` covers every tier
}

bool KvTier::WaitForWrites(absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(this, &KvTier::Idle), timeout);
}

std::vector<KvEvent> KvTier::TakeEvents() {
  absl::MutexLock l(&mu_);
  std::vector<KvEvent> out;
  out.swap(events_);
  return out;
}

std::vector<BlockHash> KvTier::Snapshot(std::vector<KvEvent>* pending) {
  absl::MutexLock l(&mu_);
  pending->clear();
  pending->swap(events_);
  return std::vector<BlockHash>(lru_.begin(), lru_.end());
}

std::span<unsigned char> KvTier::RecordForTest(const BlockHash& hash) {
  absl::MutexLock l(&mu_);
  auto it = entries_.find(hash);
  if (it == entries_.end() || it->second.handle == nullptr) return {};
  return {it->second.handle, static_cast<size_t>(record_bytes_)};
}

KvTierStats KvTier::Stats() const {
  absl::MutexLock l(&mu_);
  KvTierStats s = stats_;
  s.blocks_stored = static_cast<int64_t>(lru_.size());
  s.blocks_writing = static_cast<int64_t>(entries_.size() - lru_.size());
  s.bytes_used = static_cast<int64_t>(entries_.size()) * record_bytes_;
  return s;
}

void KvTier::Run() {
  for (;;) {
    Task task;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(this, &KvTier::HasTaskOrStop));
      if (stop_) return;
      task = tasks_.front();
      tasks_.pop_front();
      busy_ = true;
      if (task.record) pending_bytes_ -= record_bytes_;
    }
    if (!task.record) {
      store_->Remove(task.hash, nullptr);
      absl::MutexLock l(&mu_);
      busy_ = false;
      continue;
    }
    if (config_.before_write) config_.before_write();
    const uint64_t checksum =
        XXH3_64bits(task.record + sizeof(RecordHeader), payload_bytes_);
    std::memcpy(task.record + offsetof(RecordHeader, checksum), &checksum,
                sizeof(checksum));
    const KvTierStore::Stored stored = store_->Write(task.hash, task.record);
    {
      absl::MutexLock l(&mu_);
      auto it = entries_.find(task.hash);
      const bool wanted =
          it != entries_.end() && it->second.state == State::kWriting;
      if (!stored.ok) {
        busy_ = false;
        Fail(KvTierFailure::kWriteError);
        if (wanted) entries_.erase(it);
        continue;
      }
      stats_.bytes_written += record_bytes_;
      if (it != entries_.end()) {
        busy_ = false;
        // Stored already: a write from before a Clear() that offered the
        // same hash again finished first; the file holds the same bytes.
        if (!wanted) continue;
        it->second.state = State::kStored;
        it->second.handle = stored.handle;
        it->second.lru_pos = lru_.insert(lru_.end(), task.hash);
        Note(KvEvent::Type::kStored, task.hash);
        continue;
      }
    }
    // Cleared while it was written: the file goes, outside the lock (still
    // busy, so WaitForWrites waits for it). This thread alone writes and
    // removes, in queue order, so a later write of the hash comes after.
    store_->Remove(task.hash, stored.handle);
    absl::MutexLock l(&mu_);
    busy_ = false;
  }
}

}  // namespace pdserve::engine
