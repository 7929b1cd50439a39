#include "kernels/cpu/matmul.h"

#include <cblas.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>

namespace pdserve::kernels {
namespace {

constexpr int kLanes = 8;

// Fixed lane reduction: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), then the k tail
// in order. Both the AVX2 and the portable kernel end through this function,
// so they agree bit for bit.
inline float FinishDot(const float lanes[kLanes], const float* a,
                       const float* b, int64_t k8, int64_t k) {
  const float s04 = lanes[0] + lanes[4], s26 = lanes[2] + lanes[6];
  const float s15 = lanes[1] + lanes[5], s37 = lanes[3] + lanes[7];
  float s = (s04 + s26) + (s15 + s37);
  for (int64_t i = k8; i < k; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

float DotPortable(const float* a, const float* b, int64_t k) {
  float lanes[kLanes] = {0};
  const int64_t k8 = k & ~int64_t{kLanes - 1};
  for (int64_t i = 0; i < k8; i += kLanes) {
    for (int l = 0; l < kLanes; ++l)
      lanes[l] = std::fma(a[i + l], b[i + l], lanes[l]);
  }
  return FinishDot(lanes, a, b, k8, k);
}

// Register tile: MR rows of x against NR rows of w, one 8-lane accumulator per
// output element, so the per-element order matches DotPortable exactly.
template <int MR, int NR>
__attribute__((target("avx2,fma"))) void TileAvx2(const float* x, int64_t ldx,
                                                  const float* w, int64_t ldw,
                                                  int64_t k, float* y,
                                                  int64_t ldy) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t k8 = k & ~int64_t{kLanes - 1};
  for (int64_t p = 0; p < k8; p += kLanes) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * ldw + p);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + p);
      for (int j = 0; j < NR; ++j)
        acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  alignas(32) float lanes[kLanes];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      _mm256_store_ps(lanes, acc[i][j]);
      y[i * ldy + j] = FinishDot(lanes, x + i * ldx, w + j * ldw, k8, k);
    }
  }
}

__attribute__((target("avx2,fma"))) float DotAvx2(const float* a,
                                                  const float* b, int64_t k) {
  float y;
  TileAvx2<1, 1>(a, k, b, k, k, &y, 1);
  return y;
}

bool HasAvx2() {
  static const bool has =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

// Rows [0, m) of x against NR rows of w at a time, in register tiles.
template <int NR>
void DotColumns(const float* x, int64_t m, int64_t ldx, const float* w,
                int64_t ldw, int64_t k, float* y, int64_t ldy) {
  int64_t i = 0;
  for (; i + 4 <= m; i += 4)
    TileAvx2<4, NR>(x + i * ldx, ldx, w, ldw, k, y + i * ldy, ldy);
  for (; i < m; ++i)
    TileAvx2<1, NR>(x + i * ldx, ldx, w, ldw, k, y + i * ldy, ldy);
}

// Computes y[:, n0:n1] for all m rows. Rows of x are visited in blocks that
// stay in L2 while a few weight rows sit in L1.
void DeterministicPanel(const float* x, int64_t m, int64_t k, const float* w,
                        int64_t n0, int64_t n1, float* y, int64_t n) {
  constexpr int64_t kRowBlock = 64;
  for (int64_t i0 = 0; i0 < m; i0 += kRowBlock) {
    DotsFixedOrder(x + i0 * k, std::min(kRowBlock, m - i0), k, w + n0 * k,
                   n1 - n0, k, k, y + i0 * n + n0, n);
  }
}

int& ThreadsSetting() {
  static int threads = 0;
  return threads;
}

std::atomic<const KernelThreadSource*>& ThreadSource() {
  static std::atomic<const KernelThreadSource*> source{nullptr};
  return source;
}

}  // namespace

std::optional<MatMulMode> ParseMatMulMode(std::string_view s) {
  if (s == "deterministic") return MatMulMode::kDeterministic;
  if (s == "blas") return MatMulMode::kBlas;
  if (s == "bf16dot") return MatMulMode::kBf16Dot;
  if (s == "int8dot") return MatMulMode::kInt8Dot;
  return std::nullopt;
}

float DotFixedOrder(const float* a, const float* b, int64_t k) {
  return HasAvx2() ? DotAvx2(a, b, k) : DotPortable(a, b, k);
}

void DotsFixedOrder(const float* x, int64_t m, int64_t ldx, const float* w,
                    int64_t n, int64_t ldw, int64_t k, float* y, int64_t ldy) {
  if (!HasAvx2()) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j)
        y[i * ldy + j] = DotPortable(x + i * ldx, w + j * ldw, k);
    return;
  }
  int64_t j = 0;
  for (; j + 3 <= n; j += 3)
    DotColumns<3>(x, m, ldx, w + j * ldw, ldw, k, y + j, ldy);
  for (; j < n; ++j) DotColumns<1>(x, m, ldx, w + j * ldw, ldw, k, y + j, ldy);
}

void SetKernelThreads(int threads) {
  if (threads <= 0) return;
  ThreadsSetting() = threads;
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);
}

void SetKernelThreadSource(const KernelThreadSource* source) {
  ThreadSource().store(source, std::memory_order_release);
}

int KernelThreads() {
  if (const KernelThreadSource* s =
          ThreadSource().load(std::memory_order_acquire))
    return s->Threads();
  return ThreadsSetting() > 0 ? ThreadsSetting() : omp_get_max_threads();
}

void MatMulNT(const float* __restrict__ x, int64_t m, int64_t k,
              const float* __restrict__ w, int64_t n, float* __restrict__ y,
              MatMulMode mode) {
  if (m <= 0 || n <= 0) return;
  if (mode == MatMulMode::kBlas) {
    if (m == 1) {
      cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, 1.0f, w, k, x, 1, 0.0f, y,
                  1);
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, x, k,
                  w, k, 0.0f, y, n);
    }
    return;
  }
  // Column panels of 48 weight rows (a multiple of the 3-row tile) balance
  // threads while each panel's weights stay cache-resident across row blocks.
  constexpr int64_t kPanel = 48;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int threads =
      static_cast<int>(std::min<int64_t>(KernelThreads(), panels));
#pragma omp parallel for schedule(static) \
    num_threads(threads) if (threads > 1 && m * n * k > (1 << 16))
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t n0 = p * kPanel;
    DeterministicPanel(x, m, k, w, n0, std::min(n, n0 + kPanel), y, n);
  }
}

void MatMulNT(const float* __restrict__ x, int64_t m, int64_t k,
              const WeightMatrix& w, float* __restrict__ y, MatMulMode mode) {
  if (w.layout() == WeightMatrix::Layout::kRowMajorF32) {
    MatMulNT(x, m, k, w.row_major(), w.rows(), y,
             mode == MatMulMode::kBlas ? mode : MatMulMode::kDeterministic);
  } else {
    GemmNT(x, m, k, w, y,
           mode == MatMulMode::kBf16Dot   ? GemmNumerics::kBf16Dot
           : mode == MatMulMode::kInt8Dot ? GemmNumerics::kInt8Dot
                                          : GemmNumerics::kFp32Chain);
  }
}

}  // namespace pdserve::kernels
