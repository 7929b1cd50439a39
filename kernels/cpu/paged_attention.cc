#include "kernels/cpu/paged_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/task_pool.h"
#include "kernels/cpu/vec_exp.h"

namespace pdserve::kernels {
namespace {

constexpr int kQueryChunk = 32;  // queries per attention task
// (sequence, query chunk) pairs per thread from which a task takes every KV
// head.
constexpr int kTasksPerThread = 4;
// Most states per ScoresToWeights and AccumulateStates call.
constexpr int kAccStates = 4;

inline float LoadElem(const void* base, DType t, int64_t idx) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(base)[idx];
    case DType::kF16:
      return F16ToFloat(static_cast<const uint16_t*>(base)[idx]);
    case DType::kBF16:
      return Bf16ToFloat(static_cast<const uint16_t*>(base)[idx]);
    case DType::kI8:
      return static_cast<float>(static_cast<const int8_t*>(base)[idx]);
    case DType::kFp8E4M3:  // a CUDA-only KV dtype (engine/backend.cc)
      break;
  }
  return 0;
}

inline void StoreElem(void* base, DType t, int64_t idx, float v) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(base)[idx] = v;
      break;
    case DType::kF16:
      static_cast<uint16_t*>(base)[idx] = FloatToF16(v);
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(base)[idx] = FloatToBf16(v);
      break;
    case DType::kI8: {
      const float r = std::nearbyint(v);
      static_cast<int8_t*>(base)[idx] =
          static_cast<int8_t>(std::clamp(r, -127.0f, 127.0f));
      break;
    }
    case DType::kFp8E4M3:  // a CUDA-only KV dtype (engine/backend.cc)
      break;
  }
}

// Converts n elements of src to t (int8: times inv, 1 / the block's scale)
// as StoreElem does and stores them at element `dst` of base. The lines
// written are usually in no cache (a sequence's slot in a block of the
// pool): the elements are converted into a stack buffer first and stored
// with one copy per 128 elements, so that the pending stores of many rows
// fit the store buffer at once instead of one row's scalar stores filling
// it.
void StoreRow(const float* src, int n, DType t, float inv, void* base,
              int64_t dst) {
  const int64_t elem = static_cast<int64_t>(DTypeBytes(t));
  char* out = static_cast<char*>(base) + dst * elem;
  if (t == DType::kF32) {
    std::memcpy(out, src, n * sizeof(float));
    return;
  }
  if (t == DType::kFp8E4M3) return;  // a CUDA-only KV dtype, as StoreElem
  constexpr int kChunk = 128;
  alignas(64) char buf[kChunk * 2];
  for (int i0 = 0; i0 < n; i0 += kChunk) {
    const int len = std::min(kChunk, n - i0);
    for (int i = 0; i < len; ++i) {
      const float x = t == DType::kI8 ? src[i0 + i] * inv : src[i0 + i];
      StoreElem(buf, t, i, x);
    }
    std::memcpy(out + i0 * elem, buf, len * elem);
  }
}

