// The per-block arithmetic of paged attention (paged_attention_internal.h):
// key transpose, scores, online softmax and accumulation, in portable, AVX2
// and AVX-512 versions that give the same bits.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/paged_attention_internal.h"
#include "kernels/cpu/vec_exp.h"

namespace pdserve::kernels::paged_attention_internal {

AttnIsa BestAttnIsa() {
  if (__builtin_cpu_supports("avx512f")) return AttnIsa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return AttnIsa::kAvx2;
  return AttnIsa::kPortable;
}

AttnIsa& ActiveAttnIsa() {
  static AttnIsa isa = BestAttnIsa();
  return isa;
}

// --- Attention arithmetic: one definition, three instruction sets ---------
// What a query state computes per KV block, written so that the AVX-512 (16
// keys per vector), AVX2 (8) and portable (1) versions run the same IEEE
// operations on every element and so agree bit for bit (this file is built
// with -ffp-contract=off, so only the FMAs written below are fused):
//   score_t  = (FMA chain over i in order of q[i] * k_t[i], from 0) * scale
//   m'       = max(m, max_t score_t);  c = Exp(m - m');  l = l * c
//   p_t      = Exp(score_t - m');      l += p_t for t in order
//   acc[i]   = acc[i] * c, then acc[i] += p_t * v_t[i] for t in order
// Exp is vec_exp.h's.

// GCC 12 warns that its own AVX-512 intrinsics read an uninitialised
// "undefined" pass-through operand (a false positive, GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

using vec_exp::Exp16;
using vec_exp::Exp8;
using vec_exp::ExpPortable;

// kt[i * ldk + t] = k[t * d + i] for t < count, and 0 for count <= t < ldk:
// a block's keys, one row per dimension, so that 16 keys' scores are 16
// lanes of one FMA chain. A pure data move: every ISA gives the same kt.
void TransposeKeysPortable(const float* k, int count, int d, int ldk,
                           float* kt) {
  for (int t = 0; t < count; ++t) {
    for (int i = 0; i < d; ++i)
      kt[int64_t{i} * ldk + t] = k[int64_t{t} * d + i];
  }
  for (int i = 0; count < ldk && i < d; ++i)
    std::fill_n(kt + int64_t{i} * ldk + count, ldk - count, 0.0f);
}

// Elements [idx, idx + 16) of a KV block of dtype T (at `base`) as fp32:
// what WidenAvx512 gives for them (int8 times the block's scale), so that a
// block read this way computes the same bits as one widened first.
template <DType T>
PDSERVE_ATTN_AVX512 inline __m512 Load16(const void* base, int64_t idx,
                                         __m512 scale) {
  if constexpr (T == DType::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + idx);
  } else if constexpr (T == DType::kBF16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                static_cast<const uint16_t*>(base) + idx))),
        16));
  } else if constexpr (T == DType::kF16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        static_cast<const uint16_t*>(base) + idx)));
  } else {
    static_assert(T == DType::kI8);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                 static_cast<const int8_t*>(base) + idx)))),
                         scale);
  }
}

// The same for ldk == 16 and d % 16 == 0, one 16 x 16 register transpose per
// 16 dimensions (missing keys are zero rows), reading fp32 keys or widening
// a bf16, fp16 or int8 block (Load16) on the way.
template <DType T = DType::kF32>
PDSERVE_ATTN_AVX512 void TransposeKeys16Avx512(const void* k, int count, int d,
                                               float* kt, float scale = 1.0f) {
  const __m512 sv = _mm512_set1_ps(scale);
  for (int j = 0; j < d; j += 16) {
    __m512 r[16], t[16], u[16];
    for (int row = 0; row < 16; ++row) {
      r[row] = row < count ? Load16<T>(k, int64_t{row} * d + j, sv)
                           : _mm512_setzero_ps();
    }
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // u[4i + c], 128-bit lane L: rows 4i..4i+3 of column 4L + c.
    for (int i = 0; i < 4; ++i) {
      u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
      u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
      u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
      u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int c = 0; c < 4; ++c) {
      const __m512 p = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
      const __m512 q = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xdd);
      const __m512 rr = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
      const __m512 s = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xdd);
      float* out = kt + int64_t{j} * 16;
      _mm512_storeu_ps(out + c * 16, _mm512_shuffle_f32x4(p, rr, 0x88));
      _mm512_storeu_ps(out + (8 + c) * 16, _mm512_shuffle_f32x4(p, rr, 0xdd));
      _mm512_storeu_ps(out + (4 + c) * 16, _mm512_shuffle_f32x4(q, s, 0x88));
      _mm512_storeu_ps(out + (12 + c) * 16, _mm512_shuffle_f32x4(q, s, 0xdd));
    }
  }
}

