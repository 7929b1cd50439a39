#include "model/mla.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/kv_elem.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/task_pool.h"

namespace pdserve::engine {
namespace {

using kernels::LoadKvElem;
using kernels::QuantizeI8;
using kernels::StoreKvElem;

// DeepSeek's interleaved RoPE on one vector of `d` (even) values, in place:
// pair i is (x[2i], x[2i+1]); the result is de-interleaved as
// modeling_deepseek.py's apply_rotary_pos_emb leaves it.
void RopeInterleaved(float* x, int64_t d, const float* cos, const float* sin,
                     float* tmp, bool interleaved = true) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = interleaved ? x[2 * i] : x[i];
    const float b = interleaved ? x[2 * i + 1] : x[i + half];
    tmp[i] = a * cos[i] - b * sin[i];
    tmp[i + half] = b * cos[i] + a * sin[i];
  }
  std::memcpy(x, tmp, d * sizeof(float));
}

}  // namespace

int64_t MlaWeights::bytes() const {
  int64_t n =
      q_proj.bytes() + q_a_proj.bytes() + q_b_proj.bytes() + kv_a_proj.bytes();
  for (const auto& m : uk_t) n += m.bytes();
  for (const auto& m : uv) n += m.bytes();
  return n + static_cast<int64_t>((q_a_norm.size() + kv_a_norm.size()) *
                                  sizeof(float));
}

absl::Status LoadMlaWeights(const ModelConfig& c, int64_t layer,
                            const TensorFetch& fetch, const MatrixPack& pack,
                            MlaWeights* w, kernels::WeightMatrix* o_proj) {
  const std::string p = absl::StrCat("model.layers.", layer, ".self_attn.");
  const int64_t h = c.hidden_size, heads = c.num_heads;
  const int64_t nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim;
  const int64_t vd = c.v_head_dim, r = c.kv_lora_rank;
  const int64_t q_rows = heads * (nope + rope);
  std::vector<float> tmp;
  auto matrix = [&](const std::string& name, int64_t rows, int64_t cols,
                    kernels::WeightMatrix* out) -> absl::Status {
    tmp.clear();
    RETURN_IF_ERROR(fetch(p + name + ".weight", {rows, cols}, &tmp));
    *out = pack(tmp.data(), rows, cols);
    return absl::OkStatus();
  };
  if (c.q_lora_rank > 0) {
    RETURN_IF_ERROR(matrix("q_a_proj", c.q_lora_rank, h, &w->q_a_proj));
    RETURN_IF_ERROR(
        fetch(p + "q_a_layernorm.weight", {c.q_lora_rank}, &w->q_a_norm));
    RETURN_IF_ERROR(matrix("q_b_proj", q_rows, c.q_lora_rank, &w->q_b_proj));
  } else {
    RETURN_IF_ERROR(matrix("q_proj", q_rows, h, &w->q_proj));
  }
  RETURN_IF_ERROR(matrix("kv_a_proj_with_mqa", r + rope, h, &w->kv_a_proj));
  RETURN_IF_ERROR(fetch(p + "kv_a_layernorm.weight", {r}, &w->kv_a_norm));
  tmp.clear();
  RETURN_IF_ERROR(
      fetch(p + "kv_b_proj.weight", {heads * (nope + vd), r}, &tmp));
  const std::vector<float> kv_b = std::move(tmp);
  std::vector<float> part;
  for (int64_t hd = 0; hd < heads; ++hd) {
    const float* head = &kv_b[hd * (nope + vd) * r];  // [nope + v, R]
    part.assign(r * nope, 0.0f);                      // W_UK^T [R, nope]
    for (int64_t d = 0; d < nope; ++d) {
      for (int64_t j = 0; j < r; ++j) part[j * nope + d] = head[d * r + j];
    }
    w->uk_t.push_back(pack(part.data(), r, nope));
    w->uv.push_back(pack(head + nope * r, vd, r));  // W_UV [v, R]
  }
  tmp.clear();
  RETURN_IF_ERROR(fetch(p + "o_proj.weight", {h, heads * vd}, &tmp));
  *o_proj = pack(tmp.data(), h, heads * vd);
  return absl::OkStatus();
}

