// GemmNumerics::kInt8Dot on the 256-bit AVX2 path. Per-row int8 weights:
// with AVX-VNNI, the VEX form of VPDPBUSD, which CPUs without AVX-512 may
// have (Intel since Alder Lake and Sierra Forest, AMD since Zen 5); without
// it, plain AVX2 (VPMADDUBSW). Block int8 weights: plain AVX2 either way. The
// kernels read the same kPanel16Dot panels and the same activation row tiles
// ([kq / 4][rows][4], q + 128 as unsigned bytes) as the AVX-512 VNNI kernels of
// packed_gemm_int8dot.cc, and sum the same exact integers, so every kernel
// gives the same bits. Each function carries its target attribute; the driver
// calls the AVX-VNNI ones only where AvxVnniUsable() and the AVX2 ones only
// where Avx2DotUsable().

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/packed_gemm_internal.h"

#define PDSERVE_AVXVNNI __attribute__((target("avx2,fma,avxvnni")))
#define PDSERVE_AVX2DOT __attribute__((target("avx2,fma,f16c")))

namespace pdserve::kernels::packed_gemm_internal {
namespace {

// acc + Σ u8(u) * s8(w) per dword; the asm keeps each accumulator in its
// register (see DpBusd in packed_gemm_int8dot.cc).
PDSERVE_AVXVNNI inline __m256i DpBusdVex(__m256i acc, __m256i u, __m256i w) {
  __asm__("%{vex%} vpdpbusd %[w], %[u], %[acc]"
          : [acc] "+x"(acc)
          : [u] "x"(u), [w] "x"(w));
  return acc;
}

// 8 floats rounded as QuantizeAvx512 rounds 16: x / s to the nearest even
// integer, clamped to [-127, 127] (NaN to -127, as max(NaN, -127) gives the
// second operand in both), as int32.
PDSERVE_AVX2DOT inline __m256i QuantizeAvx2(__m256 v, __m256 s) {
  const __m256 lim = _mm256_set1_ps(127.0f);
  v = _mm256_round_ps(_mm256_div_ps(v, s),
                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  v = _mm256_min_ps(_mm256_max_ps(v, _mm256_sub_ps(_mm256_setzero_ps(), lim)),
                    lim);
  return _mm256_cvtps_epi32(v);
}

// Lanes [0, len) of x (len clamped to [0, 8]); the rest read as 0.
PDSERVE_AVX2DOT inline __m256 LoadFirst(const float* x, int64_t len) {
  if (len >= 8) return _mm256_loadu_ps(x);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask = _mm256_cmpgt_epi32(
      _mm256_set1_epi32(static_cast<int>(std::max<int64_t>(len, 0))), lane);
  return _mm256_maskload_ps(x, mask);
}

// acc + Σ q * w per dword, exact, for signed bytes q and w in [-127, 127]
// (aq = |q|): VPMADDUBSW multiplies |q| by w carrying q's sign (VPSIGNB),
// each int16 pair at most 2 x 127 x 127 = 32,258, and VPMADDWD by ones adds
// the pairs into int32.
PDSERVE_AVX2DOT inline __m256i DotAvx2(__m256i acc, __m256i aq, __m256i q,
                                       __m256i w, __m256i ones) {
  return _mm256_add_epi32(
      acc, _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(w, q)),
                             ones));
}

// MR rows x NV kPanel16Dot panels: per group of 4 k a panel's 64 bytes are
// columns 0-7 and 8-15 as two VPDPBUSD operands. The 2 x MR x NV
// accumulators (at most 12), two weight vectors and a broadcast fit the 16
// registers: 6 rows of one panel for batches, 1-2 rows of 3 panels (three
// streams from memory, as the AVX-512 tile) for batch 1-2.
// A single row tile streams its panels from memory (prefetch 1 KiB ahead);
// several share them from L1/L2, and row tile rt of them pulls its part of
// the next tile toward L2 (pf_lines lines from pf, spread over k).
template <int MR, int NV>
PDSERVE_AVXVNNI void RowDotAvxVnni(const uint8_t* ux, const float* sx,
                                   const uint8_t* w, int64_t panel_bytes,
                                   const float* sw, const int32_t* corr,
                                   int64_t groups, const uint8_t* pf,
                                   int64_t pf_lines, float* io) {
  static_assert(MR * NV <= 6, "accumulators beyond the 16 registers");
  __m256i acc[MR][NV][2];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v)
      acc[i][v][0] = acc[i][v][1] = _mm256_setzero_si256();
  int64_t pf_done = 0;
  for (int64_t g0 = 0; g0 < groups; g0 += kRowDotUnroll) {
    PrefetchDueLines(pf, pf_lines, groups, g0 + kRowDotUnroll - 1, &pf_done);
#pragma GCC unroll 8
    for (int64_t g = g0; g < g0 + kRowDotUnroll; ++g) {
      for (int v = 0; v < NV; ++v) {
        const uint8_t* wg = w + v * panel_bytes + g * 64;
        const __m256i w0 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg));
        const __m256i w1 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32));
        if (MR <= 2)
          _mm_prefetch(reinterpret_cast<const char*>(wg + 1024), _MM_HINT_T0);
        for (int i = 0; i < MR; ++i) {
          uint32_t u4;
          std::memcpy(&u4, ux + (g * MR + i) * 4, 4);
          const __m256i u = _mm256_set1_epi32(static_cast<int>(u4));
          acc[i][v][0] = DpBusdVex(acc[i][v][0], u, w0);
          acc[i][v][1] = DpBusdVex(acc[i][v][1], u, w1);
        }
      }
    }
  }
  // As the AVX-512 epilogue: float(isum - corr) * (sx[i] * sw[c]).
  for (int v = 0; v < NV; ++v) {
    for (int h = 0; h < 2; ++h) {
      const int c = v * kPanel + h * 8;
      const __m256i cv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr + c));
      const __m256 swv = _mm256_loadu_ps(sw + c);
      for (int i = 0; i < MR; ++i) {
        const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(sx[i]), swv);
        _mm256_storeu_ps(
            io + i * NV * kPanel + c,
            _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[i][v][h], cv)), scale));
      }
    }
  }
}

