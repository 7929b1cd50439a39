// The paged KV cache as the CUDA kernels see it: one layer's device buffers
// and their element type. Host-includable (no device code).
//
// Layout of one layer (the CPU layout, kernels/cpu/paged_attention.h):
//   data:   [num_blocks][2 (K,V)][kv_heads][block_size][head_dim] of `dtype`
//   scales: [num_blocks][2 (K,V)][kv_heads] fp32, for int8 and fp8 only
// A (block, K/V, head) run of block_size * head_dim elements is contiguous,
// which the attention kernels read with 16-byte loads.
//
// KvDtype mirrors the engine's DType (common/dtype.h), whose kFp8E4M3 is a
// CUDA-only KV dtype: the CPU engine has no fp8 path, so an fp8 pool can
// only be made by the CUDA backend (hosts just store and move its bytes).
#pragma once

#include <cstdint>
#include <optional>

#include "common/dtype.h"

namespace pdserve::kernels::cuda {

enum class KvDtype : uint8_t { kF32, kF16, kBF16, kI8, kFp8E4M3 };

inline int KvDtypeBytes(KvDtype t) {
  switch (t) {
    case KvDtype::kF32:
      return 4;
    case KvDtype::kF16:
    case KvDtype::kBF16:
      return 2;
    case KvDtype::kI8:
    case KvDtype::kFp8E4M3:
      return 1;
  }
  return 0;
}

// int8 and fp8 carry per-(block, K/V, head) fp32 scales.
inline bool KvDtypeHasScales(KvDtype t) {
  return t == KvDtype::kI8 || t == KvDtype::kFp8E4M3;
}

inline const char* KvDtypeName(KvDtype t) {
  switch (t) {
    case KvDtype::kF32:
      return "fp32";
    case KvDtype::kF16:
      return "fp16";
    case KvDtype::kBF16:
      return "bf16";
    case KvDtype::kI8:
      return "int8";
    case KvDtype::kFp8E4M3:
      return "fp8e4m3";
  }
  return "?";
}

inline KvDtype KvDtypeFromDType(DType t) {
  switch (t) {
    case DType::kF32:
      return KvDtype::kF32;
    case DType::kF16:
      return KvDtype::kF16;
    case DType::kBF16:
      return KvDtype::kBF16;
    case DType::kI8:
      return KvDtype::kI8;
    case DType::kFp8E4M3:
      return KvDtype::kFp8E4M3;
  }
  return KvDtype::kF32;
}

// One layer of a paged cache in device memory. Passed to kernels by value.
struct PagedKvView {
  void* data = nullptr;     // see layout above
  float* scales = nullptr;  // int8 / fp8 only
  KvDtype dtype = KvDtype::kF16;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_size = 0;
  int64_t num_blocks = 0;

  int64_t LayerBytes() const {
    return num_blocks * 2 * num_kv_heads * block_size * head_dim *
           KvDtypeBytes(dtype);
  }
  int64_t ScaleCount() const {
    return KvDtypeHasScales(dtype) ? num_blocks * 2 * num_kv_heads : 0;
  }
};

}  // namespace pdserve::kernels::cuda
