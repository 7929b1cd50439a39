// The paged KV cache of one worker: its geometry (KvCacheSpec), the budget
// arithmetic behind `pdserve kv-budget`, and the block storage (KvPool).
//
// Storage per layer follows kernels/cpu/paged_attention.h:
//   [num_blocks][2 (K,V)][kv_heads][block_size][head_dim] of the KV dtype,
// plus fp32 scales [num_blocks][2][kv_heads] for int8 and fp8 (fp8-e4m3 is
// a CUDA-only dtype: this host pool stores and moves its bytes for transfer
// tests, but the CPU kernels cannot compute on it). One (layer, block) is
// a contiguous span of BlockBytes() (+ scales), which KV transfer sends as is.
// KvPool is owned by the worker's engine thread; it is not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "kernels/cpu/paged_attention.h"
#include "kv_cache/kv_storage.h"

namespace pdserve::engine {

struct KvCacheSpec {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_size = 16;  // tokens per block
  DType dtype = DType::kF16;
  // MLA (DeepSeek-V2/V3) when kv_lora_rank > 0: a (layer, block) span holds
  // [block_size][kv_lora_rank + qk_rope_head_dim], one latent row per token
  // (the kv_a_layernorm'd latent, then the shared RoPE'd key) and no separate
  // V. Such a spec has num_kv_heads 1 and head_dim the row width, so the
  // scale arithmetic is unchanged: int8 keeps 2 scales per (layer, block),
  // one for the latent part and one for the rope part (model/mla.h).
  int32_t kv_lora_rank = 0;
  int32_t qk_rope_head_dim = 0;
  // Not geometry: how a host pool (KvPool) allocates. True: in one memfd
  // region that other processes on the node can map (SharedRegions), which
  // the `shm` KV transport needs on the decode side. Ignored by device
  // storage.
  bool host_shared = false;

  bool mla() const { return kv_lora_rank > 0; }
  // Rows of head_dim per (token, kv head): 2 (K and V), or 1 latent row.
  int32_t planes() const { return mla() ? 1 : 2; }
  absl::Status Validate() const;
  // 2 x layers x kv_heads x head_dim x dtype bytes (scales excluded);
  // MLA: layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes.
  int64_t BytesPerToken() const;
  // Per-(block, head, K/V) fp32 scales of all layers; 0 unless int8 or fp8.
  int64_t ScaleBytesPerBlock() const;
  // All layers of one block, scales included.
  int64_t BytesPerBlock() const;
  // One layer of one block without scales: the unit of transfer.
  int64_t LayerBlockBytes() const;
  // Blocks that fit in `memory_bytes`.
  int64_t BlocksForMemory(int64_t memory_bytes) const;
  std::string DebugString() const;
};

// Host-memory block storage: the CPU backend's KV and the reference
// KvStorage (its spans are host pointers; copies are memcpy).
class KvPool final : public KvStorage {
 public:
  // spec.host_shared: the pool lives in one memfd region (see SharedRegions);
  // UNAVAILABLE if the region cannot be created or mapped.
  static absl::StatusOr<std::unique_ptr<KvPool>> Create(const KvCacheSpec& spec,
                                                        int64_t num_blocks);
  ~KvPool() override;
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;
  const KvCacheSpec& spec() const override { return spec_; }
  int64_t num_blocks() const override { return num_blocks_; }
  KvMemory memory() const override { return {}; }
  KvSpan Span(int32_t layer, int64_t block) override;
  absl::Status CopyToHost(int32_t layer, int64_t block, void* data,
                          void* scales) override;
  absl::Status CopyFromHost(int32_t layer, int64_t block, const void* data,
                            const void* scales) override;
  // One region with every layer's data and scales when spec().host_shared,
  // else empty.
  std::vector<KvSharedRegion> SharedRegions() override;
  kernels::KvLayerView Layer(int layer);
  // Raw (layer, block) span for transfer: data and, for int8/fp8, the scales.
  uint8_t* LayerBlockData(int layer, int64_t block);
  float* LayerBlockScales(int layer, int64_t block);  // nullptr unless scaled

 private:
  KvPool(const KvCacheSpec& spec, int64_t num_blocks);
  // Carves per-layer data and scales out of [base, base + TotalBytes).
  void Layout(uint8_t* base);
  // Bytes of the one allocation holding every layer (64-byte aligned parts).
  static size_t TotalBytes(const KvCacheSpec& spec, int64_t num_blocks);

  KvCacheSpec spec_;
  int64_t num_blocks_;
  // Everything lives in one zero-filled mapping: anonymous memory, or a
  // memfd (memfd_ >= 0) when spec_.host_shared.
  uint8_t* mapped_ = nullptr;
  size_t bytes_ = 0;
  int memfd_ = -1;
  std::vector<uint8_t*> data_;  // per layer
  std::vector<float*> scales_;  // per layer, int8/fp8 only
};

}  // namespace pdserve::engine
