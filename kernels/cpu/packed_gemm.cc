#include "kernels/cpu/packed_gemm.h"

// GCC 12's own avx512fintrin.h trips -Wmaybe-uninitialized (its
// _mm512_undefined_* placeholders) in every instantiation, and
// -Wuninitialized in _mm512_reduce_max_ps; nothing here reads an
// uninitialised value.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/matmul.h"

namespace pdserve::kernels {
namespace {

constexpr int64_t kPanel = 16;  // output rows (columns of y) per panel
// Block int8: per block of 32 k, [32][16] int8 then 16 fp16 scales.
constexpr int64_t kBlockBytes = kInt8Block * kPanel + kPanel * 2;

// What a panel holds; DType alone does not say how int8 is scaled.
// kI8Dot: per-row int8 in WeightMatrix::Layout::kPanel16Dot.
enum class Fmt : uint8_t { kF32, kBF16, kF16, kI8, kI8B32, kI8Dot };

Fmt FormatOf(DType t, Int8Scaling s,
             WeightMatrix::Layout layout = WeightMatrix::Layout::kPanel16) {
  switch (t) {
    case DType::kBF16:
      return Fmt::kBF16;
    case DType::kF16:
      return Fmt::kF16;
    case DType::kI8:
      if (s == Int8Scaling::kBlock32) return Fmt::kI8B32;
      return layout == WeightMatrix::Layout::kPanel16Dot ? Fmt::kI8Dot
                                                         : Fmt::kI8;
    default:
      return Fmt::kF32;
  }
}

int64_t ElementBytes(DType t) { return static_cast<int64_t>(DTypeBytes(t)); }
// Bytes per weight of the panel-16 formats with one byte count per k (not
// kI8B32, whose blocks carry scales).
constexpr int64_t ElementBytesOf(Fmt t) {
  return t == Fmt::kF32 ? 4 : t == Fmt::kBF16 || t == Fmt::kF16 ? 2 : 1;
}

// Byte offset of weight (k index q, column c of the panel) inside a panel.
inline int64_t PanelOffset(Fmt t, int64_t q, int64_t c) {
  switch (t) {
    case Fmt::kBF16:  // [k/2][16][2]: two k of one column share a word
      return (((q >> 1) * kPanel + c) * 2 + (q & 1)) * 2;
    case Fmt::kF16:
      return (q * kPanel + c) * 2;
    case Fmt::kI8:
      return q * kPanel + c;
    case Fmt::kI8Dot:  // [k/4][16][4]
      return (q >> 2) * (kPanel * 4) + c * 4 + (q & 3);
    case Fmt::kI8B32:
      return (q / kInt8Block) * kBlockBytes + (q % kInt8Block) * kPanel + c;
    case Fmt::kF32:
      break;
  }
  return (q * kPanel + c) * 4;
}
// Byte offset of the fp16 scale of (block b, column c) in a block-int8 panel.
inline int64_t BlockScaleOffset(int64_t b, int64_t c) {
  return b * kBlockBytes + kInt8Block * kPanel + c * 2;
}

// w(q, c) of the order contract: the stored weight widened to fp32 (block
// int8: times its block's scale, an exact product).
inline float LoadWidened(Fmt t, const uint8_t* panel, int64_t q, int64_t c) {
  const uint8_t* p = panel + PanelOffset(t, q, c);
  switch (t) {
    case Fmt::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case Fmt::kBF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return Bf16ToFloat(h);
    }
    case Fmt::kF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return F16ToFloat(h);
    }
    case Fmt::kI8:
    case Fmt::kI8Dot:
      return static_cast<float>(static_cast<int8_t>(*p));
    case Fmt::kI8B32: {
      uint16_t h;
      std::memcpy(&h, panel + BlockScaleOffset(q / kInt8Block, c), 2);
      return static_cast<float>(static_cast<int8_t>(*p)) * F16ToFloat(h);
    }
  }
  return 0;
}

// Large matrices are 2 MiB aligned and asked for transparent huge pages: a
// decode step streams gigabytes of weights, and 4 KiB pages would miss the
// TLB on nearly every panel.
std::shared_ptr<uint8_t[]> AllocateWeights(int64_t bytes) {
  const size_t align = bytes >= (int64_t{4} << 20) ? (size_t{2} << 20) : 64;
  const size_t size = (static_cast<size_t>(bytes) + align - 1) / align * align;
  void* p = std::aligned_alloc(align, std::max<size_t>(size, align));
  if (p == nullptr) std::abort();
#ifdef MADV_HUGEPAGE
  if (align > 64) madvise(p, size, MADV_HUGEPAGE);
#endif
  std::memset(p, 0, size);
  return std::shared_ptr<uint8_t[]>(static_cast<uint8_t*>(p),
                                    [](uint8_t* q) { std::free(q); });
}

// ---------------------------------------------------------------------------
// Tiles. Each computes io[MR][NV*16] (+)= x[MR rows][k0:k1] · panels[k0:k1]
// for NV consecutive panels; `zero` starts the chains at 0, otherwise they
// resume from io. Every chain is fma over k in increasing order. x comes
// packed as xp[(q - k0) * MR + i] (one k's MR values side by side), so a tile
// reads one contiguous stream instead of MR rows that share cache sets.

// Portable: any rows (<= 8) and panel count (<= 3).
void TilePortable(Fmt t, int rows, int nv, const float* xp, const uint8_t* w,
                  int64_t panel_bytes, int64_t k0, int64_t k1, float* io,
                  bool zero) {
  const int width = nv * kPanel;
  for (int i = 0; i < rows; ++i) {
    for (int v = 0; v < nv; ++v) {
      const uint8_t* panel = w + v * panel_bytes;
      for (int c = 0; c < kPanel; ++c) {
        float acc = zero ? 0.0f : io[i * width + v * kPanel + c];
        for (int64_t q = k0; q < k1; ++q) {
          acc = std::fma(xp[(q - k0) * rows + i], LoadWidened(t, panel, q, c),
                         acc);
        }
        io[i * width + v * kPanel + c] = acc;
      }
    }
  }
}

