// Linear-layer products on the CPU: y[m, n] = x[m, k] · w[n, k]ᵀ (weights in
// Hugging Face [out, in] layout, row-major).
//
// The engine's matrices are WeightMatrix (packed_gemm.h: compact dtypes,
// register-tiled, the same order contract); the raw-pointer fp32 kernels here
// serve OpenBLAS mode, attention's dot products and the GPU tests' references.
// Two implementations over row-major fp32:
//  - kDeterministic (default): pdserve's own kernel. Every output element is a
//    dot product with one fixed summation order (8 FMA lanes over k, then a
//    fixed pairwise lane sum), whatever m is and however rows are tiled or
//    threaded. A token's logits therefore do not depend on which other tokens
//    share its batch, which the equivalence contract (colocated ==
//    disaggregated == prefix-cache hit, bit for bit) needs. OpenBLAS sgemm
//    does not have this property: its results for a row change with m.
//    Weights stream once per call for any m, so decode stays bandwidth-bound.
//  - kBlas: OpenBLAS sgemm/sgemv. Faster for large prefills, but only
//    equivalent up to float rounding across batch compositions.
// Stateless and thread-safe; parallel over output columns with OpenMP.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "kernels/cpu/packed_gemm.h"

namespace pdserve::kernels {

// kBf16Dot: bf16 weights with bf16-rounded activations through AVX512-BF16
// (GemmNumerics::kBf16Dot in packed_gemm.h); kInt8Dot: int8 weights with
// int8 activations (per 32 values with int8-b32 weights, per row with per-row
// int8 weights), exact integer sums through AVX512-VNNI and AMX-INT8
// (GemmNumerics::kInt8Dot). Both are batch-invariant, with other numbers
// than kDeterministic; other dtypes run as kDeterministic.
enum class MatMulMode { kDeterministic, kBlas, kBf16Dot, kInt8Dot };
std::optional<MatMulMode> ParseMatMulMode(std::string_view s);

// x: [m, k] row-major, w: [n, k] row-major, y: [m, n] row-major (overwritten).
void MatMulNT(const float* __restrict__ x, int64_t m, int64_t k,
              const float* __restrict__ w, int64_t n, float* __restrict__ y,
              MatMulMode mode = MatMulMode::kDeterministic);

// A linear layer over a WeightMatrix: row-major fp32 matrices take `mode`
// (the kernels above); packed ones (any dtype) run GemmNT, whose order
// contract is in packed_gemm.h, with kBf16Dot numerics in that mode.
// y: [m, w.rows()].
void MatMulNT(const float* __restrict__ x, int64_t m, int64_t k,
              const WeightMatrix& w, float* __restrict__ y,
              MatMulMode mode = MatMulMode::kDeterministic);

// The fixed-order dot product of the row-major deterministic kernel (also
// used by attention scores), exposed for tests.
float DotFixedOrder(const float* a, const float* b, int64_t k);

// y[i * ldy + j] = DotFixedOrder(x + i * ldx, w + j * ldw, k) for i < m,
// j < n, bit for bit, computed in register tiles on the calling thread (no
// OpenMP): for attention scores of a query group against a KV block.
void DotsFixedOrder(const float* x, int64_t m, int64_t ldx, const float* w,
                    int64_t n, int64_t ldw, int64_t k, float* y, int64_t ldy);

// Sets the threads used by kernels (OpenMP) and OpenBLAS. <= 0 keeps defaults.
void SetKernelThreads(int threads);
// The threads the next parallel kernel uses: the source's answer when one is
// set, else SetKernelThreads's count (the cores when none was set).
int KernelThreads();

// Decides, kernel by kernel, how many threads this process may use now (a
// CoreShare lends the cores of idle neighbours). Results never depend on it:
// the kernels' order contract makes every thread count give the same bits.
class KernelThreadSource {
 public:
  virtual ~KernelThreadSource() = default;
  virtual int Threads() const = 0;
};
// `source` must outlive its use; nullptr goes back to SetKernelThreads's
// count. OpenMP and OpenBLAS keep SetKernelThreads's count.
void SetKernelThreadSource(const KernelThreadSource* source);

}  // namespace pdserve::kernels