// Key r of a block's keys k [count][d], dimensions [j, j + 8); zero past
// the last key.
PDSERVE_ATTN_AVX2 inline __m256 KeyRowAvx2(const float* k, int count, int r,
                                           int d, int j) {
  return r < count ? _mm256_loadu_ps(k + int64_t{r} * d + j)
                   : _mm256_setzero_ps();
}

// TransposeKeys16Avx512 with AVX2, for ldk == 16 and d % 8 == 0: per 8 keys
// and 8 dimensions, one 8 x 8 register transpose (missing keys are zero
// rows). Named registers rather than arrays: GCC kept arrays of the 24
// vectors on the stack.
PDSERVE_ATTN_AVX2 void TransposeKeys16Avx2(const float* k, int count, int d,
                                           float* kt) {
  for (int t0 = 0; t0 < 16; t0 += 8) {
    for (int j = 0; j < d; j += 8) {
      const __m256 r0 = KeyRowAvx2(k, count, t0 + 0, d, j),
                   r1 = KeyRowAvx2(k, count, t0 + 1, d, j),
                   r2 = KeyRowAvx2(k, count, t0 + 2, d, j),
                   r3 = KeyRowAvx2(k, count, t0 + 3, d, j),
                   r4 = KeyRowAvx2(k, count, t0 + 4, d, j),
                   r5 = KeyRowAvx2(k, count, t0 + 5, d, j),
                   r6 = KeyRowAvx2(k, count, t0 + 6, d, j),
                   r7 = KeyRowAvx2(k, count, t0 + 7, d, j);
      const __m256 a0 = _mm256_unpacklo_ps(r0, r1);
      const __m256 a1 = _mm256_unpackhi_ps(r0, r1);
      const __m256 a2 = _mm256_unpacklo_ps(r2, r3);
      const __m256 a3 = _mm256_unpackhi_ps(r2, r3);
      const __m256 a4 = _mm256_unpacklo_ps(r4, r5);
      const __m256 a5 = _mm256_unpackhi_ps(r4, r5);
      const __m256 a6 = _mm256_unpacklo_ps(r6, r7);
      const __m256 a7 = _mm256_unpackhi_ps(r6, r7);
      // uC (C < 4), 128-bit lane L: rows 0..3 of column 4L + C; vC the same
      // for rows 4..7.
      const __m256 u0 = _mm256_shuffle_ps(a0, a2, 0x44);
      const __m256 u1 = _mm256_shuffle_ps(a0, a2, 0xee);
      const __m256 u2 = _mm256_shuffle_ps(a1, a3, 0x44);
      const __m256 u3 = _mm256_shuffle_ps(a1, a3, 0xee);
      const __m256 v0 = _mm256_shuffle_ps(a4, a6, 0x44);
      const __m256 v1 = _mm256_shuffle_ps(a4, a6, 0xee);
      const __m256 v2 = _mm256_shuffle_ps(a5, a7, 0x44);
      const __m256 v3 = _mm256_shuffle_ps(a5, a7, 0xee);
      float* out = kt + int64_t{j} * 16 + t0;
      _mm256_storeu_ps(out + 0 * 16, _mm256_permute2f128_ps(u0, v0, 0x20));
      _mm256_storeu_ps(out + 1 * 16, _mm256_permute2f128_ps(u1, v1, 0x20));
      _mm256_storeu_ps(out + 2 * 16, _mm256_permute2f128_ps(u2, v2, 0x20));
      _mm256_storeu_ps(out + 3 * 16, _mm256_permute2f128_ps(u3, v3, 0x20));
      _mm256_storeu_ps(out + 4 * 16, _mm256_permute2f128_ps(u0, v0, 0x31));
      _mm256_storeu_ps(out + 5 * 16, _mm256_permute2f128_ps(u1, v1, 0x31));
      _mm256_storeu_ps(out + 6 * 16, _mm256_permute2f128_ps(u2, v2, 0x31));
      _mm256_storeu_ps(out + 7 * 16, _mm256_permute2f128_ps(u3, v3, 0x31));
    }
  }
}

void TransposeKeys(AttnIsa isa, const float* k, int count, int d, int ldk,
                   float* kt) {
  if (isa == AttnIsa::kAvx512 && ldk == 16 && d % 16 == 0) {
    TransposeKeys16Avx512(k, count, d, kt);
    return;
  }
  if (isa == AttnIsa::kAvx2 && ldk == 16 && d % 8 == 0) {
    TransposeKeys16Avx2(k, count, d, kt);
    return;
  }
  TransposeKeysPortable(k, count, d, ldk, kt);
}

