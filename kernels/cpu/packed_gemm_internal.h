// What the packed_gemm*.cc files share, and nothing else includes: the panel
// formats and their byte offsets, the tile and widener signatures, the
// target attributes of each instruction-set family, and each family's entry
// points. packed_gemm.cc is the dispatcher (ISA choice, packing, the GemmNT
// driver); packed_gemm_portable.cc, _avx2.cc, _avx512.cc (with AVX512-BF16),
// _int8dot.cc (AVX512-VNNI and the kInt8Dot drivers) and _amx.cc
// (AMX-INT8) hold the kernels. Every function carries its own target
// attribute, so the files need no per-file compile flags and run only where
// the dispatcher found the instructions.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/packed_gemm.h"

namespace pdserve::kernels::packed_gemm_internal {

constexpr int64_t kPanel = 16;  // output rows (columns of y) per panel
// Block int8: per block of 32 k, [32][16] int8 then 16 fp16 scales.
constexpr int64_t kBlockBytes = kInt8Block * kPanel + kPanel * 2;

// What a panel holds; DType alone does not say how int8 is scaled.
// kI8Dot: per-row int8 in WeightMatrix::Layout::kPanel16Dot.
enum class Fmt : uint8_t { kF32, kBF16, kF16, kI8, kI8B32, kI8Dot };

inline Fmt FormatOf(
    DType t, Int8Scaling s,
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

// Bytes per weight of the panel-16 formats with one byte count per k (not
// kI8B32, whose blocks carry scales).
constexpr int64_t ElementBytesOf(Fmt t) {
  return t == Fmt::kF32 ? 4 : t == Fmt::kBF16 || t == Fmt::kF16 ? 2 : 1;
}

// Small-batch tiles stream their panels front to back and prefetch
// kStreamAheadBytes ahead in each. Where that runs past a panel's end it
// moves on to the same panel of the tile this thread runs next (next_tile
// bytes from this tile's start), which would otherwise start cold in all its
// panels at once: the offset from a panel's start to prefetch when the tile
// reads byte `at` of it.
constexpr int64_t kStreamAheadBytes = 1024;
// The most rows of an AVX-512 tile (fp32 chain, widened formats and
// int8dot's row dot) that streams its panels with a prefetch
// kStreamAheadBytes ahead. Up to 4 rows a tile still reads each weight from
// memory once for little arithmetic; without the prefetch the hardware
// prefetcher alone held one thread at 3-4 rows to 0.45-0.76 of its batch-1
// weight rate (bench/RESULTS.md).
constexpr int kStreamAheadRows = 4;
// The tile a thread is expected to run after `tile` of its claim [.., t_end)
// of `tiles` claimed `chunk` at a time by `threads` threads: the next of its
// claim, else the first of the claim after those the other threads are
// expected to have taken meanwhile (claims go out in turn), so that a tile's
// prefetches past its panels warm a tile no other thread streams already.
// Past the last tile: the next one (nothing left to warm).
constexpr int64_t ExpectedNextTile(int64_t tile, int64_t t_end, int64_t tiles,
                                   int64_t chunk, int threads) {
  const int64_t next =
      tile + 1 < t_end ? tile + 1 : t_end + (threads - 1) * chunk;
  return next < tiles ? next : tile + 1;
}
// The same for a helper of a two-ended claim (RunChunksFromBothEnds), whose
// claims go from the back down: the next of its claim [t_begin, t_end), else
// the first of the claim below it; at the front: the next one.
constexpr int64_t ExpectedNextTileFromBack(int64_t tile, int64_t t_begin,
                                           int64_t t_end, int64_t chunk) {
  if (tile + 1 < t_end) return tile + 1;
  return t_begin >= chunk ? t_begin - chunk : tile + 1;
}
constexpr int64_t StreamAheadOffset(int64_t at, int64_t panel_bytes,
                                    int64_t next_tile) {
  const int64_t ahead = at + kStreamAheadBytes;
  return ahead < panel_bytes ? ahead : ahead - panel_bytes + next_tile;
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

#define PDSERVE_AVX2 __attribute__((target("avx2,fma,f16c")))
#define PDSERVE_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#define PDSERVE_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi,f16c")))
#define PDSERVE_AMX                                             \
  __attribute__((                                               \
      target("avx512f,avx512bw,avx512vnni,avx512vbmi,f16c,amx-" \
             "tile,amx-int8")))

// Tiles. Each computes io[MR][NV*16] (+)= x[MR rows][k0:k1] · panels[k0:k1]
// for NV consecutive panels; `zero` starts the chains at 0, otherwise they
// resume from io. Every chain is fma over k in increasing order. x comes
// packed as xp[(q - k0) * MR + i] (one k's MR values side by side), so a tile
// reads one contiguous stream instead of MR rows that share cache sets.
// next_tile: the distance in bytes from w to the first panel of the tile the
// calling thread is expected to run next, where the small-batch tiles send
// their prefetches past their own panels' ends (StreamAheadOffset); it never
// changes a result.
using TileFn = void (*)(const float*, const uint8_t*, int64_t, int64_t, int64_t,
                        float*, bool, int64_t);

using WidenFn = void (*)(const uint8_t*, int64_t, int, int64_t, int64_t,
                         float*);

constexpr int kAvx512Rows = 8, kAvx512Panels = 3;
constexpr int kAvx2Rows = 4;
constexpr int kPortableRows = 4;
// k per widening stage: 3 panels x 128 k x 16 fp32 = 24 KiB, in L1 while
// every row tile of the batch passes over it.
constexpr int64_t kStageK = 128;

// --- Widening once per batch -----------------------------------------------
// With more rows than one register tile holds, each row tile would widen the
// same weights again. Instead the weights of [q0, q1) of NV panels are
// widened once into an fp32 scratch in the fp32 panel layout
// (out[v][q - q0][16]), and every row tile runs the fp32 tile over it. The
// values are exactly w(j, p) and the chains run in the same order, so the
// bits equal the direct path's.
// Each ISA's widener (null for fp32, which needs none).
WidenFn PortableWidener(Fmt t);
WidenFn Avx2Widener(Fmt t);
WidenFn Avx512Widener(Fmt t);

// Portable: any rows (<= 8) and panel count (<= 3).
void TilePortable(Fmt t, int rows, int nv, const float* xp, const uint8_t* w,
                  int64_t panel_bytes, int64_t k0, int64_t k1, float* io,
                  bool zero);
// AVX2 + FMA: rows <= kAvx2Rows, one panel.
TileFn Avx2Tile(Fmt t, int rows);
// AVX2 + FMA at batch 1 of bf16, fp16 and per-row int8: one row of up to
// kAvx2WidePanels panels (more independent FMA chains; see TileAvx2Wide).
constexpr int kAvx2WidePanels = 4;
constexpr bool Avx2Wide(Fmt t) {
  return t == Fmt::kBF16 || t == Fmt::kF16 || t == Fmt::kI8;
}
TileFn Avx2WideTile(Fmt t, int nv);
// AVX-512F: rows <= kAvx512Rows, nv <= kAvx512Panels panels (not kI8Dot,
// which GemmNT runs through GemmDotLayoutChain).
TileFn Avx512Tile(Fmt t, int rows, int nv);
// Lines a row tile pulls toward the cache while it computes on a widening
// stage: `lines` 64-byte lines from each of `nv` panels, panel v's from
// base + v * panel_bytes.
struct StagePrefetch {
  const uint8_t* base = nullptr;
  int64_t panel_bytes = 0;
  int nv = 0;
  int64_t lines = 0;
};
// The fp32 AVX-512 tile of Avx512Tile(Fmt::kF32, rows, nv) over a widened
// stage, with the prefetches of `pf` spread over its k (the same sums, the
// same bits): issued all at once, they stall the tile while the line fill
// buffers are full.
using StageTileFn = void (*)(const float*, const uint8_t*, int64_t, int64_t,
                             int64_t, float*, bool, const StagePrefetch&);
StageTileFn Avx512StageTile(int rows, int nv);
// Batch 1-2 of per-row int8 and fp16, whose weights take a conversion
// each: up to kAvx512WidePanels panels per tile, so more independent FMA
// chains and weight streams per tile. Measured on `small` at batch 1 with
// the weights cold: int8 with 3 panels 0.53-0.57 of the triad, 6 panels
// 0.60-0.62, 8 panels 0.62-0.66; fp16 0-9% more tokens/s; bf16 no change,
// so it keeps 3 (bench/RESULTS.md). The most rows such a tile takes (0:
// none).
constexpr int kAvx512WidePanels = 8;
constexpr int Avx512WideRows(Fmt t) {
  return t == Fmt::kI8 || t == Fmt::kF16 ? 2 : 0;
}
// rows <= Avx512WideRows(t), nv <= kAvx512WidePanels.
TileFn Avx512WideTile(Fmt t, int rows, int nv);

// --- bf16-activation dot products (GemmNumerics::kBf16Dot) -----------------
// x comes packed as bf16 pairs, xp[(q - k0) / 2 * MR + i] = x[2t] | x[2t+1]
// << 16, the layout of the weights' words. Per pair, as VDPBF16PS does it
// (Intel SDM): acc += w[2t+1]*x[2t+1], then acc += w[2t]*x[2t], each an fp32
// FMA with bf16 denormal inputs read as zero and denormal results flushed.
void TileBf16DotPortable(int rows, int nv, const uint32_t* xp, const uint8_t* w,
                         int64_t panel_bytes, int64_t k0, int64_t k1, float* io,
                         bool zero);
// AVX512-BF16 VDPBF16PS, the same chain (xp as floats holding the pairs),
// up to kBf16DotRows rows x kAvx512Panels panels: 8 x 3 = 24 accumulators,
// the 3 panels' words and one broadcast, so a batch of 32 is 4 row tiles.
constexpr int kBf16DotRows = 8;
TileFn Bf16DotTile(int rows, int nv);
// Rows [i0, i0 + rows) of x ([m][k]), k in [k0, k1), rounded to bf16 (nearest
// even, FloatToBf16) and packed as the tiles read them: dst[(q - k0) / 2 *
// rows + i] = x[q] | x[q + 1] << 16, an odd tail's second half 0. The
// AVX-512 one gives the same words, 16 at a time.
void PackBf16PairsPortable(const float* x, int64_t k, int64_t i0, int64_t rows,
                           int64_t k0, int64_t k1, uint32_t* dst);
void PackBf16PairsAvx512(const float* x, int64_t k, int64_t i0, int64_t rows,
                         int64_t k0, int64_t k1, uint32_t* dst);

// --- int8 activations x block-int8 weights (GemmNumerics::kInt8Dot) --------
// qx: [rows][kp] int8 (this row tile's rows), sx: [rows][blocks]; io:
// [rows][nv * 16]. Every output: per block the exact integer dot product,
// then acc = fma(float(isum), sx * sw, acc), blocks in increasing order.
void Int8DotPortable(const int8_t* qx, const float* sx, int64_t kp,
                     int64_t blocks, int rows, int nv, const uint8_t* w,
                     int64_t panel_bytes, float* io);
// One row of QuantizeActivationsInt8; the AVX-512 one gives the same bytes
// (max is exact, division and round-to-nearest-even are IEEE in both).
void QuantizeRowPortable(const float* x, int64_t k, int64_t kp, int8_t* q,
                         float* scales);

// --- kInt8Dot on per-row int8 weights ---------------------------------------
// Activations are rounded per row (one scale per row), so a row's integer
// sum runs over all of k and the only fp32 arithmetic is the final
//   y[i][j] = float(isum) * (sx[i] * sw[j]).
// Integer sums are exact (int32 up to k = 65536 on VNNI and AMX, int64 on the
// portable loop at any k, the same integers), so every kernel gives the same
// bits. Quantized rows are kRowDotK-aligned (zero padding), which AMX needs.
constexpr int64_t kRowDotK = 64;  // k per TDPBSSD at full depth
constexpr int64_t kRowDotMaxHwK = int64_t{1} << 16;

inline int64_t RowDotPaddedK(int64_t k) {
  return (k + kRowDotK - 1) / kRowDotK * kRowDotK;
}
// The row-dot tiles run their groups of 4 k kRowDotUnroll at a time (groups
// is a multiple: kq is of kRowDotK), and issue the next tile's lines due by
// the last group of a stretch at its start: the loop counters and the
// prefetch schedule's compare cost once a stretch instead of once a group.
constexpr int64_t kRowDotUnroll = 8;
static_assert(kRowDotK / 4 % kRowDotUnroll == 0);
// Lines [*done, ...) of pf's pf_lines toward L2, up to those due by group
// `due` of `groups` (line j once j * groups <= due * pf_lines).
inline void PrefetchDueLines(const uint8_t* pf, int64_t pf_lines,
                             int64_t groups, int64_t due, int64_t* done) {
  int64_t j = *done;
  for (; j < pf_lines && j * groups <= due * pf_lines; ++j)
    _mm_prefetch(reinterpret_cast<const char*>(pf + j * 64), _MM_HINT_T1);
  *done = j;
}
// One row rounded with one scale, q padded to kq with zeros.
void QuantizeRowPerRowPortable(const float* x, int64_t k, int64_t kq, int8_t* q,
                               float* scale);
// rows x nv panels of per-row int8 weights (either layout, `fmt`), y to io
// [rows][nv * 16].
void RowDotPortable(Fmt fmt, const int8_t* qx, const float* sx, int64_t kq,
                    int64_t k, int rows, int nv, const uint8_t* w,
                    int64_t panel_bytes, const float* sw, float* io);

// kFp32Chain on kPanel16Dot: the order contract, plainly (correct, slow; the
// engine packs kPanel16Dot only for kInt8Dot).
void GemmDotLayoutChain(const float* __restrict__ x, int64_t m, int64_t k,
                        const WeightMatrix& w, float* __restrict__ y);

// The vpermb index that turns 4 k x 16 columns of a block ([32 k][16
// columns] stored) into the 16 dwords of 4 consecutive k that VPDPBUSD and
// an AMX B tile want.
PDSERVE_VNNI inline __m512i Int8DotOrder() {
  alignas(64) uint8_t order[64];
  for (int c = 0; c < kPanel; ++c)
    for (int kk = 0; kk < 4; ++kk) order[c * 4 + kk] = kk * kPanel + c;
  return _mm512_load_si512(order);
}

// kInt8Dot on block int8 weights (VNNI, AMX or portable by Int8DotKernelFor)
// and on per-row int8 weights.
void GemmInt8Dot(const float* __restrict__ x, int64_t m, int64_t k,
                 const WeightMatrix& w, float* __restrict__ y);
void GemmRowDot(const float* __restrict__ x, int64_t m, int64_t k,
                const WeightMatrix& w, float* __restrict__ y);

// One row's 16 quantized activation bytes (4 groups of 4 k) stored as the
// VNNI kernels read them: one group every group_stride bytes (4: side by
// side). Baseline SSE2, so both the AVX-512 and the AVX-VNNI quantizers use
// it.
inline void StoreActivationGroups(__m128i bytes, int64_t group_stride,
                                  uint8_t* dst) {
  if (group_stride == 4) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), bytes);
    return;
  }
  alignas(16) uint8_t b[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(b), bytes);
  for (int j = 0; j < 4; ++j) std::memcpy(dst + j * group_stride, b + 4 * j, 4);
}