void WriteOne(const float* src, int64_t block, int offset, int kv, int head,
              const KvLayerView& c) {
  const int64_t base = c.Offset(block, kv, head);
  const int64_t dst = base + int64_t{offset} * c.head_dim;
  if (c.dtype != DType::kI8) {
    StoreRow(src, c.head_dim, c.dtype, 1.0f, c.data, dst);
    return;
  }
  float& scale = c.scales[(block * 2 + kv) * c.num_kv_heads + head];
  if (offset == 0) scale = 0;
  float amax = 0;
  for (int d = 0; d < c.head_dim; ++d) amax = std::max(amax, std::fabs(src[d]));
  const float needed = amax / 127.0f;
  if (needed > scale) {
    // Requantise the entries already in this block to the larger scale.
    int8_t* q = static_cast<int8_t*>(c.data);
    if (scale > 0) {
      const float ratio = scale / needed;
      for (int64_t i = base; i < dst; ++i) {
        q[i] = static_cast<int8_t>(
            std::clamp(std::nearbyint(q[i] * ratio), -127.0f, 127.0f));
      }
    }
    scale = needed;
  }
  const float inv = scale > 0 ? 1.0f / scale : 0.0f;
  StoreRow(src, c.head_dim, DType::kI8, inv, c.data, dst);
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

#define PDSERVE_ATTN_AVX512 __attribute__((target("avx512f")))
#define PDSERVE_ATTN_AVX2 __attribute__((target("avx2,fma")))

using vec_exp::Exp16;
using vec_exp::Exp8;
using vec_exp::ExpPortable;

enum class AttnIsa { kPortable, kAvx2, kAvx512 };

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

void TransposeKeys(AttnIsa isa, const float* k, int count, int d, int ldk,
                   float* kt) {
  if (isa == AttnIsa::kAvx512 && ldk == 16 && d % 16 == 0) {
    TransposeKeys16Avx512(k, count, d, kt);
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

template <int S>
PDSERVE_ATTN_AVX2 void ScoresAvx2Tile(const float* const* qs, const float* kt,
                                      int d, int ldk, float scale, float* out) {
  for (int t0 = 0; t0 < ldk; t0 += 8) {
    __m256 acc[S];
    for (int s = 0; s < S; ++s) acc[s] = _mm256_setzero_ps();
    for (int i = 0; i < d; ++i) {
      const __m256 kv = _mm256_loadu_ps(kt + i * ldk + t0);
      for (int s = 0; s < S; ++s)
        acc[s] = _mm256_fmadd_ps(_mm256_set1_ps(qs[s][i]), kv, acc[s]);
    }
    for (int s = 0; s < S; ++s)
      _mm256_storeu_ps(out + s * ldk + t0,
                       _mm256_mul_ps(acc[s], _mm256_set1_ps(scale)));
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
    const float block_max = isa == AttnIsa::kAvx512
                                ? BlockMaxAvx512(sj, valid)
                                : BlockMaxPortable(sj, valid);
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

// AccumulateAvx512 for NS states at once (weights p[s * ldp + t], factors
// c[s], accumulators a + s * d) over SEG 16-wide segments from dimension i:
// each V row segment is loaded once for all NS states. Every element sees the
// same operations in the same order as in AccumulateAvx512.
template <int NS, int SEG, DType T = DType::kF32>
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
      const __m512 ps = _mm512_set1_ps(p[s * ldp + t]);
      for (int j = 0; j < SEG; ++j)
        acc[s][j] = _mm512_add_ps(acc[s][j], _mm512_mul_ps(ps, vv[j]));
    }
  }
  for (int s = 0; s < NS; ++s) {
    for (int j = 0; j < SEG; ++j)
      _mm512_storeu_ps(a + int64_t{s} * d + i + 16 * j, acc[s][j]);
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
  for (int s = 0; s < NS; ++s) {
    float* as = a + int64_t{s} * d;
    for (int k = i; k < d; ++k) {
      float x = as[k] * c[s];
      for (int t = 0; t < valid; ++t)
        x += p[s * ldp + t] * v[int64_t{t} * d + k];
      as[k] = x;
    }
  }
}

// AccumulateStatesAvx512 for ns <= kAccStates states over a bf16, fp16 or
// int8 V block (int8: times v_scale) widened as it is read; d % 16 == 0.
// One state runs the same operations as AccumulateAvx512 (acc * c, then
// + p_t * v_t in t order), so every ns gives the bits of the widen-first
// path.
template <DType T, int NS>
PDSERVE_ATTN_AVX512 void AccumulateWidenedAvx512(const float* p, int ldp,
                                                 int valid, const float* c,
                                                 const void* v, float v_scale,
                                                 int d, float* a) {
  int i = 0;
  for (; i + 64 <= d; i += 64)
    AccumulateStatesTile<NS, 4, T>(p, ldp, valid, c, v, d, a, i, v_scale);
  for (; i < d; i += 16)
    AccumulateStatesTile<NS, 1, T>(p, ldp, valid, c, v, d, a, i, v_scale);
}

template <DType T>
void AccumulateWidenedStates(const float* p, int ldp, int ns, int valid,
                             const float* c, const void* v, float v_scale,
                             int d, float* a) {
  static_assert(kAccStates == 4);
  switch (ns) {
    case 4:
      return AccumulateWidenedAvx512<T, 4>(p, ldp, valid, c, v, v_scale, d, a);
    case 3:
      return AccumulateWidenedAvx512<T, 3>(p, ldp, valid, c, v, v_scale, d, a);
    case 2:
      return AccumulateWidenedAvx512<T, 2>(p, ldp, valid, c, v, v_scale, d, a);
    default:
      return AccumulateWidenedAvx512<T, 1>(p, ldp, valid, c, v, v_scale, d, a);
  }
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
  }
  for (int s = 0; s < ns; ++s)
    Accumulate(isa, p + s * ldp, valid, c[s], v, d, a + int64_t{s} * d);
}

}  // namespace

bool SetPagedAttentionIsa(PagedAttentionIsa isa) {
  switch (isa) {
    case PagedAttentionIsa::kBest:
      ActiveAttnIsa() = BestAttnIsa();
      return true;
    case PagedAttentionIsa::kPortable:
      ActiveAttnIsa() = AttnIsa::kPortable;
      return true;
    case PagedAttentionIsa::kAvx2:
      if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
        return false;
      ActiveAttnIsa() = AttnIsa::kAvx2;
      return true;
    case PagedAttentionIsa::kAvx512:
      if (!__builtin_cpu_supports("avx512f")) return false;
      ActiveAttnIsa() = AttnIsa::kAvx512;
      return true;
  }
  return false;
}

float AttentionExpForTesting(float x) { return ExpPortable(x); }

void WriteKv(const float* k, const float* v, int64_t num_tokens,
             const int64_t* slots, const KvLayerView& cache) {
  const int64_t stride = int64_t{cache.num_kv_heads} * cache.head_dim;
  // Over heads: tokens of one (block, head) stay in order. Large writes (a
  // prefill chunk) go to the kernel helpers as well (task_pool.h); small ones
  // run on the caller alone.
  auto heads = [&](int64_t h_begin, int64_t h_end, bool) {
    for (int64_t h = h_begin; h < h_end; ++h) {
      for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t block = slots[t] / cache.block_size;
        const int offset = static_cast<int>(slots[t] % cache.block_size);
        const int64_t at = t * stride + h * cache.head_dim;
        WriteOne(k + at, block, offset, 0, static_cast<int>(h), cache);
        WriteOne(v + at, block, offset, 1, static_cast<int>(h), cache);
      }
    }
  };
  RunChunks(cache.num_kv_heads, 1,
            num_tokens * stride > 8192 ? KernelThreads() : 1, heads);
}