double YarnMscale(double factor, double mscale) {
  return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

std::vector<double> MlaRopeInvFreq(const ModelConfig& c) {
  const int64_t dim = c.qk_rope_head_dim, half = dim / 2;
  const double base = c.rope_theta;
  std::vector<double> inv(half);
  for (int64_t i = 0; i < half; ++i)
    inv[i] = 1.0 / std::pow(base, static_cast<double>(2 * i) / dim);
  const ModelConfig::Yarn& y = c.yarn;
  if (y.factor <= 0) return inv;
  // yarn_find_correction_range(beta_fast, beta_slow, dim, base, original).
  auto correction_dim = [&](double rotations) {
    return dim *
           std::log(y.original_max_position_embeddings /
                    (rotations * 2 * M_PI)) /
           (2 * std::log(base));
  };
  const double low = std::max(std::floor(correction_dim(y.beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(y.beta_slow)),
                         static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  for (int64_t i = 0; i < half; ++i) {
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double extra_mask = 1.0 - ramp;  // 1: keep the original frequency
    inv[i] = inv[i] / y.factor * (1.0 - extra_mask) + inv[i] * extra_mask;
  }
  return inv;
}

float MlaSoftmaxScale(const ModelConfig& c) {
  double scale =
      1.0 /
      std::sqrt(static_cast<double>(c.qk_nope_head_dim + c.qk_rope_head_dim));
  if (c.yarn.factor > 0 && c.yarn.mscale_all_dim != 0) {
    const double m = YarnMscale(c.yarn.factor, c.yarn.mscale_all_dim);
    scale *= m * m;
  }
  return static_cast<float>(scale);
}

void WriteLatentRows(const float* rows, int64_t num_tokens,
                     const int64_t* slots, const KvCacheSpec& spec, void* data,
                     float* scales) {
  const int64_t width = spec.head_dim, bs = spec.block_size;
  const int64_t parts[3] = {0, spec.kv_lora_rank, width};
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* src = rows + t * width;
    const int64_t block = slots[t] / bs, offset = slots[t] % bs;
    const int64_t base = block * bs * width, dst = base + offset * width;
    if (spec.dtype != DType::kI8) {
      for (int64_t i = 0; i < width; ++i)
        StoreKvElem(data, spec.dtype, dst + i, src[i]);
      continue;
    }
    int8_t* q = static_cast<int8_t*>(data);
    for (int part = 0; part < 2; ++part) {
      const int64_t lo = parts[part], hi = parts[part + 1];
      float& scale = scales[block * 2 + part];
      if (offset == 0) scale = 0;  // the block was just given to this sequence
      float amax = 0;
      for (int64_t i = lo; i < hi; ++i)
        amax = std::max(amax, std::fabs(src[i]));
      const float needed = amax / 127.0f;
      if (needed > scale) {
        // Requantise this part of the block's earlier rows to the new scale.
        if (scale > 0) {
          const float ratio = scale / needed;
          for (int64_t row = 0; row < offset; ++row) {
            int8_t* r = q + base + row * width;
            for (int64_t i = lo; i < hi; ++i) r[i] = QuantizeI8(r[i] * ratio);
          }
        }
        scale = needed;
      }
      const float inv = scale > 0 ? 1.0f / scale : 0.0f;
      for (int64_t i = lo; i < hi; ++i) q[dst + i] = QuantizeI8(src[i] * inv);
    }
  }
}

void ReadLatentBlock(const KvCacheSpec& spec, const void* data,
                     const float* scales, int64_t block, int count,
                     float* out) {
  const int64_t width = spec.head_dim;
  const int64_t base = block * spec.block_size * width;
  if (spec.dtype == DType::kF32) {
    std::memcpy(out, static_cast<const float*>(data) + base,
                count * width * sizeof(float));
    return;
  }
  for (int row = 0; row < count; ++row) {
    for (int64_t i = 0; i < width; ++i) {
      float v = LoadKvElem(data, spec.dtype, base + row * width + i);
      if (spec.dtype == DType::kI8)
        v *= scales[block * 2 + (i < spec.kv_lora_rank ? 0 : 1)];
      out[row * width + i] = v;
    }
  }
}

MlaAttention::MlaAttention(const ModelConfig& c)
    : c_(c), inv_freq_(MlaRopeInvFreq(c)), scale_(MlaSoftmaxScale(c)) {
  if (c.yarn.factor > 0) {
    rope_mscale_ =
        static_cast<float>(YarnMscale(c.yarn.factor, c.yarn.mscale) /
                           YarnMscale(c.yarn.factor, c.yarn.mscale_all_dim));
  }
}

void MlaAttention::Forward(
    const MlaWeights& w, const kernels::WeightMatrix& o_proj, const float* x,
    int64_t total, const int32_t* positions, const int64_t* slots,
    std::span<const kernels::AttentionSeq> seqs, KvPool* pool, int32_t layer,
    kernels::MatMulMode mode, const std::function<void()>& on_written,
    float* out) {
  const ModelConfig& c = c_;
  const int64_t hidden = c.hidden_size, heads = c.num_heads;
  const int64_t nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim;
  const int64_t vd = c.v_head_dim, r = c.kv_lora_rank, width = r + rope;
  const int64_t qh = nope + rope;  // q width of one head
  const float eps = static_cast<float>(c.rms_norm_eps);

  // Queries: [total, heads, nope | rope].
  q_.resize(total * heads * qh);
  if (!w.q_a_proj.empty()) {
    qa_.resize(total * c.q_lora_rank);
    kernels::MatMulNT(x, total, hidden, w.q_a_proj, qa_.data(), mode);
    kernels::RmsNorm(qa_.data(), nullptr, w.q_a_norm.data(), total,
                     c.q_lora_rank, eps, qa_.data());
    kernels::MatMulNT(qa_.data(), total, c.q_lora_rank, w.q_b_proj, q_.data(),
                      mode);
  } else {
    kernels::MatMulNT(x, total, hidden, w.q_proj, q_.data(), mode);
  }
  // The compressed KV: latent [R] (normed) and the shared rope key [rope].
  kv_a_.resize(total * width);
  kernels::MatMulNT(x, total, hidden, w.kv_a_proj, kv_a_.data(), mode);
  latent_.resize(total * r);
  for (int64_t t = 0; t < total; ++t)
    std::memcpy(&latent_[t * r], &kv_a_[t * width], r * sizeof(float));
  kernels::RmsNorm(latent_.data(), nullptr, w.kv_a_norm.data(), total, r, eps,
                   latent_.data());

  // RoPE of q_pe (every head) and k_pe, cos/sin scaled by YaRN's mscale.
  const int64_t half = rope / 2;
  std::vector<float> cos(half), sin(half), tmp(rope);
  rows_.resize(total * width);
  for (int64_t t = 0; t < total; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(positions[t]) * inv_freq_[i];
      cos[i] = static_cast<float>(std::cos(angle)) * rope_mscale_;
      sin[i] = static_cast<float>(std::sin(angle)) * rope_mscale_;
    }
    float* row = &rows_[t * width];
    std::memcpy(row, &latent_[t * r], r * sizeof(float));
    std::memcpy(row + r, &kv_a_[t * width + r], rope * sizeof(float));
    RopeInterleaved(row + r, rope, cos.data(), sin.data(), tmp.data(),
                    c.rope_interleave);
    for (int64_t h = 0; h < heads; ++h) {
      RopeInterleaved(&q_[(t * heads + h) * qh + nope], rope, cos.data(),
                      sin.data(), tmp.data(), c.rope_interleave);
    }
  }

  const KvCacheSpec& spec = pool->spec();
  const kernels::KvLayerView view = pool->Layer(layer);
  WriteLatentRows(rows_.data(), total, slots, spec, view.data, view.scales);
  if (on_written) on_written();

  // Absorbed queries [total, heads, R | rope]: q_lat_h = W_UK_h^T q_nope_h.
  qabs_.resize(total * heads * width);
  gather_.resize(total * std::max(nope, r));
  part_.resize(total * std::max(r, vd));
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < total; ++t) {
      std::memcpy(&gather_[t * nope], &q_[(t * heads + h) * qh],
                  nope * sizeof(float));
    }
    kernels::MatMulNT(gather_.data(), total, nope, w.uk_t[h], part_.data(),
                      mode);
    for (int64_t t = 0; t < total; ++t) {
      float* qa = &qabs_[(t * heads + h) * width];
      std::memcpy(qa, &part_[t * r], r * sizeof(float));
      std::memcpy(qa + r, &q_[(t * heads + h) * qh + nope],
                  rope * sizeof(float));
    }
  }

  // Attention over the latent rows, one (query, head) at a time in position
  // order: the same arithmetic whatever else shares the call.
  out_lat_.resize(total * heads * r);
  const int bs = spec.block_size;
  for (const kernels::AttentionSeq& s : seqs) {
    const int64_t ctx = int64_t{s.start_pos} + s.num_q;
    ctx_.resize(ctx * width);
    for (int64_t b = 0; b * bs < ctx; ++b) {
      const int count = static_cast<int>(std::min<int64_t>(bs, ctx - b * bs));
      ReadLatentBlock(spec, view.data, view.scales, s.block_table[b], count,
                      &ctx_[b * bs * width]);
    }
    // (query, head) tasks are independent and each runs the same fixed-order
    // arithmetic on whichever thread takes it: the calling thread and the
    // kernel helpers that are awake (task_pool.h), which the layer's GEMMs
    // use too (an OpenMP team here would keep polling for its next region
    // for milliseconds, on the core those GEMMs' helper needs).
    const int64_t tasks = int64_t{s.num_q} * heads;
    auto run = [&](int64_t begin, int64_t end, bool) {
      thread_local std::vector<float> scores;
      scores.resize(ctx);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / heads, h = task % heads;
        const int64_t row = s.q_row + i, n = int64_t{s.start_pos} + i + 1;
        const float* qa = &qabs_[(row * heads + h) * width];
        float max = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
          scores[j] =
              kernels::DotFixedOrder(qa, &ctx_[j * width], width) * scale_;
          max = std::max(max, scores[j]);
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < n; ++j) {
          scores[j] = std::exp(scores[j] - max);
          sum += scores[j];
        }
        float* o = &out_lat_[(row * heads + h) * r];
        std::fill(o, o + r, 0.0f);
        for (int64_t j = 0; j < n; ++j) {
          const float p = scores[j];
          const float* cj = &ctx_[j * width];
          for (int64_t k = 0; k < r; ++k) o[k] += p * cj[k];
        }
        const float inv = 1.0f / sum;
        for (int64_t k = 0; k < r; ++k) o[k] *= inv;
      }
    };
    kernels::RunChunks(tasks, 1,
                       tasks * ctx > 4096 ? kernels::KernelThreads() : 1, run);
  }

  // Values: out_h = W_UV_h out_lat_h, then o_proj over [heads * v].
  attn_.resize(total * heads * vd);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < total; ++t) {
      std::memcpy(&gather_[t * r], &out_lat_[(t * heads + h) * r],
                  r * sizeof(float));
    }
    kernels::MatMulNT(gather_.data(), total, r, w.uv[h], part_.data(), mode);
    for (int64_t t = 0; t < total; ++t) {
      std::memcpy(&attn_[(t * heads + h) * vd], &part_[t * vd],
                  vd * sizeof(float));
    }
  }
  kernels::MatMulNT(attn_.data(), total, heads * vd, o_proj, out, mode);
}

}  // namespace pdserve::engine
