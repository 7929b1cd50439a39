#include "kernels/cpu/ops.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/task_pool.h"
#include "kernels/cpu/vec_exp.h"

namespace pdserve::kernels {

namespace {

// Rows in chunks over the calling thread and the awake kernel helpers
// (task_pool.h) from 17 rows on; each row's result depends only on the row.
template <typename RowFn>
void ForRows(int64_t rows, RowFn&& row_fn) {
  RunChunks(rows, std::max<int64_t>(8, rows / 32),
            rows > 16 ? KernelThreads() : 1,
            [&](int64_t begin, int64_t end, bool) {
              for (int64_t r = begin; r < end; ++r) row_fn(r);
            });
}

// RmsNorm sums a row's squares in eight running double sums (element i into
// sum i % 8), added in a fixed tree. A float's square is exact in double, so
// the AVX2 and AVX-512 rows below, which keep the eight sums in vector lanes,
// give the same bits as the portable row; so does every row, batch and
// thread count.

// Elements i.. of a row (i a multiple of 8): residual (if any) += x, and each
// element's square into its running sum.
void SquaresFrom(const float* x, float* residual, int64_t i, int64_t dim,
                 double part[8]) {
  const float* in = residual != nullptr ? residual : x;
  for (; i < dim; ++i) {
    if (residual != nullptr) residual[i] += x[i];
    part[i % 8] += static_cast<double>(in[i]) * in[i];
  }
}

// 1 / sqrt(mean square + eps) from the eight running sums.
float InverseRms(const double part[8], int64_t dim, float eps) {
  const double sum_sq = ((part[0] + part[1]) + (part[2] + part[3])) +
                        ((part[4] + part[5]) + (part[6] + part[7]));
  return static_cast<float>(1.0 / std::sqrt(sum_sq / dim + eps));
}

// One row of RmsNorm: residual (if any) += x, then out = in * inv * weight.
void RmsNormRowPortable(const float* x, float* residual, const float* weight,
                        int64_t dim, float eps, float* out) {
  double part[8] = {};
  SquaresFrom(x, residual, 0, dim, part);
  const float inv = InverseRms(part, dim, eps);
  const float* in = residual != nullptr ? residual : x;
  for (int64_t i = 0; i < dim; ++i) out[i] = in[i] * inv * weight[i];
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC bug 105593
#pragma GCC diagnostic ignored "-Wuninitialized"

// Elements i..i+7 of the row: x[i..], or residual[i..] += x[i..] (stored)
// when there is a residual.
__attribute__((target("avx2"))) inline __m256 NextEight(const float* x,
                                                        float* residual,
                                                        int64_t i) {
  const __m256 v = _mm256_loadu_ps(x + i);
  if (residual == nullptr) return v;
  const __m256 r = _mm256_add_ps(_mm256_loadu_ps(residual + i), v);
  _mm256_storeu_ps(residual + i, r);
  return r;
}

__attribute__((target("avx512f"))) void RmsNormRowAvx512(const float* x,
                                                         float* residual,
                                                         const float* weight,
                                                         int64_t dim, float eps,
                                                         float* out) {
  const float* in = residual != nullptr ? residual : x;
  __m512d acc = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= dim; i += 8) {
    const __m512d d = _mm512_cvtps_pd(NextEight(x, residual, i));
    acc = _mm512_add_pd(acc, _mm512_mul_pd(d, d));
  }
  alignas(64) double part[8];
  _mm512_store_pd(part, acc);
  SquaresFrom(x, residual, i, dim, part);
  const __m512 inv = _mm512_set1_ps(InverseRms(part, dim, eps));
  for (i = 0; i + 16 <= dim; i += 16) {
    _mm512_storeu_ps(out + i,
                     _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(in + i), inv),
                                   _mm512_loadu_ps(weight + i)));
  }
  if (i < dim) {
    const __mmask16 m = static_cast<__mmask16>((1u << (dim - i)) - 1);
    _mm512_mask_storeu_ps(
        out + i, m,
        _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, in + i), inv),
                      _mm512_maskz_loadu_ps(m, weight + i)));
  }
}

