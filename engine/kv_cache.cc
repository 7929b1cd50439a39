#include "engine/kv_cache.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace pdserve::engine {

absl::Status KvCacheSpec::Validate() const {
  if (num_layers <= 0 || num_kv_heads <= 0 || head_dim <= 0) {
    return absl::InvalidArgumentError(
        "kv cache: layers, kv_heads and head_dim must be positive");
  }
  if (block_size <= 0 || block_size > 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv cache: block_size must be in [1, 256], got ", block_size));
  }
  return absl::OkStatus();
}

int64_t KvCacheSpec::BytesPerToken() const {
  return int64_t{2} * num_layers * num_kv_heads * head_dim *
         static_cast<int64_t>(DTypeBytes(dtype));
}

int64_t KvCacheSpec::ScaleBytesPerBlock() const {
  return DTypeHasScales(dtype) ? int64_t{2} * num_layers * num_kv_heads * 4 : 0;
}

int64_t KvCacheSpec::BytesPerBlock() const {
  return BytesPerToken() * block_size + ScaleBytesPerBlock();
}

int64_t KvCacheSpec::LayerBlockBytes() const {
  return int64_t{2} * num_kv_heads * block_size * head_dim *
         static_cast<int64_t>(DTypeBytes(dtype));
}

int64_t KvCacheSpec::BlocksForMemory(int64_t memory_bytes) const {
  const int64_t per_block = BytesPerBlock();
  return per_block > 0 && memory_bytes > 0 ? memory_bytes / per_block : 0;
}

std::string KvCacheSpec::DebugString() const {
  return absl::StrCat("layers=", num_layers, " kv_heads=", num_kv_heads,
                      " head_dim=", head_dim, " block_size=", block_size,
                      " dtype=", DTypeName(dtype));
}

absl::StatusOr<std::unique_ptr<KvPool>> KvPool::Create(const KvCacheSpec& spec,
                                                       int64_t num_blocks) {
  if (auto s = spec.Validate(); !s.ok()) return s;
  if (num_blocks <= 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "kv cache: the memory budget holds no block (one block needs ",
        spec.BytesPerBlock(), " bytes)"));
  }
  return std::unique_ptr<KvPool>(new KvPool(spec, num_blocks));
}

KvPool::KvPool(const KvCacheSpec& spec, int64_t num_blocks)
    : spec_(spec), num_blocks_(num_blocks) {
  const int64_t layer_bytes = spec.LayerBlockBytes() * num_blocks;
  for (int l = 0; l < spec.num_layers; ++l) {
    // Zero-filled so that never-written slots hold finite values.
    data_.emplace_back(new uint8_t[layer_bytes]());
    if (DTypeHasScales(spec.dtype))
      scales_.emplace_back(num_blocks * 2 * spec.num_kv_heads, 0.0f);
  }
}

kernels::KvLayerView KvPool::Layer(int layer) {
  return {data_[layer].get(),
          DTypeHasScales(spec_.dtype) ? scales_[layer].data() : nullptr,
          spec_.dtype,
          spec_.num_kv_heads,
          spec_.head_dim,
          spec_.block_size};
}

uint8_t* KvPool::LayerBlockData(int layer, int64_t block) {
  return data_[layer].get() + block * spec_.LayerBlockBytes();
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
  std::memcpy(data, s.data, s.data_bytes);
  if (s.scale_bytes > 0 && scales != nullptr)
    std::memcpy(scales, s.scales, s.scale_bytes);
  return absl::OkStatus();
}

absl::Status KvPool::CopyFromHost(int32_t layer, int64_t block,
                                  const void* data, const void* scales) {
  const KvSpan s = Span(layer, block);
  std::memcpy(s.data, data, s.data_bytes);
  if (s.scale_bytes > 0 && scales != nullptr)
    std::memcpy(s.scales, scales, s.scale_bytes);
  return absl::OkStatus();
}

float* KvPool::LayerBlockScales(int layer, int64_t block) {
  if (!DTypeHasScales(spec_.dtype)) return nullptr;
  return scales_[layer].data() + block * 2 * spec_.num_kv_heads;
}

}  // namespace pdserve::engine