// Scores of `ns` query states (q rows qs[s]) against a block's keys held
// transposed, kt[i * ldk + t] = k_t[i], t < ldk (a multiple of 16, zero past
// the block's keys): out[s * ldk + t] for every t < ldk.
void ScoresPortable(const float* const* qs, int ns, const float* kt, int d,
                    int ldk, float scale, float* out) {
  for (int s = 0; s < ns; ++s) {
    for (int t = 0; t < ldk; ++t) {
      float a = 0.0f;
      for (int i = 0; i < d; ++i) a = std::fma(qs[s][i], kt[i * ldk + t], a);
      out[s * ldk + t] = a * scale;
    }
  }
}

// S states at once: S independent FMA chains per key vector.
template <int S>
PDSERVE_ATTN_AVX512 void ScoresAvx512Tile(const float* const* qs,
                                          const float* kt, int d, int ldk,
                                          float scale, float* out) {
  for (int t0 = 0; t0 < ldk; t0 += 16) {
    __m512 acc[S];
    for (int s = 0; s < S; ++s) acc[s] = _mm512_setzero_ps();
    for (int i = 0; i < d; ++i) {
      const __m512 kv = _mm512_loadu_ps(kt + i * ldk + t0);
      for (int s = 0; s < S; ++s)
        acc[s] = _mm512_fmadd_ps(_mm512_set1_ps(qs[s][i]), kv, acc[s]);
    }
    for (int s = 0; s < S; ++s)
      _mm512_storeu_ps(out + s * ldk + t0,
                       _mm512_mul_ps(acc[s], _mm512_set1_ps(scale)));
  }
}

// S states by T 8-key vectors at once (ldk is a multiple of 16, so T = 2
// always divides it): S x T independent FMA chains. The AVX2 tiles unroll
// their register-array loops explicitly (`#pragma GCC unroll`), as in
// packed_gemm_avx2.cc: without it GCC 12 kept the accumulator arrays on the
// stack.
template <int S, int T = S >= 8 ? 1 : 2>
PDSERVE_ATTN_AVX2 void ScoresAvx2Tile(const float* const* qs, const float* kt,
                                      int d, int ldk, float scale, float* out) {
  for (int t0 = 0; t0 < ldk; t0 += 8 * T) {
    __m256 acc[S][T];
#pragma GCC unroll 16
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 16
      for (int u = 0; u < T; ++u) acc[s][u] = _mm256_setzero_ps();
    for (int i = 0; i < d; ++i) {
      __m256 kv[T];
#pragma GCC unroll 16
      for (int u = 0; u < T; ++u)
        kv[u] = _mm256_loadu_ps(kt + i * ldk + t0 + 8 * u);
#pragma GCC unroll 16
      for (int s = 0; s < S; ++s) {
        const __m256 qv = _mm256_set1_ps(qs[s][i]);
#pragma GCC unroll 16
        for (int u = 0; u < T; ++u)
          acc[s][u] = _mm256_fmadd_ps(qv, kv[u], acc[s][u]);
      }
    }
#pragma GCC unroll 16
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 16
      for (int u = 0; u < T; ++u)
        _mm256_storeu_ps(out + s * ldk + t0 + 8 * u,
                         _mm256_mul_ps(acc[s][u], _mm256_set1_ps(scale)));
  }
}

void Scores(AttnIsa isa, const float* const* qs, int ns, const float* kt, int d,
            int ldk, float scale, float* out) {
  if (isa == AttnIsa::kPortable)
    return ScoresPortable(qs, ns, kt, d, ldk, scale, out);
  int s = 0;
  const bool wide = isa == AttnIsa::kAvx512;
  // Eight states keep both FMA pipes busy through the 4-cycle FMA latency.
  for (; s + 8 <= ns; s += 8) {
    if (wide) {
      ScoresAvx512Tile<8>(qs + s, kt, d, ldk, scale, out + s * ldk);
    } else {
      ScoresAvx2Tile<8>(qs + s, kt, d, ldk, scale, out + s * ldk);
    }
  }
  for (; s + 4 <= ns; s += 4) {
    if (wide) {
      ScoresAvx512Tile<4>(qs + s, kt, d, ldk, scale, out + s * ldk);
    } else {
      ScoresAvx2Tile<4>(qs + s, kt, d, ldk, scale, out + s * ldk);
    }
  }
  for (; s < ns; ++s) {
    if (wide) {
      ScoresAvx512Tile<1>(qs + s, kt, d, ldk, scale, out + s * ldk);
    } else {
      ScoresAvx2Tile<1>(qs + s, kt, d, ldk, scale, out + s * ldk);
    }
  }
}

