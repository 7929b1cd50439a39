#include "kernels/cpu/ops.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
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

}  // namespace

void RmsNorm(const float* x, float* residual, const float* weight, int64_t rows,
             int64_t dim, float eps, float* out) {
  ForRows(rows, [&](int64_t r) {
    const float* in = x + r * dim;
    if (residual != nullptr) {
      float* res = residual + r * dim;
      for (int64_t i = 0; i < dim; ++i) res[i] += in[i];
      in = res;
    }
    // Eight running sums (element i into sum i % 8), added in a fixed tree:
    // a fixed order, so every row, batch and thread count gives the same
    // bits, without one add waiting on the last for the whole row.
    double part[8] = {};
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
      for (int j = 0; j < 8; ++j)
        part[j] += static_cast<double>(in[i + j]) * in[i + j];
    }
    for (int j = 0; i < dim; ++i, ++j)
      part[j] += static_cast<double>(in[i]) * in[i];
    const double sum_sq = ((part[0] + part[1]) + (part[2] + part[3])) +
                          ((part[4] + part[5]) + (part[6] + part[7]));
    const float inv = static_cast<float>(1.0 / std::sqrt(sum_sq / dim + eps));
    float* o = out + r * dim;
    for (int64_t i = 0; i < dim; ++i) o[i] = in[i] * inv * weight[i];
  });
}

void ApplyRope(float* x, int64_t rows, int64_t heads, int64_t head_dim,
               const int32_t* positions, const float* inv_freq) {
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
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + (r * heads + h) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cos_t[i] - b * sin_t[i];
        v[i + half] = b * cos_t[i] + a * sin_t[i];
      }
    }
  });
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

bool SetSiluIsa(SiluIsa isa) {
  const CpuFeatures& f = DetectCpuFeatures();
  switch (isa) {
    case SiluIsa::kBest:
      ActiveSiluMulRow() = BestSiluMulRow();
      return true;
    case SiluIsa::kPortable:
      ActiveSiluMulRow() = SiluMulRowPortable;
      return true;
    case SiluIsa::kAvx2:
      if (!f.avx2 || !f.fma) return false;
      ActiveSiluMulRow() = SiluMulRowAvx2;
      return true;
    case SiluIsa::kAvx512:
      if (!f.avx512f) return false;
      ActiveSiluMulRow() = SiluMulRowAvx512;
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
