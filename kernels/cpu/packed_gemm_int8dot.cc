// GemmNumerics::kInt8Dot: the AVX512-VNNI kernels (VPDPBUSD), the
// activation quantizers, and the drivers that pick VNNI, AMX
// (packed_gemm_amx.cc), AVX-VNNI or AVX2 (packed_gemm_avx2dot.cc, the AVX2
// path) or the portable loops (packed_gemm_portable.cc) for
// block and per-row int8 weights. The integer sums are exact, so all of them
// give the same bits. Each vector function carries PDSERVE_VNNI; it runs
// only where VnniUsable().
// GCC 12's own avx512fintrin.h trips -Wmaybe-uninitialized (its
// _mm512_undefined_* placeholders) in every instantiation, and
// -Wuninitialized in _mm512_reduce_max_ps; nothing here reads an
// uninitialised value.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/packed_gemm_internal.h"
#include "kernels/cpu/task_pool.h"

namespace pdserve::kernels::packed_gemm_internal {
namespace {

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

// acc + Σ u8(u) * s8(w) per dword (4 bytes each). GCC 12 compiles
// _mm512_dpbusd_epi32 on an array of accumulators into a register copy and
// a stack store per instruction (measured: the 8 x 3 tile ran slower than a
// 4 x 2 one); the asm keeps every accumulator in its register.
PDSERVE_VNNI inline __m512i DpBusd(__m512i acc, __m512i u, __m512i w) {
  __asm__("vpdpbusd %[w], %[u], %[acc]"
          : [acc] "+v"(acc)
          : [u] "v"(u), [w] "v"(w));
  return acc;
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
        for (int v = 0; v < NV; ++v) isum[i][v] = DpBusd(isum[i][v], u, wg[v]);
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
        for (int v = 0; v < NV; ++v) isum[i][v] = DpBusd(isum[i][v], u, wg[v]);
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
// Per-row int8 on VNNI: 8 rows x 3 panels = 24 int32 accumulators, the 3
// weight vectors of a 4-k group and one broadcast: 28 of the 32 registers.
// Per group 3 loads and 8 broadcasts feed 24 VPDPBUSD, so a batch of 32
// takes 4 row tiles over weights held in L1/L2 after the first.
constexpr int kRowDotRows = 8, kRowDotPanels = 3;
// The io scratch of RunInt8DotTiles holds the larger of the two tiles.
constexpr int kTileRowsMax = std::max(kInt8DotRows, kRowDotRows);
constexpr int kTilePanelsMax = std::max(kInt8DotPanels, kRowDotPanels);

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

std::atomic<int64_t>& AmxMinRowsSetting() {
  static std::atomic<int64_t> rows{kInt8DotAmxDefaultMinRows};
  return rows;
}

// x + 128 as unsigned bytes, for VPDPBUSD (in place).
void OffsetToUnsigned(int8_t* q, int64_t n) {
  for (int64_t p = 0; p < n; ++p)
    q[p] = static_cast<int8_t>(static_cast<uint8_t>(q[p]) ^ 0x80);
}

// item(i) for every i < count (activation rows, or row tiles), each about
// `elements` activations, on the kernel helpers (task_pool.h) where there is
// enough work: no OpenMP region, whose start and end would wait for a
// descheduled partner thread.
template <typename Item>
void RunActivationRows(int64_t count, int64_t elements, Item&& item) {
  const int threads =
      static_cast<int>(std::min<int64_t>(KernelThreads(), count));
  const bool parallel = threads > 1 && count * elements > (int64_t{1} << 16);
  RunChunks(count, std::max<int64_t>(1, count / (threads * 4)),
            parallel ? threads : 1, [&](int64_t begin, int64_t end, bool) {
              for (int64_t i = begin; i < end; ++i) item(i);
            });
}

void QuantizeActivations(const float* x, int64_t m, int64_t k, int8_t* q,
                         float* scales, bool unsigned_bytes) {
  const int64_t kp = (k + kInt8Block - 1) / kInt8Block * kInt8Block;
  const int64_t blocks = kp / kInt8Block;
  const bool hw = ActiveGemmIsa() == GemmIsa::kAvx512 && VnniUsable();
  // Rows are independent; a prefill chunk has thousands of blocks per row.
  RunActivationRows(m, k, [&](int64_t i) {
    (hw ? QuantizeRowAvx512 : QuantizeRowPortable)(x + i * k, k, kp, q + i * kp,
                                                   scales + i * blocks);
    if (unsigned_bytes) OffsetToUnsigned(q + i * kp, kp);
  });
}

// The VNNI / portable int8dot loop: tiles of `max_nv` panels over the calling
// thread and the kernel helpers (task_pool.h; which thread takes a tile never
// changes its numbers); per tile begin(panels, nv), then for each of
// row_tiles = ceil(m / max_rows) equal row tiles
// compute(i0, rows, rt, row_tiles, panels, nv, next, io) fills io
// [rows][nv * 16], copied to y. `next` is the first panel of the tile this
// thread is expected to run next (null past the last), for the kernels to
// pull toward the cache meanwhile: the calling thread claims tiles from the
// front and the helpers from the back, so that a thread's tiles lie next to
// each other and that guess holds across its claims. (With every thread
// claiming from the front, a claim's last tile pulled in the tile another
// thread took next, and its own next tile started cold: matrices of 43-64
// tiles, claimed two to four at a time, ran 1.4-1.5x faster on two threads
// than on one against 2.0x for 342 tiles claimed 21 at a time.)
template <typename Begin, typename Compute>
void RunInt8DotTiles(int64_t m, int64_t k, const WeightMatrix& w, int max_rows,
                     int max_nv, float* __restrict__ y, Begin&& begin,
                     Compute&& compute) {
  const int64_t n = w.rows(), pb = w.panel_bytes();
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t tiles = (panels + max_nv - 1) / max_nv;
  const int64_t row_tiles = (m + max_rows - 1) / max_rows;
  const int threads =
      static_cast<int>(std::min<int64_t>(KernelThreads(), tiles));
  const bool parallel = threads > 1 && m * n * k > (int64_t{1} << 16);
  // Small claims (about 8 per thread) so that a matrix of few tiles (11 of
  // 3 panels at n = 512) still splits evenly, and a preempted thread's share
  // is taken over; which thread computes a tile never changes its numbers.
  const int64_t chunk = std::max<int64_t>(1, tiles / (threads * 8));
  auto run_tiles = [&](int64_t t_begin, int64_t t_end, bool) {
    const bool from_back = ClaimingFromBack();
    for (int64_t tile = t_begin; tile < t_end; ++tile) {
      alignas(64) float io[kTileRowsMax * kTilePanelsMax * kPanel];
      const int64_t p0 = tile * max_nv;
      const int nv = static_cast<int>(std::min<int64_t>(max_nv, panels - p0));
      const int64_t c0 = p0 * kPanel;
      const int64_t cols = std::min<int64_t>(n - c0, nv * kPanel);
      const uint8_t* wp = w.data() + p0 * pb;
      const int64_t next_tile =
          from_back ? ExpectedNextTileFromBack(tile, t_begin, t_end, chunk)
                    : ExpectedNextTile(tile, t_end, tiles, chunk, 1);
      const uint8_t* next =
          next_tile < tiles ? w.data() + next_tile * max_nv * pb : nullptr;
      begin(wp, nv);
      for (int64_t rt = 0; rt < row_tiles; ++rt) {
        const int64_t i0 = m * rt / row_tiles;
        const int rows = static_cast<int>(m * (rt + 1) / row_tiles - i0);
        compute(i0, rows, rt, row_tiles, wp, nv, next, io);
        for (int i = 0; i < rows; ++i) {
          std::memcpy(y + (i0 + i) * n + c0, io + i * nv * kPanel,
                      cols * sizeof(float));
        }
      }
    }
  };
  RunChunksFromBothEnds(tiles, chunk, parallel ? threads : 1, run_tiles);
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
                               float* scales) {
  const int64_t kq = RowDotPaddedK(k);
  const bool hw = ActiveGemmIsa() == GemmIsa::kAvx512 && VnniUsable();
  RunActivationRows(m, k, [&](int64_t i) {
    (hw ? QuantizeRowPerRowAvx512 : QuantizeRowPerRowPortable)(
        x + i * k, k, kq, q + i * kq, scales + i);
  });
}

// One row rounded as QuantizeRowPerRowAvx512 does (the same q), stored as
// VPDPBUSD reads it: q + 128 as unsigned bytes, padding to kq included, one
// 4-k group every group_stride bytes.
PDSERVE_VNNI void QuantizeRowPerRowVnni(const float* x, int64_t k, int64_t kq,
                                        int64_t group_stride, uint8_t* u,
                                        float* scale) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; p += 16) {
    const __mmask16 mk = k - p >= 16 ? 0xffff : (1u << (k - p)) - 1;
    amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(mk, x + p)));
  }
  const float s = _mm512_reduce_max_ps(amax) / 127.0f;
  *scale = s;
  const __m512 sv = _mm512_set1_ps(s);
  const __m128i offset = _mm_set1_epi8(static_cast<char>(0x80));
  for (int64_t p = 0; p < kq; p += 16) {
    const int64_t len = std::clamp<int64_t>(k - p, 0, 16);
    const __mmask16 mk = len >= 16 ? 0xffff : (1u << len) - 1;
    const __m128i q = s > 0
                          ? QuantizeAvx512(_mm512_maskz_loadu_ps(mk, x + p), sv)
                          : _mm_setzero_si128();
    StoreActivationGroups(_mm_xor_si128(q, offset), group_stride,
                          u + p / 4 * group_stride);
  }
}