__attribute__((target("avx2"))) void RmsNormRowAvx2(const float* x,
                                                    float* residual,
                                                    const float* weight,
                                                    int64_t dim, float eps,
                                                    float* out) {
  const float* in = residual != nullptr ? residual : x;
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= dim; i += 8) {
    const __m256 v = NextEight(x, residual, i);
    const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
    const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    lo = _mm256_add_pd(lo, _mm256_mul_pd(a, a));
    hi = _mm256_add_pd(hi, _mm256_mul_pd(b, b));
  }
  alignas(32) double part[8];
  _mm256_store_pd(part, lo);
  _mm256_store_pd(part + 4, hi);
  SquaresFrom(x, residual, i, dim, part);
  const float inv_s = InverseRms(part, dim, eps);
  const __m256 inv = _mm256_set1_ps(inv_s);
  for (i = 0; i + 8 <= dim; i += 8) {
    _mm256_storeu_ps(out + i,
                     _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(in + i), inv),
                                   _mm256_loadu_ps(weight + i)));
  }
  for (; i < dim; ++i) out[i] = in[i] * inv_s * weight[i];
}

#pragma GCC diagnostic pop

using RmsNormRowFn = void (*)(const float*, float*, const float*, int64_t,
                              float, float*);

RmsNormRowFn BestRmsNormRow() {
  const CpuFeatures& f = DetectCpuFeatures();
  if (f.avx512f) return RmsNormRowAvx512;
  if (f.avx2) return RmsNormRowAvx2;
  return RmsNormRowPortable;
}

RmsNormRowFn& ActiveRmsNormRow() {
  static RmsNormRowFn fn = BestRmsNormRow();
  return fn;
}

}  // namespace

void RmsNorm(const float* x, float* residual, const float* weight, int64_t rows,
             int64_t dim, float eps, float* out) {
  const RmsNormRowFn row = ActiveRmsNormRow();
  ForRows(rows, [&](int64_t r) {
    row(x + r * dim, residual != nullptr ? residual + r * dim : nullptr, weight,
        dim, eps, out + r * dim);
  });
}

void SplitQkv(float* qkv, const float* bias, int64_t rows, int64_t q_dim,
              int64_t kv_dim, float* q, float* k, float* v) {
  const int64_t qkv_dim = q_dim + 2 * kv_dim;
  ForRows(rows, [&](int64_t r) {
    float* src = qkv + r * qkv_dim;
    if (bias != nullptr) {
      for (int64_t i = 0; i < qkv_dim; ++i) src[i] += bias[i];
    }
    std::memcpy(q + r * q_dim, src, q_dim * sizeof(float));
    std::memcpy(k + r * kv_dim, src + q_dim, kv_dim * sizeof(float));
    std::memcpy(v + r * kv_dim, src + q_dim + kv_dim, kv_dim * sizeof(float));
  });
}

void ApplyRope(float* q, int64_t q_heads, float* k, int64_t k_heads,
               int64_t rows, int64_t head_dim, const int32_t* positions,
               const float* inv_freq) {
  const int64_t half = head_dim / 2;
  ForRows(rows, [&](int64_t r) {
    float cos_t[512],
        sin_t[512];  // head_dim <= 1024 is validated by the model config
    const float pos = static_cast<float>(positions[r]);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = pos * inv_freq[i];
      cos_t[i] = std::cos(angle);
      sin_t[i] = std::sin(angle);
    }
    auto rotate = [&](float* x, int64_t heads) {
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x + (r * heads + h) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * cos_t[i] - b * sin_t[i];
          v[i + half] = b * cos_t[i] + a * sin_t[i];
        }
      }
    };
    rotate(q, q_heads);
    if (k != nullptr) rotate(k, k_heads);
  });
}

void ApplyRope(float* x, int64_t rows, int64_t heads, int64_t head_dim,
               const int32_t* positions, const float* inv_freq) {
  ApplyRope(x, heads, nullptr, 0, rows, head_dim, positions, inv_freq);
}

namespace {

// SiLU(g) * u with e = Exp(-|g|) (vec_exp.h, so the argument is never
// positive): g / (1 + e) * u for g >= 0 and (g * e) / (1 + e) * u below, one
// IEEE operation at a time, so the portable, AVX2 and AVX-512 rows agree bit
// for bit (this file is built with -ffp-contract=off).
float SiluMulOne(float g, float u) {
  const float e = vec_exp::ExpPortable(-std::fabs(g));
  const float num = g >= 0.0f ? g : g * e;
  return num / (1.0f + e) * u;
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC bug 105593
#pragma GCC diagnostic ignored "-Wuninitialized"

__attribute__((target("avx512f"))) void SiluMulRowAvx512(const float* g,
                                                         const float* u,
                                                         int64_t n, float* o) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    // -|x|: the sign bit set.
    const __m512 e = vec_exp::Exp16(_mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(x), _mm512_castps_si512(sign))));
    const __mmask16 neg =
        _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 num = _mm512_mask_mul_ps(x, neg, x, e);
    _mm512_storeu_ps(o + i,
                     _mm512_mul_ps(_mm512_div_ps(num, _mm512_add_ps(one, e)),
                                   _mm512_loadu_ps(u + i)));
  }
  for (; i < n; ++i) o[i] = SiluMulOne(g[i], u[i]);
}

