// KV pool contents and send plans for the `nccl` transport's tests: the bytes
// of (layer, logical block) depend only on (seed, layer, index), so any
// receiver can check what arrived. Header-only, stateless.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kv_cache/kv_cache.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv_transfer::nccl::testing {

inline constexpr char kDecode[] = "decode-0";
inline constexpr char kModel[] = "test-model";

inline engine::KvCacheSpec Spec(DType dtype, int32_t block_size = 4) {
  return {3, 2, 8, block_size, dtype};
}

inline size_t ScaleBytes(const engine::KvCacheSpec& spec) {
  return DTypeHasScales(spec.dtype) ? 2 * spec.num_kv_heads * sizeof(float) : 0;
}

inline uint8_t ByteAt(uint64_t seed, int layer, int index, size_t i) {
  uint64_t x = (seed * 0x9E3779B97F4A7C15ull) ^
               (layer * 1000003ull + index * 7919ull + i * 131ull + 1);
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return static_cast<uint8_t>(x);
}

inline uint8_t* ScalesOf(engine::KvPool* pool, int layer, int32_t block) {
  return reinterpret_cast<uint8_t*>(pool->LayerBlockScales(layer, block));
}

// Writes logical block `index` into physical `block`, every layer.
inline void FillBlock(engine::KvPool* pool, uint64_t seed, int index,
                      int32_t block) {
  const auto& spec = pool->spec();
  for (int l = 0; l < spec.num_layers; ++l) {
    uint8_t* data = pool->LayerBlockData(l, block);
    for (int64_t i = 0; i < spec.LayerBlockBytes(); ++i) {
      data[i] = ByteAt(seed, l, index, i);
    }
    uint8_t* scales = ScalesOf(pool, l, block);
    for (size_t i = 0; i < ScaleBytes(spec); ++i) {
      scales[i] = ByteAt(seed + 1, l, index, i);
    }
  }
}

// Whether physical `block` of `layer` holds logical block `index`.
inline bool Holds(engine::KvPool* pool, uint64_t seed, int layer, int index,
                  int32_t block) {
  const auto& spec = pool->spec();
  const uint8_t* data = pool->LayerBlockData(layer, block);
  for (int64_t i = 0; i < spec.LayerBlockBytes(); ++i) {
    if (data[i] != ByteAt(seed, layer, index, i)) return false;
  }
  const uint8_t* scales = ScalesOf(pool, layer, block);
  for (size_t i = 0; i < ScaleBytes(spec); ++i) {
    if (scales[i] != ByteAt(seed + 1, layer, index, i)) return false;
  }
  return true;
}

inline bool IsZero(engine::KvPool* pool, int layer, int32_t block) {
  const auto& spec = pool->spec();
  const uint8_t* data = pool->LayerBlockData(layer, block);
  for (int64_t i = 0; i < spec.LayerBlockBytes(); ++i) {
    if (data[i] != 0) return false;
  }
  const uint8_t* scales = ScalesOf(pool, layer, block);
  for (size_t i = 0; i < ScaleBytes(spec); ++i) {
    if (scales[i] != 0) return false;
  }
  return true;
}

// A prefill worker's pool holding logical blocks [skip, num_blocks) at
// physical blocks 2i+1, and the plan that sends them to kDecode.
struct Prefill {
  Prefill(const engine::KvCacheSpec& spec, uint64_t reservation,
          const std::string& request, int num_blocks, int skip, uint64_t seed) {
    pool = *engine::KvPool::Create(spec, 2 * num_blocks + 1);
    plan.destination = kDecode;
    plan.reservation_id = reservation;
    plan.request_id = request;
    plan.sender_id = "prefill-0";
    plan.layout = KvLayout::FromSpec(spec, kModel);
    for (int i = skip; i < num_blocks; ++i) {
      FillBlock(pool.get(), seed, i, 2 * i + 1);
      plan.blocks.emplace_back(i, 2 * i + 1);
    }
  }
  std::unique_ptr<engine::KvPool> pool;
  SendPlan plan;
};

}  // namespace pdserve::kv_transfer::nccl::testing
