#include "kv_cache/kv_tier_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pdserve::engine {
namespace {

bool IsFingerprintDirName(const std::string& name) {
  if (name.size() != 32) return false;
  for (char c : name)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

// Writes all of `bytes` to `path` (through a temporary and a rename, so a
// reader never sees a half-written file under the final name). No fsync:
// the files do not outlive the process that wrote them (start-up removes
// them), so durability across a crash buys nothing.
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

class KvFileStore final : public KvTierStore {
 public:
  KvFileStore(std::string subdir, int64_t record_bytes)
      : subdir_(std::move(subdir)), record_bytes_(record_bytes) {}

  KvTierKind kind() const override { return KvTierKind::kDisk; }
  bool writes_async() const override { return true; }
  int64_t max_records() const override { return INT64_MAX; }
  unsigned char* Allocate() override {
    return new unsigned char[record_bytes_];
  }
  void Discard(unsigned char* record) override { delete[] record; }

  Stored Write(const BlockHash& hash, unsigned char* record) override {
    const bool ok = WriteFileAtomically(PathFor(hash), record,
                                        static_cast<size_t>(record_bytes_));
    delete[] record;
    return {ok, nullptr};
  }

  absl::Status Read(
      const BlockHash& hash, const unsigned char*,
      absl::FunctionRef<absl::Status(absl::Span<const unsigned char>)> use)
      override {
    const std::string path = PathFor(hash);
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) {
      return absl::NotFoundError(
          absl::StrCat("kv tier file ", path, ": ", std::strerror(errno)));
    }
    // One buffer per thread for every read: a fresh large allocation per
    // block would be mapped and faulted in each time, and a shared one would
    // need a lock held across the caller's checksum and copy.
    thread_local std::vector<unsigned char> buf;
    buf.resize(static_cast<size_t>(record_bytes_) + 1);
    size_t got = 0;
    while (got < buf.size()) {
      const ssize_t n = ::read(fd, buf.data() + got, buf.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    ::close(fd);
    return use(absl::Span<const unsigned char>(buf.data(), got));
  }

  void Remove(const BlockHash& hash, unsigned char*) override {
    std::remove(PathFor(hash).c_str());
  }

  std::string PathFor(const BlockHash& hash) const override {
    return absl::StrCat(subdir_, "/", hash.Hex(), ".kvb");
  }

 private:
  const std::string subdir_;
  const int64_t record_bytes_;
};

class KvMemoryStore final : public KvTierStore {
 public:
  KvMemoryStore(std::unique_ptr<HostStagingBuffer> arena, int64_t slots,
                int64_t record_bytes)
      : arena_(std::move(arena)),
        base_(static_cast<unsigned char*>(arena_->data())),
        slots_(slots),
        record_bytes_(record_bytes) {
    free_.reserve(slots);
    for (int64_t i = slots - 1; i >= 0; --i) free_.push_back(i);
  }

  KvTierKind kind() const override { return KvTierKind::kHostMemory; }
  bool writes_async() const override { return false; }
  int64_t max_records() const override { return slots_; }

  unsigned char* Allocate() override {
    absl::MutexLock l(&mu_);
    if (free_.empty()) return nullptr;
    const int64_t slot = free_.back();
    free_.pop_back();
    return base_ + slot * record_bytes_;
  }
  void Discard(unsigned char* record) override { Free(record); }
  Stored Write(const BlockHash&, unsigned char* record) override {
    return {true, record};
  }
  absl::Status Read(
      const BlockHash&, const unsigned char* handle,
      absl::FunctionRef<absl::Status(absl::Span<const unsigned char>)> use)
      override {
    if (handle == nullptr)
      return absl::NotFoundError("kv tier record is not in memory");
    return use(absl::Span<const unsigned char>(
        handle, static_cast<size_t>(record_bytes_)));
  }
  void Remove(const BlockHash&, unsigned char* handle) override {
    if (handle != nullptr) Free(handle);
  }

 private:
  void Free(unsigned char* record) {
    absl::MutexLock l(&mu_);
    free_.push_back((record - base_) / record_bytes_);
  }

  const std::unique_ptr<HostStagingBuffer> arena_;
  unsigned char* const base_;
  const int64_t slots_;
  const int64_t record_bytes_;
  absl::Mutex mu_;
  std::vector<int64_t> free_ ABSL_GUARDED_BY(mu_);  // slot indices (stack)
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvTierStore>> CreateKvFileStore(
    const std::string& dir, const ModelFingerprint& fingerprint,
    int64_t record_bytes) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot create --kv-offload-dir ", dir, ": ", ec.message()));
  }
  // Blocks of an earlier process or another model are unknown to this
  // process's index: remove them (only directories named like a
  // fingerprint, and only the block files in them).
  for (const auto& d : fs::directory_iterator(dir, ec)) {
    if (!d.is_directory() || !IsFingerprintDirName(d.path().filename()))
      continue;
    for (const auto& f : fs::directory_iterator(d.path(), ec)) {
      const std::string ext = f.path().extension();
      if (ext == ".kvb" || ext == ".tmp") fs::remove(f.path(), ec);
    }
    fs::remove(d.path(), ec);  // fails harmlessly if anything else is left
  }
  const std::string subdir =
      (fs::path(dir) /
       absl::StrFormat("%016x%016x", fingerprint[0], fingerprint[1]))
          .string();
  fs::create_directories(subdir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create ", subdir, ": ", ec.message()));
  }
  return std::unique_ptr<KvTierStore>(new KvFileStore(subdir, record_bytes));
}

absl::StatusOr<std::unique_ptr<KvTierStore>> CreateKvMemoryStore(
    KvStorage& storage, int64_t capacity_bytes, int64_t record_bytes) {
  const int64_t slots = capacity_bytes / record_bytes;
  if (slots < 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--kv-offload-memory ", capacity_bytes,
        " bytes holds no KV block (one needs ", record_bytes, " bytes)"));
  }
  std::unique_ptr<HostStagingBuffer> arena =
      storage.AllocateStaging(static_cast<size_t>(slots * record_bytes));
  if (arena == nullptr || arena->data() == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", slots * record_bytes,
                     " bytes of host memory for --kv-offload-memory"));
  }
  return std::unique_ptr<KvTierStore>(
      new KvMemoryStore(std::move(arena), slots, record_bytes));
}

}  // namespace pdserve::engine
