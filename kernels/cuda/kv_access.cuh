// Device-side element access for the paged KV cache: storage types, 16-byte
// vector unpacking, and the conversions the kernels share. Included only by
// .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/cuda/paged_kv.cuh"

namespace pdserve::kernels::cuda::detail {

// fp8-e4m3 storage: one byte. A tag type so that overloads can tell it from
// int8_t.
struct Fp8E4M3 {
  uint8_t bits;
};

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
__device__ __forceinline__ float ToFloat(int8_t v) {
  return static_cast<float>(v);
}
__device__ __forceinline__ float ToFloat(Fp8E4M3 v) {
  __nv_fp8_e4m3 f;
  f.__x = v.bits;
  return static_cast<float>(f);
}

template <typename T>
struct KvTraits {
  static constexpr bool kScaled = false;
  static constexpr float kMax = 0.0f;  // quantised types: largest magnitude
};
template <>
struct KvTraits<int8_t> {
  static constexpr bool kScaled = true;
  static constexpr float kMax = 127.0f;
};
template <>
struct KvTraits<Fp8E4M3> {
  static constexpr bool kScaled = true;
  static constexpr float kMax = 448.0f;
};

// Rounding stores (round to nearest even), matching common/dtype.h.
__device__ __forceinline__ void StoreFloat(float* p, float v) { *p = v; }
__device__ __forceinline__ void StoreFloat(__half* p, float v) {
  *p = __float2half_rn(v);
}
__device__ __forceinline__ void StoreFloat(__nv_bfloat16* p, float v) {
  *p = __float2bfloat16_rn(v);
}
// int8: the CPU's nearbyint + clamp to [-127, 127] (127 is the scale's max).
__device__ __forceinline__ void StoreFloat(int8_t* p, float v) {
  *p = static_cast<int8_t>(fminf(fmaxf(rintf(v), -127.0f), 127.0f));
}
// fp8: saturating to the largest finite value (448).
__device__ __forceinline__ void StoreFloat(Fp8E4M3* p, float v) {
  p->bits = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

// Number of elements of T in one 16-byte vector.
template <typename T>
constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));

// Unpacks the 16 bytes of `raw` into kVecElems<T> floats.
template <typename T>
__device__ __forceinline__ void Unpack16(const uint4& raw, float* out) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < kVecElems<T>; ++i) out[i] = ToFloat(e[i]);
}

// Read-only 16-byte load through the non-coherent cache: KV blocks are not
// written while attention reads them.
__device__ __forceinline__ uint4 Load16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// Element offset of (block, kv, head, slot 0, dim 0) in a layer.
__device__ __forceinline__ int64_t KvOffset(const PagedKvView& c, int64_t block,
                                            int kv, int head) {
  return ((block * 2 + kv) * c.num_kv_heads + head) *
         static_cast<int64_t>(c.block_size) * c.head_dim;
}

__device__ __forceinline__ int64_t ScaleIndex(const PagedKvView& c,
                                              int64_t block, int kv, int head) {
  return (block * 2 + kv) * c.num_kv_heads + head;
}

// fp16 operands for the tensor cores: clamp instead of overflowing to inf
// (bf16 KV could in principle exceed the fp16 range).
__device__ __forceinline__ __half ToHalfSat(float v) {
  return __float2half_rn(fminf(fmaxf(v, -65504.0f), 65504.0f));
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, mask));
  return v;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1)
    v += __shfl_xor_sync(0xffffffffu, v, mask);
  return v;
}

}  // namespace pdserve::kernels::cuda::detail
