#include "model/llama_model.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/paged_attention.h"
#include "kernels/cpu/step_profile.h"

namespace pdserve::engine {

using kernels::Phase;
using kernels::PhaseTimer;

LlamaModel::LlamaModel(std::shared_ptr<const ModelWeights> weights,
                       kernels::MatMulMode mode)
    : weights_(std::move(weights)), mode_(mode) {
  const ModelConfig& c = weights_->config;
  if (c.IsMla()) {
    mla_ = std::make_unique<MlaAttention>(c);
  } else {
    inv_freq_ = kernels::RopeInvFreq(c.head_dim, c.rope_theta, c.rope_scaling);
  }
}

absl::Status LlamaModel::Forward(std::span<const SeqInput> seqs, KvPool* pool,
                                 std::vector<float>* logits,
                                 const LayerWrittenFn& on_layer_written) {
  const ModelConfig& c = weights_->config;
  const KvCacheSpec& spec = pool->spec();
  const KvCacheSpec want = c.KvSpec(spec.block_size, spec.dtype);
  if (spec.num_layers != want.num_layers ||
      spec.num_kv_heads != want.num_kv_heads ||
      spec.head_dim != want.head_dim ||
      spec.kv_lora_rank != want.kv_lora_rank ||
      spec.qk_rope_head_dim != want.qk_rope_head_dim) {
    return absl::FailedPreconditionError(absl::StrCat(
        "kv pool (", spec.DebugString(), ") does not match the model"));
  }
  const int64_t hidden = c.hidden_size, hd = c.head_dim,
                inter = c.intermediate_size;
  // MLA keeps its own scratch (model/mla.h); these are for q/k/v heads.
  const int64_t q_dim = c.IsMla() ? 0 : c.num_heads * hd;
  const int64_t kv_dim = c.IsMla() ? 0 : c.num_kv_heads * hd;
  const int64_t qkv_dim = q_dim + 2 * kv_dim;
  const int bs = spec.block_size;

  int64_t total = 0;
  std::vector<kernels::AttentionSeq> attn_seqs;
  for (const SeqInput& s : seqs) {
    const int64_t end = s.start_pos + static_cast<int64_t>(s.tokens.size());
    if (s.tokens.empty() || s.start_pos < 0 ||
        static_cast<int64_t>(s.block_table.size()) * bs < end) {
      return absl::InvalidArgumentError(
          "forward: sequence without tokens or blocks");
    }
    for (int32_t t : s.tokens) {
      if (t < 0 || t >= c.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("token id ", t, " is outside the vocabulary [0, ",
                         c.vocab_size, ")"));
      }
    }
    attn_seqs.push_back({total, static_cast<int32_t>(s.tokens.size()),
                         s.start_pos, s.block_table.data()});
    total += static_cast<int64_t>(s.tokens.size());
  }
  if (total == 0) {
    logits->clear();
    return absl::OkStatus();
  }

  residual_.resize(total * hidden);
  normed_.resize(total * hidden);
  qkv_.resize(total * qkv_dim);
  q_.resize(total * q_dim);
  k_.resize(total * kv_dim);
  v_.resize(total * kv_dim);
  attn_.resize(total * q_dim);
  proj_.resize(total * hidden);
  gate_up_.resize(total * 2 * inter);
  act_.resize(total * inter);
  positions_.resize(total);
  slots_.resize(total);

  int64_t row = 0;
  {
    PhaseTimer timer(Phase::kEmbedding);
    for (const SeqInput& s : seqs) {
      for (size_t i = 0; i < s.tokens.size(); ++i, ++row) {
        weights_->embed.DequantizeRow(s.tokens[i], &residual_[row * hidden]);
        const int32_t pos = s.start_pos + static_cast<int32_t>(i);
        positions_[row] = pos;
        slots_[row] = int64_t{s.block_table[pos / bs]} * bs + pos % bs;
      }
    }
  }

  const float eps = static_cast<float>(c.rms_norm_eps);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const LayerWeights& w = weights_->layers[l];
    {
      PhaseTimer timer(Phase::kNorm);
      if (l == 0) {
        kernels::RmsNorm(residual_.data(), nullptr, w.input_norm.data(), total,
                         hidden, eps, normed_.data());
      } else {
        kernels::RmsNorm(proj_.data(), residual_.data(), w.input_norm.data(),
                         total, hidden, eps, normed_.data());
      }
    }
    if (mla_) {
      PhaseTimer timer(Phase::kMla);
      mla_->Forward(
          w.mla, w.o_proj, normed_.data(), total, positions_.data(),
          slots_.data(), attn_seqs, pool, static_cast<int32_t>(l), mode_,
          [&] {
            if (on_layer_written) on_layer_written(static_cast<int32_t>(l));
          },
          proj_.data());
    } else {
      Attention(w, total, attn_seqs, pool, static_cast<int32_t>(l),
                on_layer_written);
    }
    {
      PhaseTimer timer(Phase::kNorm);
      kernels::RmsNorm(proj_.data(), residual_.data(), w.post_norm.data(),
                       total, hidden, eps, normed_.data());
    }
    if (!w.moe.empty()) {
      PhaseTimer timer(Phase::kMoe);
      moe_.Forward(w.moe, c, normed_.data(), total, mode_, proj_.data());
      continue;
    }
    {
      PhaseTimer timer(Phase::kGateUpGemm);
      kernels::MatMulNT(normed_.data(), total, hidden, w.gate_up,
                        gate_up_.data(), mode_);
    }
    {
      PhaseTimer timer(Phase::kActivation);
      kernels::SiluAndMul(gate_up_.data(), total, inter, act_.data());
    }
    PhaseTimer timer(Phase::kDownGemm);
    kernels::MatMulNT(act_.data(), total, inter, w.down, proj_.data(), mode_);
  }
  return Finish(seqs, total, logits);
}