namespace {

// The intrinsics below draw GCC 12's false positive too (see above).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// out[i] = element i of `src` (bf16, fp16 or int8) as fp32, times `scale` for
// int8, for i < n. Every conversion is exact and int8 takes one rounding
// multiply, so every instruction set gives the same bits.
void WidenPortable(const void* src, DType t, int64_t n, float scale,
                   float* out) {
  const float s = t == DType::kI8 ? scale : 1.0f;
  for (int64_t i = 0; i < n; ++i) out[i] = LoadElem(src, t, i) * s;
}

PDSERVE_ATTN_AVX512 void WidenAvx512(const void* src, DType t, int64_t n,
                                     float scale, float* out) {
  int64_t i = 0;
  if (t == DType::kBF16) {
    const auto* h = static_cast<const uint16_t*>(src);
    for (; i + 16 <= n; i += 16) {
      const __m512i w = _mm512_slli_epi32(
          _mm512_cvtepu16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))),
          16);
      _mm512_storeu_ps(out + i, _mm512_castsi512_ps(w));
    }
  } else if (t == DType::kF16) {
    const auto* h = static_cast<const uint16_t*>(src);
    for (; i + 16 <= n; i += 16) {
      _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(h + i))));
    }
  } else if (t == DType::kI8) {
    const auto* b = static_cast<const int8_t*>(src);
    const __m512 s = _mm512_set1_ps(scale);
    for (; i + 16 <= n; i += 16) {
      const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i))));
      _mm512_storeu_ps(out + i, _mm512_mul_ps(f, s));
    }
  }
  WidenPortable(static_cast<const char*>(src) + i * DTypeBytes(t), t, n - i,
                scale, out + i);
}

