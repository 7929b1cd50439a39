#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/kv_access.cuh"
#include "kernels/cuda/mla_attention.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kThreads = 128;           // 4 warps
constexpr int kTile = 32;               // context rows per online-softmax step
constexpr int kMaxLatentPerThread = 8;  // kv_lora_rank <= 8 * kThreads

template <typename T>
__device__ __forceinline__ float LoadLatent(const T* row, const float* scales,
                                            int64_t block, int i, int rank) {
  const float v = detail::ToFloat(row[i]);
  if constexpr (std::is_same_v<T, int8_t>) {
    return v * scales[block * 2 + (i < rank ? 0 : 1)];
  } else {
    return v;
  }
}

// grid (num_queries, num_heads), kThreads threads; dynamic shared memory:
// width floats of the query.
template <typename T>
__global__ void MlaDecodeKernel(
    const float* __restrict__ q_abs,           // [queries, heads, width]
    const T* __restrict__ data,                // [blocks, block_size, width]
    const float* __restrict__ scales,          // [blocks, 2] or null
    const int32_t* __restrict__ block_tables,  // [queries, max_blocks]
    int32_t max_blocks, const int32_t* __restrict__ context_lens, int32_t heads,
    int32_t rank, int32_t width, int32_t block_size, float scale,
    float* __restrict__ out) {  // [queries, heads, rank]
  extern __shared__ float q_sm[];
  __shared__ float score_sm[kTile];
  const int query = blockIdx.x, head = blockIdx.y;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const float* q = q_abs + (int64_t{query} * heads + head) * width;
  for (int i = tid; i < width; i += kThreads) q_sm[i] = q[i];
  __syncthreads();
  const int ctx = context_lens[query];
  // A context past the query's block-table row (a caller bug) would read
  // another row: NaN output instead, which the engine turns into an INTERNAL
  // error for that request. The whole block returns together.
  if (ctx < 0 || int64_t{ctx} > int64_t{max_blocks} * block_size) {
    float* bad = out + (int64_t{query} * heads + head) * rank;
    for (int r = tid; r < rank; r += kThreads)
      bad[r] = __int_as_float(0x7fc00000);
    return;
  }
  const int32_t* table = block_tables + int64_t{query} * max_blocks;
  float acc[kMaxLatentPerThread];
#pragma unroll
  for (int k = 0; k < kMaxLatentPerThread; ++k) acc[k] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (int t0 = 0; t0 < ctx; t0 += kTile) {
    const int n = min(kTile, ctx - t0);
    for (int j = warp; j < n; j += kThreads / 32) {
      const int t = t0 + j;
      const int64_t block = table[t / block_size];
      const T* row = data + (block * block_size + t % block_size) * width;
      float s = 0.0f;
      for (int i = lane; i < width; i += 32)
        s += q_sm[i] * LoadLatent(row, scales, block, i, rank);
      s = detail::WarpSum(s);
      if (lane == 0) score_sm[j] = s * scale;
    }
    __syncthreads();
    float tile_max = -INFINITY;
    for (int j = 0; j < n; ++j) tile_max = fmaxf(tile_max, score_sm[j]);
    const float new_m = fmaxf(m, tile_max);
    const float corr = __expf(m - new_m);  // 0 on the first tile
    l *= corr;
#pragma unroll
    for (int k = 0; k < kMaxLatentPerThread; ++k) acc[k] *= corr;
    for (int j = 0; j < n; ++j) {
      const float p = __expf(score_sm[j] - new_m);
      l += p;
      const int t = t0 + j;
      const int64_t block = table[t / block_size];
      const T* row = data + (block * block_size + t % block_size) * width;
#pragma unroll
      for (int k = 0; k < kMaxLatentPerThread; ++k) {
        const int r = tid + k * kThreads;
        if (r < rank) acc[k] += p * LoadLatent(row, scales, block, r, rank);
      }
    }
    m = new_m;
    __syncthreads();  // score_sm is rewritten by the next tile
  }
  float* o = out + (int64_t{query} * heads + head) * rank;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
  for (int k = 0; k < kMaxLatentPerThread; ++k) {
    const int r = tid + k * kThreads;
    if (r < rank) o[r] = acc[k] * inv;
  }
}

template <typename T>
absl::Status Launch(const float* q_abs, const MlaLatentView& c,
                    const int32_t* block_tables, int32_t max_blocks,
                    const int32_t* context_lens, int32_t queries, int32_t heads,
                    float scale, float* out, cudaStream_t stream) {
  const int32_t width = c.kv_lora_rank + c.rope_dim;
  const dim3 grid(queries, heads);
  MlaDecodeKernel<T><<<grid, kThreads, width * sizeof(float), stream>>>(
      q_abs, static_cast<const T*>(c.data), c.scales, block_tables, max_blocks,
      context_lens, heads, c.kv_lora_rank, width, c.block_size, scale, out);
  return PDSERVE_CUDA_STATUS(cudaGetLastError());
}

}  // namespace

absl::Status InvokeMlaDecodeAttention(
    const float* q_abs, const MlaLatentView& cache, const int32_t* block_tables,
    int32_t max_blocks_per_seq, const int32_t* context_lens,
    int32_t num_queries, int32_t num_heads, float scale, float* out_lat,
    cudaStream_t stream) {
  if (cache.kv_lora_rank <= 0 ||
      cache.kv_lora_rank > kMaxLatentPerThread * kThreads ||
      cache.rope_dim < 0 || cache.block_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MLA decode: kv_lora_rank must be in [1, ",
        kMaxLatentPerThread * kThreads, "], got ", cache.kv_lora_rank));
  }
  if (num_queries == 0 || num_heads == 0) return absl::OkStatus();
  switch (cache.dtype) {
    case KvDtype::kF32:
      return Launch<float>(q_abs, cache, block_tables, max_blocks_per_seq,
                           context_lens, num_queries, num_heads, scale, out_lat,
                           stream);
    case KvDtype::kF16:
      return Launch<__half>(q_abs, cache, block_tables, max_blocks_per_seq,
                            context_lens, num_queries, num_heads, scale,
                            out_lat, stream);
    case KvDtype::kBF16:
      return Launch<__nv_bfloat16>(
          q_abs, cache, block_tables, max_blocks_per_seq, context_lens,
          num_queries, num_heads, scale, out_lat, stream);
    case KvDtype::kI8:
      return Launch<int8_t>(q_abs, cache, block_tables, max_blocks_per_seq,
                            context_lens, num_queries, num_heads, scale,
                            out_lat, stream);
    case KvDtype::kFp8E4M3:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "MLA decode: KV dtype ", KvDtypeName(cache.dtype), " is not supported"));
}

}  // namespace pdserve::kernels::cuda