__attribute__((target("avx2,fma"))) void SiluMulRowAvx2(const float* g,
                                                        const float* u,
                                                        int64_t n, float* o) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = vec_exp::Exp8(_mm256_or_ps(x, sign));
    const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), neg);
    _mm256_storeu_ps(o + i,
                     _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(one, e)),
                                   _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) o[i] = SiluMulOne(g[i], u[i]);
}

#pragma GCC diagnostic pop

void SiluMulRowPortable(const float* g, const float* u, int64_t n, float* o) {
  for (int64_t i = 0; i < n; ++i) o[i] = SiluMulOne(g[i], u[i]);
}

using SiluMulRowFn = void (*)(const float*, const float*, int64_t, float*);

SiluMulRowFn BestSiluMulRow() {
  const CpuFeatures& f = DetectCpuFeatures();
  if (f.avx512f) return SiluMulRowAvx512;
  if (f.avx2 && f.fma) return SiluMulRowAvx2;
  return SiluMulRowPortable;
}

SiluMulRowFn& ActiveSiluMulRow() {
  static SiluMulRowFn fn = BestSiluMulRow();
  return fn;
}

}  // namespace

bool SetOpsIsa(OpsIsa isa) {
  const CpuFeatures& f = DetectCpuFeatures();
  switch (isa) {
    case OpsIsa::kBest:
      ActiveSiluMulRow() = BestSiluMulRow();
      ActiveRmsNormRow() = BestRmsNormRow();
      return true;
    case OpsIsa::kPortable:
      ActiveSiluMulRow() = SiluMulRowPortable;
      ActiveRmsNormRow() = RmsNormRowPortable;
      return true;
    case OpsIsa::kAvx2:
      if (!f.avx2 || !f.fma) return false;
      ActiveSiluMulRow() = SiluMulRowAvx2;
      ActiveRmsNormRow() = RmsNormRowAvx2;
      return true;
    case OpsIsa::kAvx512:
      if (!f.avx512f) return false;
      ActiveSiluMulRow() = SiluMulRowAvx512;
      ActiveRmsNormRow() = RmsNormRowAvx512;
      return true;
  }
  return false;
}

void SiluAndMul(const float* gate_up, int64_t rows, int64_t inter, float* out) {
  const SiluMulRowFn row = ActiveSiluMulRow();
  ForRows(rows, [&](int64_t r) {
    const float* g = gate_up + r * 2 * inter;
    row(g, g + inter, inter, out + r * inter);
  });
}

void SoftmaxInPlace(float* x, int64_t n) {
  if (n <= 0) return;
  const float mx = *std::max_element(x, x + n);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

std::vector<float> RopeInvFreq(int64_t head_dim, double theta,
                               const RopeScaling& scaling) {
  std::vector<float> inv(head_dim / 2);
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    inv[i] = static_cast<float>(1.0 / std::pow(theta, (2.0 * i) / head_dim));
  }
  if (scaling.factor > 0) {
    // Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and
    // the band between is interpolated smoothly.
    const double orig =
        static_cast<double>(scaling.original_max_position_embeddings);
    const double low_wavelen = orig / scaling.low_freq_factor;
    const double high_wavelen = orig / scaling.high_freq_factor;
    for (auto& f : inv) {
      const double wavelen = 2 * std::numbers::pi / f;
      if (wavelen > low_wavelen) {
        f = static_cast<float>(f / scaling.factor);
      } else if (wavelen >= high_wavelen) {
        const double smooth =
            (orig / wavelen - scaling.low_freq_factor) /
            (scaling.high_freq_factor - scaling.low_freq_factor);
        f = static_cast<float>((1 - smooth) * f / scaling.factor + smooth * f);
      }
    }
  }
  return inv;
}

}  // namespace pdserve::kernels