__attribute__((target("avx2,fma,f16c"))) void WidenAvx2(const void* src,
                                                        DType t, int64_t n,
                                                        float scale,
                                                        float* out) {
  int64_t i = 0;
  if (t == DType::kBF16) {
    const auto* h = static_cast<const uint16_t*>(src);
    for (; i + 8 <= n; i += 8) {
      const __m256i w = _mm256_slli_epi32(
          _mm256_cvtepu16_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))),
          16);
      _mm256_storeu_ps(out + i, _mm256_castsi256_ps(w));
    }
  } else if (t == DType::kF16) {
    const auto* h = static_cast<const uint16_t*>(src);
    for (; i + 8 <= n; i += 8) {
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                    reinterpret_cast<const __m128i*>(h + i))));
    }
  } else if (t == DType::kI8) {
    const auto* b = static_cast<const int8_t*>(src);
    const __m256 s = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8) {
      const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + i))));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(f, s));
    }
  }
  WidenPortable(static_cast<const char*>(src) + i * DTypeBytes(t), t, n - i,
                scale, out + i);
}

void Widen(AttnIsa isa, const void* src, DType t, int64_t n, float scale,
           float* out) {
  static const bool f16c = __builtin_cpu_supports("f16c");
  switch (isa) {
    case AttnIsa::kAvx512:
      return WidenAvx512(src, t, n, scale, out);
    case AttnIsa::kAvx2:
      if (f16c) return WidenAvx2(src, t, n, scale, out);
      break;
    case AttnIsa::kPortable:
      break;
  }
  WidenPortable(src, t, n, scale, out);
}

#pragma GCC diagnostic pop

}  // namespace

void ReadKvBlock(const KvLayerView& cache, int64_t block, int kv, int head,
                 int count, float* out) {
  const int64_t base = cache.Offset(block, kv, head);
  const int64_t n = int64_t{count} * cache.head_dim;
  if (cache.dtype == DType::kF32) {
    std::copy_n(static_cast<const float*>(cache.data) + base, n, out);
    return;
  }
  const float scale =
      cache.dtype == DType::kI8
          ? cache.scales[(block * 2 + kv) * cache.num_kv_heads + head]
          : 1.0f;
  Widen(ActiveAttnIsa(),
        static_cast<const char*>(cache.data) +
            base * static_cast<int64_t>(DTypeBytes(cache.dtype)),
        cache.dtype, n, scale, out);
}

// Brings the K and V of the units a task computes next into L1, a share at
// a time between the steps of the current units: the hardware prefetchers
// do not run far enough ahead of the arithmetic for it to overlap the
// reads, and a whole unit's lines requested at once stall the loads that
// follow them.
class KvPrefetcher {
 public:
  // Queues unit (block, head)'s K, then its V.
  void Add(const KvLayerView& cache, int64_t block, int head) {
    const int64_t elem = static_cast<int64_t>(DTypeBytes(cache.dtype));
    const int64_t bytes = int64_t{cache.block_size} * cache.head_dim * elem;
    for (int kv = 0; kv < 2 && count_ < kMaxRanges; ++kv) {
      ranges_[count_++] = {static_cast<const char*>(cache.data) +
                               cache.Offset(block, kv, head) * elem,
                           bytes};
    }
  }
  // Queued lines not yet requested.
  int64_t Pending() const {
    int64_t lines = 0;
    for (int i = next_; i < count_; ++i)
      lines += (ranges_[i].bytes - (i == next_ ? offset_ : 0) + 63) / 64;
    return lines;
  }
  // Requests up to `lines` more queued lines.
  void Issue(int64_t lines) {
    while (lines > 0 && next_ < count_) {
      const Range& r = ranges_[next_];
      for (; lines > 0 && offset_ < r.bytes; --lines, offset_ += 64)
        _mm_prefetch(r.p + offset_, _MM_HINT_T0);
      if (offset_ >= r.bytes) {
        ++next_;
        offset_ = 0;
      }
    }
    if (next_ == count_) next_ = count_ = 0;
  }

 private:
  struct Range {
    const char* p;
    int64_t bytes;
  };
  static constexpr int kMaxRanges = 4;  // two units' K and V
  Range ranges_[kMaxRanges];
  int count_ = 0, next_ = 0;
  int64_t offset_ = 0;
};

