// Linear layers with weights kept in a compact dtype: y[m, n] = x[m, k] ·
// W[n, k]ᵀ, x and y fp32, W fp32, bf16, fp16 or int8 (symmetric; one fp32
// scale per output row, or one fp16 scale per block of 32 k of a row).
//
// Order contract (what makes the engine batch-invariant, bit for bit): every
// output element is ONE fp32 FMA chain over k in increasing order,
//   acc = 0; for p in 0..k-1: acc = fma(x[i][p], w(j, p), acc)
// where w(j, p) is the stored weight widened to fp32 (exact for every dtype;
// per-row int8 widens its integer and y = acc * scale[j] afterwards; block
// int8 widens q * scale_block, which is exact in fp32 because a 7-bit integer
// times an fp16 scale needs at most 18 significant bits). The chain does not
// depend on m, on how rows and columns are tiled or threaded, on k-blocking
// (partial sums are stored as fp32 and resumed), on whether a tile widens its
// weights on the fly or once into an L1 scratch shared by all its row tiles
// (batches and prefill), nor on the ISA: the portable, AVX2+FMA and AVX-512F
// paths give identical bits, so a prefill worker and a decode worker on
// different x86 machines agree too.
// Dot-product instructions (AVX512-BF16 vdpbf16ps, VNNI, AMX) need the
// activations rounded to bf16/int8 and sum pairs or blocks inside the
// instruction; vdpbf16ps and VNNI are the opt-in GemmNumerics::kBf16Dot and
// kInt8Dot below (kInt8Dot also runs on AMX-INT8, whose integer sums are
// exact). AMX-BF16 is not used: TDPBF16PS's rounding matches no sequential
// fp32 emulation (measured), so no portable path could give its bits (see
// cpu_features.h for what is detected).
//
// Storage: columns are grouped in panels of 16 output rows; a panel stores k
// in order, 16 weights per k (bf16: two consecutive k of a column share one
// 32-bit word, low half first, so one 512-bit load widens with a shift and a
// mask; block int8: per block of 32 k, [32][16] int8 then the 16 columns'
// fp16 scales, 544 bytes, so a decode step reads one stream). Panels pad n to
// a multiple of 16 and k to a multiple of 2 (block int8: 32) with zeros.
//
// WeightMatrix is immutable after Pack and cheap to copy (shared storage);
// GemmNT is stateless and thread-safe (column panels over the kernel helper
// pool of task_pool.h; the int8dot kernels use OpenMP).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/dtype.h"

namespace pdserve::kernels {

enum class GemmIsa { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };
const char* GemmIsaName(GemmIsa isa);  // "portable", "avx2", "avx512"
// Whether this CPU can run `isa` (kPortable always).
bool GemmIsaSupported(GemmIsa isa);
// The path GemmNT uses: the best supported one unless SetGemmIsa chose.
GemmIsa ActiveGemmIsa();
// For tests and benchmarks: forces a supported path (false if unsupported).
// Not synchronised with running GEMMs; call between them.
bool SetGemmIsa(GemmIsa isa);

// How int8 weights are scaled (ignored for other dtypes).
//   kPerRow:   scale = max|row| / 127 in fp32, q = round(w / scale).
//   kBlock32:  per 32 consecutive k of a row, scale = max|block| / 127
//              rounded UP to fp16 (so no q is clipped), q = round(w / scale);
//              1/16 byte of scale per weight, much smaller error on rows
//              with outliers.
enum class Int8Scaling { kPerRow, kBlock32 };
inline constexpr int64_t kInt8Block = 32;  // k per block scale

class WeightMatrix {
 public:
  // Row-major fp32 kept as is, for OpenBLAS (MatMulMode::kBlas) and the
  // legacy fp32 kernels; every other matrix is kPanel16, or kPanel16Dot:
  // per-row int8 only, for GemmNumerics::kInt8Dot. A kPanel16Dot panel keeps
  // k in groups of 4, [k/4][16 columns][4 k] (k padded to 64 with zeros), the
  // operand order of VPDPBUSD and of an AMX B tile (one 1 KiB tile per 64 k),
  // so the kernels read the weights as stored, with no reordering per GEMM.
  // The layout never changes a value: every GemmNumerics gives the same bits
  // on both (kFp32Chain on kPanel16Dot, and kInt8Dot on per-row kPanel16, run
  // a slow portable loop).
  enum class Layout { kPanel16, kRowMajorF32, kPanel16Dot };

