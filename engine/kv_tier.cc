#include "engine/kv_tier.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pdserve::engine {
namespace {

constexpr char kMagic[8] = {'P', 'D', 'K', 'V', 'B', 'L', 'K', '1'};

// On-disk header of one block file, little-endian as the host writes it
// (the files never leave the machine that wrote them).
struct FileHeader {
  char magic[8];
  uint64_t fingerprint[2];
  uint64_t hash_hi, hash_lo;
  uint64_t payload_bytes;
  uint64_t checksum;  // XXH3-64 of the payload
};
static_assert(sizeof(FileHeader) == 56);

bool IsFingerprintDirName(const std::string& name) {
  if (name.size() != 32) return false;
  for (char c : name)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

// Writes all of `bytes` to `path` (through a temporary and a rename, so a
// reader never sees a half-written file under the final name).
bool WriteFileAtomically(const std::string& path, const unsigned char* data,
                         size_t size) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return false;
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  const bool ok = ::close(fd) == 0 && done == size;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return false;
  }
  return true;
}

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
  if (dir.empty()) return absl::OkStatus();
  if (capacity_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-offload-bytes must be positive with --kv-offload-dir, got ",
        capacity_bytes));
  }
  if (max_pending_bytes <= 0) {
    return absl::InvalidArgumentError(
        "kv tier max_pending_bytes must be positive");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<KvFileTier>> KvFileTier::Create(
    const KvTierConfig& config, const ModelFingerprint& fingerprint,
    const KvCacheSpec& spec) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  if (config.dir.empty())
    return absl::InvalidArgumentError("kv tier needs a directory");
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(config.dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot create --kv-offload-dir ", config.dir, ": ", ec.message()));
  }
  // Blocks of an earlier process or another model are unknown to this
  // process's index: remove them (only directories named like a
  // fingerprint, and only the block files in them).
  for (const auto& d : fs::directory_iterator(config.dir, ec)) {
    if (!d.is_directory() || !IsFingerprintDirName(d.path().filename()))
      continue;
    for (const auto& f : fs::directory_iterator(d.path(), ec)) {
      const std::string ext = f.path().extension();
      if (ext == ".kvb" || ext == ".tmp") fs::remove(f.path(), ec);
    }
    fs::remove(d.path(), ec);  // fails harmlessly if anything else is left
  }
  const std::string subdir =
      (fs::path(config.dir) /
       absl::StrFormat("%016x%016x", fingerprint[0], fingerprint[1]))
          .string();
  fs::create_directories(subdir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create ", subdir, ": ", ec.message()));
  }
  return std::unique_ptr<KvFileTier>(
      new KvFileTier(config, fingerprint, spec, subdir));
}

KvFileTier::KvFileTier(const KvTierConfig& config,
                       const ModelFingerprint& fingerprint,
                       const KvCacheSpec& spec, std::string subdir)
    : config_(config),
      fingerprint_(fingerprint),
      spec_(spec),
      subdir_(std::move(subdir)),
      layer_data_bytes_(spec.LayerBlockBytes()),
      layer_scale_bytes_(spec.ScaleBytesPerBlock() / spec.num_layers),
      payload_bytes_((layer_data_bytes_ + layer_scale_bytes_) *
                     spec.num_layers),
      file_bytes_(static_cast<int64_t>(sizeof(FileHeader)) + payload_bytes_) {
  thread_ = std::thread([this] { Run(); });
}

KvFileTier::~KvFileTier() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  thread_.join();
}

std::string KvFileTier::PathFor(const BlockHash& hash) const {
  return absl::StrCat(subdir_, "/", hash.Hex(), ".kvb");
}

