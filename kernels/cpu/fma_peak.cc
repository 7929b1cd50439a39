#include "kernels/cpu/fma_peak.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>

namespace pdserve::kernels {
namespace {

constexpr int kChains = 16;  // > FMA latency x ports: throughput-bound

__attribute__((target("avx512f"))) double RunAvx512(int64_t iters) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it) {
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
    __asm__ volatile("" : "+v"(acc[0]), "+v"(acc[1]), "+v"(acc[2]),
                     "+v"(acc[3]));
  }
  __m512 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx2,fma"))) double RunAvx2(int64_t iters) {
  __m256 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(0.001f * i);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it) {
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
    __asm__ volatile("" : "+x"(acc[0]), "+x"(acc[1]), "+x"(acc[2]),
                     "+x"(acc[3]));
  }
  alignas(32) float out[8];
  __m256 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm256_add_ps(s, acc[i]);
  _mm256_store_ps(out, s);
  return out[0];
}

double RunPortable(int64_t iters) {
  float acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = 0.001f * i;
  volatile float av = 0.999999f, bv = 1e-7f;
  const float a = av, b = bv;
  for (int64_t it = 0; it < iters; ++it) {
    for (int i = 0; i < kChains; ++i) acc[i] = std::fma(acc[i], a, b);
  }
  float s = 0;
  for (float v : acc) s += v;
  return s;
}

int Lanes(GemmIsa isa) {
  return isa == GemmIsa::kAvx512 ? 16 : isa == GemmIsa::kAvx2 ? 8 : 1;
}

double Run(GemmIsa isa, int64_t iters) {
  switch (isa) {
    case GemmIsa::kAvx512:
      return RunAvx512(iters);
    case GemmIsa::kAvx2:
      return RunAvx2(iters);
    case GemmIsa::kPortable:
      return RunPortable(iters);
  }
  return 0;
}

}  // namespace

double MeasureFmaPeakGflops(GemmIsa isa, int threads, double seconds) {
  if (!GemmIsaSupported(isa)) return 0;
  threads = std::max(1, threads);
  // Calibrate one thread's iterations to ~seconds/3.
  int64_t iters = 1 << 16;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    volatile double sink = Run(isa, iters);
    (void)sink;
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count();
    if (s > seconds / 3 || iters > (int64_t{1} << 40)) break;
    iters *= 2;
  }
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    double sum = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sum)
    sum += Run(isa, iters);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count();
    volatile double sink = sum;
    (void)sink;
    const double flops =
        2.0 * kChains * Lanes(isa) * static_cast<double>(iters) * threads;
    best = std::max(best, flops / s / 1e9);
  }
  return best;
}

}  // namespace pdserve::kernels