// Scores of two units at once, ns states each (query rows qa[s], qb[s]),
// against their transposed keys kta, ktb: what Scores gives for each, with
// the two units' FMA chains interleaved (four states of one unit are four
// chains, too few to cover the FMA latency).
template <int S>
PDSERVE_ATTN_AVX512 void ScoresAvx512PairTile(
    const float* const* qa, const float* kta, const float* const* qb,
    const float* ktb, int d, int ldk, float scale, float* outa, float* outb) {
  for (int t0 = 0; t0 < ldk; t0 += 16) {
    __m512 a[S], b[S];
    for (int s = 0; s < S; ++s) a[s] = b[s] = _mm512_setzero_ps();
    for (int i = 0; i < d; ++i) {
      const __m512 ka = _mm512_loadu_ps(kta + i * ldk + t0);
      const __m512 kb = _mm512_loadu_ps(ktb + i * ldk + t0);
      for (int s = 0; s < S; ++s) {
        a[s] = _mm512_fmadd_ps(_mm512_set1_ps(qa[s][i]), ka, a[s]);
        b[s] = _mm512_fmadd_ps(_mm512_set1_ps(qb[s][i]), kb, b[s]);
      }
    }
    const __m512 sv = _mm512_set1_ps(scale);
    for (int s = 0; s < S; ++s) {
      _mm512_storeu_ps(outa + s * ldk + t0, _mm512_mul_ps(a[s], sv));
      _mm512_storeu_ps(outb + s * ldk + t0, _mm512_mul_ps(b[s], sv));
    }
  }
}

void ScoresPair(AttnIsa isa, const float* const* qa, const float* kta,
                float* outa, const float* const* qb, const float* ktb,
                float* outb, int ns, int d, int ldk, float scale) {
  int s = 0;
  if (isa == AttnIsa::kAvx512) {
    for (; s + 4 <= ns; s += 4) {
      ScoresAvx512PairTile<4>(qa + s, kta, qb + s, ktb, d, ldk, scale,
                              outa + s * ldk, outb + s * ldk);
    }
  }
  Scores(isa, qa + s, ns - s, kta, d, ldk, scale, outa + s * ldk);
  Scores(isa, qb + s, ns - s, ktb, d, ldk, scale, outb + s * ldk);
}

// p[t] = Exp(scores[t] - m) for t < n (n rounded up to the vector width;
// p has room for it).
void Weights(AttnIsa isa, const float* scores, int n, float m, float* p);

PDSERVE_ATTN_AVX512 void WeightsAvx512(const float* scores, int n, float m,
                                       float* p) {
  for (int t = 0; t < n; t += 16) {
    _mm512_storeu_ps(p + t, Exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + t),
                                                _mm512_set1_ps(m))));
  }
}

PDSERVE_ATTN_AVX2 void WeightsAvx2(const float* scores, int n, float m,
                                   float* p) {
  for (int t = 0; t < n; t += 8) {
    _mm256_storeu_ps(p + t, Exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t),
                                               _mm256_set1_ps(m))));
  }
}

void Weights(AttnIsa isa, const float* scores, int n, float m, float* p) {
  switch (isa) {
    case AttnIsa::kAvx512:
      return WeightsAvx512(scores, n, m, p);
    case AttnIsa::kAvx2:
      return WeightsAvx2(scores, n, m, p);
    case AttnIsa::kPortable:
      for (int t = 0; t < n; ++t) p[t] = ExpPortable(scores[t] - m);
      return;
  }
}

// out[j] = Exp(x[j]) for j < n (n <= kAccStates), in the vector unit where
// there is one (the portable version's std::fma is a libm call when the file
// is built for baseline x86); Exp is lane-wise, so each value is what a
// one-value call gives.
PDSERVE_ATTN_AVX512 void ExpStatesAvx512(const float* x, int n, float* out) {
  const __mmask16 k = static_cast<__mmask16>((1u << n) - 1);
  _mm512_mask_storeu_ps(out, k, Exp16(_mm512_maskz_loadu_ps(k, x)));
}
static_assert(kAccStates <= 8, "ExpStates holds the states in one vector");
PDSERVE_ATTN_AVX2 void ExpStatesAvx2(const float* x, int n, float* out) {
  alignas(32) float in[8] = {}, res[8];
  std::copy_n(x, n, in);
  _mm256_store_ps(res, Exp8(_mm256_load_ps(in)));
  std::copy_n(res, n, out);
}
void ExpStates(AttnIsa isa, const float* x, int n, float* out) {
  switch (isa) {
    case AttnIsa::kAvx512:
      return ExpStatesAvx512(x, n, out);
    case AttnIsa::kAvx2:
      return ExpStatesAvx2(x, n, out);
    case AttnIsa::kPortable:
      break;
  }
  for (int j = 0; j < n; ++j) out[j] = ExpPortable(x[j]);
}

// The largest of scores[0, valid), NaNs left out (as std::max(max, s) leaves
// them), -inf if none. Maximum is exact, so every ISA gives the same value.
float BlockMaxPortable(const float* scores, int valid) {
  float block_max = -std::numeric_limits<float>::infinity();
  for (int t = 0; t < valid; ++t) block_max = std::max(block_max, scores[t]);
  return block_max;
}

