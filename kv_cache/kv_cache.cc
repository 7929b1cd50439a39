#include "kv_cache/kv_cache.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace pdserve::engine {

absl::Status KvCacheSpec::Validate() const {
  if (num_layers <= 0 || num_kv_heads <= 0 || head_dim <= 0) {
    return absl::InvalidArgumentError(
        "kv cache: layers, kv_heads and head_dim must be positive");
  }
  if (kv_lora_rank < 0 || qk_rope_head_dim < 0 ||
      (mla() &&
       (num_kv_heads != 1 || head_dim != kv_lora_rank + qk_rope_head_dim))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv cache: an MLA latent cache has kv_heads 1 and head_dim "
        "kv_lora_rank + qk_rope_head_dim, got kv_heads=",
        num_kv_heads, " head_dim=", head_dim, " kv_lora_rank=", kv_lora_rank,
        " qk_rope_head_dim=", qk_rope_head_dim));
  }
  if (block_size <= 0 || block_size > 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv cache: block_size must be in [1, 256], got ", block_size));
  }
  return absl::OkStatus();
}

int64_t KvCacheSpec::BytesPerToken() const {
  return int64_t{planes()} * num_layers * num_kv_heads * head_dim *
         static_cast<int64_t>(DTypeBytes(dtype));
}

int64_t KvCacheSpec::ScaleBytesPerBlock() const {
  return DTypeHasScales(dtype) ? int64_t{2} * num_layers * num_kv_heads * 4 : 0;
}

int64_t KvCacheSpec::BytesPerBlock() const {
  return BytesPerToken() * block_size + ScaleBytesPerBlock();
}

int64_t KvCacheSpec::LayerBlockBytes() const {
  return int64_t{planes()} * num_kv_heads * block_size * head_dim *
         static_cast<int64_t>(DTypeBytes(dtype));
}

int64_t KvCacheSpec::BlocksForMemory(int64_t memory_bytes) const {
  const int64_t per_block = BytesPerBlock();
  return per_block > 0 && memory_bytes > 0 ? memory_bytes / per_block : 0;
}

std::string KvCacheSpec::DebugString() const {
  return absl::StrCat(
      "layers=", num_layers, " kv_heads=", num_kv_heads, " head_dim=", head_dim,
      " block_size=", block_size, " dtype=", DTypeName(dtype),
      mla() ? absl::StrCat(" kv_lora_rank=", kv_lora_rank,
                           " qk_rope_head_dim=", qk_rope_head_dim)
            : "");
}

namespace {
size_t Align64(size_t n) { return (n + 63) & ~size_t{63}; }
}  // namespace

size_t KvPool::TotalBytes(const KvCacheSpec& spec, int64_t num_blocks) {
  const size_t data = Align64(static_cast<size_t>(spec.LayerBlockBytes()) *
                              static_cast<size_t>(num_blocks));
  const size_t scales = DTypeHasScales(spec.dtype)
                            ? Align64(static_cast<size_t>(num_blocks) * 2 *
                                      spec.num_kv_heads * sizeof(float))
                            : 0;
  return (data + scales) * static_cast<size_t>(spec.num_layers);
}