void PagedAttention(const float* q, int32_t num_heads,
                    std::span<const AttentionSeq> seqs,
                    const KvLayerView& cache, float scale, float* out) {
  const int kv_heads = cache.num_kv_heads;
  const int group = num_heads / kv_heads;
  const int d = cache.head_dim;
  const int bs = cache.block_size;
  // A task is a sequence's query chunk over a range of KV heads. With enough
  // (sequence, chunk) pairs to share out, a task takes every head, and walks
  // a block's heads one after another: the block's K (and V) of all heads
  // are contiguous, so the task reads long runs instead of one head's few
  // KiB per block. With few pairs (batch 1) each head is its own task, so
  // that the threads share the work. A head's numbers are the same either
  // way.
  struct Task {
    int seq;
    int head_begin;
    int head_end;
    int q_begin;
    int q_end;
  };
  int64_t chunks = 0;
  for (const AttentionSeq& seq : seqs)
    chunks += (seq.num_q + kQueryChunk - 1) / kQueryChunk;
  const int heads_per_task =
      chunks >= int64_t{kTasksPerThread} * KernelThreads() ? kv_heads : 1;
  std::vector<Task> tasks;
  for (int s = 0; s < static_cast<int>(seqs.size()); ++s) {
    for (int h = 0; h < kv_heads; h += heads_per_task) {
      for (int q0 = 0; q0 < seqs[s].num_q; q0 += kQueryChunk) {
        tasks.push_back({s, h, std::min(kv_heads, h + heads_per_task), q0,
                         std::min(seqs[s].num_q, q0 + kQueryChunk)});
      }
    }
  }
  const int64_t row_stride = int64_t{num_heads} * d;
  // Tasks go to the calling thread and whichever kernel helpers are awake
  // (task_pool.h); each task's numbers depend only on the task. Scratch is
  // per thread and kept between calls.
  // One (block, head) unit of a task between its preparation and its
  // softmax: the block's keys transposed, its V rows, its states' scores.
  struct Unit {
    int b, hi, block_start, count, first_state;
    int64_t block;
    const float* vb;
    // A bf16, fp16 or int8 V block read in place (widened by the
    // accumulation), and its int8 scale; null when vb holds the V rows.
    const void* v_raw;
    float v_scale;
    float *kbuf, *vbuf, *kt, *scores;  // this unit's scratch
  };
  struct Scratch {
    std::vector<float> kbuf, vbuf, kt, acc, m, l, scores, weights;
    std::vector<const float*> qs;
  };
  const int ldk = (bs + 15) / 16 * 16;
  const AttnIsa isa = ActiveAttnIsa();
  const bool widen_in_place =
      isa == AttnIsa::kAvx512 && ldk == 16 && d % 16 == 0 &&
      (cache.dtype == DType::kBF16 || cache.dtype == DType::kF16 ||
       cache.dtype == DType::kI8);
  auto run = [&](int64_t t_begin, int64_t t_end, bool) {
    // Per unit of a pair: widened K and V, keys transposed and zero-padded
    // to ldk (a multiple of 16), the states' scores [states][ldk]; the
    // weights of up to kAccStates states; per head of the task, its states'
    // accumulators, running maxima and sums, and query rows.
    thread_local Scratch sc;
    sc.kbuf.resize(2 * int64_t{bs} * d);
    sc.vbuf.resize(2 * int64_t{bs} * d);
    sc.kt.resize(2 * int64_t{d} * ldk);
    sc.weights.resize(int64_t{kAccStates} * ldk);
    std::vector<float>&acc_all = sc.acc, &m_all = sc.m, &l_all = sc.l,
    &weights = sc.weights;
    std::vector<const float*>& qs_all = sc.qs;
    Unit unit[2];
    for (int64_t ti = t_begin; ti < t_end; ++ti) {
      const Task& task = tasks[ti];
      const AttentionSeq& seq = seqs[task.seq];
      const int nq = task.q_end - task.q_begin;
      const int states = nq * group;
      const int nh = task.head_end - task.head_begin;
      acc_all.assign(int64_t{nh} * states * d, 0.0f);
      m_all.assign(int64_t{nh} * states,
                   -std::numeric_limits<float>::infinity());
      l_all.assign(int64_t{nh} * states, 0.0f);
      sc.scores.resize(2 * int64_t{states} * ldk);
      for (int i = 0; i < 2; ++i) {
        unit[i].kbuf = sc.kbuf.data() + i * int64_t{bs} * d;
        unit[i].vbuf = sc.vbuf.data() + i * int64_t{bs} * d;
        unit[i].kt = sc.kt.data() + i * int64_t{d} * ldk;
        unit[i].scores = sc.scores.data() + i * int64_t{states} * ldk;
      }
      // State st = qi * group + g of KV head h reads query head h * group + g
      // of its row; the group's heads are consecutive in q.
      qs_all.resize(int64_t{nh} * states);
      for (int hi = 0; hi < nh; ++hi) {
        const int kv_head = task.head_begin + hi;
        for (int qi = 0; qi < nq; ++qi) {
          const float* row_q = q +
                               (seq.q_row + task.q_begin + qi) * row_stride +
                               int64_t{kv_head} * group * d;
          for (int g = 0; g < group; ++g)
            qs_all[int64_t{hi} * states + qi * group + g] =
                row_q + int64_t{g} * d;
        }
      }
      const int last_pos = seq.start_pos + task.q_end - 1;
      const int num_blocks = last_pos / bs + 1;
      // The task's (block, head) units in order, a block's heads one after
      // another, two at a time: both units' keys are transposed and their
      // scores computed together (twice the independent FMA chains), then
      // each unit's softmax and accumulation run in unit order, so every
      // state sees its blocks in order as before.
      const int units = num_blocks * nh;
      auto prepare = [&](int u, Unit& x) {
        x.b = u / nh;
        x.hi = u % nh;
        x.block = seq.block_table[x.b];
        x.block_start = x.b * bs;
        x.count = std::min(bs, last_pos - x.block_start + 1);
        // Queries before this block (causal) see none of it.
        const int first_q =
            std::max(0, x.block_start - seq.start_pos - task.q_begin);
        x.first_state = std::min(first_q, nq) * group;
        if (x.first_state >= states) return;
        const int kv_head = task.head_begin + x.hi;
        // fp32 blocks are read in place; with AVX-512 and 16-token blocks so
        // are the others, widened by the key transpose and the
        // accumulation; else they are widened into scratch first.
        const float* kb = x.kbuf;
        x.vb = x.vbuf;
        x.v_raw = nullptr;
        if (cache.dtype == DType::kF32) {
          const float* data = static_cast<const float*>(cache.data);
          kb = data + cache.Offset(x.block, 0, kv_head);
          x.vb = data + cache.Offset(x.block, 1, kv_head);
        } else if (widen_in_place) {
          const auto* data = static_cast<const char*>(cache.data);
          const int64_t elem = static_cast<int64_t>(DTypeBytes(cache.dtype));
          const bool i8 = cache.dtype == DType::kI8;
          const int64_t s0 = (x.block * 2) * cache.num_kv_heads + kv_head;
          const float k_scale = i8 ? cache.scales[s0] : 1.0f;
          x.v_scale = i8 ? cache.scales[s0 + cache.num_kv_heads] : 1.0f;
          x.v_raw = data + cache.Offset(x.block, 1, kv_head) * elem;
          const void* k_raw = data + cache.Offset(x.block, 0, kv_head) * elem;
          switch (cache.dtype) {
            case DType::kBF16:
              TransposeKeys16Avx512<DType::kBF16>(k_raw, x.count, d, x.kt,
                                                  k_scale);
              break;
            case DType::kF16:
              TransposeKeys16Avx512<DType::kF16>(k_raw, x.count, d, x.kt,
                                                 k_scale);
              break;
            default:
              TransposeKeys16Avx512<DType::kI8>(k_raw, x.count, d, x.kt,
                                                k_scale);
              break;
          }
          return;
        } else {
          ReadKvBlock(cache, x.block, 0, kv_head, x.count, x.kbuf);
          ReadKvBlock(cache, x.block, 1, kv_head, x.count, x.vbuf);
        }
        TransposeKeys(isa, kb, x.count, d, ldk, x.kt);
      };
      // The next pair's K and V are requested over the current pair's
      // steps, `share` lines at a time.
      KvPrefetcher prefetcher;
      int64_t share = 0;
      auto finish = [&](const Unit& x) {
        float* acc = acc_all.data() + int64_t{x.hi} * states * d;
        float* m = m_all.data() + int64_t{x.hi} * states;
        float* l = l_all.data() + int64_t{x.hi} * states;
        // States in runs of up to kAccStates that see the same keys of the
        // block (a query's group, or whole queries once the block is behind
        // them), accumulated together.
        auto valid_of = [&](int st) {
          const int pos = seq.start_pos + task.q_begin + st / group;
          return std::min(x.count, pos - x.block_start + 1);
        };
        for (int st = x.first_state; st < states;) {
          const int valid = valid_of(st);
          int ns = 1;
          while (ns < kAccStates && st + ns < states &&
                 valid_of(st + ns) == valid)
            ++ns;
          float corrections[kAccStates];
          ScoresToWeights(isa, x.scores + int64_t{st} * ldk, ldk, ns, valid,
                          &m[st], &l[st], weights.data(), corrections);
          prefetcher.Issue(share);
          float* a = acc + int64_t{st} * d;
          if (x.v_raw == nullptr) {
            AccumulateStates(isa, weights.data(), ldk, ns, valid, corrections,
                             x.vb, d, a);
          } else if (cache.dtype == DType::kBF16) {
            AccumulateWidenedStates<DType::kBF16>(weights.data(), ldk, ns,
                                                  valid, corrections, x.v_raw,
                                                  x.v_scale, d, a);
          } else if (cache.dtype == DType::kF16) {
            AccumulateWidenedStates<DType::kF16>(weights.data(), ldk, ns, valid,
                                                 corrections, x.v_raw,
                                                 x.v_scale, d, a);
          } else {
            AccumulateWidenedStates<DType::kI8>(weights.data(), ldk, ns, valid,
                                                corrections, x.v_raw, x.v_scale,
                                                d, a);
          }
          st += ns;
        }
      };
      auto qs_of = [&](const Unit& x) {
        return qs_all.data() + int64_t{x.hi} * states + x.first_state;
      };
      for (int u = 0; u < units; u += 2) {
        Unit& a = unit[0];
        Unit& c = unit[1];
        const bool two = u + 1 < units;
        // The next pair's K and V, over this pair's seven steps.
        for (int next = u + 2; next < std::min(units, u + 4); ++next) {
          prefetcher.Add(cache, seq.block_table[next / nh],
                         task.head_begin + next % nh);
        }
        share = (prefetcher.Pending() + 6) / 7;
        prefetcher.Issue(share);
        prepare(u, a);
        prefetcher.Issue(share);
        if (two) prepare(u + 1, c);
        prefetcher.Issue(share);
        if (two && a.first_state == c.first_state && a.first_state < states) {
          ScoresPair(isa, qs_of(a), a.kt,
                     a.scores + int64_t{a.first_state} * ldk, qs_of(c), c.kt,
                     c.scores + int64_t{c.first_state} * ldk,
                     states - a.first_state, d, ldk, scale);
        } else {
          if (a.first_state < states) {
            Scores(isa, qs_of(a), states - a.first_state, a.kt, d, ldk, scale,
                   a.scores + int64_t{a.first_state} * ldk);
          }
          if (two && c.first_state < states) {
            Scores(isa, qs_of(c), states - c.first_state, c.kt, d, ldk, scale,
                   c.scores + int64_t{c.first_state} * ldk);
          }
        }
        prefetcher.Issue(share);
        finish(a);
        prefetcher.Issue(share);
        if (two) finish(c);
        prefetcher.Issue(prefetcher.Pending());
      }
      for (int hi = 0; hi < nh; ++hi) {
        const int kv_head = task.head_begin + hi;
        const float* acc = acc_all.data() + int64_t{hi} * states * d;
        const float* l = l_all.data() + int64_t{hi} * states;
        for (int qi = 0; qi < nq; ++qi) {
          const int64_t row = seq.q_row + task.q_begin + qi;
          for (int g = 0; g < group; ++g) {
            const int head = kv_head * group + g;
            const int st = qi * group + g;
            const float inv = l[st] > 0 ? 1.0f / l[st] : 0.0f;
            float* o = out + row * row_stride + int64_t{head} * d;
            for (int i = 0; i < d; ++i) o[i] = acc[int64_t{st} * d + i] * inv;
          }
        }
      }
    }
  };
  RunChunks(static_cast<int64_t>(tasks.size()), 1, KernelThreads(), run);
}

}  // namespace pdserve::kernels