template <int NV, int... R>
constexpr std::array<RowDotAvxVnniFn, sizeof...(R)> RowDotAvxVnniRows(
    std::integer_sequence<int, R...>) {
  return {&RowDotAvxVnni<R + 1, NV>...};
}

// The AVX2 form of the tile above, without VNNI: VPMADDUBSW adds its pairs
// into int16 with saturation, which q + 128 (up to 255) times a weight would
// reach, so the tile takes q back (u ^ 0x80) and sums Σ q w with DotAvx2.
// That is the VNNI tile's Σ (q + 128) w - corr: the same integer, the same
// epilogue.
// The weight operand comes from memory (L1) per row, so 2 x MR x NV
// accumulators (at most 8), the constants and the row's |q| and q fit the
// 16 registers: 4 rows of one panel for batches, 1-2 rows of 2 panels for
// batch 1-2. Prefetches as the AVX-VNNI tile.
template <int MR, int NV>
PDSERVE_AVX2DOT void RowDotAvx2(const uint8_t* ux, const float* sx,
                                const uint8_t* w, int64_t panel_bytes,
                                const float* sw, const int32_t*, int64_t groups,
                                const uint8_t* pf, int64_t pf_lines,
                                float* io) {
  static_assert(MR * NV <= 4, "accumulators beyond the 16 registers");
  __m256i acc[MR][NV][2];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v)
      acc[i][v][0] = acc[i][v][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
  int64_t pf_done = 0;
  for (int64_t g0 = 0; g0 < groups; g0 += kRowDotUnroll) {
    PrefetchDueLines(pf, pf_lines, groups, g0 + kRowDotUnroll - 1, &pf_done);
#pragma GCC unroll 8
    for (int64_t g = g0; g < g0 + kRowDotUnroll; ++g) {
      if (MR <= 2) {
        for (int v = 0; v < NV; ++v)
          _mm_prefetch(reinterpret_cast<const char*>(w + v * panel_bytes +
                                                     g * 64 + 1024),
                       _MM_HINT_T0);
      }
      for (int i = 0; i < MR; ++i) {
        uint32_t u4;
        std::memcpy(&u4, ux + (g * MR + i) * 4, 4);
        const __m256i q =
            _mm256_xor_si256(_mm256_set1_epi32(static_cast<int>(u4)), offset);
        const __m256i aq = _mm256_abs_epi8(q);
        for (int v = 0; v < NV; ++v) {
          const uint8_t* wg = w + v * panel_bytes + g * 64;
          for (int h = 0; h < 2; ++h) {
            acc[i][v][h] =
                DotAvx2(acc[i][v][h], aq, q,
                        _mm256_loadu_si256(
                            reinterpret_cast<const __m256i*>(wg + 32 * h)),
                        ones);
          }
        }
      }
    }
  }
  for (int v = 0; v < NV; ++v) {
    for (int h = 0; h < 2; ++h) {
      const int c = v * kPanel + h * 8;
      const __m256 swv = _mm256_loadu_ps(sw + c);
      for (int i = 0; i < MR; ++i) {
        const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(sx[i]), swv);
        _mm256_storeu_ps(
            io + i * NV * kPanel + c,
            _mm256_mul_ps(_mm256_cvtepi32_ps(acc[i][v][h]), scale));
      }
    }
  }
}

