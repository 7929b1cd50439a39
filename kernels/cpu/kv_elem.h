// One element of a host KV cache in its stored dtype, to and from fp32: the
// conversions the CPU attention kernels and the MLA latent cache share. int8
// rounds to nearest and saturates at +-127 (the caller applies the block's
// scale); fp8 is a CUDA-only KV dtype, read as 0 and never written here.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/dtype.h"

namespace pdserve::kernels {

inline int8_t QuantizeI8(float v) {
  return static_cast<int8_t>(std::clamp(std::nearbyint(v), -127.0f, 127.0f));
}

inline float LoadKvElem(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(base)[i];
    case DType::kF16:
      return F16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kBF16:
      return Bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kI8:
      return static_cast<float>(static_cast<const int8_t*>(base)[i]);
    case DType::kFp8E4M3:
      break;
  }
  return 0.0f;
}

inline void StoreKvElem(void* base, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(base)[i] = v;
      break;
    case DType::kF16:
      static_cast<uint16_t*>(base)[i] = FloatToF16(v);
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(base)[i] = FloatToBf16(v);
      break;
    case DType::kI8:
      static_cast<int8_t*>(base)[i] = QuantizeI8(v);
      break;
    case DType::kFp8E4M3:
      break;
  }
}

}  // namespace pdserve::kernels
