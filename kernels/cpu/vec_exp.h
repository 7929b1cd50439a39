// exp(x) for x <= 0 in three instruction sets that give the same bits:
// portable (std::fma), AVX2 (8 lanes) and AVX-512 (16 lanes). Used by paged
// attention's softmax and by SiLU. A file that includes this must be built
// with -ffp-contract=off, so that the compiler fuses nothing but the FMAs
// written here and the caller's arithmetic around them.
//
// Exp(x), x <= 0: 0 below -87; else n = nearest-even(x * log2 e),
// r = x - n ln2 (two FMAs, ln2 split in hi + lo), a degree-7 Taylor
// polynomial in r by Horner with FMAs (|r| <= 0.35: truncation < 1e-8), times
// 2^n built from its exponent bits. Within 2 ulp of exp; not libm's bits.
// Positive arguments are clamped to 0 (result 1); NaN stays NaN.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pdserve::kernels::vec_exp {

// GCC 12 warns that its own AVX-512 intrinsics read an uninitialised
// "undefined" pass-through operand (a false positive, GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

constexpr float kExpMin = -87.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f;
constexpr float kLn2Lo = 1.42860682030941723212e-6f;
constexpr float kExpC[6] = {1.0f / 5040, 1.0f / 720, 1.0f / 120,
                            1.0f / 24,   1.0f / 6,   0.5f};

// NaN stays NaN (in attention a NaN score poisons the softmax, so the output
// and then the logits carry it and the engine ends the request, instead of
// dropping that key silently); below kExpMin the result is 0.
inline float ExpPortable(float x) {
  if (x != x) return x;
  if (!(x >= kExpMin)) return 0.0f;
  x = std::min(x, 0.0f);
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(-n, kLn2Hi, x);
  r = std::fma(-n, kLn2Lo, r);
  float p = kExpC[0];
  for (int c = 1; c < 6; ++c) p = std::fma(p, r, kExpC[c]);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127)
                        << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

__attribute__((target("avx512f"))) inline __m512 Exp16(__m512 x) {
  const __m512 in = x;
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __mmask16 ok =
      _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_GE_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_setzero_ps()),
                    _mm512_set1_ps(kExpMin));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpC[0]);
  for (int c = 1; c < 6; ++c)
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC[c]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mask_mov_ps(
      _mm512_maskz_mov_ps(ok, _mm512_mul_ps(p, _mm512_castsi512_ps(bits))), nan,
      in);
}

__attribute__((target("avx2,fma"))) inline __m256 Exp8(__m256 x) {
  const __m256 in = x;
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 ok = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMin), _CMP_GE_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_setzero_ps()),
                    _mm256_set1_ps(kExpMin));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpC[0]);
  for (int c = 1; c < 6; ++c)
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC[c]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_blendv_ps(
      _mm256_and_ps(ok, _mm256_mul_ps(p, _mm256_castsi256_ps(bits))), in, nan);
}

#pragma GCC diagnostic pop

}  // namespace pdserve::kernels::vec_exp