  WeightMatrix() = default;
  // w: [n, k] row-major fp32; rounded to `dtype` (nearest even; int8: see
  // Int8Scaling, q in [-127, 127]).
  // layout: kPanel16, or kPanel16Dot for per-row int8 (ignored otherwise).
  static WeightMatrix Pack(const float* w, int64_t n, int64_t k, DType dtype,
                           Int8Scaling scaling = Int8Scaling::kPerRow,
                           Layout layout = Layout::kPanel16);
  static WeightMatrix RowMajorF32(const float* w, int64_t n, int64_t k);

  DType dtype() const { return dtype_; }
  // kBlock32 only for int8 packed with it.
  Int8Scaling int8_scaling() const { return scaling_; }
  Layout layout() const { return layout_; }
  int64_t rows() const { return n_; }  // n: output features
  int64_t cols() const { return k_; }  // k: input features
  bool empty() const { return n_ == 0; }
  // Bytes of weights and scales one full read of the matrix touches.
  int64_t bytes() const { return bytes_; }

  // Row r (k floats) as fp32: widened, int8 times its scale.
  void DequantizeRow(int64_t r, float* out) const;
  std::vector<float> ToFloat() const;  // [n, k] row-major, dequantized
  // [n, k] row-major w(j, p) of the order contract (per-row int8: the
  // integers, not scaled; block int8: q * scale, exact); with scales() this
  // is what ReferenceGemmNT takes.
  std::vector<float> Widened() const;
  // Block int8: the fp16 scale of (row r, block b = k / 32) widened.
  float BlockScale(int64_t r, int64_t b) const;

  // For the kernels.
  const uint8_t* data() const { return data_.get(); }
  // Per-row int8: [n padded]; null for every other format (block int8
  // keeps its scales inside the panels).
  const float* scales() const { return scales_.get(); }
  // kPanel16Dot only (else null): [n padded] of 128 * Σ_p q(j, p), what
  // VPDPBUSD's +128 offset on the activations adds to row j's integer sum
  // (the kernels subtract it; computed once here instead of per GEMM).
  const int32_t* dot_offsets() const { return dot_offsets_.get(); }
  int64_t padded_k() const { return kp_; }
  int64_t panel_bytes() const;  // one panel: padded_k * 16 * element bytes
  const float* row_major() const {
    return reinterpret_cast<const float*>(data_.get());
  }

  // Same dtype, layout, shape and stored bytes (and scales).
  friend bool operator==(const WeightMatrix& a, const WeightMatrix& b);