template <int NV, int... R>
constexpr std::array<RowDotAvxVnniFn, sizeof...(R)> RowDotAvx2Rows(
    std::integer_sequence<int, R...>) {
  return {&RowDotAvx2<R + 1, NV>...};
}

// Block int8 (kInt8Dot on int8-b32 weights) on plain AVX2, for CPUs without
// AVX-512 VNNI (with or without AVX-VNNI). Per block of 32 k, MR rows of
// signed activations (qx [rows][kp], scales sx [rows][blocks]) against one
// kPanel16 panel, whose block stores 32 k rows of 16 column bytes and then
// the 16 columns' fp16 scales. Each group of 4 k is transposed (byte and
// word unpacks) so that a dword holds one column's 4 weights, then summed as
// RowDotAvx2 sums them (DotAvx2: exact). Per block and
// column, as Int8DotPortable: acc = fma(float(isum), sx * scale, acc), in
// block order, kept in io between blocks.
template <int MR>
PDSERVE_AVX2DOT void Int8DotAvx2(const int8_t* qx, const float* sx, int64_t kp,
                                 int64_t blocks, const uint8_t* w, float* io) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(io + i * kPanel, _mm256_setzero_ps());
    _mm256_storeu_ps(io + i * kPanel + 8, _mm256_setzero_ps());
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * kBlockBytes;
    __m256i isum[MR][2];
    for (int i = 0; i < MR; ++i)
      isum[i][0] = isum[i][1] = _mm256_setzero_si256();
    for (int g = 0; g < kInt8Block / 4; ++g) {
      const uint8_t* r = blk + g * 4 * kPanel;
      const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r));
      const __m128i r1 =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + kPanel));
      const __m128i r2 =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 2 * kPanel));
      const __m128i r3 =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 3 * kPanel));
      // Columns 0-7 and 8-15: per column, its k = 4g .. 4g + 3 in a dword.
      const __m128i a_lo = _mm_unpacklo_epi8(r0, r1);
      const __m128i a_hi = _mm_unpackhi_epi8(r0, r1);
      const __m128i b_lo = _mm_unpacklo_epi8(r2, r3);
      const __m128i b_hi = _mm_unpackhi_epi8(r2, r3);
      const __m256i w0 = _mm256_set_m128i(_mm_unpackhi_epi16(a_lo, b_lo),
                                          _mm_unpacklo_epi16(a_lo, b_lo));
      const __m256i w1 = _mm256_set_m128i(_mm_unpackhi_epi16(a_hi, b_hi),
                                          _mm_unpacklo_epi16(a_hi, b_hi));
      for (int i = 0; i < MR; ++i) {
        int32_t q4;
        std::memcpy(&q4, qx + i * kp + b * kInt8Block + g * 4, 4);
        const __m256i q = _mm256_set1_epi32(q4);
        const __m256i aq = _mm256_abs_epi8(q);
        isum[i][0] = DotAvx2(isum[i][0], aq, q, w0, ones);
        isum[i][1] = DotAvx2(isum[i][1], aq, q, w1, ones);
      }
    }
    const uint8_t* scales = blk + kInt8Block * kPanel;
    for (int h = 0; h < 2; ++h) {
      const __m256 sw = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 16 * h)));
      for (int i = 0; i < MR; ++i) {
        float* o = io + i * kPanel + 8 * h;
        const __m256 scale =
            _mm256_mul_ps(_mm256_set1_ps(sx[i * blocks + b]), sw);
        _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][h]),
                                            scale, _mm256_loadu_ps(o)));
      }
    }
  }
}

