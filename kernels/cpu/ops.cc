#include "kernels/cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/task_pool.h"

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
    double sum_sq = 0;
    for (int64_t i = 0; i < dim; ++i)
      sum_sq += static_cast<double>(in[i]) * in[i];
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

void SiluAndMul(const float* gate_up, int64_t rows, int64_t inter, float* out) {
  ForRows(rows, [&](int64_t r) {
    const float* g = gate_up + r * 2 * inter;
    const float* u = g + inter;
    float* o = out + r * inter;
    for (int64_t i = 0; i < inter; ++i)
      o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
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