#define PDSERVE_AVX2 __attribute__((target("avx2,fma,f16c")))
#define PDSERVE_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

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
                           float* io, bool zero) {
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) {
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
    for (int i = 0; i < MR; ++i) {
      const __m256 xa = _mm256_broadcast_ss(xq + i);
      acc[i][0] = _mm256_fmadd_ps(xa, a[0], acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xa, a[1], acc[i][1]);
    }
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
    for (int i = 0; i < MR; ++i) {
      const __m256 xa = _mm256_broadcast_ss(xq + i);
      acc[i][0] = _mm256_fmadd_ps(xa, a[0], acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xa, a[1], acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(io + i * 16, acc[i][0]);
    _mm256_storeu_ps(io + i * 16 + 8, acc[i][1]);
  }
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
                              float* io, bool zero) {
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) {
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
      for (int i = 0; i < MR; ++i) {
        const __m256 xa = _mm256_broadcast_ss(xq + i);
        acc[i][0] = _mm256_fmadd_ps(xa, a0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(xa, a1, acc[i][1]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(io + i * 16, acc[i][0]);
    _mm256_storeu_ps(io + i * 16 + 8, acc[i][1]);
  }
}

// One pair of k (q even) of one panel: Raw is what stays in a register
// between the two halves (bf16: the packed words; others: the address).
template <Fmt W>
struct Avx512Pair;
template <>
struct Avx512Pair<Fmt::kF32> {
  using Raw = const float*;
  PDSERVE_AVX512 static Raw Load(const uint8_t* panel, int64_t q) {
    return reinterpret_cast<const float*>(panel) + q * kPanel;
  }
  PDSERVE_AVX512 static __m512 First(Raw p) { return _mm512_loadu_ps(p); }
  PDSERVE_AVX512 static __m512 Second(Raw p) { return _mm512_loadu_ps(p + 16); }
};
template <>
struct Avx512Pair<Fmt::kBF16> {
  using Raw = __m512i;
  PDSERVE_AVX512 static Raw Load(const uint8_t* panel, int64_t q) {
    return _mm512_loadu_si512(panel + (q >> 1) * 64);
  }
  PDSERVE_AVX512 static __m512 First(Raw d) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(d, 16));
  }
  PDSERVE_AVX512 static __m512 Second(Raw d) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(d, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
};
template <>
struct Avx512Pair<Fmt::kF16> {
  using Raw = const uint8_t*;
  PDSERVE_AVX512 static Raw Load(const uint8_t* panel, int64_t q) {
    return panel + q * 32;
  }
  PDSERVE_AVX512 static __m512 First(Raw p) {
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  PDSERVE_AVX512 static __m512 Second(Raw p) {
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
  }
};
PDSERVE_AVX512 inline __m512 WidenInt8Avx512(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
template <>
struct Avx512Pair<Fmt::kI8> {
  using Raw = const uint8_t*;
  PDSERVE_AVX512 static Raw Load(const uint8_t* panel, int64_t q) {
    return panel + q * 16;
  }
  PDSERVE_AVX512 static __m512 First(Raw p) { return WidenInt8Avx512(p); }
  PDSERVE_AVX512 static __m512 Second(Raw p) { return WidenInt8Avx512(p + 16); }
};

template <Fmt W, int MR, int NV>
PDSERVE_AVX512 void TileAvx512(const float* xp, const uint8_t* w,
                               int64_t panel_bytes, int64_t k0, int64_t k1,
                               float* io, bool zero) {
  using P = Avx512Pair<W>;
  constexpr int kWidth = NV * 16;
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < NV; ++v) {
      acc[i][v] = zero ? _mm512_setzero_ps()
                       : _mm512_loadu_ps(io + i * kWidth + v * 16);
    }
  }
  const uint8_t* wp[NV];
  for (int v = 0; v < NV; ++v) wp[v] = w + v * panel_bytes;
  // Bytes of one panel per k; at small batches the tile streams its panels
  // from DRAM, and a prefetch 1 KiB ahead in each keeps more lines in flight
  // than the hardware prefetcher alone (one per 64 bytes).
  constexpr int64_t kBytesPerK = ElementBytesOf(W) * kPanel;
  int64_t q = k0;
  for (; q + 2 <= k1; q += 2) {
    const float* xq = xp + (q - k0) * MR;
    if (MR <= 2 && (q * kBytesPerK) % 64 == 0) {
      for (int v = 0; v < NV; ++v)
        _mm_prefetch(
            reinterpret_cast<const char*>(wp[v] + q * kBytesPerK + 1024),
            _MM_HINT_T0);
    }
    typename P::Raw raw[NV];
    for (int v = 0; v < NV; ++v) raw[v] = P::Load(wp[v], q);
    // Broadcast each x once and reuse it across the NV panels: 3 x 6
    // accumulators, 3 widened weights, the raw words and one broadcast fit
    // the 32 registers without spills.
    __m512 a[NV];
    for (int v = 0; v < NV; ++v) a[v] = P::First(raw[v]);
    for (int i = 0; i < MR; ++i) {
      const __m512 xa = _mm512_set1_ps(xq[i]);
      for (int v = 0; v < NV; ++v)
        acc[i][v] = _mm512_fmadd_ps(xa, a[v], acc[i][v]);
    }
    for (int v = 0; v < NV; ++v) a[v] = P::Second(raw[v]);
    for (int i = 0; i < MR; ++i) {
      const __m512 xb = _mm512_set1_ps(xq[MR + i]);
      for (int v = 0; v < NV; ++v)
        acc[i][v] = _mm512_fmadd_ps(xb, a[v], acc[i][v]);
    }
  }
  if (q < k1) {  // odd k: the pair's second weight is padding
    const float* xq = xp + (q - k0) * MR;
    for (int v = 0; v < NV; ++v) {
      const __m512 a = P::First(P::Load(wp[v], q));
      for (int i = 0; i < MR; ++i)
        acc[i][v] = _mm512_fmadd_ps(_mm512_set1_ps(xq[i]), a, acc[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < NV; ++v)
      _mm512_storeu_ps(io + i * kWidth + v * 16, acc[i][v]);
  }
}

// Block int8: per block the NV panels' scales stay in registers; each k's
// weights are widened and scaled once (an exact product) for all MR rows.
template <int MR, int NV>
PDSERVE_AVX512 void TileAvx512B32(const float* xp, const uint8_t* w,
                                  int64_t panel_bytes, int64_t k0, int64_t k1,
                                  float* io, bool zero) {
  constexpr int kWidth = NV * 16;
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < NV; ++v) {
      acc[i][v] = zero ? _mm512_setzero_ps()
                       : _mm512_loadu_ps(io + i * kWidth + v * 16);
    }
  }
  const uint8_t* wp[NV];
  for (int v = 0; v < NV; ++v) wp[v] = w + v * panel_bytes;
  // Pointers and a block-relative index only: k0 >= 0, and index
  // arithmetic per k would cost more than the widening.
  const float* xq = xp;
  for (int64_t b = k0 / kInt8Block; b * kInt8Block < k1; ++b) {
    const int64_t base = b * kInt8Block;
    const int64_t j1 = std::min(k1, base + kInt8Block) - base;
    const uint8_t* blk[NV];
    __m512 s[NV];
    for (int v = 0; v < NV; ++v) {
      blk[v] = wp[v] + b * kBlockBytes;
      s[v] = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(blk[v] + kInt8Block * kPanel)));
    }
    for (int64_t j = std::max(k0, base) - base; j < j1; ++j, xq += MR) {
      __m512 a[NV];
      for (int v = 0; v < NV; ++v)
        a[v] = _mm512_mul_ps(WidenInt8Avx512(blk[v] + j * kPanel), s[v]);
      for (int i = 0; i < MR; ++i) {
        const __m512 xa = _mm512_set1_ps(xq[i]);
        for (int v = 0; v < NV; ++v)
          acc[i][v] = _mm512_fmadd_ps(xa, a[v], acc[i][v]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < NV; ++v)
      _mm512_storeu_ps(io + i * kWidth + v * 16, acc[i][v]);
  }
}

// --- Widening once per batch -----------------------------------------------
// With more rows than one register tile holds, each row tile would widen the
// same weights again. Instead the weights of [q0, q1) of NV panels are
// widened once into an fp32 scratch in the fp32 panel layout
// (out[v][q - q0][16]), and every row tile runs the fp32 tile over it. The
// values are exactly w(j, p) and the chains run in the same order, so the
// bits equal the direct path's.

void WidenPortable(Fmt t, const uint8_t* w, int64_t panel_bytes, int nv,
                   int64_t q0, int64_t q1, float* out) {
  for (int v = 0; v < nv; ++v) {
    const uint8_t* panel = w + v * panel_bytes;
    float* o = out + v * (q1 - q0) * kPanel;
    for (int64_t q = q0; q < q1; ++q)
      for (int c = 0; c < kPanel; ++c)
        o[(q - q0) * kPanel + c] = LoadWidened(t, panel, q, c);
  }
}

template <Fmt W>
void WidenPortableAs(const uint8_t* w, int64_t panel_bytes, int nv, int64_t q0,
                     int64_t q1, float* out) {
  WidenPortable(W, w, panel_bytes, nv, q0, q1, out);
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

template <Fmt W>
PDSERVE_AVX512 void WidenAvx512(const uint8_t* w, int64_t panel_bytes, int nv,
                                int64_t q0, int64_t q1, float* out) {
  for (int v = 0; v < nv; ++v) {
    const uint8_t* panel = w + v * panel_bytes;
    float* o = out + v * (q1 - q0) * kPanel;
    if constexpr (W == Fmt::kI8B32) {
      for (int64_t q = q0; q < q1;) {
        const int64_t b = q / kInt8Block;
        const int64_t end = std::min(q1, (b + 1) * kInt8Block);
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(panel + BlockScaleOffset(b, 0))));
        const uint8_t* p =
            panel + b * kBlockBytes + (q - b * kInt8Block) * kPanel;
        for (; q < end; ++q, p += kPanel) {
          _mm512_storeu_ps(o + (q - q0) * kPanel,
                           _mm512_mul_ps(WidenInt8Avx512(p), s));
        }
      }
    } else {
      using P = Avx512Pair<W>;
      for (int64_t q = q0; q < q1; q += 2) {  // q0 is even
        const typename P::Raw raw = P::Load(panel, q);
        _mm512_storeu_ps(o + (q - q0) * kPanel, P::First(raw));
        if (q + 1 < q1)
          _mm512_storeu_ps(o + (q + 1 - q0) * kPanel, P::Second(raw));
      }
    }
  }
}

// --- bf16-activation dot products (GemmNumerics::kBf16Dot) -----------------
// x comes packed as bf16 pairs, xp[(q - k0) / 2 * MR + i] = x[2t] | x[2t+1]
// << 16, the layout of the weights' words. Per pair, as VDPBF16PS does it
// (Intel SDM): acc += w[2t+1]*x[2t+1], then acc += w[2t]*x[2t], each an fp32
// FMA with bf16 denormal inputs read as zero and denormal results flushed.

inline float FlushDenormal(float v) {
  return std::fabs(v) < 1.17549435e-38f ? std::copysign(0.0f, v) : v;
}
inline float Bf16Daz(uint16_t h) { return FlushDenormal(Bf16ToFloat(h)); }

void TileBf16DotPortable(int rows, int nv, const uint32_t* xp, const uint8_t* w,
                         int64_t panel_bytes, int64_t k0, int64_t k1, float* io,
                         bool zero) {
  const int width = nv * kPanel;
  for (int i = 0; i < rows; ++i) {
    for (int v = 0; v < nv; ++v) {
      const uint32_t* panel =
          reinterpret_cast<const uint32_t*>(w + v * panel_bytes);
      for (int c = 0; c < kPanel; ++c) {
        float acc = zero ? 0.0f : io[i * width + v * kPanel + c];
        for (int64_t q = k0; q < k1; q += 2) {
          const uint32_t wd = panel[(q >> 1) * kPanel + c];
          const uint32_t xd = xp[(q - k0) / 2 * rows + i];
          acc = FlushDenormal(
              std::fma(Bf16Daz(wd >> 16), Bf16Daz(xd >> 16), acc));
          acc = FlushDenormal(
              std::fma(Bf16Daz(wd & 0xffff), Bf16Daz(xd & 0xffff), acc));
        }
        io[i * width + v * kPanel + c] = acc;
      }
    }
  }
}

template <int MR, int NV>
__attribute__((target("avx512f,avx512bf16"))) void TileBf16Dot(
    const float* xpf, const uint8_t* w, int64_t panel_bytes, int64_t k0,
    int64_t k1, float* io, bool zero) {
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xpf);
  constexpr int kWidth = NV * 16;
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < NV; ++v) {
      acc[i][v] = zero ? _mm512_setzero_ps()
                       : _mm512_loadu_ps(io + i * kWidth + v * 16);
    }
  }
  const uint8_t* wp[NV];
  for (int v = 0; v < NV; ++v) wp[v] = w + v * panel_bytes;
  for (int64_t q = k0; q < k1; q += 2) {
    const uint32_t* xq = xp + (q - k0) / 2 * MR;
    __m512i raw[NV];
    for (int v = 0; v < NV; ++v)
      raw[v] = _mm512_loadu_si512(wp[v] + (q >> 1) * 64);
    for (int i = 0; i < MR; ++i) {
      const __m512i xb = _mm512_set1_epi32(static_cast<int>(xq[i]));
      for (int v = 0; v < NV; ++v) {
        acc[i][v] = _mm512_dpbf16_ps(acc[i][v], (__m512bh)raw[v], (__m512bh)xb);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < NV; ++v)
      _mm512_storeu_ps(io + i * kWidth + v * 16, acc[i][v]);
  }
}

// --- int8 activations x block-int8 weights (GemmNumerics::kInt8Dot) --------
// qx: [rows][kp] int8 (this row tile's rows), sx: [rows][blocks]; io:
// [rows][nv * 16]. Every output: per block the exact integer dot product,
// then acc = fma(float(isum), sx * sw, acc), blocks in increasing order.

void Int8DotPortable(const int8_t* qx, const float* sx, int64_t kp,
                     int64_t blocks, int rows, int nv, const uint8_t* w,
                     int64_t panel_bytes, float* io) {
  const int width = nv * kPanel;
  for (int i = 0; i < rows; ++i) {
    for (int v = 0; v < nv; ++v) {
      const uint8_t* panel = w + v * panel_bytes;
      for (int c = 0; c < kPanel; ++c) {
        float acc = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
          const int8_t* xq = qx + i * kp + b * kInt8Block;
          const uint8_t* wq = panel + b * kBlockBytes + c;
          int32_t isum = 0;
          for (int p = 0; p < kInt8Block; ++p) {
            isum +=
                int32_t{xq[p]} * int32_t{static_cast<int8_t>(wq[p * kPanel])};
          }
          uint16_t h;
          std::memcpy(&h, panel + BlockScaleOffset(b, c), 2);
          const float scale = sx[i * blocks + b] * F16ToFloat(h);
          acc = std::fma(static_cast<float>(isum), scale, acc);
        }
        io[i * width + v * kPanel + c] = acc;
      }
    }
  }
}

#define PDSERVE_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi,f16c")))

// ux: x + 128 as unsigned bytes (vpdpbusd multiplies unsigned by signed);
// Σ (q + 128) w - 128 Σ w = Σ q w, exactly. A block's weights are stored
// [32 k][16 columns]; vpermb turns 4 k x 16 columns into the 16 dwords of 4
// consecutive k that vpdpbusd wants.
// With more rows than one tile holds, a tile's weights are prepared once
// for all row tiles: per block, [8 groups][NV][64 B] permuted weights, then
// [NV] x 16 int32 of 128 Σ w, then [NV] x 16 fp32 scales (PrepBlockBytes(nv)
// bytes). The kernel then reads these instead of permuting and summing again;
// the integers and scales are the same, so are the bits.
constexpr int64_t PrepBlockBytes(int nv) { return (512 + 64 + 64) * nv; }

PDSERVE_VNNI inline __m512i Int8DotOrder() {
  alignas(64) uint8_t order[64];
  for (int c = 0; c < kPanel; ++c)
    for (int kk = 0; kk < 4; ++kk) order[c * 4 + kk] = kk * kPanel + c;
  return _mm512_load_si512(order);
}

PDSERVE_VNNI void PrepareInt8DotTile(const uint8_t* w, int64_t panel_bytes,
                                     int nv, int64_t blocks, uint8_t* out) {
  const __m512i idx = Int8DotOrder();
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* o = out + b * PrepBlockBytes(nv);
    for (int v = 0; v < nv; ++v) {
      const uint8_t* blk = w + v * panel_bytes + b * kBlockBytes;
      __m512i wsum = _mm512_setzero_si512();
      for (int g = 0; g < kInt8Block / 4; ++g) {
        const __m512i wg = _mm512_permutexvar_epi8(
            idx, _mm512_loadu_si512(blk + g * 4 * kPanel));
        wsum = _mm512_dpbusd_epi32(wsum, ones, wg);
        _mm512_storeu_si512(o + (g * nv + v) * 64, wg);
      }
      _mm512_storeu_si512(o + 512 * nv + v * 64, _mm512_slli_epi32(wsum, 7));
      _mm512_storeu_ps(
          o + 576 * nv + v * 64,
          _mm512_cvtph_ps(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(blk + kInt8Block * kPanel))));
    }
  }
}

