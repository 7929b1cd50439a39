#include "kernels/cpu/fma_peak.h"

// GCC 12's avx512fintrin.h (_mm512_reduce_add_ps) trips -Wuninitialized on
// its own placeholders.
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/task_pool.h"

namespace pdserve::kernels {
namespace {

// 12 independent chains (> FMA latency x FMA ports), held in named
// registers: an array would be kept in memory and time loads and stores.
constexpr int kChains = 12;

#define PDSERVE_FMA12(FMA) \
  c0 = FMA(c0, a, b);      \
  c1 = FMA(c1, a, b);      \
  c2 = FMA(c2, a, b);      \
  c3 = FMA(c3, a, b);      \
  c4 = FMA(c4, a, b);      \
  c5 = FMA(c5, a, b);      \
  c6 = FMA(c6, a, b);      \
  c7 = FMA(c7, a, b);      \
  c8 = FMA(c8, a, b);      \
  c9 = FMA(c9, a, b);      \
  c10 = FMA(c10, a, b);    \
  c11 = FMA(c11, a, b)

__attribute__((target("avx512f"))) double RunAvx512(int64_t iters) {
  __m512 c0 = _mm512_set1_ps(0.1f), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0,
         c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it) {
    PDSERVE_FMA12(_mm512_fmadd_ps);
    __asm__ volatile(""
                     : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4),
                       "+v"(c5), "+v"(c6), "+v"(c7), "+v"(c8), "+v"(c9),
                       "+v"(c10), "+v"(c11));
  }
  const __m512 s = _mm512_add_ps(
      _mm512_add_ps(
          _mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
          _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7))),
      _mm512_add_ps(_mm512_add_ps(c8, c9), _mm512_add_ps(c10, c11)));
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx2,fma"))) double RunAvx2(int64_t iters) {
  __m256 c0 = _mm256_set1_ps(0.1f), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0,
         c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it) {
    PDSERVE_FMA12(_mm256_fmadd_ps);
    __asm__ volatile(""
                     : "+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3), "+x"(c4),
                       "+x"(c5), "+x"(c6), "+x"(c7), "+x"(c8), "+x"(c9),
                       "+x"(c10), "+x"(c11));
  }
  alignas(32) float out[8];
  const __m256 s = _mm256_add_ps(
      _mm256_add_ps(
          _mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)),
          _mm256_add_ps(_mm256_add_ps(c4, c5), _mm256_add_ps(c6, c7))),
      _mm256_add_ps(_mm256_add_ps(c8, c9), _mm256_add_ps(c10, c11)));
  _mm256_store_ps(out, s);
  return out[0];
}

double RunPortable(int64_t iters) {
  volatile float av = 0.999999f, bv = 1e-7f;
  const float a = av, b = bv;
  float c0 = 0.1f, c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0,
        c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
  auto fma = [](float x, float y, float z) { return std::fma(x, y, z); };
  for (int64_t it = 0; it < iters; ++it) {
    PDSERVE_FMA12(fma);
  }
  return c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7 + c8 + c9 + c10 + c11;
}

__attribute__((target("avx512f,avx512bf16"))) double RunBf16Dot(int64_t iters) {
  __m512 c0 = _mm512_set1_ps(0.1f), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0,
         c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f7f3f7f);  // ~0.996 pairs
  const __m512bh b = (__m512bh)_mm512_set1_epi32(0x33d633d6);  // ~1e-7 pairs
#define PDSERVE_DPBF16(c, x, y) _mm512_dpbf16_ps(c, x, y)
  for (int64_t it = 0; it < iters; ++it) {
    PDSERVE_FMA12(PDSERVE_DPBF16);
    __asm__ volatile(""
                     : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4),
                       "+v"(c5), "+v"(c6), "+v"(c7), "+v"(c8), "+v"(c9),
                       "+v"(c10), "+v"(c11));
  }
  const __m512 s = _mm512_add_ps(
      _mm512_add_ps(
          _mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
          _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7))),
      _mm512_add_ps(_mm512_add_ps(c8, c9), _mm512_add_ps(c10, c11)));
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx512f,avx512vnni"))) double RunInt8Dot(int64_t iters) {
  __m512i c0 = _mm512_set1_epi32(1), c1 = c0, c2 = c0, c3 = c0, c4 = c0,
          c5 = c0, c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-1);