PDSERVE_ATTN_AVX512 float BlockMaxAvx512(const float* scores, int valid) {
  const __m512 neg_inf =
      _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mx = neg_inf;
  for (int t = 0; t < valid; t += 16) {
    const __mmask16 in = valid - t >= 16
                             ? static_cast<__mmask16>(0xffff)
                             : static_cast<__mmask16>((1u << (valid - t)) - 1);
    __m512 x = _mm512_mask_loadu_ps(neg_inf, in, scores + t);
    // NaN lanes become -inf, so they never win.
    x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), neg_inf);
    mx = _mm512_max_ps(mx, x);
  }
  return _mm512_reduce_max_ps(mx);
}

PDSERVE_ATTN_AVX2 float BlockMaxAvx2(const float* scores, int valid) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m256 neg_inf8 = _mm256_set1_ps(neg_inf);
  __m256 mx = neg_inf8;
  int t = 0;
  for (; t + 8 <= valid; t += 8) {
    __m256 x = _mm256_loadu_ps(scores + t);
    // NaN lanes become -inf, so they never win.
    x = _mm256_blendv_ps(x, neg_inf8, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, x);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float block_max = neg_inf;
  for (float x : lanes) block_max = std::max(block_max, x);
  for (; t < valid; ++t) block_max = std::max(block_max, scores[t]);
  return block_max;
}

float BlockMax(AttnIsa isa, const float* scores, int valid) {
  switch (isa) {
    case AttnIsa::kAvx512:
      return BlockMaxAvx512(scores, valid);
    case AttnIsa::kAvx2:
      return BlockMaxAvx2(scores, valid);
    case AttnIsa::kPortable:
      break;
  }
  return BlockMaxPortable(scores, valid);
}

// The online-softmax step of ns states (ns <= kAccStates) over a block's
// `valid` scores (state j's at scores + j * ldk): m[j] and l[j] updated,
// p + j * ldk the weights, c[j] the factor for the accumulators. Each l[j]
// adds its weights in t order as before; the states' sums are independent
// chains, run side by side in registers.
void ScoresToWeights(AttnIsa isa, const float* scores, int ldk, int ns,
                     int valid, float* m, float* l, float* p, float* c) {
  float sum[kAccStates], new_m[kAccStates], shift[kAccStates];
  for (int j = 0; j < ns; ++j) {
    const float* sj = scores + int64_t{j} * ldk;
    const float block_max = BlockMax(isa, sj, valid);
    new_m[j] = std::max(m[j], block_max);
    shift[j] = m[j] - new_m[j];
  }
  ExpStates(isa, shift, ns, c);
  for (int j = 0; j < ns; ++j) {
    sum[j] = l[j] * c[j];
    Weights(isa, scores + int64_t{j} * ldk, valid, new_m[j],
            p + int64_t{j} * ldk);
    m[j] = new_m[j];
  }
  if (ns == kAccStates) {
    for (int t = 0; t < valid; ++t) {
      for (int j = 0; j < kAccStates; ++j) sum[j] += p[int64_t{j} * ldk + t];
    }
  } else {
    for (int j = 0; j < ns; ++j) {
      for (int t = 0; t < valid; ++t) sum[j] += p[int64_t{j} * ldk + t];
    }
  }
  for (int j = 0; j < ns; ++j) l[j] = sum[j];
}

void AccumulatePortable(const float* p, int valid, float correction,
                        const float* v, int d, float* a) {
  for (int i = 0; i < d; ++i) a[i] *= correction;
  for (int t = 0; t < valid; ++t) {
    const float* vv = v + int64_t{t} * d;
    for (int i = 0; i < d; ++i) a[i] += p[t] * vv[i];
  }
}

PDSERVE_ATTN_AVX512 void AccumulateAvx512(const float* p, int valid,
                                          float correction, const float* v,
                                          int d, float* a) {
  const __m512 c = _mm512_set1_ps(correction);
  int i = 0;
  for (; i + 16 <= d; i += 16) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a + i), c);
    for (int t = 0; t < valid; ++t) {
      acc = _mm512_add_ps(
          acc, _mm512_mul_ps(_mm512_set1_ps(p[t]),
                             _mm512_loadu_ps(v + int64_t{t} * d + i)));
    }
    _mm512_storeu_ps(a + i, acc);
  }
  for (; i < d; ++i) {
    float x = a[i] * correction;
    for (int t = 0; t < valid; ++t) x += p[t] * v[int64_t{t} * d + i];
    a[i] = x;
  }
}

