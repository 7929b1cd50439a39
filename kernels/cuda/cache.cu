#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cache.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/kv_access.cuh"

namespace pdserve::kernels::cuda {
namespace {

using detail::Fp8E4M3;
using detail::KvTraits;

// Unquantised types: one block of threads per token, each element
// independent. grid: num_tokens; block: 128.
template <typename T>
__global__ void __launch_bounds__(128)
    CacheStoreKernel(const float* __restrict__ k,  // [num_tokens, kv_heads, hd]
                     const float* __restrict__ v,  // [num_tokens, kv_heads, hd]
                     const int64_t* __restrict__ slots,  // [num_tokens]
                     PagedKvView cache) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  const int64_t block = slot / cache.block_size;
  const int offset = static_cast<int>(slot % cache.block_size);
  const int hd = cache.head_dim;
  const int per_token = cache.num_kv_heads * hd;
  T* data = static_cast<T*>(cache.data);
  for (int i = threadIdx.x; i < 2 * per_token; i += blockDim.x) {
    const int which = i / per_token;
    const int rem = i % per_token;
    const int head = rem / hd;
    const int d = rem % hd;
    const float x = (which == 0 ? k : v)[t * per_token + rem];
    detail::StoreFloat(data + detail::KvOffset(cache, block, which, head) +
                           static_cast<int64_t>(offset) * hd + d,
                       x);
  }
}

__device__ __forceinline__ float Requantise(int8_t q, float ratio) {
  return static_cast<float>(q) * ratio;
}
__device__ __forceinline__ float Requantise(Fp8E4M3 q, float ratio) {
  return detail::ToFloat(q) * ratio;
}

// Quantised types: one warp per (run of consecutive tokens in one block,
// head, K/V), walking the run in order like the CPU. A warp whose token does
// not start a run exits at once. grid: (ceil(num_tokens / 4), kv_heads, 2);
// block: 128 (4 warps, one token each).
template <typename T>
__global__ void __launch_bounds__(128) CacheQuantiseKernel(
    const float* __restrict__ k,        // [num_tokens, kv_heads, hd]
    const float* __restrict__ v,        // [num_tokens, kv_heads, hd]
    const int64_t* __restrict__ slots,  // [num_tokens]
    int64_t num_tokens, PagedKvView cache) {
  const int lane = threadIdx.x % 32;
  const int64_t first = int64_t{blockIdx.x} * 4 + threadIdx.x / 32;
  const int head = blockIdx.y;
  const int which = blockIdx.z;
  if (first >= num_tokens) return;
  const int bs = cache.block_size;
  const int64_t slot0 = slots[first];
  if (slot0 < 0) return;
  const int64_t block = slot0 / bs;
  if (first > 0 && slots[first - 1] >= 0 && slots[first - 1] / bs == block)
    return;  // not the start of a run

  const int hd = cache.head_dim;
  const int per_token = cache.num_kv_heads * hd;
  const float* src_all = which == 0 ? k : v;
  T* base =
      static_cast<T*>(cache.data) + detail::KvOffset(cache, block, which, head);
  float* scale_ptr =
      cache.scales + detail::ScaleIndex(cache, block, which, head);
  float scale = *scale_ptr;
  for (int64_t t = first; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot / bs != block) break;
    const int offset = static_cast<int>(slot % bs);
    const float* src = src_all + t * per_token + int64_t{head} * hd;
    if (offset == 0) scale = 0.0f;
    float amax = 0.0f;
    for (int d = lane; d < hd; d += 32) amax = fmaxf(amax, fabsf(src[d]));
    amax = detail::WarpMax(amax);
    const float needed = amax / KvTraits<T>::kMax;
    if (needed > scale) {
      if (scale > 0.0f) {
        // Requantise the block's earlier entries to the larger scale.
        const float ratio = scale / needed;
        for (int i = lane; i < offset * hd; i += 32)
          detail::StoreFloat(base + i, Requantise(base[i], ratio));
        __syncwarp();
      }
      scale = needed;
    }
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int d = lane; d < hd; d += 32)
      detail::StoreFloat(base + static_cast<int64_t>(offset) * hd + d,
                         src[d] * inv);
    __syncwarp();
  }
  if (lane == 0) *scale_ptr = scale;
}

}  // namespace

absl::Status InvokeReshapeAndCache(const float* k, const float* v,
                                   const int64_t* slots, int64_t num_tokens,
                                   const PagedKvView& cache,
                                   cudaStream_t stream) {
  if (cache.data == nullptr || cache.num_kv_heads <= 0 || cache.head_dim <= 0 ||
      cache.block_size <= 0 || num_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "reshape_and_cache: bad geometry (kv_heads=", cache.num_kv_heads,
        " head_dim=", cache.head_dim, " block_size=", cache.block_size,
        " tokens=", num_tokens, ")"));
  }
  if (KvDtypeHasScales(cache.dtype) && cache.scales == nullptr) {
    return absl::InvalidArgumentError(
        "reshape_and_cache: quantised KV needs scales");
  }
  if (num_tokens == 0) return absl::OkStatus();
  const dim3 qgrid(static_cast<unsigned>((num_tokens + 3) / 4),
                   cache.num_kv_heads, 2);
  switch (cache.dtype) {
    case KvDtype::kF32:
      CacheStoreKernel<float>
          <<<static_cast<unsigned>(num_tokens), 128, 0, stream>>>(k, v, slots,
                                                                  cache);
      break;
    case KvDtype::kF16:
      CacheStoreKernel<__half>
          <<<static_cast<unsigned>(num_tokens), 128, 0, stream>>>(k, v, slots,
                                                                  cache);
      break;
    case KvDtype::kBF16:
      CacheStoreKernel<__nv_bfloat16>
          <<<static_cast<unsigned>(num_tokens), 128, 0, stream>>>(k, v, slots,
                                                                  cache);
      break;
    case KvDtype::kI8:
      CacheQuantiseKernel<int8_t>
          <<<qgrid, 128, 0, stream>>>(k, v, slots, num_tokens, cache);
      break;
    case KvDtype::kFp8E4M3:
      CacheQuantiseKernel<Fp8E4M3>
          <<<qgrid, 128, 0, stream>>>(k, v, slots, num_tokens, cache);
      break;
  }
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace pdserve::kernels::cuda
