// The AVX-512F kernels of packed_gemm.h (up to kAvx512Rows rows by
// kAvx512Panels panels of 16 columns, the widener of the batched path) and
// the AVX512-BF16 VDPBF16PS tiles of GemmNumerics::kBf16Dot. Each function
// carries its target attribute; the dispatcher calls them only where cpuid
// reports the instructions.
// GCC 12's own avx512fintrin.h trips -Wmaybe-uninitialized (its
// _mm512_undefined_* placeholders) in every instantiation, and
// -Wuninitialized in _mm512_reduce_max_ps; nothing here reads an
// uninitialised value.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "kernels/cpu/packed_gemm_internal.h"

namespace pdserve::kernels::packed_gemm_internal {
namespace {

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

// pf: lines to prefetch, spread over the pairs of k (null: none).
template <Fmt W, int MR, int NV>
PDSERVE_AVX512 inline void TileAvx512Body(const float* xp, const uint8_t* w,
                                          int64_t panel_bytes, int64_t k0,
                                          int64_t k1, float* io, bool zero,
                                          int64_t next_tile,
                                          const StagePrefetch* pf) {
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
  // from DRAM, and a prefetch 1 KiB ahead in each (StreamAheadOffset) keeps
  // more lines in flight than the hardware prefetcher alone (one per 64
  // bytes).
  constexpr int64_t kBytesPerK = ElementBytesOf(W) * kPanel;
  // Every kPfPairs pairs, the lines due by then: line j (of all panels',
  // panel by panel within a line index) once j * pairs <= pair * total.
  constexpr int64_t kPfPairs = 4;
  const int64_t pairs = (k1 - k0) / 2;
  const int64_t pf_total = pf != nullptr ? pf->lines * pf->nv : 0;
  int64_t pf_done = 0;
  int pf_v = 0;
  const uint8_t* pf_line = pf != nullptr ? pf->base : nullptr;
  auto issue_next = [&] {
    _mm_prefetch(
        reinterpret_cast<const char*>(pf_line + pf_v * pf->panel_bytes),
        _MM_HINT_T0);
    if (++pf_v == pf->nv) {
      pf_v = 0;
      pf_line += 64;
    }
  };
  int64_t q = k0;
  for (; q + 2 <= k1; q += 2) {
    const float* xq = xp + (q - k0) * MR;
    const int64_t pair = (q - k0) / 2;
    if (pf_total > 0 && pair % kPfPairs == 0) {
      const int64_t due = std::min(pairs - 1, pair + kPfPairs - 1) * pf_total;
      for (; pf_done < pf_total && pf_done * pairs <= due; ++pf_done)
        issue_next();
    }
    if (MR <= kStreamAheadRows && pf == nullptr && (q * kBytesPerK) % 64 == 0) {
      // Every line the pair reads, each kStreamAheadBytes ahead: fp32 reads
      // two lines of a panel a pair, and with only the first requested the
      // hardware prefetcher left the other to a demand miss (the `small`
      // shape's 32 fp32 GEMMs, weights flushed, one thread: 28-29 GB/s at
      // batch 1 and 17.5-23 at batch 2-4, against 34-35 and 29.5-33.4 with
      // both lines requested).
      for (int64_t b = 0; b < 2 * kBytesPerK; b += 64) {
        const int64_t off =
            StreamAheadOffset(q * kBytesPerK + b, panel_bytes, next_tile);
        for (int v = 0; v < NV; ++v)
          _mm_prefetch(reinterpret_cast<const char*>(wp[v] + off), _MM_HINT_T0);
      }
    }
    typename P::Raw raw[NV];
    for (int v = 0; v < NV; ++v) raw[v] = P::Load(wp[v], q);
    // Broadcast each x once and reuse it across the NV panels: 8 x 3
    // accumulators, 3 widened weights, the raw words and one broadcast fit
    // the 32 registers.
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
  // What the stage's k did not reach (fewer pairs than lines).
  for (; pf_done < pf_total; ++pf_done) issue_next();
}

template <Fmt W, int MR, int NV>
PDSERVE_AVX512 void TileAvx512(const float* xp, const uint8_t* w,
                               int64_t panel_bytes, int64_t k0, int64_t k1,
                               float* io, bool zero, int64_t next_tile) {
  TileAvx512Body<W, MR, NV>(xp, w, panel_bytes, k0, k1, io, zero, next_tile,
                            nullptr);
}

template <int MR, int NV>
PDSERVE_AVX512 void StageTileAvx512(const float* xp, const uint8_t* w,
                                    int64_t panel_bytes, int64_t k0, int64_t k1,
                                    float* io, bool zero,
                                    const StagePrefetch& pf) {
  TileAvx512Body<Fmt::kF32, MR, NV>(xp, w, panel_bytes, k0, k1, io, zero,
                                    NV * panel_bytes, &pf);
}

// Block int8: per block the NV panels' scales stay in registers; each k's
// weights are widened and scaled once (an exact product) for all MR rows.
template <int MR, int NV>
PDSERVE_AVX512 void TileAvx512B32(const float* xp, const uint8_t* w,
                                  int64_t panel_bytes, int64_t k0, int64_t k1,
                                  float* io, bool zero, int64_t /*next_tile*/) {
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

template <int MR, int NV>
__attribute__((target("avx512f,avx512bf16"))) void TileBf16Dot(
    const float* xpf, const uint8_t* w, int64_t panel_bytes, int64_t k0,
    int64_t k1, float* io, bool zero, int64_t /*next_tile*/) {
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

// 16 floats to bf16, nearest even, as FloatToBf16: u + 0x7fff + (bit 16),
// high half; NaN keeps its sign and high payload with the quiet bit set.
PDSERVE_AVX512 inline __m256i Bf16Round16(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb =
      _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb),
      16);
  const __m512i quiet =
      _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
      _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

template <Fmt W, int NV, int... R>
constexpr std::array<TileFn, sizeof...(R)> Avx512Rows(
    std::integer_sequence<int, R...>) {
  if constexpr (W == Fmt::kI8B32) {
    return {&TileAvx512B32<R + 1, NV>...};
  } else {
    return {&TileAvx512<W, R + 1, NV>...};
  }
}
template <Fmt W, int R, int... NV>
constexpr std::array<TileFn, sizeof...(NV)> Avx512WidePanels(
    std::integer_sequence<int, NV...>) {
  return {&TileAvx512<W, R, NV + 1>...};
}
template <Fmt W>
struct Avx512WideTable {
  static constexpr auto kSeq =
      std::make_integer_sequence<int, kAvx512WidePanels>{};
  static_assert(Avx512WideRows(W) == 2);
  static constexpr std::array<std::array<TileFn, kAvx512WidePanels>, 2> kFns = {
      Avx512WidePanels<W, 1>(kSeq), Avx512WidePanels<W, 2>(kSeq)};
};
template <Fmt W>
struct Avx512Table {
  static constexpr auto kSeq = std::make_integer_sequence<int, kAvx512Rows>{};
  static constexpr std::array<std::array<TileFn, kAvx512Rows>, kAvx512Panels>
      kFns = {Avx512Rows<W, 1>(kSeq), Avx512Rows<W, 2>(kSeq),
              Avx512Rows<W, 3>(kSeq)};
};
template <int NV, int... R>
constexpr std::array<StageTileFn, sizeof...(R)> StageRows(
    std::integer_sequence<int, R...>) {
  return {&StageTileAvx512<R + 1, NV>...};
}
template <int NV, int... R>
constexpr std::array<TileFn, sizeof...(R)> Bf16DotRows(
    std::integer_sequence<int, R...>) {
  return {&TileBf16Dot<R + 1, NV>...};
}

}  // namespace

TileFn Bf16DotTile(int rows, int nv) {
  static constexpr auto kSeq = std::make_integer_sequence<int, kBf16DotRows>{};
  static constexpr std::array<std::array<TileFn, kBf16DotRows>, kAvx512Panels>
      kFns = {Bf16DotRows<1>(kSeq), Bf16DotRows<2>(kSeq), Bf16DotRows<3>(kSeq)};
  return kFns[nv - 1][rows - 1];
}

// Each row's [k0, k1) is rounded 16 at a time into a row-major scratch of
// bf16 (whose 32-bit words are the pairs, low half first), then its words
// are spread at stride `rows`.
PDSERVE_AVX512 void PackBf16PairsAvx512(const float* x, int64_t k, int64_t i0,
                                        int64_t rows, int64_t k0, int64_t k1,
                                        uint32_t* dst) {
  thread_local std::vector<uint16_t> scratch;
  const int64_t len = k1 - k0, words = (len + 1) / 2;
  scratch.resize(static_cast<size_t>(words * 2 + 16));
  for (int64_t i = 0; i < rows; ++i) {
    const float* xr = x + (i0 + i) * k + k0;
    uint16_t* h = scratch.data();
    int64_t q = 0;
    for (; q + 16 <= len; q += 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + q),
                          Bf16Round16(_mm512_loadu_ps(xr + q)));
    }
    if (q < len) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (len - q)) - 1);
      // Masked-off lanes load 0.0f, whose bf16 is 0: the odd tail's pad.
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + q),
                          Bf16Round16(_mm512_maskz_loadu_ps(tail, xr + q)));
    }
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(h);
    uint32_t* d = dst + i;
    for (int64_t t = 0; t < words; ++t) d[t * rows] = pairs[t];
  }
}

StageTileFn Avx512StageTile(int rows, int nv) {
  static constexpr auto kSeq = std::make_integer_sequence<int, kAvx512Rows>{};
  static constexpr std::array<std::array<StageTileFn, kAvx512Rows>,
                              kAvx512Panels>
      kFns = {StageRows<1>(kSeq), StageRows<2>(kSeq), StageRows<3>(kSeq)};
  return kFns[nv - 1][rows - 1];
}

TileFn Avx512WideTile(Fmt t, int rows, int nv) {
  switch (t) {
    case Fmt::kF16:
      return Avx512WideTable<Fmt::kF16>::kFns[rows - 1][nv - 1];
    case Fmt::kI8:
      return Avx512WideTable<Fmt::kI8>::kFns[rows - 1][nv - 1];
    default:
      break;
  }
  return nullptr;
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

WidenFn Avx512Widener(Fmt t) {
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
  return nullptr;
}

}  // namespace pdserve::kernels::packed_gemm_internal
