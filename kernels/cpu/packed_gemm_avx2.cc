// The AVX2 + FMA kernels of packed_gemm.h: one panel (16 columns as two
// 8-wide halves) by up to kAvx2Rows rows, and the widener of the batched
// path. Each function carries the target attribute PDSERVE_AVX2; the
// dispatcher calls them only where cpuid reports AVX2, FMA and F16C.
//
// Every loop over a tile's rows, panels or halves carries `#pragma GCC
// unroll`: at -O3 GCC 12 tried to vectorize those loops before unrolling
// them, left the accumulator arrays in memory, and stored every accumulator
// to the stack on each step of k (the fp32 tile of the batched path: 8
// stores per 16 FMAs, about half the FMA peak). Unrolled first, the
// accumulators stay in registers.
#include <algorithm>
#include <array>
#include <utility>

#include "kernels/cpu/packed_gemm_internal.h"

namespace pdserve::kernels::packed_gemm_internal {
namespace {

PDSERVE_AVX2 inline __m256 WidenInt8Avx2(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Weights of k = q (a) and q + 1 (b) for 16 columns as two halves of 8.
template <Fmt W>
PDSERVE_AVX2 inline void LoadPairAvx2(const uint8_t* panel, int64_t q,
                                      __m256 a[2], __m256 b[2]) {
  if constexpr (W == Fmt::kF32) {
    const float* p = reinterpret_cast<const float*>(panel) + q * kPanel;
    a[0] = _mm256_loadu_ps(p);
    a[1] = _mm256_loadu_ps(p + 8);
    b[0] = _mm256_loadu_ps(p + 16);
    b[1] = _mm256_loadu_ps(p + 24);
  } else if constexpr (W == Fmt::kBF16) {
    const uint8_t* p = panel + (q >> 1) * 64;
    const __m256i d0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i d1 =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
    const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    a[0] = _mm256_castsi256_ps(_mm256_slli_epi32(d0, 16));
    a[1] = _mm256_castsi256_ps(_mm256_slli_epi32(d1, 16));
    b[0] = _mm256_castsi256_ps(_mm256_and_si256(d0, hi));
    b[1] = _mm256_castsi256_ps(_mm256_and_si256(d1, hi));
  } else if constexpr (W == Fmt::kF16) {
    const uint8_t* p = panel + q * 32;
    a[0] =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    a[1] = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
    b[0] = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32)));
    b[1] = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 48)));
  } else {
    static_assert(W == Fmt::kI8);
    const uint8_t* p = panel + q * 16;
    a[0] = WidenInt8Avx2(p);
    a[1] = WidenInt8Avx2(p + 8);
    b[0] = WidenInt8Avx2(p + 16);
    b[1] = WidenInt8Avx2(p + 24);
  }
}

template <Fmt W, int MR>
PDSERVE_AVX2 void TileAvx2(const float* xp, const uint8_t* w,
                           int64_t /*panel_bytes*/, int64_t k0, int64_t k1,
                           float* io, bool zero, int64_t /*next_tile*/) {
  __m256 acc[MR][2];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 16
    for (int h = 0; h < 2; ++h) {
      acc[i][h] =
          zero ? _mm256_setzero_ps() : _mm256_loadu_ps(io + i * 16 + h * 8);
    }
  }
  int64_t q = k0;
  for (; q + 2 <= k1; q += 2) {
    const float* xq = xp + (q - k0) * MR;
    __m256 a[2], b[2];
    LoadPairAvx2<W>(w, q, a, b);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m256 xa = _mm256_broadcast_ss(xq + i);
      acc[i][0] = _mm256_fmadd_ps(xa, a[0], acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xa, a[1], acc[i][1]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m256 xb = _mm256_broadcast_ss(xq + MR + i);
      acc[i][0] = _mm256_fmadd_ps(xb, b[0], acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xb, b[1], acc[i][1]);
    }
  }
  if (q < k1) {  // odd k: the last weight of the pair is padding
    const float* xq = xp + (q - k0) * MR;
    __m256 a[2], b[2];
    LoadPairAvx2<W>(w, q, a, b);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m256 xa = _mm256_broadcast_ss(xq + i);
      acc[i][0] = _mm256_fmadd_ps(xa, a[0], acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xa, a[1], acc[i][1]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(io + i * 16, acc[i][0]);
    _mm256_storeu_ps(io + i * 16 + 8, acc[i][1]);
  }
}