// The AVX2 path's int8dot (packed_gemm_avx2dot.cc): GemmRowDot's kernels
// where the AVX-512 path is off or lacks VNNI. AVX-VNNI (the 256-bit VEX
// VPDPBUSD) where the CPU has it, else plain AVX2 (VPMADDUBSW on |q| and the
// signed weights). Same activation row tiles and panels as the AVX-512
// kernels, same bits.
// AVX-VNNI tiles: up to 6 rows of one panel, or (m <= 2) up to 2 rows of 3
// panels. AVX2 tiles: up to 4 rows of one panel, or (m <= 2) up to 2 rows of
// 2 panels.
constexpr int kAvxVnniRowDotRows = 6, kAvxVnniStreamRows = 2,
              kAvxVnniStreamPanels = 3;
constexpr int kAvx2DotRowDotRows = 4, kAvx2DotStreamRows = 2,
              kAvx2DotStreamPanels = 2;
bool AvxVnniUsable();
bool Avx2DotUsable();
// rows x nv panels: ux one row tile ([groups][rows][4], q + 128), sx its
// scales, w the first panel, sw and corr its columns' scales and
// dot_offsets() (the AVX2 tiles sum Σ q w directly and need no corr);
// pf_lines 64-byte lines from pf are prefetched toward L2 over k.
using RowDotAvxVnniFn = void (*)(const uint8_t* ux, const float* sx,
                                 const uint8_t* w, int64_t panel_bytes,
                                 const float* sw, const int32_t* corr,
                                 int64_t groups, const uint8_t* pf,
                                 int64_t pf_lines, float* io);