template <int MR, int NV>
PDSERVE_VNNI void Int8DotVnniPrepared(const uint8_t* ux, const float* sx,
                                      int64_t kp, int64_t blocks,
                                      const uint8_t* prep, int64_t /*unused*/,
                                      float* io) {
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* o = prep + b * PrepBlockBytes(NV);
    __m512i isum[MR][NV];
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < NV; ++v) isum[i][v] = _mm512_setzero_si512();
    for (int g = 0; g < kInt8Block / 4; ++g) {
      __m512i wg[NV];
      for (int v = 0; v < NV; ++v)
        wg[v] = _mm512_loadu_si512(o + (g * NV + v) * 64);
      for (int i = 0; i < MR; ++i) {
        uint32_t u4;
        std::memcpy(&u4, ux + i * kp + b * kInt8Block + g * 4, 4);
        const __m512i u = _mm512_set1_epi32(static_cast<int>(u4));
        for (int v = 0; v < NV; ++v)
          isum[i][v] = _mm512_dpbusd_epi32(isum[i][v], u, wg[v]);
      }
    }
    for (int v = 0; v < NV; ++v) {
      const __m512i corr = _mm512_loadu_si512(o + 512 * NV + v * 64);
      const __m512 sw = _mm512_loadu_ps(o + 576 * NV + v * 64);
      for (int i = 0; i < MR; ++i) {
        const __m512 scale =
            _mm512_mul_ps(_mm512_set1_ps(sx[i * blocks + b]), sw);
        acc[i][v] = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_sub_epi32(isum[i][v], corr)), scale,
            acc[i][v]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v)
      _mm512_storeu_ps(io + (i * NV + v) * kPanel, acc[i][v]);
}

template <int MR, int NV>
PDSERVE_VNNI void Int8DotVnni(const uint8_t* ux, const float* sx, int64_t kp,
                              int64_t blocks, const uint8_t* w,
                              int64_t panel_bytes, float* io) {
  const __m512i idx = Int8DotOrder();
  const __m512i ones = _mm512_set1_epi8(1);
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk[NV];
    __m512i isum[MR][NV], wsum[NV];
    for (int v = 0; v < NV; ++v) {
      blk[v] = w + v * panel_bytes + b * kBlockBytes;
      wsum[v] = _mm512_setzero_si512();
      for (int i = 0; i < MR; ++i) isum[i][v] = _mm512_setzero_si512();
    }
    for (int g = 0; g < kInt8Block / 4; ++g) {
      __m512i wg[NV];
      for (int v = 0; v < NV; ++v) {
        wg[v] = _mm512_permutexvar_epi8(
            idx, _mm512_loadu_si512(blk[v] + g * 4 * kPanel));
        wsum[v] = _mm512_dpbusd_epi32(wsum[v], ones, wg[v]);
      }
      for (int i = 0; i < MR; ++i) {
        uint32_t u4;
        std::memcpy(&u4, ux + i * kp + b * kInt8Block + g * 4, 4);
        const __m512i u = _mm512_set1_epi32(static_cast<int>(u4));
        for (int v = 0; v < NV; ++v)
          isum[i][v] = _mm512_dpbusd_epi32(isum[i][v], u, wg[v]);
      }
    }
    for (int v = 0; v < NV; ++v) {
      const __m512i corr = _mm512_slli_epi32(wsum[v], 7);
      const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(blk[v] + kInt8Block * kPanel)));
      for (int i = 0; i < MR; ++i) {
        const __m512 scale =
            _mm512_mul_ps(_mm512_set1_ps(sx[i * blocks + b]), sw);
        acc[i][v] = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_sub_epi32(isum[i][v], corr)), scale,
            acc[i][v]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v)
      _mm512_storeu_ps(io + (i * NV + v) * kPanel, acc[i][v]);
}

using Int8DotFn = void (*)(const uint8_t*, const float*, int64_t, int64_t,
                           const uint8_t*, int64_t, float*);
constexpr int kInt8DotRows = 4, kInt8DotPanels = 2;

Int8DotFn Int8DotVnniTile(int rows, int nv) {
  static constexpr Int8DotFn kFns[kInt8DotPanels][kInt8DotRows] = {
      {&Int8DotVnni<1, 1>, &Int8DotVnni<2, 1>, &Int8DotVnni<3, 1>,
       &Int8DotVnni<4, 1>},
      {&Int8DotVnni<1, 2>, &Int8DotVnni<2, 2>, &Int8DotVnni<3, 2>,
       &Int8DotVnni<4, 2>}};
  return kFns[nv - 1][rows - 1];
}
Int8DotFn Int8DotVnniPreparedTile(int rows, int nv) {
  static constexpr Int8DotFn kFns[kInt8DotPanels][kInt8DotRows] = {
      {&Int8DotVnniPrepared<1, 1>, &Int8DotVnniPrepared<2, 1>,
       &Int8DotVnniPrepared<3, 1>, &Int8DotVnniPrepared<4, 1>},
      {&Int8DotVnniPrepared<1, 2>, &Int8DotVnniPrepared<2, 2>,
       &Int8DotVnniPrepared<3, 2>, &Int8DotVnniPrepared<4, 2>}};
  return kFns[nv - 1][rows - 1];
}

// One row of QuantizeActivationsInt8; the AVX-512 one gives the same bytes
// (max is exact, division and round-to-nearest-even are IEEE in both).
void QuantizeRowPortable(const float* x, int64_t k, int64_t kp, int8_t* q,
                         float* scales) {
  for (int64_t b = 0; b * kInt8Block < kp; ++b) {
    const int64_t q0 = b * kInt8Block, q1 = std::min(k, q0 + kInt8Block);
    float amax = 0;
    for (int64_t p = q0; p < q1; ++p) amax = std::max(amax, std::fabs(x[p]));
    const float s = amax / 127.0f;
    scales[b] = s;
    for (int64_t p = q0; p < q0 + kInt8Block; ++p) {
      const float v = p < q1 && s > 0 ? std::nearbyint(x[p] / s) : 0.0f;
      q[p] = static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
    }
  }
}

PDSERVE_VNNI inline __m128i QuantizeAvx512(__m512 v, __m512 scale) {
  const __m512 lim = _mm512_set1_ps(127.0f);
  v = _mm512_roundscale_ps(_mm512_div_ps(v, scale),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  v = _mm512_min_ps(_mm512_max_ps(v, _mm512_sub_ps(_mm512_setzero_ps(), lim)),
                    lim);
  return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v));
}

PDSERVE_VNNI void QuantizeRowAvx512(const float* x, int64_t k, int64_t kp,
                                    int8_t* q, float* scales) {
  for (int64_t b = 0; b * kInt8Block < kp; ++b) {
    const int64_t q0 = b * kInt8Block;
    const int64_t len = std::clamp<int64_t>(k - q0, 0, kInt8Block);
    const __mmask16 m0 = len >= 16 ? 0xffff : (1u << len) - 1;
    const __mmask16 m1 = len >= 32  ? 0xffff
                         : len > 16 ? (1u << (len - 16)) - 1
                                    : 0;
    const __m512 a = _mm512_maskz_loadu_ps(m0, x + q0);
    const __m512 c = _mm512_maskz_loadu_ps(m1, x + q0 + 16);
    const float amax =
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
    const float s = amax / 127.0f;
    scales[b] = s;
    if (!(s > 0)) {
      std::memset(q + q0, 0, kInt8Block);
      continue;
    }
    const __m512 sv = _mm512_set1_ps(s);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + q0), QuantizeAvx512(a, sv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + q0 + 16),
                     QuantizeAvx512(c, sv));
  }
}

std::vector<uint8_t>& Int8DotPrepBuffer() {
  thread_local std::vector<uint8_t> buffer;
  return buffer;
}

bool VnniUsable() {
  const CpuFeatures& f = DetectCpuFeatures();
  return f.avx512f && f.avx512bw && f.avx512vnni && f.avx512vbmi && f.f16c;
}

// --- AMX-INT8 for kInt8Dot --------------------------------------------------
// TDPBSSD multiplies a tile of 16 activation rows x 32 int8 (one block) by a
// tile of 8 rows x 64 bytes (the block's 32 k x 16 columns, 4 consecutive k
// of a column per dword: vpermb of the stored [32 k][16 columns], as for
// VNNI) into 16 x 16 exact int32 sums: the same integers as VNNI and the
// portable loop (signed x signed, no offset). The epilogue is the same fp32
// code, so the bits are the same; only the integer products moved.
//
// Tiles (one palette, loaded per thread at kernel entry): tmm0/tmm1 A, 16 x
// 32 bytes; tmm2/tmm3 B, 8 x 64 bytes; tmm4..7 C, 16 x 16 int32 (two pairs,
// see Int8DotAmx). Activation rows are padded to 16 with zeros (their sums
// are discarded) and packed per row tile and block, 512 contiguous bytes.
#define PDSERVE_AMX                                             \
  __attribute__((                                               \
      target("avx512f,avx512bw,avx512vnni,avx512vbmi,f16c,amx-" \
             "tile,amx-int8")))
// GCC 12's _tile_loadd/_tile_stored are asm that tell the compiler nothing
// about the memory they touch, so it could move a read of a stored tile
// before the store. These name the bytes (tiles here are contiguous: stride =
// row bytes) as memory operands; a blanket "memory" clobber instead would
// keep the accumulators in memory.
// (The operands are typed int32_t, not bytes: a char-typed operand may alias
// anything, which made GCC keep the fp32 accumulators in memory.)
template <int N>
struct AmxSums {
  int32_t v[N / 4];
};
#define PDSERVE_TILE_LOAD(t, base, stride, bytes)               \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), \
                   "r"(static_cast<long>(stride)),              \
                   "m"(*reinterpret_cast<const AmxSums<bytes>*>(base)))
#define PDSERVE_TILE_STORE(t, base, stride, bytes)                  \
  __asm__ volatile("tilestored %%tmm" #t ", (%1,%2,1)"              \
                   : "=m"(*reinterpret_cast<AmxSums<bytes>*>(base)) \
                   : "r"(base), "r"(static_cast<long>(stride)))
#define PDSERVE_TILE_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define PDSERVE_TILE_DPBSSD(c, a, b) \
  __asm__ volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

constexpr int kAmxRows = 16;
constexpr int64_t kAmxATileBytes = kAmxRows * kInt8Block;  // 16 rows x 32 k
// Per block of a panel: the B tile (512 bytes) then the 16 columns' scales
// as fp32.
constexpr int64_t kAmxBlockBytes = 512 + 64;

struct alignas(64) AmxTileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void AmxLoadConfig() {
  AmxTileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t : {0, 1}) {  // A
    cfg.rows[t] = kAmxRows;
    cfg.colsb[t] = kInt8Block;
  }
  for (int t : {2, 3}) {  // B
    cfg.rows[t] = kInt8Block / 4;
    cfg.colsb[t] = 64;
  }
  for (int t : {4, 5, 6, 7}) {  // C
    cfg.rows[t] = kAmxRows;
    cfg.colsb[t] = 64;
  }
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
}
void AmxRelease() { __asm__ volatile("tilerelease" ::: "memory"); }