// AccumulateAvx512 for NS states at once (weights p[s * ldp + t * LDT],
// factors c[s], accumulators a + s * d) over SEG 16-wide segments from
// dimension i: each V row segment is loaded once for all NS states. Every
// element sees the same operations in the same order as in AccumulateAvx512.
template <int NS, int SEG, DType T = DType::kF32, int LDT = 1>
PDSERVE_ATTN_AVX512 void AccumulateStatesTile(const float* p, int ldp,
                                              int valid, const float* c,
                                              const void* v, int d, float* a,
                                              int i, float v_scale = 1.0f) {
  const __m512 sv = _mm512_set1_ps(v_scale);
  __m512 acc[NS][SEG];
  for (int s = 0; s < NS; ++s) {
    const __m512 cs = _mm512_set1_ps(c[s]);
    for (int j = 0; j < SEG; ++j)
      acc[s][j] =
          _mm512_mul_ps(_mm512_loadu_ps(a + int64_t{s} * d + i + 16 * j), cs);
  }
  for (int t = 0; t < valid; ++t) {
    __m512 vv[SEG];
    for (int j = 0; j < SEG; ++j)
      vv[j] = Load16<T>(v, int64_t{t} * d + i + 16 * j, sv);
    for (int s = 0; s < NS; ++s) {
      const __m512 ps = _mm512_set1_ps(p[s * ldp + t * LDT]);
      for (int j = 0; j < SEG; ++j)
        acc[s][j] = _mm512_add_ps(acc[s][j], _mm512_mul_ps(ps, vv[j]));
    }
  }
  for (int s = 0; s < NS; ++s) {
    for (int j = 0; j < SEG; ++j)
      _mm512_storeu_ps(a + int64_t{s} * d + i + 16 * j, acc[s][j]);
  }
}

// The accumulation of ns states over dimensions [i, d), one at a time: what
// the vector versions run past their last whole vector.
void AccumulateDimsPortable(const float* p, int ldp, int ns, int valid,
                            const float* c, const float* v, int d, float* a,
                            int i) {
  for (int s = 0; s < ns; ++s) {
    float* as = a + int64_t{s} * d;
    for (int k = i; k < d; ++k) {
      float x = as[k] * c[s];
      for (int t = 0; t < valid; ++t)
        x += p[s * ldp + t] * v[int64_t{t} * d + k];
      as[k] = x;
    }
  }
}

template <int NS>
PDSERVE_ATTN_AVX512 void AccumulateStatesAvx512(const float* p, int ldp,
                                                int valid, const float* c,
                                                const float* v, int d,
                                                float* a) {
  int i = 0;
  for (; i + 64 <= d; i += 64)
    AccumulateStatesTile<NS, 4>(p, ldp, valid, c, v, d, a, i);
  for (; i + 16 <= d; i += 16)
    AccumulateStatesTile<NS, 1>(p, ldp, valid, c, v, d, a, i);
  AccumulateDimsPortable(p, ldp, NS, valid, c, v, d, a, i);
}

// AccumulateStatesTile with AVX2: NS states over SEG 8-wide segments from
// dimension i, fp32 V rows; the same operations on every element.
template <int NS, int SEG>
PDSERVE_ATTN_AVX2 void AccumulateStatesAvx2Tile(const float* p, int ldp,
                                                int valid, const float* c,
                                                const float* v, int d, float* a,
                                                int i) {
  __m256 acc[NS][SEG];
#pragma GCC unroll 16
  for (int s = 0; s < NS; ++s) {
    const __m256 cs = _mm256_set1_ps(c[s]);
#pragma GCC unroll 16
    for (int j = 0; j < SEG; ++j)
      acc[s][j] =
          _mm256_mul_ps(_mm256_loadu_ps(a + int64_t{s} * d + i + 8 * j), cs);
  }
  for (int t = 0; t < valid; ++t) {
    __m256 vv[SEG];
#pragma GCC unroll 16
    for (int j = 0; j < SEG; ++j)
      vv[j] = _mm256_loadu_ps(v + int64_t{t} * d + i + 8 * j);
#pragma GCC unroll 16
    for (int s = 0; s < NS; ++s) {
      const __m256 ps = _mm256_set1_ps(p[s * ldp + t]);
#pragma GCC unroll 16
      for (int j = 0; j < SEG; ++j)
        acc[s][j] = _mm256_add_ps(acc[s][j], _mm256_mul_ps(ps, vv[j]));
    }
  }
#pragma GCC unroll 16
  for (int s = 0; s < NS; ++s) {
#pragma GCC unroll 16
    for (int j = 0; j < SEG; ++j)
      _mm256_storeu_ps(a + int64_t{s} * d + i + 8 * j, acc[s][j]);
  }
}

