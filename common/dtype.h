// Element types for weights and the KV cache, with scalar conversions.
// Header-only and stateless, so thread-safe.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace pdserve {

// kFp8E4M3 is a KV-cache dtype of the CUDA backend only (the CPU kernels
// have no fp8 path; EngineConfig/BackendConfig refuse it on the CPU). Like
// kI8 it carries per-(block, K/V, head) fp32 scales; host code only stores
// and moves its bytes (transfer, tiers), never computes with them.
enum class DType : uint8_t {
  kF32 = 0,
  kF16 = 1,
  kBF16 = 2,
  kI8 = 3,
  kFp8E4M3 = 4
};

inline size_t DTypeBytes(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kI8:
    case DType::kFp8E4M3:
      return 1;
  }
  return 0;
}

// Names as used on the command line and in the model fingerprint.
inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "fp32";
    case DType::kF16:
      return "fp16";
    case DType::kBF16:
      return "bf16";
    case DType::kI8:
      return "int8";
    case DType::kFp8E4M3:
      return "fp8";
  }
  return "?";
}

inline std::optional<DType> ParseDType(std::string_view s) {
  if (s == "fp32" || s == "float32" || s == "f32") return DType::kF32;
  if (s == "fp16" || s == "float16" || s == "f16" || s == "half")
    return DType::kF16;
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  if (s == "int8" || s == "i8") return DType::kI8;
  if (s == "fp8" || s == "fp8_e4m3" || s == "fp8e4m3" || s == "e4m3")
    return DType::kFp8E4M3;
  return std::nullopt;
}

// Quantized KV dtypes (int8, fp8) carry fp32 scales per (block, K/V, head).
inline bool DTypeHasScales(DType t) {
  return t == DType::kI8 || t == DType::kFp8E4M3;
}

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bf16 is the high half of an fp32; rounding is to nearest even, NaN kept.
inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float Bf16ToFloat(uint16_t h) {
  return BitsFloat(static_cast<uint32_t>(h) << 16);
}

// IEEE 754 binary16, round to nearest even; overflow saturates to infinity.
inline uint16_t FloatToF16(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00u |
                                 (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u)
    return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {                         // subnormal half (or zero)
    // Scale into the subnormal range with the FPU doing the rounding.
    const float scaled = BitsFloat(abs) * 16777216.0f;  // 2^24
    return static_cast<uint16_t>(
        sign | static_cast<uint32_t>(__builtin_nearbyintf(scaled)));
  }
  uint32_t mant = abs & 0x7fffffu;
  uint32_t exp = (abs >> 23) - 112;  // rebias 127 -> 15
  uint32_t half = (exp << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(sign | half);
}
inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // 2^-24
    return (sign ? -v : v);
  }
  if (exp == 31) return BitsFloat(sign | 0x7f800000u | (mant << 13));
  return BitsFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

}  // namespace pdserve