// The VNNI tiles' activations: x [m, k] rounded per row (scales [m]), in the
// row tiles RunInt8DotTiles makes of kRowDotRows at most (row_tiles equal
// ones). The tile of rows [i0, i0 + rows) holds u [i0 * kq, (i0 + rows) *
// kq) as [kq / 4 groups][rows][4 bytes]: per group its rows' 4 bytes side by
// side, so the tile's broadcasts read one contiguous stream.
// avx2: round with the AVX2 build of the same quantizer (the same bytes)
// where the AVX-512 one cannot run.
void QuantizeActivationsVnniTiles(const float* x, int64_t m, int64_t k,
                                  int64_t row_tiles, bool avx2, uint8_t* u,
                                  float* scales) {
  const int64_t kq = RowDotPaddedK(k);
  const auto quantize = avx2 ? QuantizeRowPerRowAvx2 : QuantizeRowPerRowVnni;
  RunActivationRows(row_tiles, k * ((m + row_tiles - 1) / row_tiles),
                    [&](int64_t rt) {
                      const int64_t i0 = m * rt / row_tiles;
                      const int64_t rows = m * (rt + 1) / row_tiles - i0;
                      for (int64_t i = i0; i < i0 + rows; ++i) {
                        quantize(x + i * k, k, kq, rows * 4,
                                 u + i0 * kq + (i - i0) * 4, scales + i);
                      }
                    });
}

