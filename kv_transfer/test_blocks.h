// Deterministic KV block contents for transfer tests: the bytes of
// (layer, logical block) depend only on (seed, layer, index), so sender and
// receiver processes agree on what must arrive.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "kv_cache/kv_cache.h"
#include "kv_cache/kv_storage.h"

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
  return DTypeHasScales(spec.dtype) ? 2 * spec.num_kv_heads * sizeof(float) : 0;
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

// Host memory behind a device-memory face, for CPU tests of the transports'
// device paths. With kPoisonPointers, Span() hands out unmapped addresses, so
// bytes can only move through CopyToHost / CopyFromHost (the grpc path);
// with kRefuseHostCopies those fail instead, so bytes can only move through
// the span pointers, as a communicator's device copies do (the nccl path).
class DeviceFacedStorage : public engine::KvStorage {
 public:
  enum Mode { kPoisonPointers, kRefuseHostCopies };
  DeviceFacedStorage(engine::KvPool* pool, Mode mode)
      : pool_(pool), mode_(mode) {}
  const engine::KvCacheSpec& spec() const override { return pool_->spec(); }
  int64_t num_blocks() const override { return pool_->num_blocks(); }
  engine::KvMemory memory() const override {
    return {engine::MemoryKind::kDevice, 3};
  }
  engine::KvSpan Span(int32_t layer, int64_t block) override {
    engine::KvSpan s = pool_->Span(layer, block);
    if (mode_ == kPoisonPointers) {
      const uintptr_t poison = uintptr_t{0xdead} << 32;  // unmapped
      s.data = reinterpret_cast<void*>(poison + layer * 4096 + block * 64);
      if (s.scales != nullptr)
        s.scales = reinterpret_cast<float*>(poison + (uintptr_t{1} << 30));
    }
    s.memory = memory();
    return s;
  }
  absl::Status CopyToHost(int32_t layer, int64_t block, void* data,
                          void* scales) override {
    if (mode_ == kRefuseHostCopies)
      return absl::InternalError("the device path must not copy to host");
    ++to_host;
    return pool_->CopyToHost(layer, block, data, scales);
  }
  absl::Status CopyFromHost(int32_t layer, int64_t block, const void* data,
                            const void* scales) override {
    if (mode_ == kRefuseHostCopies)
      return absl::InternalError("the device path must not copy from host");
    ++from_host;
    return pool_->CopyFromHost(layer, block, data, scales);
  }
  std::atomic<int> to_host{0}, from_host{0};

 private:
  engine::KvPool* pool_;
  const Mode mode_;
};

}  // namespace pdserve::kv_transfer::testing