template <int... R>
constexpr std::array<Int8DotAvx2Fn, sizeof...(R)> Int8DotAvx2Rows(
    std::integer_sequence<int, R...>) {
  return {&Int8DotAvx2<R + 1>...};
}

}  // namespace

bool AvxVnniUsable() {
  const CpuFeatures& f = DetectCpuFeatures();
  return f.avx2 && f.fma && f.avxvnni;
}

bool Avx2DotUsable() {
  const CpuFeatures& f = DetectCpuFeatures();
  return f.avx2 && f.fma && f.f16c;
}

RowDotAvxVnniFn RowDotAvx2Tile(int rows, int nv) {
  static constexpr auto kOnePanel =
      RowDotAvx2Rows<1>(std::make_integer_sequence<int, kAvx2DotRowDotRows>{});
  static constexpr auto kTwoPanels =
      RowDotAvx2Rows<2>(std::make_integer_sequence<int, kAvx2DotStreamRows>{});
  return nv == 1 ? kOnePanel[rows - 1] : kTwoPanels[rows - 1];
}

Int8DotAvx2Fn Int8DotAvx2Tile(int rows) {
  static constexpr auto kFns =
      Int8DotAvx2Rows(std::make_integer_sequence<int, kAvx2DotBlockRows>{});
  return kFns[rows - 1];
}

RowDotAvxVnniFn RowDotAvxVnniTile(int rows, int nv) {
  static constexpr auto kOnePanel = RowDotAvxVnniRows<1>(
      std::make_integer_sequence<int, kAvxVnniRowDotRows>{});
  static constexpr auto kTwoPanels = RowDotAvxVnniRows<2>(
      std::make_integer_sequence<int, kAvxVnniStreamRows>{});
  static constexpr auto kThreePanels = RowDotAvxVnniRows<3>(
      std::make_integer_sequence<int, kAvxVnniStreamRows>{});
  return nv == 1   ? kOnePanel[rows - 1]
         : nv == 2 ? kTwoPanels[rows - 1]
                   : kThreePanels[rows - 1];
}

PDSERVE_AVX2DOT void QuantizeRowPerRowAvx2(const float* x, int64_t k,
                                           int64_t kq, int64_t group_stride,
                                           uint8_t* u, float* scale) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax = _mm256_setzero_ps();
  for (int64_t p = 0; p < k; p += 8)
    amax =
        _mm256_max_ps(amax, _mm256_and_ps(abs_mask, LoadFirst(x + p, k - p)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  const float s = *std::max_element(lanes, lanes + 8) / 127.0f;
  *scale = s;
  const __m256 sv = _mm256_set1_ps(s);
  const __m128i offset = _mm_set1_epi8(static_cast<char>(0x80));
  for (int64_t p = 0; p < kq; p += 16) {
    __m128i q = _mm_setzero_si128();
    if (s > 0) {
      const __m256i a = QuantizeAvx2(LoadFirst(x + p, k - p), sv);
      const __m256i b = QuantizeAvx2(LoadFirst(x + p + 8, k - p - 8), sv);
      // packs works per 128-bit lane: [a0-3 b0-3 | a4-7 b4-7] -> in order.
      const __m256i h =
          _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8);
      q = _mm_packs_epi16(_mm256_castsi256_si128(h),
                          _mm256_extracti128_si256(h, 1));
    }
    StoreActivationGroups(_mm_xor_si128(q, offset), group_stride,
                          u + p / 4 * group_stride);
  }
}

}  // namespace pdserve::kernels::packed_gemm_internal
