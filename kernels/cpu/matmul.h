// Linear-layer products on the CPU: y[m, n] = x[m, k] · w[n, k]ᵀ (weights in
// Hugging Face [out, in] layout, row-major).
//
// Two implementations:
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

namespace pdserve::kernels {

enum class MatMulMode { kDeterministic, kBlas };
std::optional<MatMulMode> ParseMatMulMode(std::string_view s);

// x: [m, k] row-major, w: [n, k] row-major, y: [m, n] row-major (overwritten).
void MatMulNT(const float* __restrict__ x, int64_t m, int64_t k,
              const float* __restrict__ w, int64_t n, float* __restrict__ y,
              MatMulMode mode = MatMulMode::kDeterministic);

// The fixed-order dot product every deterministic kernel uses (also used by
// attention scores), exposed for tests.
float DotFixedOrder(const float* a, const float* b, int64_t k);

// Sets the threads used by kernels (OpenMP) and OpenBLAS. <= 0 keeps defaults.
void SetKernelThreads(int threads);
int KernelThreads();

}  // namespace pdserve::kernels