#define PDSERVE_DPBUSD(c, x, y) _mm512_dpbusd_epi32(c, x, y)
  for (int64_t it = 0; it < iters; ++it) {
    PDSERVE_FMA12(PDSERVE_DPBUSD);
    __asm__ volatile(""
                     : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4),
                       "+v"(c5), "+v"(c6), "+v"(c7), "+v"(c8), "+v"(c9),
                       "+v"(c10), "+v"(c11));
  }
  const __m512i s = _mm512_add_epi32(
      _mm512_add_epi32(
          _mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)),
          _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(c6, c7))),
      _mm512_add_epi32(_mm512_add_epi32(c8, c9), _mm512_add_epi32(c10, c11)));
  return static_cast<double>(_mm512_reduce_add_epi32(s));
}

// AVX-VNNI: the 256-bit VEX VPDPBUSD, 12 chains.
__attribute__((target("avx2,avxvnni"))) double RunAvxVnni(int64_t iters) {
  __m256i c0 = _mm256_set1_epi32(1), c1 = c0, c2 = c0, c3 = c0, c4 = c0,
          c5 = c0, c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-1);
#define PDSERVE_DPBUSD_VEX(c, x, y) _mm256_dpbusd_avx_epi32(c, x, y)
  for (int64_t it = 0; it < iters; ++it) {
    PDSERVE_FMA12(PDSERVE_DPBUSD_VEX);
    __asm__ volatile(""
                     : "+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3), "+x"(c4),
                       "+x"(c5), "+x"(c6), "+x"(c7), "+x"(c8), "+x"(c9),
                       "+x"(c10), "+x"(c11));
  }
  __m256i s = _mm256_add_epi32(
      _mm256_add_epi32(
          _mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
          _mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(c6, c7))),
      _mm256_add_epi32(_mm256_add_epi32(c8, c9), _mm256_add_epi32(c10, c11)));
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), s);
  double sum = 0;
  for (const int32_t v : lanes) sum += v;
  return sum;
}

// AVX2 without VNNI: the kernel's exact int8 dot of 32 byte pairs
// (VPSIGNB, VPMADDUBSW, VPMADDWD by ones, VPADDD), 10 chains. Each chain's
// signs come from its own accumulator, so no chain shares an instruction
// with another and none can be hoisted out of the loop.
#define PDSERVE_AVX2DOT10(X) \
  X(c0);                     \
  X(c1);                     \
  X(c2);                     \
  X(c3);                     \
  X(c4);                     \
  X(c5);                     \
  X(c6);                     \
  X(c7);                     \
  X(c8);                     \
  X(c9)
constexpr int kAvx2DotChains = 10;
__attribute__((target("avx2"))) double RunAvx2Dot(int64_t iters) {
  __m256i c0 = _mm256_set1_epi32(1), c1 = c0, c2 = c0, c3 = c0, c4 = c0,
          c5 = c0, c6 = c0, c7 = c0, c8 = c0, c9 = c0;
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-1);
  const __m256i ones = _mm256_set1_epi16(1);
#define PDSERVE_AVX2DOT_STEP(c)                                             \
  c = _mm256_add_epi32(                                                     \
      c, _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(b, c)), \
                           ones))
  for (int64_t it = 0; it < iters; ++it) {
    PDSERVE_AVX2DOT10(PDSERVE_AVX2DOT_STEP);
    __asm__ volatile(""
                     : "+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3), "+x"(c4),
                       "+x"(c5), "+x"(c6), "+x"(c7), "+x"(c8), "+x"(c9));
  }
#undef PDSERVE_AVX2DOT_STEP
  const __m256i s = _mm256_add_epi32(
      _mm256_add_epi32(
          _mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
          _mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(c6, c7))),
      _mm256_add_epi32(c8, c9));
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), s);
  double sum = 0;
  for (const int32_t v : lanes) sum += v;
  return sum;
}