// One panel's weights in B-tile order, per block (kAmxBlockBytes each).
PDSERVE_AMX void PrepareAmxPanel(const uint8_t* panel, int64_t blocks,
                                 uint8_t* out) {
  const __m512i idx = Int8DotOrder();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = panel + b * kBlockBytes;
    uint8_t* o = out + b * kAmxBlockBytes;
    for (int g = 0; g < kInt8Block / 4; ++g) {
      _mm512_storeu_si512(o + g * 64,
                          _mm512_permutexvar_epi8(
                              idx, _mm512_loadu_si512(blk + g * 4 * kPanel)));
    }
    _mm512_storeu_ps(
        o + 512,
        _mm512_cvtph_ps(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(blk + kInt8Block * kPanel))));
  }
}

// R (<= 16) real rows of one row tile (qx: 16 rows readable, stride kp) x
// one prepared panel: io[R][16] = the kInt8Dot chain of packed_gemm.h.
// acc[i] = fma(float(sums[i]), sx[i][b] * sw[b], acc[i]) for the R rows;
// sa: this row tile's activation scales as [blocks][16]. (A macro over the
// kernel's own accumulators; see Int8DotAmx on the unrolling.)
#define PDSERVE_AMX_SCALE_ADD(sums, b)                                      \
  do {                                                                      \
    const __m512 sw = _mm512_loadu_ps(prep + (b)*kAmxBlockBytes + 512);     \
    _Pragma("GCC unroll 16") for (int i = 0; i < R; ++i) {                  \
      const __m512 scale =                                                  \
          _mm512_mul_ps(_mm512_set1_ps(sa[(b)*kAmxRows + i]), sw);          \
      acc[i] = _mm512_fmadd_ps(                                             \
          _mm512_cvtepi32_ps(_mm512_load_si512((sums)[i])), scale, acc[i]); \
    }                                                                       \
  } while (0)

// Blocks b and b + 1 into C tiles C0 and C1; A tiles are packed
// [block][16 rows][32 bytes] (stride 32).
#define PDSERVE_AMX_PAIR(C0, C1, b)                                         \
  do {                                                                      \
    PDSERVE_TILE_LOAD(0, qa + (b)*kAmxATileBytes, kInt8Block, 512);         \
    PDSERVE_TILE_LOAD(2, prep + (b)*kAmxBlockBytes, 64, 512);               \
    PDSERVE_TILE_ZERO(C0);                                                  \
    PDSERVE_TILE_DPBSSD(C0, 0, 2);                                          \
    PDSERVE_TILE_LOAD(1, qa + ((b) + 1) * kAmxATileBytes, kInt8Block, 512); \
    PDSERVE_TILE_LOAD(3, prep + ((b) + 1) * kAmxBlockBytes, 64, 512);       \
    PDSERVE_TILE_ZERO(C1);                                                  \
    PDSERVE_TILE_DPBSSD(C1, 1, 3);                                          \
  } while (0)

// R (<= 16) real rows of one row tile x one prepared panel: io[R][16] = the
// kInt8Dot chain of packed_gemm.h. qa: [blocks][16][32] int8 (rows past R
// are zero padding), sa: [blocks][16] their scales. Software-pipelined by
// pairs of blocks: a pair's products are issued before the previous pair's
// stored sums are scaled (a vector load right after a tile store of the same
// bytes waits for the store), pairs alternating between C tiles 4, 5 and
// 6, 7; the last blocks % 4 go one at a time. Blocks are scaled and added
// in increasing order.
// (The loops over rows are unrolled by pragma: left to GCC 12, the
// accumulators of this pipelined loop stayed in memory, a load and a store
// per FMA. Checked with objdump.)
template <int R>
PDSERVE_AMX void Int8DotAmx(const int8_t* qa, const float* sa, int64_t blocks,
                            const uint8_t* prep, float* io) {
  alignas(64) int32_t c[2][2][kAmxRows][kPanel];
  __m512 acc[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) {
    PDSERVE_AMX_PAIR(4, 5, b);
    if (b > 0) {
      PDSERVE_AMX_SCALE_ADD(c[1][0], b - 2);
      PDSERVE_AMX_SCALE_ADD(c[1][1], b - 1);
    }
    PDSERVE_TILE_STORE(4, &c[0][0][0][0], 64, 1024);
    PDSERVE_TILE_STORE(5, &c[0][1][0][0], 64, 1024);
    PDSERVE_AMX_PAIR(6, 7, b + 2);
    PDSERVE_AMX_SCALE_ADD(c[0][0], b);
    PDSERVE_AMX_SCALE_ADD(c[0][1], b + 1);
    PDSERVE_TILE_STORE(6, &c[1][0][0][0], 64, 1024);
    PDSERVE_TILE_STORE(7, &c[1][1][0][0], 64, 1024);
  }
  if (b > 0) {
    PDSERVE_AMX_SCALE_ADD(c[1][0], b - 2);
    PDSERVE_AMX_SCALE_ADD(c[1][1], b - 1);
  }
  for (; b < blocks; ++b) {
    PDSERVE_TILE_LOAD(0, qa + b * kAmxATileBytes, kInt8Block, 512);
    PDSERVE_TILE_LOAD(2, prep + b * kAmxBlockBytes, 64, 512);
    PDSERVE_TILE_ZERO(4);
    PDSERVE_TILE_DPBSSD(4, 0, 2);
    PDSERVE_TILE_STORE(4, &c[0][0][0][0], 64, 1024);
    PDSERVE_AMX_SCALE_ADD(c[0][0], b);
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(io + i * kPanel, acc[i]);
}
#undef PDSERVE_AMX_PAIR
#undef PDSERVE_AMX_SCALE_ADD

using Int8DotAmxFn = void (*)(const int8_t*, const float*, int64_t,
                              const uint8_t*, float*);
template <size_t... R>
constexpr std::array<Int8DotAmxFn, sizeof...(R)> AmxRows(
    std::index_sequence<R...>) {
  return {&Int8DotAmx<static_cast<int>(R) + 1>...};
}
Int8DotAmxFn Int8DotAmxTile(int rows) {
  static constexpr auto kFns = AmxRows(std::make_index_sequence<kAmxRows>());
  return kFns[rows - 1];
}

std::atomic<int64_t>& AmxMinRowsSetting() {
  static std::atomic<int64_t> rows{kInt8DotAmxDefaultMinRows};
  return rows;
}

using TileFn = void (*)(const float*, const uint8_t*, int64_t, int64_t, int64_t,
                        float*, bool);

using WidenFn = void (*)(const uint8_t*, int64_t, int, int64_t, int64_t,
                         float*);

constexpr int kAvx512Rows = 6, kAvx512Panels = 3;
constexpr int kAvx2Rows = 4;
constexpr int kPortableRows = 4;
// k per widening stage: 3 panels x 128 k x 16 fp32 = 24 KiB, in L1 while
// every row tile of the batch passes over it.
constexpr int64_t kStageK = 128;

template <Fmt W, int NV, int... R>
constexpr std::array<TileFn, sizeof...(R)> Avx512Rows(
    std::integer_sequence<int, R...>) {
  if constexpr (W == Fmt::kI8B32) {
    return {&TileAvx512B32<R + 1, NV>...};
  } else {
    return {&TileAvx512<W, R + 1, NV>...};
  }
}
template <Fmt W>
struct Avx512Table {
  static constexpr auto kSeq = std::make_integer_sequence<int, kAvx512Rows>{};
  static constexpr std::array<std::array<TileFn, kAvx512Rows>, kAvx512Panels>
      kFns = {Avx512Rows<W, 1>(kSeq), Avx512Rows<W, 2>(kSeq),
              Avx512Rows<W, 3>(kSeq)};
};
template <int NV, int... R>
constexpr std::array<TileFn, sizeof...(R)> Bf16DotRows(
    std::integer_sequence<int, R...>) {
  return {&TileBf16Dot<R + 1, NV>...};
}
TileFn Bf16DotTile(int rows, int nv) {
  static constexpr auto kSeq = std::make_integer_sequence<int, kAvx512Rows>{};
  static constexpr std::array<std::array<TileFn, kAvx512Rows>, kAvx512Panels>
      kFns = {Bf16DotRows<1>(kSeq), Bf16DotRows<2>(kSeq), Bf16DotRows<3>(kSeq)};
  return kFns[nv - 1][rows - 1];
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

TileFn Avx512Tile(Fmt t, int rows, int nv) {
  switch (t) {
    case Fmt::kF32:
      return Avx512Table<Fmt::kF32>::kFns[nv - 1][rows - 1];
    case Fmt::kBF16:
      return Avx512Table<Fmt::kBF16>::kFns[nv - 1][rows - 1];
    case Fmt::kF16:
      return Avx512Table<Fmt::kF16>::kFns[nv - 1][rows - 1];
    case Fmt::kI8:
      return Avx512Table<Fmt::kI8>::kFns[nv - 1][rows - 1];
    case Fmt::kI8B32:
      return Avx512Table<Fmt::kI8B32>::kFns[nv - 1][rows - 1];
    case Fmt::kI8Dot:  // never: GemmNT runs GemmDotLayoutChain for it
      break;
  }
  return nullptr;
}

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

// The widening of the batched path (null for fp32, which needs none).
WidenFn Widener(GemmIsa isa, Fmt t) {
  switch (isa) {
    case GemmIsa::kAvx512:
      switch (t) {
        case Fmt::kBF16:
          return &WidenAvx512<Fmt::kBF16>;
        case Fmt::kF16:
          return &WidenAvx512<Fmt::kF16>;
        case Fmt::kI8:
          return &WidenAvx512<Fmt::kI8>;
        case Fmt::kI8B32:
          return &WidenAvx512<Fmt::kI8B32>;
        case Fmt::kF32:
        case Fmt::kI8Dot:  // (never reaches here)
          return nullptr;
      }
      break;
    case GemmIsa::kAvx2:
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
      break;
    case GemmIsa::kPortable:
      switch (t) {
        case Fmt::kBF16:
          return &WidenPortableAs<Fmt::kBF16>;
        case Fmt::kF16:
          return &WidenPortableAs<Fmt::kF16>;
        case Fmt::kI8:
          return &WidenPortableAs<Fmt::kI8>;
        case Fmt::kI8B32:
          return &WidenPortableAs<Fmt::kI8B32>;
        case Fmt::kF32:
        case Fmt::kI8Dot:  // (never reaches here)
          return nullptr;
      }
      break;
  }
  return nullptr;
}

GemmIsa DetectBestIsa() {
  const CpuFeatures& f = DetectCpuFeatures();
  if (f.avx512f && f.fma && f.f16c && f.avx2) return GemmIsa::kAvx512;
  if (f.avx2 && f.fma && f.f16c) return GemmIsa::kAvx2;
  return GemmIsa::kPortable;
}

std::vector<float>& PackBuffer() {
  thread_local std::vector<float> buffer;
  return buffer;
}
std::vector<float>& IoBuffer() {
  thread_local std::vector<float> buffer;
  return buffer;
}

std::atomic<int>& IsaSetting() {
  static std::atomic<int> isa{static_cast<int>(DetectBestIsa())};
  return isa;
}

}  // namespace

const char* GemmIsaName(GemmIsa isa) {
  switch (isa) {
    case GemmIsa::kPortable:
      return "portable";
    case GemmIsa::kAvx2:
      return "avx2";
    case GemmIsa::kAvx512:
      return "avx512";
  }
  return "?";
}

bool GemmIsaSupported(GemmIsa isa) {
  return static_cast<int>(isa) <= static_cast<int>(DetectBestIsa());
}

GemmIsa ActiveGemmIsa() { return static_cast<GemmIsa>(IsaSetting().load()); }

bool SetGemmIsa(GemmIsa isa) {
  if (!GemmIsaSupported(isa)) return false;
  IsaSetting() = static_cast<int>(isa);
  return true;
}

// ---------------------------------------------------------------------------

WeightMatrix WeightMatrix::Pack(const float* w, int64_t n, int64_t k,
                                DType dtype, Int8Scaling scaling,
                                Layout layout) {
  WeightMatrix m;
  m.dtype_ = dtype;
  m.scaling_ = dtype == DType::kI8 ? scaling : Int8Scaling::kPerRow;
  m.layout_ = dtype == DType::kI8 && m.scaling_ == Int8Scaling::kPerRow &&
                      layout == Layout::kPanel16Dot
                  ? Layout::kPanel16Dot
                  : Layout::kPanel16;
  m.n_ = n;
  m.k_ = k;
  const Fmt fmt = FormatOf(dtype, m.scaling_, m.layout_);
  m.kp_ = fmt == Fmt::kI8B32   ? (k + kInt8Block - 1) / kInt8Block * kInt8Block
          : fmt == Fmt::kI8Dot ? (k + 63) / 64 * 64
                               : (k + 1) & ~int64_t{1};
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t pb = m.panel_bytes();
  m.data_ = AllocateWeights(panels * pb);
  m.bytes_ = n * k * ElementBytes(dtype);
  if (fmt == Fmt::kI8 || fmt == Fmt::kI8Dot) {
    m.scales_ = std::shared_ptr<float[]>(new float[panels * kPanel]());
    m.bytes_ += n * static_cast<int64_t>(sizeof(float));
  } else if (fmt == Fmt::kI8B32) {
    m.bytes_ += n * ((k + kInt8Block - 1) / kInt8Block) * 2;
  }
  auto quantize = [](float v, float scale) {
    const float q = scale > 0 ? std::nearbyint(v / scale) : 0.0f;
    return static_cast<uint8_t>(
        static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f)));
  };
  for (int64_t r = 0; r < n; ++r) {
    const float* row = w + r * k;
    uint8_t* panel = m.data_.get() + (r / kPanel) * pb;
    const int64_t c = r % kPanel;
    switch (fmt) {
      case Fmt::kF32:
        for (int64_t q = 0; q < k; ++q)
          std::memcpy(panel + PanelOffset(fmt, q, c), &row[q], 4);
        break;
      case Fmt::kBF16:
        for (int64_t q = 0; q < k; ++q) {
          const uint16_t h = FloatToBf16(row[q]);
          std::memcpy(panel + PanelOffset(fmt, q, c), &h, 2);
        }
        break;
      case Fmt::kF16:
        for (int64_t q = 0; q < k; ++q) {
          const uint16_t h = FloatToF16(row[q]);
          std::memcpy(panel + PanelOffset(fmt, q, c), &h, 2);
        }
        break;
      case Fmt::kI8:
      case Fmt::kI8Dot: {
        float amax = 0;
        for (int64_t q = 0; q < k; ++q)
          amax = std::max(amax, std::fabs(row[q]));
        const float s = amax / 127.0f;
        m.scales_[r] = s;
        const float inv = s > 0 ? 1.0f / s : 0.0f;
        for (int64_t q = 0; q < k; ++q) {
          const float v = std::nearbyint(row[q] * inv);
          panel[PanelOffset(fmt, q, c)] = static_cast<uint8_t>(
              static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f)));
        }
        break;
      }
      case Fmt::kI8B32:
        for (int64_t b = 0; b * kInt8Block < k; ++b) {
          const int64_t q0 = b * kInt8Block;
          const int64_t q1 = std::min(k, q0 + kInt8Block);
          float amax = 0;
          for (int64_t q = q0; q < q1; ++q)
            amax = std::max(amax, std::fabs(row[q]));
          // Rounded up to fp16 so that |w| / scale <= 127 (no clipping);
          // saturates at the largest finite fp16.
          const float want = amax / 127.0f;
          uint16_t h = FloatToF16(want);
          if ((h & 0x7fffu) >= 0x7c00u) h = 0x7bff;
          if (F16ToFloat(h) < want && h < 0x7bff) ++h;
          std::memcpy(panel + BlockScaleOffset(b, c), &h, 2);
          const float scale = F16ToFloat(h);
          for (int64_t q = q0; q < q1; ++q)
            panel[PanelOffset(fmt, q, c)] = quantize(row[q], scale);
        }
        break;
    }
  }
  return m;
}