// nv: 1 (rows <= kAvxVnniRowDotRows), or up to kAvxVnniStreamPanels (rows
// <= kAvxVnniStreamRows).
RowDotAvxVnniFn RowDotAvxVnniTile(int rows, int nv);
// nv: 1 (rows <= kAvx2DotRowDotRows), or 2 (rows <= kAvx2DotStreamRows).
RowDotAvxVnniFn RowDotAvx2Tile(int rows, int nv);
// Block int8 weights (one kPanel16 panel) on plain AVX2 where the AVX-512
// VNNI kernels cannot run: rows (up to kAvx2DotBlockRows) of signed
// activations qx [rows][kp] with block scales sx [rows][blocks]; io [rows][16].
constexpr int kAvx2DotBlockRows = 4;
using Int8DotAvx2Fn = void (*)(const int8_t* qx, const float* sx, int64_t kp,
                               int64_t blocks, const uint8_t* w, float* io);
Int8DotAvx2Fn Int8DotAvx2Tile(int rows);
// One row rounded as QuantizeRowPerRowPortable rounds it, stored as the
// kernels read it: q + 128 as unsigned bytes, padding to kq included, one
// 4-k group every group_stride bytes. AVX2, FMA and F16C only.
void QuantizeRowPerRowAvx2(const float* x, int64_t k, int64_t kq,
                           int64_t group_stride, uint8_t* u, float* scale);

// AMX-INT8 (packed_gemm_amx.cc). Rows of qx are padded to a multiple of
// kAmxRows with zeros (scales 0).
constexpr int kAmxRows = 16;
// Block int8: qx [m padded][kp] signed, sx [m padded][kp / 32].
void GemmInt8DotAmx(const int8_t* qx, const float* sx, int64_t m, int64_t kp,
                    const WeightMatrix& w, float* __restrict__ y);
// Per-row int8 on kPanel16Dot: qx [m padded][kq] signed, sx [m padded].
void GemmRowDotAmx(const int8_t* qx, const float* sx, int64_t m, int64_t kq,
                   const WeightMatrix& w, float* __restrict__ y);

}  // namespace pdserve::kernels::packed_gemm_internal
