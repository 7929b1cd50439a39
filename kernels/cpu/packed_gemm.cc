#include "kernels/cpu/packed_gemm.h"

// The dispatcher of packed_gemm.h: which instruction set runs (cpuid, or
// SetGemmIsa), how WeightMatrix packs and reads its panels, and GemmNT's
// driver (k blocking, row and column tiles over the threads, the
// widen-once path) over the kernels of packed_gemm_portable.cc, _avx2.cc,
// _avx512.cc, _int8dot.cc and _amx.cc (see packed_gemm_internal.h).

// GCC 12's own avx512fintrin.h trips -Wmaybe-uninitialized (its
// _mm512_undefined_* placeholders) in every instantiation, and
// -Wuninitialized in _mm512_reduce_max_ps; nothing here reads an
// uninitialised value.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/packed_gemm_internal.h"
#include "kernels/cpu/step_profile.h"
#include "kernels/cpu/task_pool.h"

namespace pdserve::kernels {
namespace {

using packed_gemm_internal::Avx2Tile;
using packed_gemm_internal::Avx2Wide;
using packed_gemm_internal::Avx2Widener;
using packed_gemm_internal::Avx2WideTile;
using packed_gemm_internal::Avx512StageTile;
using packed_gemm_internal::Avx512Tile;
using packed_gemm_internal::Avx512Widener;
using packed_gemm_internal::Avx512WideRows;
using packed_gemm_internal::Avx512WideTile;
using packed_gemm_internal::Bf16DotTile;
using packed_gemm_internal::BlockScaleOffset;
using packed_gemm_internal::ExpectedNextTile;
using packed_gemm_internal::ExpectedNextTileFromBack;
using packed_gemm_internal::Fmt;
using packed_gemm_internal::FormatOf;
using packed_gemm_internal::GemmDotLayoutChain;
using packed_gemm_internal::GemmInt8Dot;
using packed_gemm_internal::GemmRowDot;
using packed_gemm_internal::kAvx2Rows;
using packed_gemm_internal::kAvx2WidePanels;
using packed_gemm_internal::kAvx512Panels;
using packed_gemm_internal::kAvx512Rows;
using packed_gemm_internal::kAvx512WidePanels;
using packed_gemm_internal::kBf16DotRows;
using packed_gemm_internal::kBlockBytes;
using packed_gemm_internal::kPanel;
using packed_gemm_internal::kPortableRows;
using packed_gemm_internal::kStageK;
using packed_gemm_internal::kStreamAheadRows;
using packed_gemm_internal::LoadWidened;
using packed_gemm_internal::PackBf16PairsAvx512;
using packed_gemm_internal::PackBf16PairsPortable;
using packed_gemm_internal::PanelOffset;
using packed_gemm_internal::PortableWidener;
using packed_gemm_internal::StagePrefetch;
using packed_gemm_internal::TileBf16DotPortable;
using packed_gemm_internal::TilePortable;
using packed_gemm_internal::WidenFn;

int64_t ElementBytes(DType t) { return static_cast<int64_t>(DTypeBytes(t)); }

// The least weight bytes a thread claims at once in a parallel GEMM (see
// GemmNT's chunks).
constexpr int64_t kChunkMinBytes = int64_t{512} << 10;

// Weights live in 2 MiB-aligned memory advised for transparent huge pages:
// a decode step streams every weight once, and with 4 KiB pages each page
// costs a TLB miss whose page walk follows a triad-cold page table, and the
// hardware prefetchers stop at every 4 KiB boundary. Matrices of 4 MiB and
// more get their own allocation; smaller ones (every matrix of a small model)
// are packed back to back into shared 32 MiB chunks, so they sit on huge
// pages too without rounding each one up to 2 MiB. A chunk is freed when the
// last matrix in it is (the returned pointers share the chunk's ownership).
std::shared_ptr<uint8_t[]> AllocateHugeAligned(size_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t size =
      std::max<size_t>((bytes + kHuge - 1) / kHuge * kHuge, kHuge);
  void* p = std::aligned_alloc(kHuge, size);
  if (p == nullptr) std::abort();
#ifdef MADV_HUGEPAGE
  madvise(p, size, MADV_HUGEPAGE);
#endif
  return std::shared_ptr<uint8_t[]>(static_cast<uint8_t*>(p),
                                    [](uint8_t* q) { std::free(q); });
}

class SmallWeightArena {
 public:
  static SmallWeightArena& Get() {
    static SmallWeightArena* arena = new SmallWeightArena();  // never freed
    return *arena;
  }
  // bytes (> 0, < kChunkBytes) of zeroed, 64-byte-aligned memory.
  std::shared_ptr<uint8_t[]> Allocate(size_t bytes) {
    bytes = (bytes + 63) / 64 * 64;
    absl::MutexLock lock(&mu_);
    if (chunk_ == nullptr || used_ + bytes > kChunkBytes) {
      chunk_ = AllocateHugeAligned(kChunkBytes);
      used_ = 0;
    }
    uint8_t* p = chunk_.get() + used_;
    used_ += bytes;
    std::memset(p, 0, bytes);
    return std::shared_ptr<uint8_t[]>(chunk_, p);
  }