void KvFileTier::Offer(const BlockHash& hash, KvStorage& storage,
                       int64_t block) {
  {
    absl::MutexLock l(&mu_);
    if (entries_.contains(hash)) return;  // stored or being written
    if (pending_bytes_ + file_bytes_ > config_.max_pending_bytes) {
      Fail(KvTierFailure::kQueueFull);
      return;
    }
    // Make room in LRU order; blocks being written are not in the LRU.
    while (static_cast<int64_t>(entries_.size() + 1) * file_bytes_ >
               config_.capacity_bytes &&
           !lru_.empty()) {
      DropStored(lru_.front());
    }
    if (static_cast<int64_t>(entries_.size() + 1) * file_bytes_ >
        config_.capacity_bytes) {
      Fail(KvTierFailure::kFull);
      return;
    }
    entries_[hash] = Entry{State::kWriting, {}};
    pending_bytes_ += file_bytes_;
  }
  // The copy runs outside the lock: only this thread touches the pool.
  // Only the copy runs on the caller's (engine) thread: no zero-fill, and
  // the checksum is left to the tier thread.
  std::unique_ptr<unsigned char[]> file(new unsigned char[file_bytes_]);
  unsigned char* payload = file.get() + sizeof(FileHeader);
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
  FileHeader h;
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.fingerprint[0] = fingerprint_[0];
  h.fingerprint[1] = fingerprint_[1];
  h.hash_hi = hash.hi;
  h.hash_lo = hash.lo;
  h.payload_bytes = static_cast<uint64_t>(payload_bytes_);
  h.checksum = 0;  // set by the tier thread
  std::memcpy(file.get(), &h, sizeof(h));
  absl::MutexLock l(&mu_);
  auto it = entries_.find(hash);
  if (it == entries_.end() || it->second.state != State::kWriting)
    return;  // cleared meanwhile (Clear() also dropped its pending bytes)
  if (!copied) {
    entries_.erase(hash);
    pending_bytes_ -= file_bytes_;
    Fail(KvTierFailure::kWriteError);
    return;
  }
  tasks_.push_back(Task{hash, std::move(file), PathFor(hash)});
}

void KvFileTier::DropStored(const BlockHash& hash) {
  auto it = entries_.find(hash);
  if (it == entries_.end() || it->second.state != State::kStored) return;
  lru_.erase(it->second.lru_pos);
  entries_.erase(it);
  tasks_.push_back(Task{hash, {}, PathFor(hash)});
}

int64_t KvFileTier::Match(std::span<const BlockHash> hashes) {
  absl::MutexLock l(&mu_);
  int64_t n = 0;
  for (const BlockHash& h : hashes) {
    auto it = entries_.find(h);
    if (it == entries_.end() || it->second.state != State::kStored) break;
    lru_.splice(lru_.end(), lru_, it->second.lru_pos);
    ++n;
  }
  return n;
}

absl::Status KvFileTier::Load(const BlockHash& hash, KvStorage& storage,
                              int64_t block) {
  {
    absl::MutexLock l(&mu_);
    auto it = entries_.find(hash);
    if (it == entries_.end() || it->second.state != State::kStored)
      return absl::NotFoundError("block is not in the kv tier");
    // Most recently used: move to the LRU's end.
    lru_.splice(lru_.end(), lru_, it->second.lru_pos);
  }
  auto fail = [&](KvTierFailure f, absl::Status s) {
    absl::MutexLock l(&mu_);
    Fail(f);
    DropStored(hash);
    return s;
  };
  const std::string path = PathFor(hash);
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) {
    return fail(KvTierFailure::kMissing,
                absl::NotFoundError(absl::StrCat("kv tier file ", path, ": ",
                                                 std::strerror(errno))));
  }
  // Read one byte past the expected size to notice a file that is too long.
  const size_t want = static_cast<size_t>(file_bytes_) + 1;
  std::unique_ptr<unsigned char[]> file(new unsigned char[want]);
  size_t got = 0;
  while (got < want) {
    const ssize_t n = ::read(fd, file.get() + got, want - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  if (static_cast<int64_t>(got) != file_bytes_) {
    return fail(KvTierFailure::kShort, absl::DataLossError(absl::StrCat(
                                           "kv tier file ", path, " has ", got,
                                           " bytes, expected ", file_bytes_)));
  }
  FileHeader h;
  std::memcpy(&h, file.get(), sizeof(h));
  const unsigned char* payload = file.get() + sizeof(FileHeader);
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0 ||
      h.fingerprint[0] != fingerprint_[0] ||
      h.fingerprint[1] != fingerprint_[1] || h.hash_hi != hash.hi ||
      h.hash_lo != hash.lo ||
      h.payload_bytes != static_cast<uint64_t>(payload_bytes_) ||
      h.checksum != XXH3_64bits(payload, payload_bytes_)) {
    return fail(KvTierFailure::kCorrupt,
                absl::DataLossError(
                    absl::StrCat("kv tier file ", path, " is corrupt")));
  }
  for (int32_t layer = 0; layer < spec_.num_layers; ++layer) {
    const unsigned char* p =
        payload + layer * (layer_data_bytes_ + layer_scale_bytes_);
    absl::Status s = storage.CopyFromHost(
        layer, block, p, layer_scale_bytes_ ? p + layer_data_bytes_ : nullptr);
    if (!s.ok()) return fail(KvTierFailure::kCorrupt, s);
  }
  absl::MutexLock l(&mu_);
  stats_.bytes_read += file_bytes_;
  ++stats_.blocks_loaded;
  stats_.hit_tokens += spec_.block_size;
  return absl::OkStatus();
}