// AccumulateStatesAvx512 with AVX2 (NS x SEG accumulators and SEG V
// segments within the 16 vector registers).
template <int NS>
PDSERVE_ATTN_AVX2 void AccumulateStatesAvx2(const float* p, int ldp, int valid,
                                            const float* c, const float* v,
                                            int d, float* a) {
  constexpr int kSeg = NS >= 3 ? 2 : 4;
  int i = 0;
  for (; i + 8 * kSeg <= d; i += 8 * kSeg)
    AccumulateStatesAvx2Tile<NS, kSeg>(p, ldp, valid, c, v, d, a, i);
  for (; i + 8 <= d; i += 8)
    AccumulateStatesAvx2Tile<NS, 1>(p, ldp, valid, c, v, d, a, i);
  AccumulateDimsPortable(p, ldp, NS, valid, c, v, d, a, i);
}

// AccumulateStatesAvx512 for ns <= kAccStates states over a bf16, fp16 or
// int8 V block (int8: times v_scale) widened as it is read; d % 16 == 0.
// One state runs the same operations as AccumulateAvx512 (acc * c, then
// + p_t * v_t in t order), so every ns gives the bits of the widen-first
// path.
// (weights p[s * ldp + t * LDT]; LDT 16 for the lane form's weights)
template <DType T, int NS, int LDT = 1>
PDSERVE_ATTN_AVX512 void AccumulateWidenedAvx512(const float* p, int ldp,
                                                 int valid, const float* c,
                                                 const void* v, float v_scale,
                                                 int d, float* a) {
  int i = 0;
  for (; i + 64 <= d; i += 64) {
    AccumulateStatesTile<NS, 4, T, LDT>(p, ldp, valid, c, v, d, a, i, v_scale);
  }
  for (; i < d; i += 16) {
    AccumulateStatesTile<NS, 1, T, LDT>(p, ldp, valid, c, v, d, a, i, v_scale);
  }
}

template <DType T, int LDT = 1>
void AccumulateWidenedStatesT(const float* p, int ldp, int ns, int valid,
                              const float* c, const void* v, float v_scale,
                              int d, float* a) {
  static_assert(kAccStates == 4);
  switch (ns) {
    case 4:
      return AccumulateWidenedAvx512<T, 4, LDT>(p, ldp, valid, c, v, v_scale, d,
                                                a);
    case 3:
      return AccumulateWidenedAvx512<T, 3, LDT>(p, ldp, valid, c, v, v_scale, d,
                                                a);
    case 2:
      return AccumulateWidenedAvx512<T, 2, LDT>(p, ldp, valid, c, v, v_scale, d,
                                                a);
    default:
      return AccumulateWidenedAvx512<T, 1, LDT>(p, ldp, valid, c, v, v_scale, d,
                                                a);
  }
}

// --- Lane form: 16 query states side by side, state s in lane s ----------

// Scores and the online-softmax step of 16 states against one block of 16
// keys, with head_dim D. Per state, the operations of ScoresAvx512Tile and
// ScoresToWeights in the same order: lane s of s_t is fma(q_s[i], k_t[i],
// acc) over i in order, as the tile's lane t is fma(q_s[i], kt[i][t], acc);
// the maximum runs over the keys one lane at a time instead of as a
// reduction, which can differ only in the sign of a zero maximum, and Exp
// of +0 and -0 are both 1.
template <int D>
PDSERVE_ATTN_AVX512 void BlockLanesAvx512(const float* qt, const float* k,
                                          float scale, const int32_t* valid,
                                          float* m, float* l, float* p,
                                          float* c) {
  __m512 sc[kLaneStates];
  for (int t = 0; t < kLaneStates; ++t) sc[t] = _mm512_setzero_ps();
  for (int i = 0; i < D; ++i) {
    const __m512 qv = _mm512_loadu_ps(qt + i * kLaneStates);
    for (int t = 0; t < kLaneStates; ++t)
      sc[t] = _mm512_fmadd_ps(qv, _mm512_set1_ps(k[t * D + i]), sc[t]);
  }
  const __m512 sv = _mm512_set1_ps(scale);
  const __m512 neg_inf =
      _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i vl = _mm512_loadu_si512(valid);
  __m512 block_max = neg_inf;
  __mmask16 in[kLaneStates];
  for (int t = 0; t < kLaneStates; ++t) {
    sc[t] = _mm512_mul_ps(sc[t], sv);
    in[t] = _mm512_cmpgt_epi32_mask(vl, _mm512_set1_epi32(t));
    // Keys past a state's valid ones, and NaN scores, never win.
    const __mmask16 take =
        in[t] & ~_mm512_cmp_ps_mask(sc[t], sc[t], _CMP_UNORD_Q);
    block_max =
        _mm512_max_ps(block_max, _mm512_mask_mov_ps(neg_inf, take, sc[t]));
  }
  const __m512 mv = _mm512_loadu_ps(m);
  const __m512 new_m = _mm512_mask_mov_ps(
      mv, _mm512_cmp_ps_mask(mv, block_max, _CMP_LT_OQ), block_max);
  const __m512 cv = Exp16(_mm512_sub_ps(mv, new_m));
  __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(l), cv);
  for (int t = 0; t < kLaneStates; ++t) {
    const __m512 w = Exp16(_mm512_sub_ps(sc[t], new_m));
    _mm512_storeu_ps(p + t * kLaneStates, w);
    sum = _mm512_mask_add_ps(sum, in[t], sum, w);
  }
  // A state that sees none of the block keeps its maximum and sum.
  const __mmask16 active = in[0];
  _mm512_mask_storeu_ps(m, active, new_m);
  _mm512_mask_storeu_ps(l, active, sum);
  _mm512_storeu_ps(c, cv);
}