// MR rows (ux: q + 128 as QuantizeActivationsVnniTiles lays out one row
// tile, [kq / 4][MR][4]) x NV kPanel16Dot panels on VPDPBUSD; the
// stored 64 bytes per 4 k are the instruction's operand as they are, and the
// +128 offset comes off with the matrix's dot_offsets() (corr, 16 per panel).
// One tile runs all of k: the int32 sums need no partial stores, and a
// panel's k in one pass streams it from memory once (small batches: the
// weight stream is the limit, hence the prefetch 1 KiB ahead).
// With several row tiles per weight tile, the first streams the weights and
// the rest read them from L2; each row tile then also pulls its share of the
// next weight tile into L2 (pf_lines 64-byte lines from pf, spread over k),
// so that the memory stream overlaps the arithmetic instead of stalling the
// next tile's first pass.
template <int MR, int NV>
PDSERVE_VNNI void RowDotVnni(const uint8_t* ux, const float* sx,
                             const uint8_t* w, int64_t panel_bytes,
                             const float* sw, const int32_t* corr,
                             int64_t groups, const uint8_t* pf,
                             int64_t pf_lines, float* io) {
  __m512i isum[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) isum[i][v] = _mm512_setzero_si512();
  const uint8_t* wp[NV];
  for (int v = 0; v < NV; ++v) wp[v] = w + v * panel_bytes;
  int64_t pf_done = 0;
  for (int64_t g0 = 0; g0 < groups; g0 += kRowDotUnroll) {
    PrefetchDueLines(pf, pf_lines, groups, g0 + kRowDotUnroll - 1, &pf_done);
#pragma GCC unroll 8
    for (int64_t g = g0; g < g0 + kRowDotUnroll; ++g) {
      __m512i wg[NV];
      for (int v = 0; v < NV; ++v) {
        wg[v] = _mm512_loadu_si512(wp[v] + g * 64);
        if (MR <= kStreamAheadRows)
          _mm_prefetch(reinterpret_cast<const char*>(wp[v] + g * 64 + 1024),
                       _MM_HINT_T0);
      }
      for (int i = 0; i < MR; ++i) {
        uint32_t u4;
        std::memcpy(&u4, ux + (g * MR + i) * 4, 4);
        const __m512i u = _mm512_set1_epi32(static_cast<int>(u4));
        for (int v = 0; v < NV; ++v) isum[i][v] = DpBusd(isum[i][v], u, wg[v]);
      }
    }
  }
  for (int v = 0; v < NV; ++v) {
    const __m512i cv = _mm512_loadu_si512(corr + v * kPanel);
    const __m512 swv = _mm512_loadu_ps(sw + v * kPanel);
    for (int i = 0; i < MR; ++i) {
      const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(sx[i]), swv);
      _mm512_storeu_ps(
          io + (i * NV + v) * kPanel,
          _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[i][v], cv)),
                        scale));
    }
  }
}