// One row (batch 1) of NV panels of bf16, fp16 or per-row int8: 2 x NV
// independent FMA chains instead of one panel's 2, which each wait on their
// previous FMA, and a prefetch 1 KiB ahead in each panel's stream
// (StreamAheadOffset). Every column's chain is the same fma over k in
// increasing order. (TileAvx2 with a panel dimension added gave the same
// bits, but GCC 12 kept more of its accumulators on the stack: 8-10% fewer
// tokens/s at `small` int8 batch 1.)
template <Fmt W, int NV>
PDSERVE_AVX2 void TileAvx2Wide(const float* xp, const uint8_t* w,
                               int64_t panel_bytes, int64_t k0, int64_t k1,
                               float* io, bool zero, int64_t next_tile) {
  __m256 acc[NV][2];
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) {
#pragma GCC unroll 16
    for (int h = 0; h < 2; ++h) {
      acc[v][h] =
          zero ? _mm256_setzero_ps() : _mm256_loadu_ps(io + v * 16 + h * 8);
    }
  }
  constexpr int64_t kBytesPerK = ElementBytesOf(W) * kPanel;
  int64_t q = k0;
  for (; q + 2 <= k1; q += 2) {
    const __m256 xa = _mm256_broadcast_ss(xp + (q - k0));
    const __m256 xb = _mm256_broadcast_ss(xp + (q - k0) + 1);
    if ((q * kBytesPerK) % 64 == 0) {
      const int64_t off =
          StreamAheadOffset(q * kBytesPerK, panel_bytes, next_tile);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(w + v * panel_bytes + off),
                     _MM_HINT_T0);
    }
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      __m256 a[2], b[2];
      LoadPairAvx2<W>(w + v * panel_bytes, q, a, b);
      acc[v][0] = _mm256_fmadd_ps(xa, a[0], acc[v][0]);
      acc[v][1] = _mm256_fmadd_ps(xa, a[1], acc[v][1]);
      acc[v][0] = _mm256_fmadd_ps(xb, b[0], acc[v][0]);
      acc[v][1] = _mm256_fmadd_ps(xb, b[1], acc[v][1]);
    }
  }
  if (q < k1) {  // odd k: the last weight of the pair is padding
    const __m256 xa = _mm256_broadcast_ss(xp + (q - k0));
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      __m256 a[2], b[2];
      LoadPairAvx2<W>(w + v * panel_bytes, q, a, b);
      acc[v][0] = _mm256_fmadd_ps(xa, a[0], acc[v][0]);
      acc[v][1] = _mm256_fmadd_ps(xa, a[1], acc[v][1]);
    }
  }
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) {
    _mm256_storeu_ps(io + v * 16, acc[v][0]);
    _mm256_storeu_ps(io + v * 16 + 8, acc[v][1]);
  }
}

template <Fmt W, int... NV>
constexpr std::array<TileFn, sizeof...(NV)> Avx2WidePanels(
    std::integer_sequence<int, NV...>) {
  return {&TileAvx2Wide<W, NV + 1>...};
}