void BlockLanes(const float* qt, const float* k, int d, float scale,
                const int32_t* valid, float* m, float* l, float* p, float* c) {
  if (d == 64) return BlockLanesAvx512<64>(qt, k, scale, valid, m, l, p, c);
  BlockLanesAvx512<128>(qt, k, scale, valid, m, l, p, c);
}

// AccumulateWidenedStatesT for the KV dtype t, weights p[s * ldp + t * LDT].
template <int LDT>
void AccumulateWidenedStatesOf(DType t, const float* p, int ldp, int ns,
                               int valid, const float* c, const void* v,
                               float v_scale, int d, float* a) {
  switch (t) {
    case DType::kBF16:
      return AccumulateWidenedStatesT<DType::kBF16, LDT>(p, ldp, ns, valid, c,
                                                         v, v_scale, d, a);
    case DType::kF16:
      return AccumulateWidenedStatesT<DType::kF16, LDT>(p, ldp, ns, valid, c, v,
                                                        v_scale, d, a);
    case DType::kI8:
      return AccumulateWidenedStatesT<DType::kI8, LDT>(p, ldp, ns, valid, c, v,
                                                       v_scale, d, a);
    default:
      return AccumulateWidenedStatesT<DType::kF32, LDT>(p, ldp, ns, valid, c, v,
                                                        v_scale, d, a);
  }
}

void AccumulateLanes(DType t, const float* p, int ns, int valid, const float* c,
                     const void* v, float v_scale, int d, float* a) {
  AccumulateWidenedStatesOf<kLaneStates>(t, p, 1, ns, valid, c, v, v_scale, d,
                                         a);
}

#pragma GCC diagnostic pop

void Accumulate(AttnIsa isa, const float* p, int valid, float correction,
                const float* v, int d, float* a) {
  if (isa == AttnIsa::kAvx512) {
    AccumulateAvx512(p, valid, correction, v, d, a);
  } else {
    AccumulatePortable(p, valid, correction, v, d, a);
  }
}

// Accumulate for ns consecutive states (accumulators a + s * d) that share
// `valid`: weights p[s * ldp + t], factors c[s].
void AccumulateStates(AttnIsa isa, const float* p, int ldp, int ns, int valid,
                      const float* c, const float* v, int d, float* a) {
  if (isa == AttnIsa::kAvx512) {
    switch (ns) {
      case 4:
        return AccumulateStatesAvx512<4>(p, ldp, valid, c, v, d, a);
      case 3:
        return AccumulateStatesAvx512<3>(p, ldp, valid, c, v, d, a);
      case 2:
        return AccumulateStatesAvx512<2>(p, ldp, valid, c, v, d, a);
      default:
        break;
    }
  } else if (isa == AttnIsa::kAvx2) {
    switch (ns) {
      case 4:
        return AccumulateStatesAvx2<4>(p, ldp, valid, c, v, d, a);
      case 3:
        return AccumulateStatesAvx2<3>(p, ldp, valid, c, v, d, a);
      case 2:
        return AccumulateStatesAvx2<2>(p, ldp, valid, c, v, d, a);
      default:
        return AccumulateStatesAvx2<1>(p, ldp, valid, c, v, d, a);
    }
  }
  for (int s = 0; s < ns; ++s)
    Accumulate(isa, p + s * ldp, valid, c[s], v, d, a + int64_t{s} * d);
}

void TransposeKeysWidened(DType t, const void* k, int count, int d, float scale,
                          float* kt) {
  switch (t) {
    case DType::kBF16:
      return TransposeKeys16Avx512<DType::kBF16>(k, count, d, kt, scale);
    case DType::kF16:
      return TransposeKeys16Avx512<DType::kF16>(k, count, d, kt, scale);
    case DType::kI8:
      return TransposeKeys16Avx512<DType::kI8>(k, count, d, kt, scale);
    default:
      break;
  }
}

void AccumulateWidenedStates(DType t, const float* p, int ldp, int ns,
                             int valid, const float* c, const void* v,
                             float v_scale, int d, float* a) {
  AccumulateWidenedStatesOf<1>(t, p, ldp, ns, valid, c, v, v_scale, d, a);
}

}  // namespace pdserve::kernels::paged_attention_internal
