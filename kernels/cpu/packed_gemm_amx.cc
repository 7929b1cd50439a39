// GemmNumerics::kInt8Dot on AMX-INT8 (TDPBSSD): block int8 weights one
// block per instruction, per-row int8 weights (kPanel16Dot) at full 64-k
// depth with the sums kept in the tiles over all of k. The integer sums equal
// VNNI's and the portable loop's, so the bits do too. Each function carries
// PDSERVE_AMX; the dispatcher calls them only where Int8DotAmxUsable().
// GCC 12's own avx512fintrin.h trips -Wmaybe-uninitialized (its
// _mm512_undefined_* placeholders) in every instantiation, and
// -Wuninitialized in _mm512_reduce_max_ps; nothing here reads an
// uninitialised value.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/packed_gemm_internal.h"

namespace pdserve::kernels::packed_gemm_internal {
namespace {

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

}  // namespace

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

}  // namespace pdserve::kernels::packed_gemm_internal
