#include "kernels/cpu/packed_gemm.h"

// GCC 12's own avx512fintrin.h trips -Wmaybe-uninitialized (its
// _mm512_undefined_* placeholders) in every instantiation; nothing here reads
// an uninitialised value.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

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

int64_t ElementBytes(DType t) { return static_cast<int64_t>(DTypeBytes(t)); }

// Byte offset of weight (k index q, column c of the panel) inside a panel.
inline int64_t PanelOffset(DType t, int64_t q, int64_t c) {
  switch (t) {
    case DType::kBF16:  // [k/2][16][2]: two k of one column share a word
      return (((q >> 1) * kPanel + c) * 2 + (q & 1)) * 2;
    default:  // [k][16]
      return (q * kPanel + c) * ElementBytes(t);
  }
}

inline float LoadWidened(DType t, const uint8_t* p) {
  switch (t) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return Bf16ToFloat(h);
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return F16ToFloat(h);
    }
    case DType::kI8:
      return static_cast<float>(static_cast<int8_t>(*p));
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
void TilePortable(DType t, int rows, int nv, const float* xp, const uint8_t* w,
                  int64_t panel_bytes, int64_t k0, int64_t k1, float* io,
                  bool zero) {
  const int width = nv * kPanel;
  for (int i = 0; i < rows; ++i) {
    for (int v = 0; v < nv; ++v) {
      const uint8_t* panel = w + v * panel_bytes;
      for (int c = 0; c < kPanel; ++c) {
        float acc = zero ? 0.0f : io[i * width + v * kPanel + c];
        for (int64_t q = k0; q < k1; ++q) {
          acc = std::fma(xp[(q - k0) * rows + i],
                         LoadWidened(t, panel + PanelOffset(t, q, c)), acc);
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
template <DType W>
PDSERVE_AVX2 inline void LoadPairAvx2(const uint8_t* panel, int64_t q,
                                      __m256 a[2], __m256 b[2]) {
  if constexpr (W == DType::kF32) {
    const float* p = reinterpret_cast<const float*>(panel) + q * kPanel;
    a[0] = _mm256_loadu_ps(p);
    a[1] = _mm256_loadu_ps(p + 8);
    b[0] = _mm256_loadu_ps(p + 16);
    b[1] = _mm256_loadu_ps(p + 24);
  } else if constexpr (W == DType::kBF16) {
    const uint8_t* p = panel + (q >> 1) * 64;
    const __m256i d0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i d1 =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
    const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    a[0] = _mm256_castsi256_ps(_mm256_slli_epi32(d0, 16));
    a[1] = _mm256_castsi256_ps(_mm256_slli_epi32(d1, 16));
    b[0] = _mm256_castsi256_ps(_mm256_and_si256(d0, hi));
    b[1] = _mm256_castsi256_ps(_mm256_and_si256(d1, hi));
  } else if constexpr (W == DType::kF16) {
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
    const uint8_t* p = panel + q * 16;
    a[0] = WidenInt8Avx2(p);
    a[1] = WidenInt8Avx2(p + 8);
    b[0] = WidenInt8Avx2(p + 16);
    b[1] = WidenInt8Avx2(p + 24);
  }
}

template <DType W, int MR>
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

// One pair of k (q even) of one panel: Raw is what stays in a register
// between the two halves (bf16: the packed words; others: the address).
template <DType W>
struct Avx512Pair;
template <>
struct Avx512Pair<DType::kF32> {
  using Raw = const float*;
  PDSERVE_AVX512 static Raw Load(const uint8_t* panel, int64_t q) {
    return reinterpret_cast<const float*>(panel) + q * kPanel;
  }
  PDSERVE_AVX512 static __m512 First(Raw p) { return _mm512_loadu_ps(p); }
  PDSERVE_AVX512 static __m512 Second(Raw p) { return _mm512_loadu_ps(p + 16); }
};
template <>
struct Avx512Pair<DType::kBF16> {
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
struct Avx512Pair<DType::kF16> {
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
template <>
struct Avx512Pair<DType::kI8> {
  using Raw = const uint8_t*;
  PDSERVE_AVX512 static Raw Load(const uint8_t* panel, int64_t q) {
    return panel + q * 16;
  }
  PDSERVE_AVX512 static __m512 First(Raw p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  PDSERVE_AVX512 static __m512 Second(Raw p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  }
};

template <DType W, int MR, int NV>
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
  int64_t q = k0;
  for (; q + 2 <= k1; q += 2) {
    const float* xq = xp + (q - k0) * MR;
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

using TileFn = void (*)(const float*, const uint8_t*, int64_t, int64_t, int64_t,
                        float*, bool);

constexpr int kAvx512Rows = 6, kAvx512Panels = 3;
constexpr int kAvx2Rows = 4;
constexpr int kPortableRows = 4;

template <DType W, int NV, int... R>
constexpr std::array<TileFn, sizeof...(R)> Avx512Rows(
    std::integer_sequence<int, R...>) {
  return {&TileAvx512<W, R + 1, NV>...};
}
template <DType W>
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

template <DType W, int... R>
constexpr std::array<TileFn, sizeof...(R)> Avx2Rows(
    std::integer_sequence<int, R...>) {
  return {&TileAvx2<W, R + 1>...};
}

TileFn Avx512Tile(DType t, int rows, int nv) {
  switch (t) {
    case DType::kF32:
      return Avx512Table<DType::kF32>::kFns[nv - 1][rows - 1];
    case DType::kBF16:
      return Avx512Table<DType::kBF16>::kFns[nv - 1][rows - 1];
    case DType::kF16:
      return Avx512Table<DType::kF16>::kFns[nv - 1][rows - 1];
    case DType::kI8:
      return Avx512Table<DType::kI8>::kFns[nv - 1][rows - 1];
  }
  return nullptr;
}

TileFn Avx2Tile(DType t, int rows) {
  static constexpr auto kSeq = std::make_integer_sequence<int, kAvx2Rows>{};
  static constexpr auto f32 = Avx2Rows<DType::kF32>(kSeq);
  static constexpr auto bf16 = Avx2Rows<DType::kBF16>(kSeq);
  static constexpr auto f16 = Avx2Rows<DType::kF16>(kSeq);
  static constexpr auto i8 = Avx2Rows<DType::kI8>(kSeq);
  switch (t) {
    case DType::kF32:
      return f32[rows - 1];
    case DType::kBF16:
      return bf16[rows - 1];
    case DType::kF16:
      return f16[rows - 1];
    case DType::kI8:
      return i8[rows - 1];
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
                                DType dtype) {
  WeightMatrix m;
  m.dtype_ = dtype;
  m.layout_ = Layout::kPanel16;
  m.n_ = n;
  m.k_ = k;
  m.kp_ = (k + 1) & ~int64_t{1};
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t pb = m.panel_bytes();
  m.data_ = AllocateWeights(panels * pb);
  m.bytes_ = n * k * ElementBytes(dtype);
  std::vector<float> scale;
  if (dtype == DType::kI8) {
    m.scales_ = std::shared_ptr<float[]>(new float[panels * kPanel]());
    m.bytes_ += n * static_cast<int64_t>(sizeof(float));
  }
  for (int64_t r = 0; r < n; ++r) {
    const float* row = w + r * k;
    uint8_t* panel = m.data_.get() + (r / kPanel) * pb;
    const int64_t c = r % kPanel;
    float inv = 0;
    if (dtype == DType::kI8) {
      float amax = 0;
      for (int64_t q = 0; q < k; ++q) amax = std::max(amax, std::fabs(row[q]));
      const float s = amax / 127.0f;
      m.scales_[r] = s;
      inv = s > 0 ? 1.0f / s : 0.0f;
    }
    for (int64_t q = 0; q < k; ++q) {
      uint8_t* dst = panel + PanelOffset(dtype, q, c);
      switch (dtype) {
        case DType::kF32:
          std::memcpy(dst, &row[q], 4);
          break;
        case DType::kBF16: {
          const uint16_t h = FloatToBf16(row[q]);
          std::memcpy(dst, &h, 2);
          break;
        }
        case DType::kF16: {
          const uint16_t h = FloatToF16(row[q]);
          std::memcpy(dst, &h, 2);
          break;
        }
        case DType::kI8: {
          const float v = std::nearbyint(row[q] * inv);
          *dst = static_cast<uint8_t>(
              static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f)));
          break;
        }
      }
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
  return kp_ * kPanel * ElementBytes(dtype_);
}

void WeightMatrix::DequantizeRow(int64_t r, float* out) const {
  if (layout_ == Layout::kRowMajorF32) {
    std::memcpy(out, row_major() + r * k_, k_ * sizeof(float));
    return;
  }
  const uint8_t* panel = data_.get() + (r / kPanel) * panel_bytes();
  const int64_t c = r % kPanel;
  const float s = dtype_ == DType::kI8 ? scales_[r] : 1.0f;
  for (int64_t q = 0; q < k_; ++q) {
    const float v = LoadWidened(dtype_, panel + PanelOffset(dtype_, q, c));
    out[q] = dtype_ == DType::kI8 ? v * s : v;
  }
}

bool operator==(const WeightMatrix& a, const WeightMatrix& b) {
  if (a.dtype_ != b.dtype_ || a.layout_ != b.layout_ || a.n_ != b.n_ ||
      a.k_ != b.k_) {
    return false;
  }
  if (a.n_ == 0) return true;
  const int64_t bytes = a.layout_ == WeightMatrix::Layout::kRowMajorF32
                            ? a.n_ * a.k_ * 4
                            : (a.n_ + kPanel - 1) / kPanel * a.panel_bytes();
  if (std::memcmp(a.data(), b.data(), bytes) != 0) return false;
  return a.dtype_ != DType::kI8 ||
         std::memcmp(a.scales(), b.scales(), a.n_ * sizeof(float)) == 0;
}

std::vector<float> WeightMatrix::ToFloat() const {
  std::vector<float> out(n_ * k_);
  for (int64_t r = 0; r < n_; ++r) DequantizeRow(r, out.data() + r * k_);
  return out;
}

std::vector<float> WeightMatrix::Widened() const {
  if (dtype_ != DType::kI8) return ToFloat();
  std::vector<float> out(n_ * k_);
  for (int64_t r = 0; r < n_; ++r) {
    const uint8_t* panel = data_.get() + (r / kPanel) * panel_bytes();
    for (int64_t q = 0; q < k_; ++q) {
      out[r * k_ + q] =
          LoadWidened(dtype_, panel + PanelOffset(dtype_, q, r % kPanel));
    }
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

void GemmNT(const float* __restrict__ x, int64_t m, int64_t k,
            const WeightMatrix& w, float* __restrict__ y,
            GemmNumerics numerics) {
  const int64_t n = w.rows();
  if (m <= 0 || n <= 0) return;
  const GemmIsa isa = ActiveGemmIsa();
  const DType t = w.dtype();
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
  const int64_t pb = w.panel_bytes();
  // k is cut in blocks so that this thread's packed x (m x kc floats) stays
  // in L2 while a tile's weights pass every row tile: up to 64 rows (decode
  // batches) that is usually all of k, so each panel streams from memory
  // once, front to back; prefill chunks use 256 (a bf16 tile is then 24 KiB,
  // L1). The fp32 partial sums wait in y between blocks.
  const int64_t kc =
      m > 64 ? 256
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
    alignas(64) float io[kAvx512Rows * kAvx512Panels * kPanel];
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
        for (int64_t rt = 0; rt < row_tiles; ++rt) {
          const int64_t i0 = m * rt / row_tiles;
          const int rows = static_cast<int>(m * (rt + 1) / row_tiles - i0);
          if (!first) {
            for (int i = 0; i < rows; ++i) {
              std::memcpy(io + i * width, y + (i0 + i) * n + c0,
                          cols * sizeof(float));
            }
          }
          const float* xi = xp.data() + i0 * kc;
          if (bf16dot_hw) {
            Bf16DotTile(rows, nv)(xi, wp, pb, k0, k1, io, first);
          } else if (bf16dot) {
            TileBf16DotPortable(rows, nv, reinterpret_cast<const uint32_t*>(xi),
                                wp, pb, k0, k1, io, first);
          } else
            switch (isa) {
              case GemmIsa::kAvx512:
                Avx512Tile(t, rows, nv)(xi, wp, pb, k0, k1, io, first);
                break;
              case GemmIsa::kAvx2:
                Avx2Tile(t, rows)(xi, wp, pb, k0, k1, io, first);
                break;
              case GemmIsa::kPortable:
                TilePortable(t, rows, nv, xi, wp, pb, k0, k1, io, first);
                break;
            }
          for (int i = 0; i < rows; ++i) {
            float* dst = y + (i0 + i) * n + c0;
            const float* src = io + i * width;
            if (last && scales != nullptr) {
              for (int64_t c = 0; c < cols; ++c)
                dst[c] = src[c] * scales[c0 + c];
            } else {
              std::memcpy(dst, src, cols * sizeof(float));
            }
          }
        }
      }
    }
  }
}

}  // namespace pdserve::kernels
