// Deterministic KV block contents for transfer tests: the bytes of
// (layer, logical block) depend only on (seed, layer, index), so sender and
// receiver processes agree on what must arrive.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "engine/kv_cache.h"

namespace pdserve::kv_transfer::testing {

inline engine::KvCacheSpec TestSpec(DType dtype) { return {3, 2, 8, 4, dtype}; }

inline std::vector<uint8_t> ExpectedSpan(const engine::KvCacheSpec& spec,
                                         uint64_t seed, int layer, int index,
                                         size_t bytes) {
  std::vector<uint8_t> out(bytes);
  uint64_t x =
      seed * 0x9E3779B97F4A7C15ull + layer * 1000003ull + index * 7919ull + 1;
  for (auto& b : out) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<uint8_t>(x);
  }
  (void)spec;
  return out;
}

inline size_t ScaleBytes(const engine::KvCacheSpec& spec) {
  return spec.dtype == DType::kI8 ? 2 * spec.num_kv_heads * sizeof(float) : 0;
}

// Writes the expected contents of logical block `index` into physical `block`.
inline void FillBlock(engine::KvPool* pool, uint64_t seed, int index,
                      int32_t block) {
  const auto& spec = pool->spec();
  for (int l = 0; l < spec.num_layers; ++l) {
    auto data = ExpectedSpan(spec, seed, l, index, spec.LayerBlockBytes());
    std::memcpy(pool->LayerBlockData(l, block), data.data(), data.size());
    if (ScaleBytes(spec)) {
      auto scales = ExpectedSpan(spec, seed + 1, l, index, ScaleBytes(spec));
      std::memcpy(pool->LayerBlockScales(l, block), scales.data(),
                  scales.size());
    }
  }
}

}  // namespace pdserve::kv_transfer::testing