absl::StatusOr<std::unique_ptr<KvPool>> KvPool::Create(const KvCacheSpec& spec,
                                                       int64_t num_blocks) {
  if (auto s = spec.Validate(); !s.ok()) return s;
  if (num_blocks <= 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "kv cache: the memory budget holds no block (one block needs ",
        spec.BytesPerBlock(), " bytes)"));
  }
  std::unique_ptr<KvPool> pool(new KvPool(spec, num_blocks));
  pool->bytes_ = TotalBytes(spec, num_blocks);
  if (!spec.host_shared) {
    // Anonymous pages read as zero (never-written slots hold finite values)
    // and are backed only once touched: a worker does not fault in and
    // clear its whole budget at start, only the blocks it uses.
    void* p = mmap(nullptr, pool->bytes_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("kv cache: reserving the pool (", pool->bytes_,
                       " bytes) failed: ", std::strerror(errno)));
    }
    pool->mapped_ = static_cast<uint8_t*>(p);
    pool->Layout(pool->mapped_);
    return pool;
  }
  // A memfd rather than shm_open: nothing is left in /dev/shm when the
  // process dies, and the region is not bounded by /dev/shm's size (64 MiB
  // in a default container). Its pages start zeroed. The name carries the
  // creating process's pid, and the size is sealed, so a process this fd is
  // passed to can tell whose pool it is and cannot be made to fault
  // (SIGBUS) by a pool that shrinks under its mapping.
  pool->memfd_ =
      memfd_create(absl::StrCat("pdserve-kv-pool-", getpid()).c_str(),
                   MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (pool->memfd_ < 0) {
    return absl::UnavailableError(
        absl::StrCat("kv cache: memfd_create for a shared pool failed: ",
                     std::strerror(errno)));
  }
  if (ftruncate(pool->memfd_, static_cast<off_t>(pool->bytes_)) != 0) {
    return absl::UnavailableError(
        absl::StrCat("kv cache: sizing the shared pool to ", pool->bytes_,
                     " bytes failed: ", std::strerror(errno)));
  }
  if (fcntl(pool->memfd_, F_ADD_SEALS,
            F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return absl::UnavailableError(
        absl::StrCat("kv cache: sealing the shared pool's size failed: ",
                     std::strerror(errno)));
  }
  void* p = mmap(nullptr, pool->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED,
                 pool->memfd_, 0);
  if (p == MAP_FAILED) {
    return absl::UnavailableError(
        absl::StrCat("kv cache: mapping the shared pool (", pool->bytes_,
                     " bytes) failed: ", std::strerror(errno)));
  }
  pool->mapped_ = static_cast<uint8_t*>(p);
  pool->Layout(pool->mapped_);
  return pool;
}

KvPool::KvPool(const KvCacheSpec& spec, int64_t num_blocks)
    : spec_(spec), num_blocks_(num_blocks) {}

KvPool::~KvPool() {
  if (mapped_ != nullptr) munmap(mapped_, bytes_);
  if (memfd_ >= 0) close(memfd_);
}

void KvPool::Layout(uint8_t* base) {
  const size_t data = Align64(static_cast<size_t>(spec_.LayerBlockBytes()) *
                              static_cast<size_t>(num_blocks_));
  const size_t scales = Align64(static_cast<size_t>(num_blocks_) * 2 *
                                spec_.num_kv_heads * sizeof(float));
  uint8_t* at = base;
  for (int l = 0; l < spec_.num_layers; ++l) {
    data_.push_back(at);
    at += data;
    if (DTypeHasScales(spec_.dtype)) {
      scales_.push_back(reinterpret_cast<float*>(at));
      at += scales;
    }
  }
}

std::vector<KvSharedRegion> KvPool::SharedRegions() {
  if (memfd_ < 0) return {};
  return {KvSharedRegion{mapped_, bytes_, "", memfd_}};
}

kernels::KvLayerView KvPool::Layer(int layer) {
  return {
      data_[layer],   DTypeHasScales(spec_.dtype) ? scales_[layer] : nullptr,
      spec_.dtype,    spec_.num_kv_heads,
      spec_.head_dim, spec_.block_size};
}

uint8_t* KvPool::LayerBlockData(int layer, int64_t block) {
  return data_[layer] + block * spec_.LayerBlockBytes();
}

KvSpan KvPool::Span(int32_t layer, int64_t block) {
  KvSpan s;
  s.data = LayerBlockData(layer, block);
  s.data_bytes = static_cast<size_t>(spec_.LayerBlockBytes());
  s.scales = LayerBlockScales(layer, block);
  s.scale_bytes =
      s.scales ? 2 * static_cast<size_t>(spec_.num_kv_heads) * sizeof(float)
               : 0;
  return s;
}

absl::Status KvPool::CopyToHost(int32_t layer, int64_t block, void* data,
                                void* scales) {
  const KvSpan s = Span(layer, block);
  if (s.scale_bytes > 0 && scales == nullptr)
    return MissingScales(layer, block);
  std::memcpy(data, s.data, s.data_bytes);
  if (s.scale_bytes > 0) std::memcpy(scales, s.scales, s.scale_bytes);
  return absl::OkStatus();
}

absl::Status KvPool::CopyFromHost(int32_t layer, int64_t block,
                                  const void* data, const void* scales) {
  const KvSpan s = Span(layer, block);
  if (s.scale_bytes > 0 && scales == nullptr)
    return MissingScales(layer, block);
  std::memcpy(s.data, data, s.data_bytes);
  if (s.scale_bytes > 0) std::memcpy(s.scales, scales, s.scale_bytes);
  return absl::OkStatus();
}

float* KvPool::LayerBlockScales(int layer, int64_t block) {
  if (!DTypeHasScales(spec_.dtype)) return nullptr;
  return scales_[layer] + block * 2 * spec_.num_kv_heads;
}

}  // namespace pdserve::engine