void KvFileTier::Clear() {
  absl::MutexLock l(&mu_);
  // Queued writes are dropped; a write in progress finds no entry when it
  // ends and removes its file.
  std::deque<Task> kept;
  for (Task& t : tasks_) {
    if (!t.file) kept.push_back(std::move(t));
  }
  tasks_ = std::move(kept);
  pending_bytes_ = 0;
  while (!lru_.empty()) DropStored(lru_.front());
  entries_.clear();
}

bool KvFileTier::WaitForWrites(absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(this, &KvFileTier::Idle),
                              timeout);
}

KvTierStats KvFileTier::Stats() const {
  absl::MutexLock l(&mu_);
  KvTierStats s = stats_;
  s.blocks_stored = static_cast<int64_t>(lru_.size());
  s.blocks_writing = static_cast<int64_t>(entries_.size() - lru_.size());
  s.bytes_used = static_cast<int64_t>(entries_.size()) * file_bytes_;
  return s;
}

void KvFileTier::Run() {
  for (;;) {
    Task task;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(this, &KvFileTier::HasTaskOrStop));
      if (stop_) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
      busy_ = true;
      if (task.file) pending_bytes_ -= file_bytes_;
    }
    if (!task.file) {
      std::remove(task.path.c_str());
      absl::MutexLock l(&mu_);
      busy_ = false;
      continue;
    }
    if (config_.before_write) config_.before_write();
    const uint64_t checksum =
        XXH3_64bits(task.file.get() + sizeof(FileHeader), payload_bytes_);
    std::memcpy(task.file.get() + offsetof(FileHeader, checksum), &checksum,
                sizeof(checksum));
    const bool ok = WriteFileAtomically(task.path, task.file.get(),
                                        static_cast<size_t>(file_bytes_));
    absl::MutexLock l(&mu_);
    busy_ = false;
    auto it = entries_.find(task.hash);
    const bool wanted =
        it != entries_.end() && it->second.state == State::kWriting;
    if (!ok) {
      Fail(KvTierFailure::kWriteError);
      if (wanted) entries_.erase(it);
      continue;
    }
    stats_.bytes_written += file_bytes_;
    if (it == entries_.end()) {        // cleared while it was written
      std::remove(task.path.c_str());  // under the lock: rare, and small
      continue;
    }
    // Stored already: a write from before a Clear() that offered the same
    // hash again finished first; the file holds the same bytes.
    if (!wanted) continue;
    it->second.state = State::kStored;
    it->second.lru_pos = lru_.insert(lru_.end(), task.hash);
  }
}

}  // namespace pdserve::engine
