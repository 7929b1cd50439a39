// Writing new tokens' K and V into the paged cache on the GPU
// (reshape_and_cache), quantising for int8 and fp8-e4m3 KV.
//
// Semantics match the CPU's WriteKv (kernels/cpu/paged_attention.h): tokens
// of one block are applied in order; a quantised block's per-(block, K/V,
// head) scale is amax / max_code, grows when a new token needs more (the
// block's earlier codes are requantised to the larger scale, so nothing
// clips), and a token at offset 0 starts a fresh scale. int8 follows the CPU
// arithmetic step for step, so its codes and scales equal the CPU's. fp8 uses
// max_code 448 and saturating conversion.
//
// Tokens of one call that land in the same block must be consecutive (a
// sequence's run of new tokens); two calls must not write one block at once.
// Slots < 0 are skipped (padding). Thread-safe; ordered by `stream`.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/paged_kv.cuh"

namespace pdserve::kernels::cuda {

absl::Status InvokeReshapeAndCache(
    const float* k,        // [num_tokens, kv_heads, head_dim]
    const float* v,        // [num_tokens, kv_heads, head_dim]
    const int64_t* slots,  // [num_tokens]: block * block_size + offset
    int64_t num_tokens, const PagedKvView& cache, cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