  static constexpr size_t kChunkBytes = size_t{32} << 20;

 private:
  absl::Mutex mu_;
  std::shared_ptr<uint8_t[]> chunk_ ABSL_GUARDED_BY(mu_);
  size_t used_ ABSL_GUARDED_BY(mu_) = 0;
};

std::shared_ptr<uint8_t[]> AllocateWeights(int64_t bytes) {
  const size_t size = static_cast<size_t>(std::max<int64_t>(bytes, 1));
  if (size < (size_t{4} << 20)) return SmallWeightArena::Get().Allocate(size);
  std::shared_ptr<uint8_t[]> p = AllocateHugeAligned(size);
  std::memset(p.get(), 0, size);
  return p;
}

// Rows of the largest register tile (the io scratch of the direct path).
constexpr int kTileRowsMax = std::max(kAvx512Rows, kBf16DotRows);

// The widening of the batched path (null for fp32, which needs none).
WidenFn Widener(GemmIsa isa, Fmt t) {
  switch (isa) {
    case GemmIsa::kAvx512:
      return Avx512Widener(t);
    case GemmIsa::kAvx2:
      return Avx2Widener(t);
    case GemmIsa::kPortable:
      return PortableWidener(t);
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
    if (fmt == Fmt::kI8Dot)
      m.dot_offsets_ =
          std::shared_ptr<int32_t[]>(new int32_t[panels * kPanel]());
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
        int64_t sum = 0;
        for (int64_t q = 0; q < k; ++q) {
          const float v = std::nearbyint(row[q] * inv);
          const int8_t b = static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
          panel[PanelOffset(fmt, q, c)] = static_cast<uint8_t>(b);
          sum += b;
        }
        if (m.dot_offsets_) m.dot_offsets_[r] = static_cast<int32_t>(128 * sum);
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

void GemmNT(const float* __restrict__ x, int64_t m, int64_t k,
            const WeightMatrix& w, float* __restrict__ y,
            GemmNumerics numerics) {
  StepProfile* const prof = ActiveProfile();
  if (prof != nullptr) ++prof->gemm_calls;
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
  const int max_rows = bf16dot ? (bf16dot_hw ? kBf16DotRows : kPortableRows)
                       : isa == GemmIsa::kAvx512 ? kAvx512Rows
                       : isa == GemmIsa::kAvx2   ? kAvx2Rows
                                                 : kPortableRows;
  // Batch 1-2 of the widened formats: wider tiles (see kAvx512WidePanels).
  const bool wide =
      !bf16dot && isa == GemmIsa::kAvx512 && m <= Avx512WideRows(fmt);
  const bool wide_avx2 =
      !bf16dot && isa == GemmIsa::kAvx2 && m == 1 && Avx2Wide(fmt);
  const int max_nv = bf16dot     ? (bf16dot_hw ? kAvx512Panels : 1)
                     : wide      ? kAvx512WidePanels
                     : wide_avx2 ? kAvx2WidePanels
                     : isa == GemmIsa::kAvx512 ? kAvx512Panels
                                               : 1;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t tiles = (panels + max_nv - 1) / max_nv;
  // Rows are split into equal tiles (30 = 8+8+7+7, not 8x3+6): a tile
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
  // Within a k block tiles are independent: the calling thread and the
  // kernel helpers that are awake claim them in small chunks (task_pool.h),
  // so a preempted helper's share is taken over instead of stalling the
  // step. Which thread computes a tile never changes its numbers; k blocks
  // run one after the other, which keeps each tile's blocks in order.
  // A chunk is 1/16 of a thread's share. Where a tile does not prefetch
  // into the next tile its thread runs, it is also at least kChunkMinBytes
  // of weights (and at most half a thread's share): each claim then starts a
  // new stream from memory, and a small model's matrices (0.5-3 MB) cut into
  // 1/16 shares gave 64 KiB streams (measured on `small` bf16 decode, batch
  // 1, alternating builds: +3-15% tokens/s with only weights and KV cold,
  // -4 to +6% with every cache cold). The small-batch tiles that stream
  // ahead (StreamAheadOffset) carry their stream across claims instead, so
  // their small matrices go in claims of one tile, and the threads finish
  // within a tile of each other (`small` decode, batch 1, weights and KV
  // cold: 0-4% more tokens/s at int8, bf16 and fp32).
  const bool streams_ahead = (isa == GemmIsa::kAvx512 && !bf16dot &&
                              m <= kStreamAheadRows && fmt != Fmt::kI8B32) ||
                             wide_avx2;
  const int64_t tile_bytes = std::max<int64_t>(
      1, max_nv * pb * std::min(kc, k) / std::max<int64_t>(w.padded_k(), 1));
  const int64_t chunk = std::max<int64_t>(
      1, std::max(tiles / (threads * 16),
                  streams_ahead
                      ? 0
                      : std::min((kChunkMinBytes + tile_bytes - 1) / tile_bytes,
                                 tiles / (threads * 2))));
  const int run_threads = parallel ? threads : 1;
  // Tiles that stream ahead are claimed from both ends (the caller from the
  // front, helpers from the back), so that each thread's tiles lie next to
  // each other and the tile it prefetches into is the one it runs next.
  // Claimed alternately from one end, a thread's next tile was a guess that
  // missed whenever the other thread got ahead (`small` bf16 decode, batch
  // 1, weights and KV cold, AMD EPYC: the GEMM phases 0.85-0.98 ms a step
  // against 0.88-1.04, alternating runs).
  const bool two_ended = streams_ahead;
  const int width_max = max_nv * kPanel;
  // One row's packed copy ([k][1]) would be x itself: the tiles read x in
  // place (bf16dot packs it into bf16 pairs).
  const bool x_in_place = m == 1 && !bf16dot && widen == nullptr;
  if (prof != nullptr && parallel) {
    prof->parallel_regions += (k + kc - 1) / kc;
    prof->barriers += (k + kc - 1) / kc - 1;
  }
  for (int64_t k0 = 0; k0 < k; k0 += kc) {
    const int64_t k1 = std::min(k, k0 + kc);
    const bool first = k0 == 0, last = k1 == k;
    auto run_tiles = [&](int64_t t_begin, int64_t t_end, bool first_call) {
      // Direct path: one row tile's accumulators. Widening path: every row's
      // (m x width), and the widened stage.
      std::vector<float>& io_all = IoBuffer();
      // This thread's copy of x[:, k0:k1], packed per row tile (see the
      // tiles), made on its first chunk of this k block.
      std::vector<float>& xp = PackBuffer();
      if (first_call) {
        io_all.resize(widen ? m * width_max : kTileRowsMax * width_max);
      }
      if (first_call && !x_in_place) {
        // Only the calling thread has a profile installed.
        StepProfile* const tprof = ActiveProfile();
        const int64_t pack_start = tprof != nullptr ? ProfileNowNs() : 0;
        xp.resize(m * kc + 2 * max_rows);
        if (bf16dot) {  // bf16 pairs, the odd tail padded with 0
          for (int64_t rt = 0; rt < row_tiles; ++rt) {
            const int64_t i0 = m * rt / row_tiles;
            const int64_t rows = m * (rt + 1) / row_tiles - i0;
            uint32_t* dst = reinterpret_cast<uint32_t*>(xp.data() + i0 * kc);
            (isa == GemmIsa::kAvx512
                 ? PackBf16PairsAvx512
                 : PackBf16PairsPortable)(x, k, i0, rows, k0, k1, dst);
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
        if (tprof != nullptr) tprof->pack_ns += ProfileNowNs() - pack_start;
      }
      float* const io = io_all.data();
      const bool from_back = two_ended && ClaimingFromBack();
      const float* const xbase = x_in_place ? x + k0 : xp.data();
      alignas(64) float stage[kAvx512Panels * kStageK * kPanel];
      for (int64_t tile = t_begin; tile < t_end; ++tile) {
        const int64_t next =
            from_back ? ExpectedNextTileFromBack(tile, t_begin, t_end, chunk)
                      : ExpectedNextTile(tile, t_end, tiles, chunk,
                                         two_ended ? 1 : run_threads);
        const int64_t next_tile = (next - tile) * max_nv * pb;
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
            // The next stage's weights (after the last, the next tile's
            // first): each row tile prefetches its share of them, so they
            // arrive while the tiles compute. A stage of a bf16 panel is one
            // 4 KiB page, where the hardware prefetcher starts over.
            const bool next_tile = q1 >= k1;
            const int64_t nq0 = next_tile ? k0 : q1;
            int next_nv = nv;
            if (next_tile) {
              next_nv = tile + 1 < t_end ? static_cast<int>(std::min<int64_t>(
                                               max_nv, panels - p0 - nv))
                                         : 0;
            }
            const uint8_t* next_wp = next_tile ? wp + nv * pb : wp;
            const int64_t next0 = PanelOffset(fmt, nq0, 0);
            const int64_t next1 =
                PanelOffset(fmt, std::min(k1, nq0 + kStageK), 0);
            const int64_t lines = (next1 - next0 + 63) / 64;
            for (int64_t rt = 0; rt < row_tiles; ++rt) {
              const int64_t i0 = m * rt / row_tiles;
              const int rows = static_cast<int>(m * (rt + 1) / row_tiles - i0);
              const int64_t l0 = lines * rt / row_tiles;
              const int64_t l1 = lines * (rt + 1) / row_tiles;
              const float* xi = xbase + i0 * kc + (q0 - k0) * rows;
              float* iot = io + i0 * width;
              const bool zero = first && q0 == k0;
              if (isa == GemmIsa::kAvx512) {
                const StagePrefetch pf{next_wp + next0 + l0 * 64, pb, next_nv,
                                       l1 - l0};
                Avx512StageTile(rows, nv)(xi, sw, spb, 0, q1 - q0, iot, zero,
                                          pf);
                continue;
              }
              for (int v = 0; v < next_nv; ++v) {
                const uint8_t* base = next_wp + v * pb + next0;
                for (int64_t l = l0; l < l1; ++l)
                  __builtin_prefetch(base + l * 64);
              }
              if (isa == GemmIsa::kAvx2) {
                Avx2Tile(Fmt::kF32, rows)(xi, sw, spb, 0, q1 - q0, iot, zero,
                                          0);
              } else {
                TilePortable(Fmt::kF32, rows, nv, xi, sw, spb, 0, q1 - q0, iot,
                             zero);
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
          const float* xi = xbase + i0 * kc;
          if (bf16dot_hw) {
            Bf16DotTile(rows, nv)(xi, wp, pb, k0, k1, io, first, next_tile);
          } else if (bf16dot) {
            TileBf16DotPortable(rows, nv, reinterpret_cast<const uint32_t*>(xi),
                                wp, pb, k0, k1, io, first);
          } else
            switch (isa) {
              case GemmIsa::kAvx512:
                (wide ? Avx512WideTile(fmt, rows, nv)
                      : Avx512Tile(fmt, rows, nv))(xi, wp, pb, k0, k1, io,
                                                   first, next_tile);
                break;
              case GemmIsa::kAvx2:
                (wide_avx2 ? Avx2WideTile(fmt, nv) : Avx2Tile(fmt, rows))(
                    xi, wp, pb, k0, k1, io, first, next_tile);
                break;
              case GemmIsa::kPortable:
                TilePortable(fmt, rows, nv, xi, wp, pb, k0, k1, io, first);
                break;
            }
          store(i0, rows, io);
        }
      }
    };
    if (two_ended) {
      RunChunksFromBothEnds(tiles, chunk, run_threads, run_tiles);
    } else {
      RunChunks(tiles, chunk, run_threads, run_tiles);
    }
    if (prof != nullptr && parallel) {
      const ChunkRunStats& stats = LastChunkRunStats();
      if (first) {
        prof->fork_ns += stats.publish_ns;
      } else {
        prof->barrier_ns += stats.publish_ns;
      }
      if (last) {
        prof->join_ns += stats.wait_ns;
      } else {
        prof->barrier_ns += stats.wait_ns;
      }
    }
  }
}

}  // namespace pdserve::kernels