 private:
  DType dtype_ = DType::kF32;
  Int8Scaling scaling_ = Int8Scaling::kPerRow;
  Layout layout_ = Layout::kPanel16;
  int64_t n_ = 0, k_ = 0, kp_ = 0, bytes_ = 0;
  std::shared_ptr<uint8_t[]> data_;
  std::shared_ptr<float[]> scales_;
  std::shared_ptr<int32_t[]> dot_offsets_;
};

// What a GEMM computes. kFp32Chain is the order contract above. kBf16Dot
// (bf16 weights only; others fall back to kFp32Chain) rounds x to bf16 and
// runs AVX512-BF16 VDPBF16PS: per pair of k, acc += w[2t+1]x[2t+1] then
// acc += w[2t]x[2t], fp32 FMAs with bf16 denormals read as 0 and denormal
// results flushed (the instruction as Intel documents it). Twice the FMA
// throughput, less accurate activations; still one fixed chain per output, so
// batch-invariant. CPUs without the instruction run a scalar emulation of the
// same chain (tested bit-exact against the instruction where present); other
// vendors' implementations are not assumed to match, so engines put the
// numerics in the model fingerprint.
//
// kInt8Dot (int8 weights; other dtypes fall back to kFp32Chain). With block
// int8 weights it rounds x to int8 too, per row and block of 32 k
// (QuantizeActivationsInt8), and sums exact integer products per block:
//   acc = 0; for each block b in increasing order:
//     isum = Σ_{p in b} qx[i][p] * qw[j][p]            (int32, exact)
//     acc = fma(float(isum), sx[i][b] * sw[j][b], acc)   (fp32)
// The integer sums do not depend on any order, so AVX512-VNNI (vpdpbusd,
// with a +128 offset on x undone exactly), AMX-INT8 (tdpbssd, one block per
// instruction) and the portable loop give the same bits on every CPU; rows
// depend only on themselves, so it is batch-invariant. Activations lose
// precision (int8 per 32 values), so it is its own numerics (engines put it in
// the model fingerprint).
// With per-row int8 weights x is rounded per row instead (scale = max|row| /
// 127, q = round-to-nearest-even(x / scale)), and one exact integer sum runs
// over all of k:
//   y[i][j] = float(Σ_p qx[i][p] * qw[j][p]) * (sx[i] * sw[j])
// so AMX accumulates whole rows in its tiles (64 k per TDPBSSD) with no
// per-block epilogue; the same three kernels, the same bits (int32 sums up to
// k = 65536, the portable loop's int64 beyond). Coarser activations than the
// block form (one scale per row), fewer operations.
enum class GemmNumerics { kFp32Chain, kBf16Dot, kInt8Dot };

// kInt8Dot's activation rounding, per row and block of 32 (the last block
// may be shorter): scale = max|x| / 127 (fp32), q = round-to-nearest-even(x /
// scale) in [-127, 127] (0 where the block is all zero).
// x: [m, k]; q: [m, padded k (multiple of 32)], padding 0; scales: [m, k/32
// rounded up].
void QuantizeActivationsInt8(const float* x, int64_t m, int64_t k, int8_t* q,
                             float* scales);
// Whether kInt8Dot runs the AVX512-VNNI kernel here (AVX-512 path active,
// VNNI and VBMI present); else the portable loop with the same bits.
bool Int8DotUsesVnni();

// The kernel kInt8Dot runs for a GEMM of m rows. All of them give the same
// bits (the integer sums are exact and the fp32 epilogue is the same code):
//   kAmx:      AMX-INT8 TDPBSSD, 16 rows x 32 k x 16 columns per instruction
//              (one block), where Int8DotAmxUsable() and m >=
//              Int8DotAmxMinRows(): batches and prefill;
//   kVnni:     where Int8DotUsesVnni() (decode at small batch, where the
//              weight stream, not arithmetic, is the limit);
//   kAvxVnni:  where the path is AVX2 or AVX-512 without VNNI and the CPU
//              has AVX-VNNI (256-bit VPDPBUSD): per-row int8 weights on it,
//              block int8 weights on the plain AVX2 block kernel;
//   kAvx2:     the same without AVX-VNNI, where the CPU has AVX2 (VPMADDUBSW
//              on |q| and the signed weights: exact int16 pairs), for both
//              scalings;
//   kPortable: everywhere else.
enum class Int8DotKernel { kPortable, kVnni, kAmx, kAvxVnni, kAvx2 };
// portable|vnni|amx|avxvnni|avx2
const char* Int8DotKernelName(Int8DotKernel kernel);
Int8DotKernel Int8DotKernelFor(int64_t m);
// Testing: false makes Int8DotKernelFor pass AVX-VNNI over (kAvx2 instead),
// so that the plain AVX2 kernel is checked on CPUs that have both.
void SetInt8DotAvxVnniForTesting(bool enabled);
// VNNI usable, the CPU has AMX-TILE and AMX-INT8, and Linux granted this
// process the tile state (arch_prctl, see cpu_features.h).
bool Int8DotAmxUsable();
// Smallest m that takes AMX where usable: a tile holds 16 rows, and below
// 16 the padded rows cost as much as real ones (measured on the 1B shape's
// matrices: m = 8 ran at 0.2-0.9x VNNI, m = 16-32 at 1.1-1.7x when the
// shared machine was quiet; see bench/RESULTS.md). 0 disables AMX; 1 takes
// it at every m (tests). Not synchronised with running GEMMs; call between
// them.
inline constexpr int64_t kInt8DotAmxDefaultMinRows = 16;
int64_t Int8DotAmxMinRows();
void SetInt8DotAmxMinRows(int64_t rows);

// y[m, n] = x[m, k] · Wᵀ. w.cols() == k, w.layout() == kPanel16. y is
// overwritten.
void GemmNT(const float* __restrict__ x, int64_t m, int64_t k,
            const WeightMatrix& w, float* __restrict__ y,
            GemmNumerics numerics = GemmNumerics::kFp32Chain);

// The contract written plainly (scalar, unpacked): what every path must equal
// bit for bit. w: [n, k] as WeightMatrix::Widened() returns it; scales: [n]
// for int8, else null.
void ReferenceGemmNT(const float* x, int64_t m, int64_t k, const float* w,
                     int64_t n, const float* scales, float* y);

}  // namespace pdserve::kernels
