#include "kv_transfer/ipc/peer_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "kv_cache/kv_cache.h"

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

// "/proc/<pid>/fd/<n>" naming a memfd made by KvPool (kv_cache/kv_cache.cc
// names it "pdserve-kv-pool"; the kernel shows it as "/memfd:<name>").
bool IsPoolMemfd(const std::string& path) {
  int pid = 0, fd = 0, end = 0;
  if (std::sscanf(path.c_str(), "/proc/%d/fd/%d%n", &pid, &fd, &end) != 2 ||
      static_cast<size_t>(end) != path.size()) {
    return false;
  }
  char target[256];
  const ssize_t n = readlink(path.c_str(), target, sizeof target - 1);
  if (n <= 0) return true;  // unreadable: open() reports why
  const std::string_view link(target, static_cast<size_t>(n));
  return link.rfind("/memfd:pdserve-kv-pool", 0) == 0;
}

class ShmMapping final : public PeerMapping {
 public:
  ~ShmMapping() override {
    for (auto& [p, n] : maps_) munmap(p, n);
  }
  absl::Status Add(const ExportedRegion& region) {
    // Only a KvPool memfd of a process on this node: a peer must not be
    // able to point this process's writes at an arbitrary file.
    if (!IsPoolMemfd(region.handle)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shm: \"", region.handle,
          "\" is not the KV pool memfd of a process on this node"));
    }
    const int fd = open(region.handle.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      return absl::UnavailableError(absl::StrCat(
          "shm: cannot open the decode worker's KV pool ", region.handle, ": ",
          std::strerror(errno),
          " (shm needs both workers on one node, in one PID namespace, as "
          "one user)"));
    }
    struct stat st {};
    if (fstat(fd, &st) != 0 ||
        static_cast<uint64_t>(st.st_size) < region.bytes) {
      close(fd);
      return absl::UnavailableError(absl::StrCat(
          "shm: the decode worker's KV pool ", region.handle, " is smaller (",
          st.st_size, " bytes) than exported (", region.bytes, ")"));
    }
    void* p =
        mmap(nullptr, region.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);  // the mapping keeps the memory
    if (p == MAP_FAILED) {
      return absl::UnavailableError(
          absl::StrCat("shm: mapping ", region.bytes, " bytes of ",
                       region.handle, " failed: ", std::strerror(errno)));
    }
    maps_.emplace_back(static_cast<uint8_t*>(p), region.bytes);
    exported_.push_back({region.handle, st.st_dev, st.st_ino});
    return absl::OkStatus();
  }
  bool PeerAlive() override {
    // The same memfd (inode) still open at the same /proc path: a reused fd
    // number or pid names another file.
    for (const Exported& e : exported_) {
      struct stat st {};
      if (stat(e.path.c_str(), &st) != 0 || st.st_dev != e.dev ||
          st.st_ino != e.ino)
        return false;
    }
    return true;
  }
  uint8_t* base(size_t region) override { return maps_[region].first; }
  absl::Status Copy(std::span<const CopyOp> ops, absl::Time deadline) override {
    for (const CopyOp& op : ops) {
      std::memcpy(op.dst, op.src, op.bytes);
    }
    (void)deadline;  // memcpy of a batch is bounded; nothing to abandon
    return absl::OkStatus();
  }

 private:
  std::vector<std::pair<uint8_t*, size_t>> maps_;
  struct Exported {
    std::string path;  // the exporter's /proc/<pid>/fd/<n>
    dev_t dev;
    ino_t ino;
  };
  std::vector<Exported> exported_;
};

class ShmBackend final : public PeerMemoryBackend {
 public:
  PeerMemoryKind kind() const override { return PeerMemoryKind::kShm; }
  engine::MemoryKind memory_kind() const override {
    return engine::MemoryKind::kHost;
  }
  absl::StatusOr<std::string> ExportHandle(
      const engine::KvSharedRegion& region) override {
    if (region.path.empty()) {
      return absl::FailedPreconditionError(
          "shm: a KV region without a path cannot be shared");
    }
    return region.path;
  }
  absl::StatusOr<std::unique_ptr<PeerMapping>> Map(
      const KvExport& peer) override {
    if (peer.kind != PeerMemoryKind::kShm) {
      return absl::FailedPreconditionError(
          absl::StrCat("shm: the decode worker exports its KV over ",
                       PeerMemoryName(peer.kind)));
    }
    auto mapping = std::make_unique<ShmMapping>();
    for (const ExportedRegion& r : peer.regions) {
      if (auto s = mapping->Add(r); !s.ok()) return s;
    }
    return std::unique_ptr<PeerMapping>(std::move(mapping));
  }
};

}  // namespace

std::unique_ptr<PeerMemoryBackend> NewShmBackend() {
  return std::make_unique<ShmBackend>();
}

}  // namespace pdserve::kv_transfer::ipc