WeightMatrix WeightMatrix::RowMajorF32(const float* w, int64_t n, int64_t k) {
  WeightMatrix m;
  m.dtype_ = DType::kF32;
  m.layout_ = Layout::kRowMajorF32;
  m.n_ = n;
  m.k_ = k;
  m.kp_ = k;
  m.bytes_ = n * k * 4;
  m.data_ = AllocateWeights(m.bytes_);
  if (m.bytes_ > 0) std::memcpy(m.data_.get(), w, m.bytes_);
  return m;
}

int64_t WeightMatrix::panel_bytes() const {
  if (FormatOf(dtype_, scaling_) == Fmt::kI8B32)
    return kp_ / kInt8Block * kBlockBytes;
  return kp_ * kPanel * ElementBytes(dtype_);
}

float WeightMatrix::BlockScale(int64_t r, int64_t b) const {
  if (FormatOf(dtype_, scaling_) != Fmt::kI8B32) return 1.0f;
  uint16_t h;
  std::memcpy(&h,
              data_.get() + (r / kPanel) * panel_bytes() +
                  BlockScaleOffset(b, r % kPanel),
              2);
  return F16ToFloat(h);
}

void WeightMatrix::DequantizeRow(int64_t r, float* out) const {
  if (layout_ == Layout::kRowMajorF32) {
    std::memcpy(out, row_major() + r * k_, k_ * sizeof(float));
    return;
  }
  const Fmt fmt = FormatOf(dtype_, scaling_, layout_);
  const uint8_t* panel = data_.get() + (r / kPanel) * panel_bytes();
  const int64_t c = r % kPanel;
  const bool row_scale = fmt == Fmt::kI8 || fmt == Fmt::kI8Dot;
  const float s = row_scale ? scales_[r] : 1.0f;
  for (int64_t q = 0; q < k_; ++q) {
    const float v = LoadWidened(fmt, panel, q, c);
    out[q] = row_scale ? v * s : v;
  }
}

bool operator==(const WeightMatrix& a, const WeightMatrix& b) {
  if (a.dtype_ != b.dtype_ || a.layout_ != b.layout_ || a.n_ != b.n_ ||
      a.k_ != b.k_ || a.scaling_ != b.scaling_) {
    return false;
  }
  if (a.n_ == 0) return true;
  const int64_t bytes = a.layout_ == WeightMatrix::Layout::kRowMajorF32
                            ? a.n_ * a.k_ * 4
                            : (a.n_ + kPanel - 1) / kPanel * a.panel_bytes();
  if (std::memcmp(a.data(), b.data(), bytes) != 0) return false;
  return a.scales() == nullptr ||
         std::memcmp(a.scales(), b.scales(), a.n_ * sizeof(float)) == 0;
}

std::vector<float> WeightMatrix::ToFloat() const {
  std::vector<float> out(n_ * k_);
  for (int64_t r = 0; r < n_; ++r) DequantizeRow(r, out.data() + r * k_);
  return out;
}

std::vector<float> WeightMatrix::Widened() const {
  const Fmt fmt = FormatOf(dtype_, scaling_, layout_);
  if (fmt != Fmt::kI8 && fmt != Fmt::kI8Dot) return ToFloat();
  std::vector<float> out(n_ * k_);
  for (int64_t r = 0; r < n_; ++r) {
    const uint8_t* panel = data_.get() + (r / kPanel) * panel_bytes();
    for (int64_t q = 0; q < k_; ++q)
      out[r * k_ + q] = LoadWidened(fmt, panel, q, r % kPanel);
  }
  return out;
}

void ReferenceGemmNT(const float* x, int64_t m, int64_t k, const float* w,
                     int64_t n, const float* scales, float* y) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.0f;
      for (int64_t p = 0; p < k; ++p)
        acc = std::fma(x[i * k + p], w[j * k + p], acc);
      y[i * n + j] = scales ? acc * scales[j] : acc;
    }
  }
}

namespace {
// x + 128 as unsigned bytes, for VPDPBUSD (in place).
void OffsetToUnsigned(int8_t* q, int64_t n) {
  for (int64_t p = 0; p < n; ++p)
    q[p] = static_cast<int8_t>(static_cast<uint8_t>(q[p]) ^ 0x80);
}

void QuantizeActivations(const float* x, int64_t m, int64_t k, int8_t* q,
                         float* scales, bool unsigned_bytes) {
  const int64_t kp = (k + kInt8Block - 1) / kInt8Block * kInt8Block;
  const int64_t blocks = kp / kInt8Block;
  const bool hw = ActiveGemmIsa() == GemmIsa::kAvx512 && VnniUsable();
  // Rows are independent; a prefill chunk has thousands of blocks per row.
  const int threads = static_cast<int>(std::min<int64_t>(KernelThreads(), m));
#pragma omp parallel for num_threads(threads) if (threads > 1 && \
                                                  m * k > (int64_t{1} << 16))
  for (int64_t i = 0; i < m; ++i) {
    (hw ? QuantizeRowAvx512 : QuantizeRowPortable)(x + i * k, k, kp, q + i * kp,
                                                   scales + i * blocks);
    if (unsigned_bytes) OffsetToUnsigned(q + i * kp, kp);
  }
}

}  // namespace

void QuantizeActivationsInt8(const float* x, int64_t m, int64_t k, int8_t* q,
                             float* scales) {
  QuantizeActivations(x, m, k, q, scales, /*unsigned_bytes=*/false);
}

bool Int8DotUsesVnni() {
  return ActiveGemmIsa() == GemmIsa::kAvx512 && VnniUsable();
}

bool Int8DotAmxUsable() {
  const CpuFeatures& f = DetectCpuFeatures();
  return Int8DotUsesVnni() && f.amx_int8 && f.amx_usable;
}

int64_t Int8DotAmxMinRows() { return AmxMinRowsSetting().load(); }
void SetInt8DotAmxMinRows(int64_t rows) {
  AmxMinRowsSetting().store(std::max<int64_t>(0, rows));
}

const char* Int8DotKernelName(Int8DotKernel kernel) {
  switch (kernel) {
    case Int8DotKernel::kVnni:
      return "vnni";
    case Int8DotKernel::kAmx:
      return "amx";
    case Int8DotKernel::kPortable:
      break;
  }
  return "portable";
}

Int8DotKernel Int8DotKernelFor(int64_t m) {
  const int64_t min_rows = Int8DotAmxMinRows();
  if (min_rows > 0 && m >= min_rows && Int8DotAmxUsable())
    return Int8DotKernel::kAmx;
  return Int8DotUsesVnni() ? Int8DotKernel::kVnni : Int8DotKernel::kPortable;
}

