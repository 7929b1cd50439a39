// MLA (DeepSeek-V2/V3) decode attention over paged latent blocks on the GPU
// (host launcher). The weight-absorbed form of model/mla.h: each query row
// holds, per head, the absorbed query [kv_lora_rank | qk_rope_head_dim]
// (q_lat = W_UK^T q_nope, then the roped q_pe); scores are its dot product
// with each cached latent row [latent | k_pe] times `scale`, and the output
// is the softmax-weighted sum of the latents [kv_lora_rank] (the caller
// applies W_UV and o_proj). One thread block per (query, head) reads the
// context in tiles with an online softmax; fp32 arithmetic.
//
// Cache layout of one layer (kv_cache/kv_cache.h, MLA spec):
//   data:   [num_blocks][block_size][kv_lora_rank + rope_dim] of `dtype`
//   scales: [num_blocks][2] fp32 (latent part, rope part), int8 only
// kv_lora_rank at most 1024 and a multiple of nothing in particular;
// fp8 is refused (INVALID_ARGUMENT). Launchers are thread-safe; work is
// ordered only by `stream`.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/paged_kv.cuh"

namespace pdserve::kernels::cuda {

struct MlaLatentView {
  const void* data = nullptr;     // see layout above
  const float* scales = nullptr;  // int8 only
  KvDtype dtype = KvDtype::kBF16;
  int32_t kv_lora_rank = 0;
  int32_t rope_dim = 0;
  int32_t block_size = 0;
};

// Query r attends to positions [0, context_lens[r]) through block table row
// r. All pointers are device pointers.
absl::Status InvokeMlaDecodeAttention(
    const float* __restrict__ q_abs,  // [num_queries, num_heads, R + rope]
    const MlaLatentView& cache,
    const int32_t* __restrict__ block_tables,  // [num_queries, max_blocks]
    int32_t max_blocks_per_seq,
    const int32_t* __restrict__ context_lens,  // [num_queries]
    int32_t num_queries, int32_t num_heads, float scale,
    float* __restrict__ out_lat,  // [num_queries, num_heads, R]
    cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