// Block int8, one block's scales in registers while its k run.
PDSERVE_AVX2 inline void BlockScalesAvx2(const uint8_t* panel, int64_t b,
                                         __m256 s[2]) {
  const uint8_t* p = panel + BlockScaleOffset(b, 0);
  s[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  s[1] = _mm256_cvtph_ps(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
}

template <int MR>
PDSERVE_AVX2 void TileAvx2B32(const float* xp, const uint8_t* w,
                              int64_t /*panel_bytes*/, int64_t k0, int64_t k1,
                              float* io, bool zero, int64_t /*next_tile*/) {
  __m256 acc[MR][2];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 16
    for (int h = 0; h < 2; ++h) {
      acc[i][h] =
          zero ? _mm256_setzero_ps() : _mm256_loadu_ps(io + i * 16 + h * 8);
    }
  }
  const float* xq = xp;
  for (int64_t b = k0 / kInt8Block; b * kInt8Block < k1; ++b) {
    const int64_t base = b * kInt8Block;
    const int64_t j1 = std::min(k1, base + kInt8Block) - base;
    const uint8_t* blk = w + b * kBlockBytes;
    __m256 s[2];
    BlockScalesAvx2(w, b, s);
    for (int64_t j = std::max(k0, base) - base; j < j1; ++j, xq += MR) {
      const uint8_t* p = blk + j * kPanel;
      const __m256 a0 = _mm256_mul_ps(WidenInt8Avx2(p), s[0]);
      const __m256 a1 = _mm256_mul_ps(WidenInt8Avx2(p + 8), s[1]);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const __m256 xa = _mm256_broadcast_ss(xq + i);
        acc[i][0] = _mm256_fmadd_ps(xa, a0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(xa, a1, acc[i][1]);
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(io + i * 16, acc[i][0]);
    _mm256_storeu_ps(io + i * 16 + 8, acc[i][1]);
  }
}

template <Fmt W>
PDSERVE_AVX2 void WidenAvx2(const uint8_t* w, int64_t panel_bytes, int nv,
                            int64_t q0, int64_t q1, float* out) {
  for (int v = 0; v < nv; ++v) {
    const uint8_t* panel = w + v * panel_bytes;
    float* o = out + v * (q1 - q0) * kPanel;
    if constexpr (W == Fmt::kI8B32) {
      for (int64_t q = q0; q < q1;) {
        const int64_t b = q / kInt8Block;
        const int64_t end = std::min(q1, (b + 1) * kInt8Block);
        __m256 s[2];
        BlockScalesAvx2(panel, b, s);
        const uint8_t* p =
            panel + b * kBlockBytes + (q - b * kInt8Block) * kPanel;
        for (; q < end; ++q, p += kPanel) {
          _mm256_storeu_ps(o + (q - q0) * kPanel,
                           _mm256_mul_ps(WidenInt8Avx2(p), s[0]));
          _mm256_storeu_ps(o + (q - q0) * kPanel + 8,
                           _mm256_mul_ps(WidenInt8Avx2(p + 8), s[1]));
        }
      }
    } else {
      int64_t q = q0;  // q0 is even: pairs line up with bf16 words
      for (; q < q1; q += 2) {
        __m256 a[2], b[2];
        LoadPairAvx2<W>(panel, q, a, b);
        _mm256_storeu_ps(o + (q - q0) * kPanel, a[0]);
        _mm256_storeu_ps(o + (q - q0) * kPanel + 8, a[1]);
        if (q + 1 < q1) {
          _mm256_storeu_ps(o + (q + 1 - q0) * kPanel, b[0]);
          _mm256_storeu_ps(o + (q + 1 - q0) * kPanel + 8, b[1]);
        }
      }
    }
  }
}

template <Fmt W, int... R>
constexpr std::array<TileFn, sizeof...(R)> Avx2Rows(
    std::integer_sequence<int, R...>) {
  if constexpr (W == Fmt::kI8B32) {
    return {&TileAvx2B32<R + 1>...};
  } else {
    return {&TileAvx2<W, R + 1>...};
  }
}

}  // namespace

TileFn Avx2Tile(Fmt t, int rows) {
  static constexpr auto kSeq = std::make_integer_sequence<int, kAvx2Rows>{};
  static constexpr auto f32 = Avx2Rows<Fmt::kF32>(kSeq);
  static constexpr auto bf16 = Avx2Rows<Fmt::kBF16>(kSeq);
  static constexpr auto f16 = Avx2Rows<Fmt::kF16>(kSeq);
  static constexpr auto i8 = Avx2Rows<Fmt::kI8>(kSeq);
  static constexpr auto i8b32 = Avx2Rows<Fmt::kI8B32>(kSeq);
  switch (t) {
    case Fmt::kF32:
      return f32[rows - 1];
    case Fmt::kBF16:
      return bf16[rows - 1];
    case Fmt::kF16:
      return f16[rows - 1];
    case Fmt::kI8:
      return i8[rows - 1];
    case Fmt::kI8B32:
      return i8b32[rows - 1];
    case Fmt::kI8Dot:  // never: GemmNT runs GemmDotLayoutChain for it
      break;
  }
  return nullptr;
}

TileFn Avx2WideTile(Fmt t, int nv) {
  static constexpr auto kSeq =
      std::make_integer_sequence<int, kAvx2WidePanels>{};
  static constexpr auto bf16 = Avx2WidePanels<Fmt::kBF16>(kSeq);
  static constexpr auto f16 = Avx2WidePanels<Fmt::kF16>(kSeq);
  static constexpr auto i8 = Avx2WidePanels<Fmt::kI8>(kSeq);
  switch (t) {
    case Fmt::kBF16:
      return bf16[nv - 1];
    case Fmt::kF16:
      return f16[nv - 1];
    case Fmt::kI8:
      return i8[nv - 1];
    default:
      break;
  }
  return nullptr;
}

WidenFn Avx2Widener(Fmt t) {
  switch (t) {
    case Fmt::kBF16:
      return &WidenAvx2<Fmt::kBF16>;
    case Fmt::kF16:
      return &WidenAvx2<Fmt::kF16>;
    case Fmt::kI8:
      return &WidenAvx2<Fmt::kI8>;
    case Fmt::kI8B32:
      return &WidenAvx2<Fmt::kI8B32>;
    case Fmt::kF32:
    case Fmt::kI8Dot:  // (never reaches here)
      return nullptr;
  }
  return nullptr;
}

}  // namespace pdserve::kernels::packed_gemm_internal