namespace {

// How the AMX GEMMs split n: tasks of up to 4 panels (at least 8 tasks per
// thread where n allows), and the threads that run them.
struct AmxTasks {
  int64_t panels, per_task, tasks;
  int threads;
  bool parallel;
};
AmxTasks SplitAmxTasks(int64_t m, int64_t n, int64_t k) {
  AmxTasks t;
  t.panels = (n + kPanel - 1) / kPanel;
  const int max_threads = KernelThreads();
  t.per_task = std::clamp<int64_t>(
      t.panels / (int64_t{8} * std::max(1, max_threads)), 1, 4);
  t.tasks = (t.panels + t.per_task - 1) / t.per_task;
  t.threads = static_cast<int>(std::min<int64_t>(max_threads, t.tasks));
  t.parallel = t.threads > 1 && m * n * k > (int64_t{1} << 16);
  return t;
}

// kInt8Dot on AMX: tasks of up to 4 panels (64 columns); a task prepares its
// panels' B tiles once (L2: 576 bytes per block and panel) and runs every
// row tile of 16 over them, panel by panel, so a row tile's activations
// (16 x kp bytes) stay in L2 while its panels pass.
void GemmInt8DotAmx(const int8_t* qx, const float* sx, int64_t m, int64_t kp,
                    const WeightMatrix& w, float* __restrict__ y) {
  const int64_t n = w.rows(), blocks = kp / kInt8Block;
  const int64_t pb = w.panel_bytes();
  const int64_t row_tiles = (m + kAmxRows - 1) / kAmxRows;
  const auto [panels, per_task, tasks, threads, parallel] =
      SplitAmxTasks(m, n, kp);
  // Which thread takes a task never changes its numbers.
  // Activations and their scales per row tile and block,
  // [row_tiles][blocks][16][32] and [row_tiles][blocks][16].
  thread_local std::vector<int8_t> qa_buffer;
  thread_local std::vector<float> sa_buffer;
  qa_buffer.resize(row_tiles * blocks * kAmxATileBytes);
  sa_buffer.resize(row_tiles * blocks * kAmxRows);
  int8_t* const qa = qa_buffer.data();
  float* const sa = sa_buffer.data();
  // (On this thread: m x kp bytes, small next to the GEMM; a parallel loop
  // here would add a barrier, and on a shared machine every barrier that
  // meets a preempted thread costs a scheduler tick.)
  for (int64_t rt = 0; rt < row_tiles; ++rt) {
    for (int64_t b = 0; b < blocks; ++b) {
      for (int i = 0; i < kAmxRows; ++i) {
        const int64_t row = rt * kAmxRows + i;
        std::memcpy(qa + (rt * blocks + b) * kAmxATileBytes + i * kInt8Block,
                    qx + row * kp + b * kInt8Block, kInt8Block);
        sa[(rt * blocks + b) * kAmxRows + i] =
            row < m ? sx[row * blocks + b] : 0.0f;
      }
    }
  }
#pragma omp parallel num_threads(threads) if (parallel)
  {
    AmxLoadConfig();  // tile configuration is per thread
    thread_local std::vector<uint8_t> prep;
    prep.resize(per_task * blocks * kAmxBlockBytes);
    alignas(64) float io[kAmxRows * kPanel];
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t p0 = task * per_task;
      const int64_t np = std::min(per_task, panels - p0);
      for (int64_t v = 0; v < np; ++v) {
        PrepareAmxPanel(w.data() + (p0 + v) * pb, blocks,
                        prep.data() + v * blocks * kAmxBlockBytes);
      }
      for (int64_t rt = 0; rt < row_tiles; ++rt) {
        const int64_t i0 = rt * kAmxRows;
        const int rows = static_cast<int>(std::min<int64_t>(kAmxRows, m - i0));
        const Int8DotAmxFn fn = Int8DotAmxTile(rows);
        for (int64_t v = 0; v < np; ++v) {
          const int64_t c0 = (p0 + v) * kPanel;
          const int64_t cols = std::min<int64_t>(n - c0, kPanel);
          fn(qa + rt * blocks * kAmxATileBytes, sa + rt * blocks * kAmxRows,
             blocks, prep.data() + v * blocks * kAmxBlockBytes, io);
          for (int i = 0; i < rows; ++i) {
            std::memcpy(y + (i0 + i) * n + c0, io + i * kPanel,
                        cols * sizeof(float));
          }
        }
      }
    }
    AmxRelease();
  }
}

// The VNNI / portable int8dot loop: tiles of `max_nv` panels over the threads
// (which thread takes a tile never changes its numbers); per tile
// begin(panels, nv), then for each of ceil(m / 4) equal row tiles
// compute(i0, rows, panels, nv, io) fills io [rows][nv * 16], copied to y.
template <typename Begin, typename Compute>
void RunInt8DotTiles(int64_t m, int64_t k, const WeightMatrix& w, int max_nv,
                     float* __restrict__ y, Begin&& begin, Compute&& compute) {
  const int64_t n = w.rows(), pb = w.panel_bytes();
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t tiles = (panels + max_nv - 1) / max_nv;
  const int64_t row_tiles = (m + kInt8DotRows - 1) / kInt8DotRows;
  const int threads =
      static_cast<int>(std::min<int64_t>(KernelThreads(), tiles));
  const bool parallel = threads > 1 && m * n * k > (int64_t{1} << 16);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4) if (parallel)
  for (int64_t tile = 0; tile < tiles; ++tile) {
    alignas(64) float io[kInt8DotRows * kInt8DotPanels * kPanel];
    const int64_t p0 = tile * max_nv;
    const int nv = static_cast<int>(std::min<int64_t>(max_nv, panels - p0));
    const int64_t c0 = p0 * kPanel;
    const int64_t cols = std::min<int64_t>(n - c0, nv * kPanel);
    const uint8_t* wp = w.data() + p0 * pb;
    begin(wp, nv);
    for (int64_t rt = 0; rt < row_tiles; ++rt) {
      const int64_t i0 = m * rt / row_tiles;
      const int rows = static_cast<int>(m * (rt + 1) / row_tiles - i0);
      compute(i0, rows, wp, nv, io);
      for (int i = 0; i < rows; ++i) {
        std::memcpy(y + (i0 + i) * n + c0, io + i * nv * kPanel,
                    cols * sizeof(float));
      }
    }
  }
}

void GemmInt8Dot(const float* __restrict__ x, int64_t m, int64_t k,
                 const WeightMatrix& w, float* __restrict__ y) {
  const int64_t kp = w.padded_k(), blocks = kp / kInt8Block;
  const int64_t pb = w.panel_bytes();
  const Int8DotKernel kernel = Int8DotKernelFor(m);
  const bool amx = kernel == Int8DotKernel::kAmx;
  const bool hw = kernel == Int8DotKernel::kVnni;
  // Reused across calls (a decode step makes ~100 of them); every byte is
  // written by the quantizer (AMX: rows up to a multiple of 16, the padding
  // zeroed here, are read too).
  thread_local std::vector<int8_t> qx;
  thread_local std::vector<float> sx;
  const int64_t m_pad = amx ? (m + kAmxRows - 1) / kAmxRows * kAmxRows : m;
  qx.resize(m_pad * kp);
  sx.resize(m_pad * blocks);
  QuantizeActivations(x, m, k, qx.data(), sx.data(), /*unsigned_bytes=*/hw);
  if (amx) {
    std::memset(qx.data() + m * kp, 0, (m_pad - m) * kp);
    GemmInt8DotAmx(qx.data(), sx.data(), m, kp, w, y);
    return;
  }
  // (thread_local: the OpenMP threads below must use these, not their own.)
  const int8_t* const qxp = qx.data();
  const float* const sxp = sx.data();
  const int64_t row_tiles = (m + kInt8DotRows - 1) / kInt8DotRows;
  const bool prepared = hw && row_tiles > 1;
  RunInt8DotTiles(
      m, k, w, hw ? kInt8DotPanels : 1, y,
      [&](const uint8_t* wp, int nv) {
        if (!prepared) return;
        std::vector<uint8_t>& prep = Int8DotPrepBuffer();
        prep.resize(blocks * PrepBlockBytes(nv));
        PrepareInt8DotTile(wp, pb, nv, blocks, prep.data());
      },
      [&](int64_t i0, int rows, const uint8_t* wp, int nv, float* io) {
        const std::vector<uint8_t>& prep = Int8DotPrepBuffer();
        if (prepared) {
          Int8DotVnniPreparedTile(rows, nv)(
              reinterpret_cast<const uint8_t*>(qxp) + i0 * kp,
              sxp + i0 * blocks, kp, blocks, prep.data(), 0, io);
        } else if (hw) {
          Int8DotVnniTile(rows, nv)(
              reinterpret_cast<const uint8_t*>(qxp) + i0 * kp,
              sxp + i0 * blocks, kp, blocks, wp, pb, io);
        } else {
          Int8DotPortable(qxp + i0 * kp, sxp + i0 * blocks, kp, blocks, rows,
                          nv, wp, pb, io);
        }
      });
}

// --- kInt8Dot on per-row int8 weights ---------------------------------------
// Activations are rounded per row (one scale per row), so a row's integer
// sum runs over all of k and the only fp32 arithmetic is the final
//   y[i][j] = float(isum) * (sx[i] * sw[j]).
// Integer sums are exact (int32 up to k = 65536 on VNNI and AMX, int64 on the
// portable loop at any k, the same integers), so every kernel gives the same
// bits. Quantized rows are kRowDotK-aligned (zero padding), which AMX needs.
constexpr int64_t kRowDotK = 64;  // k per TDPBSSD at full depth
constexpr int64_t kRowDotMaxHwK = int64_t{1} << 16;

int64_t RowDotPaddedK(int64_t k) {
  return (k + kRowDotK - 1) / kRowDotK * kRowDotK;
}

void QuantizeRowPerRowPortable(const float* x, int64_t k, int64_t kq, int8_t* q,
                               float* scale) {
  float amax = 0;
  for (int64_t p = 0; p < k; ++p) amax = std::max(amax, std::fabs(x[p]));
  const float s = amax / 127.0f;
  *scale = s;
  for (int64_t p = 0; p < kq; ++p) {
    const float v = p < k && s > 0 ? std::nearbyint(x[p] / s) : 0.0f;
    q[p] = static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
  }
}

PDSERVE_VNNI void QuantizeRowPerRowAvx512(const float* x, int64_t k, int64_t kq,
                                          int8_t* q, float* scale) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; p += 16) {
    const __mmask16 mk = k - p >= 16 ? 0xffff : (1u << (k - p)) - 1;
    amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(mk, x + p)));
  }
  const float s = _mm512_reduce_max_ps(amax) / 127.0f;
  *scale = s;
  if (!(s > 0)) {
    std::memset(q, 0, kq);
    return;
  }
  const __m512 sv = _mm512_set1_ps(s);
  for (int64_t p = 0; p < kq; p += 16) {
    const int64_t len = std::clamp<int64_t>(k - p, 0, 16);
    const __mmask16 mk = len >= 16 ? 0xffff : (1u << len) - 1;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + p),
                     QuantizeAvx512(_mm512_maskz_loadu_ps(mk, x + p), sv));
  }
}

// x [m, k] -> q [m, kq] (kq = RowDotPaddedK(k)), scales [m]; unsigned_bytes:
// q + 128 as unsigned bytes (VPDPBUSD), padding included.
void QuantizeActivationsPerRow(const float* x, int64_t m, int64_t k, int8_t* q,
                               float* scales, bool unsigned_bytes) {
  const int64_t kq = RowDotPaddedK(k);
  const bool hw = ActiveGemmIsa() == GemmIsa::kAvx512 && VnniUsable();
  const int threads = static_cast<int>(std::min<int64_t>(KernelThreads(), m));
#pragma omp parallel for num_threads(threads) if (threads > 1 && \
                                                  m * k > (int64_t{1} << 16))
  for (int64_t i = 0; i < m; ++i) {
    (hw ? QuantizeRowPerRowAvx512 : QuantizeRowPerRowPortable)(
        x + i * k, k, kq, q + i * kq, scales + i);
    if (unsigned_bytes) OffsetToUnsigned(q + i * kq, kq);
  }
}