void LlamaModel::Attention(const LayerWeights& w, int64_t total,
                           std::span<const kernels::AttentionSeq> attn_seqs,
                           KvPool* pool, int32_t l,
                           const LayerWrittenFn& on_layer_written) {
  const ModelConfig& c = weights_->config;
  const int64_t hd = c.head_dim;
  const int64_t q_dim = c.num_heads * hd, kv_dim = c.num_kv_heads * hd;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  {
    PhaseTimer timer(Phase::kQkvGemm);
    kernels::MatMulNT(normed_.data(), total, c.hidden_size, w.qkv, qkv_.data(),
                      mode_);
  }
  {
    PhaseTimer timer(Phase::kQkvSplit);
    kernels::SplitQkv(qkv_.data(),
                      w.qkv_bias.empty() ? nullptr : w.qkv_bias.data(), total,
                      q_dim, kv_dim, q_.data(), k_.data(), v_.data());
  }
  if (!w.q_norm.empty()) {  // Qwen3: RMSNorm of every head, before RoPE
    PhaseTimer timer(Phase::kNorm);
    kernels::RmsNorm(q_.data(), nullptr, w.q_norm.data(), total * c.num_heads,
                     hd, eps, q_.data());
    kernels::RmsNorm(k_.data(), nullptr, w.k_norm.data(),
                     total * c.num_kv_heads, hd, eps, k_.data());
  }
  {
    PhaseTimer timer(Phase::kRope);
    kernels::ApplyRope(q_.data(), c.num_heads, k_.data(), c.num_kv_heads, total,
                       hd, positions_.data(), inv_freq_.data());
  }
  const kernels::KvLayerView layer = pool->Layer(static_cast<int>(l));
  {
    PhaseTimer timer(Phase::kKvWrite);
    kernels::WriteKv(k_.data(), v_.data(), total, slots_.data(), layer);
  }
  if (on_layer_written) on_layer_written(static_cast<int32_t>(l));
  {
    PhaseTimer timer(Phase::kAttention);
    kernels::PagedAttention(q_.data(), static_cast<int32_t>(c.num_heads),
                            attn_seqs, layer, scale, attn_.data());
  }
  PhaseTimer timer(Phase::kOGemm);
  kernels::MatMulNT(attn_.data(), total, q_dim, w.o_proj, proj_.data(), mode_);
}

absl::Status LlamaModel::Finish(std::span<const SeqInput> seqs, int64_t total,
                                std::vector<float>* logits) {
  const ModelConfig& c = weights_->config;
  const int64_t hidden = c.hidden_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  {
    PhaseTimer timer(Phase::kNorm);
    kernels::RmsNorm(proj_.data(), residual_.data(), weights_->norm.data(),
                     total, hidden, eps, normed_.data());
  }

  // Gather the rows that need logits, then one product with the output matrix.
  PhaseTimer gather_timer(Phase::kLogitsGather);
  rows_.clear();
  int64_t row = 0;
  for (const SeqInput& s : seqs) {
    const int64_t n = static_cast<int64_t>(s.tokens.size());
    if (s.logits == Logits::kAll) {
      rows_.insert(rows_.end(), normed_.begin() + row * hidden,
                   normed_.begin() + (row + n) * hidden);
    } else if (s.logits == Logits::kLast) {
      rows_.insert(rows_.end(), normed_.begin() + (row + n - 1) * hidden,
                   normed_.begin() + (row + n) * hidden);
    }
    row += n;
  }
  const int64_t out_rows = static_cast<int64_t>(rows_.size()) / hidden;
  // Every element is written by the product below.
  logits->resize(out_rows * c.vocab_size);
  gather_timer.Stop();
  PhaseTimer timer(Phase::kLmHead);
  kernels::MatMulNT(rows_.data(), out_rows, hidden, weights_->output_matrix(),
                    logits->data(), mode_);
  return absl::OkStatus();
}

}  // namespace pdserve::engine
