#include "kv_transfer/ipc/peer_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "kv_cache/kv_cache.h"
#include "kv_transfer/ipc/pool_fd_socket.h"

namespace pdserve::kv_transfer::ipc {

const char* PeerMemoryName(PeerMemoryKind kind) {
  return kind == PeerMemoryKind::kCudaIpc ? "cuda_ipc" : "shm";
}

namespace {

// [offset, offset + count * stride) inside [0, size), without overflow.
bool RangeFits(uint64_t offset, uint64_t count, uint64_t stride,
               uint64_t size) {
  if (offset > size) return false;
  if (stride != 0 && count > (size - offset) / stride) return false;
  return true;
}

}  // namespace

absl::Status KvExport::Validate(const engine::KvCacheSpec& spec) const {
  const uint64_t want_data = static_cast<uint64_t>(spec.LayerBlockBytes());
  const uint64_t want_scales =
      DTypeHasScales(spec.dtype) ? 2ull * spec.num_kv_heads * sizeof(float) : 0;
  auto mismatch = [](const char* what, auto got, auto want) {
    return absl::FailedPreconditionError(
        absl::StrCat("KV export of the decode worker: ", what, " ", got, " vs ",
                     want, " of this worker's pool"));
  };
  if (data_bytes != want_data)
    return mismatch("span bytes", data_bytes, want_data);
  if (scale_bytes != want_scales)
    return mismatch("scale bytes", scale_bytes, want_scales);
  if (layers.size() != static_cast<size_t>(spec.num_layers))
    return mismatch("layers", layers.size(), spec.num_layers);
  if (num_blocks <= 0) return mismatch("blocks", num_blocks, "> 0");
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerPlacement& p = layers[l];
    const bool data_ok =
        p.data_region < regions.size() &&
        RangeFits(p.data_offset, static_cast<uint64_t>(num_blocks), data_bytes,
                  regions[p.data_region].bytes);
    const bool scales_ok =
        scale_bytes == 0 ||
        (p.scale_region < regions.size() &&
         RangeFits(p.scale_offset, static_cast<uint64_t>(num_blocks),
                   scale_bytes, regions[p.scale_region].bytes));
    if (!data_ok || !scales_ok) {
      return absl::FailedPreconditionError(
          absl::StrCat("KV export of the decode worker: layer ", l, "'s ",
                       data_ok ? "scales" : "spans", " (", num_blocks,
                       " blocks) do not lie inside their region"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<KvExport> ExportStorage(engine::KvStorage* storage,
                                       PeerMemoryBackend* backend) {
  const engine::KvMemory memory = storage->memory();
  if (memory.kind != backend->memory_kind()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--kv-transport ", PeerMemoryName(backend->kind()), " moves ",
        backend->memory_kind() == engine::MemoryKind::kHost ? "host" : "GPU",
        " KV pools, but this worker's pool is in ",
        engine::KvMemoryName(memory),
        backend->kind() == PeerMemoryKind::kCudaIpc
            ? " (cuda_ipc needs --device cuda; use shm on CPU)"
            : " (shm needs --device cpu; use cuda_ipc on a GPU)"));
  }
  const std::vector<engine::KvSharedRegion> shared = storage->SharedRegions();
  if (shared.empty()) {
    return absl::FailedPreconditionError(
        "this worker's KV pool cannot be shared with other processes (a host "
        "pool must be created with KvCacheSpec::host_shared)");
  }
  KvExport out;
  std::random_device random;
  out.export_id = (uint64_t{random()} << 32 | random()) | 1;  // never 0
  out.kind = backend->kind();
  out.device = memory.kind == engine::MemoryKind::kDevice ? memory.device : -1;
  out.num_blocks = storage->num_blocks();
  for (const engine::KvSharedRegion& r : shared) {
    absl::StatusOr<std::string> handle = backend->ExportHandle(r);
    if (!handle.ok()) return handle.status();
    out.regions.push_back({r.bytes, *std::move(handle)});
  }
  // Each layer's block 0 names where its spans start; the validation below
  // proves all of them lie in that region.
  auto locate = [&](const void* p, uint32_t* region, uint64_t* offset) -> bool {
    const auto* at = static_cast<const uint8_t*>(p);
    for (size_t i = 0; i < shared.size(); ++i) {
      const auto* base = static_cast<const uint8_t*>(shared[i].base);
      if (at >= base && at < base + shared[i].bytes) {
        *region = static_cast<uint32_t>(i);
        *offset = static_cast<uint64_t>(at - base);
        return true;
      }
    }
    return false;
  };
  const engine::KvSpan first = storage->Span(0, 0);
  out.data_bytes = first.data_bytes;
  out.scale_bytes = first.scales != nullptr ? first.scale_bytes : 0;
  for (int32_t l = 0; l < storage->spec().num_layers; ++l) {
    const engine::KvSpan s = storage->Span(l, 0);
    LayerPlacement p;
    bool ok = locate(s.data, &p.data_region, &p.data_offset);
    if (ok && out.scale_bytes > 0)
      ok = locate(s.scales, &p.scale_region, &p.scale_offset);
    // Spans of one layer must be evenly strided from block 0 (the layout of
    // kv_cache/kv_cache.h); check the last block agrees.
    const int64_t last = out.num_blocks - 1;
    const engine::KvSpan e = storage->Span(l, last);
    ok = ok && static_cast<const uint8_t*>(e.data) ==
                   static_cast<const uint8_t*>(s.data) + last * out.data_bytes;
    if (!ok) {
      return absl::FailedPreconditionError(
          absl::StrCat("KV pool layer ", l,
                       " is not one strided range inside its shared "
                       "regions; it cannot be exported"));
    }
    out.layers.push_back(p);
  }
  return out;
}

namespace {

constexpr absl::Duration kFetchTimeout = absl::Seconds(5);
constexpr absl::Duration kAliveTimeout = absl::Milliseconds(500);
constexpr char kPoolName[] = "/memfd:pdserve-kv-pool-";

struct FileId {
  uint64_t dev = 0, ino = 0;
  bool operator==(const FileId&) const = default;
};

// The regions of `own` (the sender's storage) a peer could name: its memfds.
std::vector<FileId> OwnFiles(engine::KvStorage* own) {
  std::vector<FileId> out;
  if (own == nullptr) return out;
  for (const engine::KvSharedRegion& r : own->SharedRegions()) {
    struct stat st {};
    if (r.fd >= 0 && fstat(r.fd, &st) == 0)
      out.push_back(
          {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)});
  }
  return out;
}

// Everything the sender checks about an fd a peer passed for `region`
// before it maps it for writing. FAILED_PRECONDITION naming what is wrong.
absl::Status CheckPoolFd(int fd, const PoolFdHandle& declared, pid_t passed_by,
                         uint64_t bytes, const std::vector<FileId>& own) {
  auto refuse = [&](auto&&... what) {
    return absl::FailedPreconditionError(
        absl::StrCat("shm: the decode worker passed ", what...,
                     "; refusing to write into it"));
  };
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    return absl::UnavailableError(absl::StrCat(
        "shm: fstat of the passed fd failed: ", std::strerror(errno)));
  }
  // Our own descriptor's link, so nothing can change the file behind it.
  char link[256];
  const ssize_t n = readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), link,
                             sizeof link - 1);
  const absl::string_view name(link, n > 0 ? static_cast<size_t>(n) : 0);
  if (!S_ISREG(st.st_mode) || !absl::StartsWith(name, kPoolName)) {
    return refuse("a file that is not a KV pool memfd (\"",
                  absl::CEscape(name.substr(0, 80)), "\")");
  }
  const FileId id{static_cast<uint64_t>(st.st_dev),
                  static_cast<uint64_t>(st.st_ino)};
  if (std::find(own.begin(), own.end(), id) != own.end())
    return refuse("this worker's own KV pool");
  // KvPool names its memfd after the pid of the process that created it;
  // the kernel names the process that passed it (SO_PEERCRED). A pool of
  // any other process is not the decode worker's to hand out.
  absl::string_view digits = name.substr(std::strlen(kPoolName));
  digits = digits.substr(0, digits.find_first_not_of("0123456789"));
  int64_t owner = -1;
  if (!absl::SimpleAtoi(digits, &owner) || owner != passed_by) {
    return refuse("the KV pool of process ", digits, ", not its own (pid ",
                  passed_by, ")");
  }
  if (id != FileId{declared.dev, declared.ino}) {
    return refuse("a memfd (", id.dev, ":", id.ino,
                  ") that is not the region its export declared (",
                  declared.dev, ":", declared.ino, ")");
  }
  const int seals = fcntl(fd, F_GET_SEALS);
  constexpr int kNeeded = F_SEAL_SHRINK | F_SEAL_GROW;
  if (seals < 0 || (seals & kNeeded) != kNeeded ||
      (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0) {
    return refuse("a memfd not sealed against shrinking and growing (seals ",
                  seals, "), which could fault this worker mid-copy");
  }
  if (static_cast<uint64_t>(st.st_size) != bytes) {
    return refuse("a memfd of ", st.st_size, " bytes for a region of ", bytes);
  }
  return absl::OkStatus();
}

class ShmMapping final : public PeerMapping {
 public:
  ~ShmMapping() override {
    for (auto& [p, n] : maps_) munmap(p, n);
  }
  absl::Status Add(const ExportedRegion& region,
                   const std::vector<FileId>& own) {
    absl::StatusOr<PoolFdHandle> handle = PoolFdHandle::Parse(region.handle);
    if (!handle.ok()) {
      return absl::FailedPreconditionError(handle.status().message());
    }
    ASSIGN_OR_RETURN(ReceivedPoolFd got, FetchPoolFd(*handle, kFetchTimeout));
    absl::Status checked =
        CheckPoolFd(got.fd, *handle, got.peer_pid, region.bytes, own);
    void* p = MAP_FAILED;
    int map_errno = 0;
    if (checked.ok()) {
      p = mmap(nullptr, region.bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
               got.fd, 0);
      map_errno = errno;
    }
    close(got.fd);  // the mapping keeps the memory
    RETURN_IF_ERROR(checked);
    if (p == MAP_FAILED) {
      return absl::UnavailableError(
          absl::StrCat("shm: mapping ", region.bytes,
                       " bytes of the decode worker's KV pool failed: ",
                       std::strerror(map_errno)));
    }
    maps_.emplace_back(static_cast<uint8_t*>(p), region.bytes);
    handles_.push_back(*std::move(handle));
    return absl::OkStatus();
  }
  bool PeerAlive() override {
    for (const PoolFdHandle& h : handles_) {
      if (QueryPoolFd(h, kAliveTimeout) == ExportState::kGone) return false;
    }
    return true;
  }
  uint8_t* base(size_t region) override { return maps_[region].first; }
  absl::Status Copy(std::span<const CopyOp> ops, absl::Time deadline) override {
    // Sealed regions of the exported size (CheckPoolFd): no page of these
    // mappings can disappear under memcpy.
    for (const CopyOp& op : ops) {
      std::memcpy(op.dst, op.src, op.bytes);
    }
    (void)deadline;  // memcpy of a batch is bounded; nothing to abandon
    return absl::OkStatus();
  }