// rows x nv panels of per-row int8 weights (either layout, `fmt`), y to io
// [rows][nv * 16].
void RowDotPortable(Fmt fmt, const int8_t* qx, const float* sx, int64_t kq,
                    int64_t k, int rows, int nv, const uint8_t* w,
                    int64_t panel_bytes, const float* sw, float* io) {
  const int width = nv * kPanel;
  for (int i = 0; i < rows; ++i) {
    for (int v = 0; v < nv; ++v) {
      const uint8_t* panel = w + v * panel_bytes;
      for (int c = 0; c < kPanel; ++c) {
        int64_t isum = 0;
        for (int64_t p = 0; p < k; ++p) {
          isum += int64_t{qx[i * kq + p]} *
                  int64_t{static_cast<int8_t>(panel[PanelOffset(fmt, p, c)])};
        }
        io[i * width + v * kPanel + c] =
            static_cast<float>(isum) * (sx[i] * sw[v * kPanel + c]);
      }
    }
  }
}

// MR rows (ux: q + 128, stride kq) x NV kPanel16Dot panels on VPDPBUSD; the
// stored 64 bytes per 4 k are the instruction's operand as they are (small
// batches: the weight stream is the limit).
template <int MR, int NV>
PDSERVE_VNNI void RowDotVnni(const uint8_t* ux, const float* sx, int64_t kq,
                             const uint8_t* w, int64_t panel_bytes,
                             const float* sw, float* io) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i isum[MR][NV], wsum[NV];
  for (int v = 0; v < NV; ++v) {
    wsum[v] = _mm512_setzero_si512();
    for (int i = 0; i < MR; ++i) isum[i][v] = _mm512_setzero_si512();
  }
  for (int64_t g = 0; g < kq / 4; ++g) {
    __m512i wg[NV];
    for (int v = 0; v < NV; ++v) {
      const uint8_t* p = w + v * panel_bytes + g * 64;
      wg[v] = _mm512_loadu_si512(p);
      _mm_prefetch(reinterpret_cast<const char*>(p + 1024), _MM_HINT_T0);
      wsum[v] = _mm512_dpbusd_epi32(wsum[v], ones, wg[v]);
    }
    for (int i = 0; i < MR; ++i) {
      uint32_t u4;
      std::memcpy(&u4, ux + i * kq + g * 4, 4);
      const __m512i u = _mm512_set1_epi32(static_cast<int>(u4));
      for (int v = 0; v < NV; ++v)
        isum[i][v] = _mm512_dpbusd_epi32(isum[i][v], u, wg[v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const __m512i corr = _mm512_slli_epi32(wsum[v], 7);
    const __m512 swv = _mm512_loadu_ps(sw + v * kPanel);
    for (int i = 0; i < MR; ++i) {
      const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(sx[i]), swv);
      _mm512_storeu_ps(
          io + (i * NV + v) * kPanel,
          _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[i][v], corr)),
                        scale));
    }
  }
}

using RowDotVnniFn = void (*)(const uint8_t*, const float*, int64_t,
                              const uint8_t*, int64_t, const float*, float*);
RowDotVnniFn RowDotVnniTile(int rows, int nv) {
  static constexpr RowDotVnniFn kFns[kInt8DotPanels][kInt8DotRows] = {
      {&RowDotVnni<1, 1>, &RowDotVnni<2, 1>, &RowDotVnni<3, 1>,
       &RowDotVnni<4, 1>},
      {&RowDotVnni<1, 2>, &RowDotVnni<2, 2>, &RowDotVnni<3, 2>,
       &RowDotVnni<4, 2>}};
  return kFns[nv - 1][rows - 1];
}

// AMX at full depth: every tile is 16 rows x 64 bytes (A: 16 rows x 64 k;
// B: 16 groups of 4 k x 16 columns, one stored 1 KiB step of a kPanel16Dot
// panel; C: 16 x 16 int32), and C accumulates over all of k, so a tile's
// sums are stored once per GEMM, not per block.
void AmxLoadRowDotConfig() {
  AmxTileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kAmxRows;
    cfg.colsb[t] = 64;
  }
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
}

constexpr int64_t kRowDotStepBytes = 16 * 64;  // one B tile: 64 k

// RT (1-2) row tiles x NP (1-2) panels over ksteps of 64 k: the exact sums
// into c[RT * NP][16][16] (row tile r, panel u at r * NP + u). qa: the first
// row tile's quantized rows (stride kq; the second tile 16 rows below); b:
// the first panel's stored weights, the second `panel_bytes` further.
template <int RT, int NP>
PDSERVE_AMX void RowDotAmx(const int8_t* qa, int64_t kq, int64_t ksteps,
                           const uint8_t* b, int64_t panel_bytes,
                           int32_t (*c)[kAmxRows][kPanel]) {
  PDSERVE_TILE_ZERO(4);
  if (NP > 1) PDSERVE_TILE_ZERO(5);
  if (RT > 1) PDSERVE_TILE_ZERO(6);
  if (RT > 1 && NP > 1) PDSERVE_TILE_ZERO(7);
  const int8_t* a1 = qa + kAmxRows * kq;
  for (int64_t s = 0; s < ksteps; ++s) {
    const uint8_t* b0 = b + s * kRowDotStepBytes;
    PDSERVE_TILE_LOAD(0, qa + s * kRowDotK, kq, 1024);
    PDSERVE_TILE_LOAD(2, b0, 64, 1024);
    PDSERVE_TILE_DPBSSD(4, 0, 2);
    if (NP > 1) {
      PDSERVE_TILE_LOAD(3, b0 + panel_bytes, 64, 1024);
      PDSERVE_TILE_DPBSSD(5, 0, 3);
    }
    if (RT > 1) {
      PDSERVE_TILE_LOAD(1, a1 + s * kRowDotK, kq, 1024);
      PDSERVE_TILE_DPBSSD(6, 1, 2);
      if (NP > 1) PDSERVE_TILE_DPBSSD(7, 1, 3);
    }
  }
  PDSERVE_TILE_STORE(4, &c[0][0][0], 64, 1024);
  if (NP > 1) PDSERVE_TILE_STORE(5, &c[1][0][0], 64, 1024);
  if (RT > 1) PDSERVE_TILE_STORE(6, &c[NP][0][0], 64, 1024);
  if (RT > 1 && NP > 1) PDSERVE_TILE_STORE(7, &c[3][0][0], 64, 1024);
}

using RowDotAmxFn = void (*)(const int8_t*, int64_t, int64_t, const uint8_t*,
                             int64_t, int32_t (*)[kAmxRows][kPanel]);
RowDotAmxFn RowDotAmxTile(int rt, int np) {
  static constexpr RowDotAmxFn kFns[2][2] = {
      {&RowDotAmx<1, 1>, &RowDotAmx<1, 2>},
      {&RowDotAmx<2, 1>, &RowDotAmx<2, 2>}};
  return kFns[rt - 1][np - 1];
}

// Up to 16 rows x one panel's columns of y from their exact sums.
PDSERVE_VNNI void RowDotEpilogue(const int32_t (*sums)[kPanel], int rows,
                                 const float* sx, const float* sw, int cols,
                                 float* y, int64_t n) {
  const __mmask16 mk = cols >= 16 ? 0xffff : (1u << cols) - 1;
  const __m512 swv = _mm512_loadu_ps(sw);
  for (int i = 0; i < rows; ++i) {
    const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(sx[i]), swv);
    _mm512_mask_storeu_ps(
        y + i * n, mk,
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[i])), scale));
  }
}

// Tasks of up to 4 panels (contiguous in memory), claimed in order: each
// runs every pair of row tiles over pairs of its panels, so a panel streams
// from DRAM once (for the first pair of row tiles; prefill's other pairs
// find it in L2) and the tile loads stream it as stored.
void GemmRowDotAmx(const int8_t* qx, const float* sx, int64_t m, int64_t kq,
                   const WeightMatrix& w, float* __restrict__ y) {
  const int64_t n = w.rows(), ksteps = kq / kRowDotK;
  const int64_t pb = w.panel_bytes();
  const int64_t row_tiles = (m + kAmxRows - 1) / kAmxRows;
  const auto [panels, per_task, tasks, threads, parallel] =
      SplitAmxTasks(m, n, kq);
  const float* const sw = w.scales();
#pragma omp parallel num_threads(threads) if (parallel)
  {
    AmxLoadRowDotConfig();
    alignas(64) int32_t c[4][kAmxRows][kPanel];
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t p0 = task * per_task;
      const int64_t np = std::min(per_task, panels - p0);
      for (int64_t rt = 0; rt < row_tiles; rt += 2) {
        const int nrt = static_cast<int>(std::min<int64_t>(2, row_tiles - rt));
        for (int64_t v = 0; v < np; v += 2) {
          const int nnp = static_cast<int>(std::min<int64_t>(2, np - v));
          RowDotAmxTile(nrt, nnp)(qx + rt * kAmxRows * kq, kq, ksteps,
                                  w.data() + (p0 + v) * pb, pb, c);
          for (int r = 0; r < nrt; ++r) {
            const int64_t i0 = (rt + r) * kAmxRows;
            const int rows =
                static_cast<int>(std::min<int64_t>(kAmxRows, m - i0));
            for (int u = 0; u < nnp; ++u) {
              const int64_t c0 = (p0 + v + u) * kPanel;
              RowDotEpilogue(
                  c[r * nnp + u], rows, sx + i0, sw + c0,
                  static_cast<int>(std::min<int64_t>(kPanel, n - c0)),
                  y + i0 * n + c0, n);
            }
          }
        }
      }
    }
    AmxRelease();
  }
}

// kInt8Dot on per-row int8 weights. The kernels need kPanel16Dot; a kPanel16
// matrix (packed for the fp32 chain) runs the portable loop, same bits.
void GemmRowDot(const float* __restrict__ x, int64_t m, int64_t k,
                const WeightMatrix& w, float* __restrict__ y) {
  const int64_t kq = RowDotPaddedK(k);
  const int64_t pb = w.panel_bytes();
  const bool dot_layout = w.layout() == WeightMatrix::Layout::kPanel16Dot;
  const Fmt fmt = dot_layout ? Fmt::kI8Dot : Fmt::kI8;
  Int8DotKernel kernel = Int8DotKernelFor(m);
  // Not the stored operand order, or past exact int32 sums.
  if (!dot_layout || k > kRowDotMaxHwK) kernel = Int8DotKernel::kPortable;
  const bool amx = kernel == Int8DotKernel::kAmx;
  const bool hw = kernel == Int8DotKernel::kVnni;
  thread_local std::vector<int8_t> qx;
  thread_local std::vector<float> sx;
  const int64_t m_pad = amx ? (m + kAmxRows - 1) / kAmxRows * kAmxRows : m;
  qx.resize(m_pad * kq);
  sx.resize(m_pad);
  QuantizeActivationsPerRow(x, m, k, qx.data(), sx.data(),
                            /*unsigned_bytes=*/hw);
  if (amx) {
    std::memset(qx.data() + m * kq, 0, (m_pad - m) * kq);
    std::fill(sx.begin() + m, sx.end(), 0.0f);
    GemmRowDotAmx(qx.data(), sx.data(), m, kq, w, y);
    return;
  }
  const int8_t* const qxp = qx.data();
  const float* const sxp = sx.data();
  RunInt8DotTiles(
      m, k, w, hw ? kInt8DotPanels : 1, y, [](const uint8_t*, int) {},
      [&](int64_t i0, int rows, const uint8_t* wp, int nv, float* io) {
        const float* sw = w.scales() + (wp - w.data()) / pb * kPanel;
        if (hw) {
          RowDotVnniTile(rows, nv)(
              reinterpret_cast<const uint8_t*>(qxp) + i0 * kq, sxp + i0, kq, wp,
              pb, sw, io);
        } else {
          RowDotPortable(fmt, qxp + i0 * kq, sxp + i0, kq, k, rows, nv, wp, pb,
                         sw, io);
        }
      });
}