using RowDotVnniFn = void (*)(const uint8_t*, const float*, const uint8_t*,
                              int64_t, const float*, const int32_t*, int64_t,
                              const uint8_t*, int64_t, float*);
template <int NV, int... R>
constexpr std::array<RowDotVnniFn, sizeof...(R)> RowDotVnniRows(
    std::integer_sequence<int, R...>) {
  return {&RowDotVnni<R + 1, NV>...};
}
RowDotVnniFn RowDotVnniTile(int rows, int nv) {
  static constexpr auto kSeq = std::make_integer_sequence<int, kRowDotRows>{};
  static constexpr std::array<std::array<RowDotVnniFn, kRowDotRows>,
                              kRowDotPanels>
      kFns = {RowDotVnniRows<1>(kSeq), RowDotVnniRows<2>(kSeq),
              RowDotVnniRows<3>(kSeq)};
  return kFns[nv - 1][rows - 1];
}

}  // namespace

void GemmInt8Dot(const float* __restrict__ x, int64_t m, int64_t k,
                 const WeightMatrix& w, float* __restrict__ y) {
  const int64_t kp = w.padded_k(), blocks = kp / kInt8Block;
  const int64_t pb = w.panel_bytes();
  const Int8DotKernel kernel = Int8DotKernelFor(m);
  const bool amx = kernel == Int8DotKernel::kAmx;
  const bool hw = kernel == Int8DotKernel::kVnni;
  // The AVX2 path's block kernel serves CPUs with AVX-VNNI too.
  const bool avx2 =
      kernel == Int8DotKernel::kAvx2 || kernel == Int8DotKernel::kAvxVnni;
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
      m, k, w, avx2 ? kAvx2DotBlockRows : kInt8DotRows, hw ? kInt8DotPanels : 1,
      y,
      [&](const uint8_t* wp, int nv) {
        if (!prepared) return;
        std::vector<uint8_t>& prep = Int8DotPrepBuffer();
        prep.resize(blocks * PrepBlockBytes(nv));
        PrepareInt8DotTile(wp, pb, nv, blocks, prep.data());
      },
      [&](int64_t i0, int rows, int64_t, int64_t, const uint8_t* wp, int nv,
          const uint8_t*, float* io) {
        const std::vector<uint8_t>& prep = Int8DotPrepBuffer();
        if (prepared) {
          Int8DotVnniPreparedTile(rows, nv)(
              reinterpret_cast<const uint8_t*>(qxp) + i0 * kp,
              sxp + i0 * blocks, kp, blocks, prep.data(), 0, io);
        } else if (hw) {
          Int8DotVnniTile(rows, nv)(
              reinterpret_cast<const uint8_t*>(qxp) + i0 * kp,
              sxp + i0 * blocks, kp, blocks, wp, pb, io);
        } else if (avx2) {
          Int8DotAvx2Tile(rows)(qxp + i0 * kp, sxp + i0 * blocks, kp, blocks,
                                wp, io);
        } else {
          Int8DotPortable(qxp + i0 * kp, sxp + i0 * blocks, kp, blocks, rows,
                          nv, wp, pb, io);
        }
      });
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
  const bool avx_vnni = kernel == Int8DotKernel::kAvxVnni;
  const bool avx2 = kernel == Int8DotKernel::kAvx2;
  const bool hw = kernel == Int8DotKernel::kVnni || avx_vnni || avx2;
  thread_local std::vector<int8_t> qx;
  thread_local std::vector<float> sx;
  const int64_t m_pad = amx ? (m + kAmxRows - 1) / kAmxRows * kAmxRows : m;
  qx.resize(m_pad * kq);
  sx.resize(m_pad);
  // The hardware kernels' row tiles and panels per tile.
  int max_rows = kRowDotRows, max_nv = kRowDotPanels;
  if (avx_vnni) {
    const bool stream = m <= kAvxVnniStreamRows;
    max_rows = stream ? kAvxVnniStreamRows : kAvxVnniRowDotRows;
    max_nv = stream ? kAvxVnniStreamPanels : 1;
  } else if (avx2) {
    const bool stream = m <= kAvx2DotStreamRows;
    max_rows = stream ? kAvx2DotStreamRows : kAvx2DotRowDotRows;
    max_nv = stream ? kAvx2DotStreamPanels : 1;
  }
  const int64_t vnni_row_tiles = (m + max_rows - 1) / max_rows;
  if (hw) {
    QuantizeActivationsVnniTiles(x, m, k, vnni_row_tiles, avx_vnni || avx2,
                                 reinterpret_cast<uint8_t*>(qx.data()),
                                 sx.data());
  } else {
    QuantizeActivationsPerRow(x, m, k, qx.data(), sx.data());
  }
  if (amx) {
    std::memset(qx.data() + m * kq, 0, (m_pad - m) * kq);
    std::fill(sx.begin() + m, sx.end(), 0.0f);
    GemmRowDotAmx(qx.data(), sx.data(), m, kq, w, y);
    return;
  }
  const int8_t* const qxp = qx.data();
  const float* const sxp = sx.data();
  // The tiles are consecutive in memory, one after the other.
  const uint8_t* const w_end = w.data() + (w.rows() + kPanel - 1) / kPanel * pb;
  RunInt8DotTiles(
      m, k, w, hw ? max_rows : kInt8DotRows, hw ? max_nv : 1, y,
      [](const uint8_t*, int) {},
      [&](int64_t i0, int rows, int64_t rt, int64_t row_tiles,
          const uint8_t* wp, int nv, const uint8_t* next, float* io) {
        const int64_t c0 = (wp - w.data()) / pb * kPanel;
        const float* sw = w.scales() + c0;
        if (hw) {
          // Row tile rt of row_tiles prefetches that share of the next tile.
          const int64_t next_bytes =
              row_tiles > 1 && next != nullptr
                  ? std::min<int64_t>(w_end - next, max_nv * pb)
                  : 0;
          const int64_t lines = (next_bytes + 63) / 64;
          const int64_t l0 = lines * rt / row_tiles;
          const int64_t l1 = lines * (rt + 1) / row_tiles;
          if (avx_vnni || avx2) {
            (avx2 ? RowDotAvx2Tile : RowDotAvxVnniTile)(rows, nv)(
                reinterpret_cast<const uint8_t*>(qxp) + i0 * kq, sxp + i0, wp,
                pb, sw, w.dot_offsets() + c0, kq / 4, next + l0 * 64, l1 - l0,
                io);
            return;
          }
          RowDotVnniTile(rows, nv)(
              reinterpret_cast<const uint8_t*>(qxp) + i0 * kq, sxp + i0, wp, pb,
              sw, w.dot_offsets() + c0, kq / 4, next + l0 * 64, l1 - l0, io);
        } else {
          RowDotPortable(fmt, qxp + i0 * kq, sxp + i0, kq, k, rows, nv, wp, pb,
                         sw, io);
        }
      });
}

}  // namespace pdserve::kernels::packed_gemm_internal