// AMX-INT8: 4 independent C tiles (16 x 16 int32) from 2 A tiles (16 rows x
// k_bytes) and 2 B tiles (k_bytes / 4 rows x 64 bytes), loaded once; per
// iteration 4 TDPBSSD. The tile configuration is per thread, so each thread
// loads it here.
double RunAmxInt8(int64_t iters, int k_bytes) {
  struct alignas(64) {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    const bool b = t == 2 || t == 3;
    cfg.rows[t] = static_cast<uint8_t>(b ? k_bytes / 4 : 16);
    cfg.colsb[t] = static_cast<uint16_t>(t < 2 ? k_bytes : 64);
  }
  alignas(64) int8_t data[16 * 64];
  for (int i = 0; i < 16 * 64; ++i) data[i] = static_cast<int8_t>(i % 7 - 3);
  alignas(64) int32_t out[16 * 16];
  const long stride = 64;
  __asm__ volatile(
      "ldtilecfg %0\n\t"
      "tileloadd (%1,%2,1), %%tmm0\n\t"
      "tileloadd (%1,%2,1), %%tmm1\n\t"
      "tileloadd (%1,%2,1), %%tmm2\n\t"
      "tileloadd (%1,%2,1), %%tmm3\n\t"
      "tilezero %%tmm4\n\t"
      "tilezero %%tmm5\n\t"
      "tilezero %%tmm6\n\t"
      "tilezero %%tmm7" ::"m"(cfg),
      "r"(data), "r"(stride)
      : "memory");
  for (int64_t it = 0; it < iters; ++it) {
    __asm__ volatile(
        "tdpbssd %%tmm2, %%tmm0, %%tmm4\n\t"
        "tdpbssd %%tmm3, %%tmm0, %%tmm5\n\t"
        "tdpbssd %%tmm2, %%tmm1, %%tmm6\n\t"
        "tdpbssd %%tmm3, %%tmm1, %%tmm7" ::);
  }
  __asm__ volatile(
      "tilestored %%tmm4, (%0,%1,1)\n\t"
      "tilerelease" ::"r"(out),
      "r"(stride)
      : "memory");
  return static_cast<double>(out[0]);
}

#undef PDSERVE_DPBUSD
#undef PDSERVE_DPBF16
#undef PDSERVE_FMA12

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

// GFLOP/s of `run` (flops_per_iter per thread per iteration) on `threads`.
template <typename Run>
double Measure(Run run, double flops_per_iter, int threads, double seconds) {
  threads = std::max(1, threads);
  // Calibrate one thread's iterations to ~seconds/3.
  int64_t iters = 1 << 16;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    volatile double sink = run(iters);
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
    std::vector<double> sums(threads, 0.0);
    RunOnOwnThreads(threads, [&](int i) { sums[i] = run(iters); });
    double sum = 0;
    for (double v : sums) sum += v;
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count();
    volatile double sink = sum;
    (void)sink;
    best = std::max(
        best, flops_per_iter * static_cast<double>(iters) * threads / s / 1e9);
  }
  return best;
}

}  // namespace

double MeasureFmaPeakGflops(GemmIsa isa, int threads, double seconds) {
  if (!GemmIsaSupported(isa)) return 0;
  return Measure([isa](int64_t iters) { return Run(isa, iters); },
                 2.0 * kChains * Lanes(isa), threads, seconds);
}

double MeasureBf16DotPeakGflops(int threads, double seconds) {
  if (!DetectCpuFeatures().avx512bf16) return 0;
  // One VDPBF16PS: 16 lanes x 2 products x (multiply + add).
  return Measure(RunBf16Dot, 64.0 * kChains, threads, seconds);
}

double MeasureInt8DotPeakGops(int threads, double seconds) {
  const CpuFeatures& f = DetectCpuFeatures();
  if (!f.avx512f || !f.avx512vnni) return 0;
  // One VPDPBUSD: 16 lanes x 4 products x (multiply + add).
  return Measure(RunInt8Dot, 128.0 * kChains, threads, seconds);
}

double MeasureAvxVnniPeakGops(int threads, double seconds) {
  const CpuFeatures& f = DetectCpuFeatures();
  if (!f.avx2 || !f.avxvnni) return 0;
  // One 256-bit VPDPBUSD: 8 lanes x 4 products x (multiply + add).
  return Measure(RunAvxVnni, 64.0 * kChains, threads, seconds);
}

double MeasureAvx2DotPeakGops(int threads, double seconds) {
  const CpuFeatures& f = DetectCpuFeatures();
  if (!f.avx2) return 0;
  // One sequence: 32 products x (multiply + add), as a 256-bit VPDPBUSD.
  return Measure(RunAvx2Dot, 64.0 * kAvx2DotChains, threads, seconds);
}

double MeasureAmxInt8PeakGops(int threads, double seconds, int k_bytes) {
  const CpuFeatures& f = DetectCpuFeatures();
  if (!f.amx_int8 || !f.amx_usable) return 0;
  k_bytes = std::clamp(k_bytes / 4 * 4, 4, 64);
  // One TDPBSSD: 16 x 16 outputs x k_bytes products x (multiply + add).
  return Measure(
      [k_bytes](int64_t iters) { return RunAmxInt8(iters, k_bytes); },
      4.0 * 16 * 16 * k_bytes * 2, threads, seconds);
}

}  // namespace pdserve::kernels