 private:
  std::vector<std::pair<uint8_t*, size_t>> maps_;
  std::vector<PoolFdHandle> handles_;
};

class ShmBackend final : public PeerMemoryBackend {
 public:
  PeerMemoryKind kind() const override { return PeerMemoryKind::kShm; }
  engine::MemoryKind memory_kind() const override {
    return engine::MemoryKind::kHost;
  }
  absl::StatusOr<std::string> ExportHandle(
      const engine::KvSharedRegion& region) override {
    if (region.fd < 0) {
      return absl::FailedPreconditionError(
          "shm: a KV region without a memfd cannot be shared");
    }
    absl::MutexLock l(&mu_);
    if (server_ == nullptr) {
      ASSIGN_OR_RETURN(server_, PoolFdServer::Start());
    }
    return server_->Add(region.fd);
  }
  void Unexport(const std::string& handle) override {
    absl::MutexLock l(&mu_);
    if (server_ != nullptr) server_->Remove(handle);
  }
  absl::StatusOr<std::unique_ptr<PeerMapping>> Map(
      const KvExport& peer) override {
    return MapPeer(peer, nullptr);
  }
  absl::StatusOr<std::unique_ptr<PeerMapping>> MapPeer(
      const KvExport& peer, engine::KvStorage* own) override {
    if (peer.kind != PeerMemoryKind::kShm) {
      return absl::FailedPreconditionError(
          absl::StrCat("shm: the decode worker exports its KV over ",
                       PeerMemoryName(peer.kind)));
    }
    const std::vector<FileId> own_files = OwnFiles(own);
    auto mapping = std::make_unique<ShmMapping>();
    for (const ExportedRegion& r : peer.regions) {
      if (auto s = mapping->Add(r, own_files); !s.ok()) return s;
    }
    return std::unique_ptr<PeerMapping>(std::move(mapping));
  }

 private:
  absl::Mutex mu_;
  std::unique_ptr<PoolFdServer> server_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<PeerMemoryBackend> NewShmBackend() {
  return std::make_unique<ShmBackend>();
}

}  // namespace pdserve::kv_transfer::ipc