namespace pdserve::kernels {

using packed_gemm_internal::AmxMinRowsSetting;
using packed_gemm_internal::Avx2DotUsable;
using packed_gemm_internal::AvxVnniUsable;
using packed_gemm_internal::QuantizeActivations;
using packed_gemm_internal::VnniUsable;

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

namespace {
std::atomic<bool>& AvxVnniOff() {
  static std::atomic<bool> off{false};
  return off;
}
bool Int8DotAvxVnniOffForTesting() { return AvxVnniOff().load(); }
}  // namespace

void SetInt8DotAvxVnniForTesting(bool enabled) { AvxVnniOff().store(!enabled); }

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
    case Int8DotKernel::kAvxVnni:
      return "avxvnni";
    case Int8DotKernel::kAvx2:
      return "avx2";
    case Int8DotKernel::kPortable:
      break;
  }
  return "portable";
}

Int8DotKernel Int8DotKernelFor(int64_t m) {
  const int64_t min_rows = Int8DotAmxMinRows();
  if (min_rows > 0 && m >= min_rows && Int8DotAmxUsable())
    return Int8DotKernel::kAmx;
  if (Int8DotUsesVnni()) return Int8DotKernel::kVnni;
  if (ActiveGemmIsa() == GemmIsa::kPortable) return Int8DotKernel::kPortable;
  if (AvxVnniUsable() && !Int8DotAvxVnniOffForTesting())
    return Int8DotKernel::kAvxVnni;
  if (Avx2DotUsable()) return Int8DotKernel::kAvx2;
  return Int8DotKernel::kPortable;
}

}  // namespace pdserve::kernels