// kFp32Chain on kPanel16Dot: the order contract, plainly (correct, slow; the
// engine packs kPanel16Dot only for kInt8Dot).
void GemmDotLayoutChain(const float* __restrict__ x, int64_t m, int64_t k,
                        const WeightMatrix& w, float* __restrict__ y) {
  const int64_t n = w.rows(), pb = w.panel_bytes();
  const float* const sw = w.scales();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* panel = w.data() + (j / kPanel) * pb;
      float acc = 0.0f;
      for (int64_t p = 0; p < k; ++p) {
        acc = std::fma(x[i * k + p],
                       LoadWidened(Fmt::kI8Dot, panel, p, j % kPanel), acc);
      }
      y[i * n + j] = acc * sw[j];
    }
  }
}

}  // namespace

void GemmNT(const float* __restrict__ x, int64_t m, int64_t k,
            const WeightMatrix& w, float* __restrict__ y,
            GemmNumerics numerics) {
  if (numerics == GemmNumerics::kInt8Dot && w.dtype() == DType::kI8 &&
      w.int8_scaling() == Int8Scaling::kBlock32) {
    if (m > 0 && w.rows() > 0) GemmInt8Dot(x, m, k, w, y);
    return;
  }
  if (numerics == GemmNumerics::kInt8Dot && w.dtype() == DType::kI8 &&
      w.int8_scaling() == Int8Scaling::kPerRow) {
    if (m > 0 && w.rows() > 0) GemmRowDot(x, m, k, w, y);
    return;
  }
  if (w.layout() == WeightMatrix::Layout::kPanel16Dot) {
    if (m > 0 && w.rows() > 0) GemmDotLayoutChain(x, m, k, w, y);
    return;
  }
  const int64_t n = w.rows();
  if (m <= 0 || n <= 0) return;
  const GemmIsa isa = ActiveGemmIsa();
  const DType t = w.dtype();
  const Fmt fmt = FormatOf(t, w.int8_scaling(), w.layout());
  const bool bf16dot = numerics == GemmNumerics::kBf16Dot && t == DType::kBF16;
  // The instruction where the CPU has it (and the AVX-512 path is active),
  // else the scalar emulation of the same chain.
  const bool bf16dot_hw =
      bf16dot && isa == GemmIsa::kAvx512 && DetectCpuFeatures().avx512bf16;
  const int max_rows = bf16dot ? (bf16dot_hw ? kAvx512Rows : kPortableRows)
                       : isa == GemmIsa::kAvx512 ? kAvx512Rows
                       : isa == GemmIsa::kAvx2   ? kAvx2Rows
                                                 : kPortableRows;
  const int max_nv = bf16dot ? (bf16dot_hw ? kAvx512Panels : 1)
                     : isa == GemmIsa::kAvx512 ? kAvx512Panels
                                               : 1;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t tiles = (panels + max_nv - 1) / max_nv;
  // Rows are split into equal tiles (32 = 6+6+5+5+5+5, not 6x5+2): a tile
  // widens its weights once for all its rows, so a 2-row tail would cost as
  // much widening as a full tile.
  const int64_t row_tiles = (m + max_rows - 1) / max_rows;
  // More than one row tile: widen each stage of weights once into an fp32
  // scratch that all row tiles read (see WidenPortable).
  const WidenFn widen = !bf16dot && row_tiles > 1 ? Widener(isa, fmt) : nullptr;
  const int64_t pb = w.panel_bytes();
  // k is cut in blocks so that this thread's packed x (m x kc floats) stays
  // in L2 while a tile's weights pass every row tile: up to 64 rows (decode
  // batches) that is usually all of k, so each panel streams from memory
  // once, front to back. Prefill chunks take up to 4 MiB of x (kc = 2048 at
  // 512 rows): each k block costs a round trip of the fp32 partial sums
  // through y (m x n floats) and a barrier, and 256-wide blocks made that
  // dominate on a loaded machine (measured: 512 x 2048 x 16384 bf16 ran at
  // 60 GFLOP/s with kc 256, 130-240 with kc >= 2048, load 4-5).
  const int64_t kc =
      m > 64
          ? std::max<int64_t>(
                256, std::min<int64_t>((k + 1) & ~int64_t{1},
                                       ((int64_t{1} << 20) / m) & ~int64_t{1}))
          : std::max<int64_t>(
                256,
                std::min<int64_t>((k + 1) & ~int64_t{1},
                                  ((int64_t{128} << 10) / m) & ~int64_t{1}));
  const int threads =
      static_cast<int>(std::min<int64_t>(KernelThreads(), tiles));
  const bool parallel = threads > 1 && m * n * k > (int64_t{1} << 16);
  const float* scales = w.scales();
  // Within a k block tiles are independent, so threads claim them in small
  // chunks: on a shared machine a preempted thread's share is taken over
  // instead of stalling the step. Which thread computes a tile never changes
  // its numbers; a barrier between k blocks keeps each tile's blocks in order.
  const int64_t k_blocks = (k + kc - 1) / kc;
  const int64_t chunk = std::max<int64_t>(1, tiles / (threads * 16));
  std::vector<std::atomic<int64_t>> next_claim(k_blocks);
  const int width_max = max_nv * kPanel;

#pragma omp parallel num_threads(threads) if (parallel)
  {
    int64_t cursor = 0, cursor_end = 0, kb = 0;
    auto next_tile = [&]() -> int64_t {
      if (cursor < cursor_end) return cursor++;
      const int64_t c = next_claim[kb].fetch_add(chunk);
      if (c >= tiles) return -1;
      cursor = c;
      cursor_end = std::min(tiles, c + chunk);
      return cursor++;
    };
    // Direct path: one row tile's accumulators. Widening path: every row's
    // (m x width), and the widened stage.
    std::vector<float>& io_all = IoBuffer();
    io_all.resize(widen ? m * width_max : kAvx512Rows * width_max);
    float* const io = io_all.data();
    alignas(64) float stage[kAvx512Panels * kStageK * kPanel];
    // This thread's copy of x[:, k0:k1], packed per row tile (see the tiles).
    std::vector<float>& xp = PackBuffer();
    xp.resize(m * kc + 2 * max_rows);
    for (int64_t k0 = 0; k0 < k; k0 += kc, ++kb) {
      const int64_t k1 = std::min(k, k0 + kc);
      const bool first = k0 == 0, last = k1 == k;
      if (kb > 0) {
#pragma omp barrier
      }
      if (bf16dot) {  // bf16 pairs, the odd tail padded with 0
        for (int64_t rt = 0; rt < row_tiles; ++rt) {
          const int64_t i0 = m * rt / row_tiles;
          const int64_t rows = m * (rt + 1) / row_tiles - i0;
          uint32_t* dst = reinterpret_cast<uint32_t*>(xp.data() + i0 * kc);
          for (int64_t q = k0; q < k1; q += 2)
            for (int64_t i = 0; i < rows; ++i) {
              const float* xr = x + (i0 + i) * k;
              const uint32_t lo = FloatToBf16(xr[q]);
              const uint32_t hi = q + 1 < k1 ? FloatToBf16(xr[q + 1]) : 0;
              dst[(q - k0) / 2 * rows + i] = lo | (hi << 16);
            }
        }
      } else {
        for (int64_t rt = 0; rt < row_tiles; ++rt) {
          const int64_t i0 = m * rt / row_tiles;
          const int64_t rows = m * (rt + 1) / row_tiles - i0;
          float* dst = xp.data() + i0 * kc;
          for (int64_t q = k0; q < k1; ++q)
            for (int64_t i = 0; i < rows; ++i)
              dst[(q - k0) * rows + i] = x[(i0 + i) * k + q];
        }
      }
      cursor = cursor_end = 0;
      for (int64_t tile; (tile = next_tile()) >= 0;) {
        const int64_t p0 = tile * max_nv;
        const int nv = static_cast<int>(std::min<int64_t>(max_nv, panels - p0));
        const int64_t c0 = p0 * kPanel;
        const int64_t cols = std::min<int64_t>(n - c0, nv * kPanel);
        const int width = nv * kPanel;
        const uint8_t* wp = w.data() + p0 * pb;
        // Partial sums of rows [i0, i0 + rows) in and out of io (at
        // io_row0's rows), scaled at the end for per-row int8.
        auto load_partial = [&](int64_t i0, int64_t rows, float* dst) {
          for (int64_t i = 0; i < rows; ++i) {
            std::memcpy(dst + i * width, y + (i0 + i) * n + c0,
                        cols * sizeof(float));
          }
        };
        auto store = [&](int64_t i0, int64_t rows, const float* src_rows) {
          for (int64_t i = 0; i < rows; ++i) {
            float* dst = y + (i0 + i) * n + c0;
            const float* src = src_rows + i * width;
            if (last && scales != nullptr) {
              for (int64_t c = 0; c < cols; ++c)
                dst[c] = src[c] * scales[c0 + c];
            } else {
              std::memcpy(dst, src, cols * sizeof(float));
            }
          }
        };
        if (widen) {
          if (!first) load_partial(0, m, io);
          for (int64_t q0 = k0; q0 < k1; q0 += kStageK) {
            const int64_t q1 = std::min(k1, q0 + kStageK);
            widen(wp, pb, nv, q0, q1, stage);
            const int64_t spb = (q1 - q0) * kPanel * 4;
            const uint8_t* sw = reinterpret_cast<const uint8_t*>(stage);
            for (int64_t rt = 0; rt < row_tiles; ++rt) {
              const int64_t i0 = m * rt / row_tiles;
              const int rows = static_cast<int>(m * (rt + 1) / row_tiles - i0);
              const float* xi = xp.data() + i0 * kc + (q0 - k0) * rows;
              float* iot = io + i0 * width;
              const bool zero = first && q0 == k0;
              switch (isa) {
                case GemmIsa::kAvx512:
                  Avx512Tile(Fmt::kF32, rows, nv)(xi, sw, spb, 0, q1 - q0, iot,
                                                  zero);
                  break;
                case GemmIsa::kAvx2:
                  Avx2Tile(Fmt::kF32, rows)(xi, sw, spb, 0, q1 - q0, iot, zero);
                  break;
                case GemmIsa::kPortable:
                  TilePortable(Fmt::kF32, rows, nv, xi, sw, spb, 0, q1 - q0,
                               iot, zero);
                  break;
              }
            }
          }
          store(0, m, io);
          continue;
        }
        for (int64_t rt = 0; rt < row_tiles; ++rt) {
          const int64_t i0 = m * rt / row_tiles;
          const int rows = static_cast<int>(m * (rt + 1) / row_tiles - i0);
          if (!first) load_partial(i0, rows, io);
          const float* xi = xp.data() + i0 * kc;
          if (bf16dot_hw) {
            Bf16DotTile(rows, nv)(xi, wp, pb, k0, k1, io, first);
          } else if (bf16dot) {
            TileBf16DotPortable(rows, nv, reinterpret_cast<const uint32_t*>(xi),
                                wp, pb, k0, k1, io, first);
          } else
            switch (isa) {
              case GemmIsa::kAvx512:
                Avx512Tile(fmt, rows, nv)(xi, wp, pb, k0, k1, io, first);
                break;
              case GemmIsa::kAvx2:
                Avx2Tile(fmt, rows)(xi, wp, pb, k0, k1, io, first);
                break;
              case GemmIsa::kPortable:
                TilePortable(fmt, rows, nv, xi, wp, pb, k0, k1, io, first);
                break;
            }
          store(i0, rows, io);
        }
      }
    }
  }
}

}  // namespace pdserve::kernels
