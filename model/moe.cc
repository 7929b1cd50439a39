#include "model/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/ops.h"

namespace pdserve::engine {

int64_t MoeWeights::bytes() const {
  int64_t n = router.bytes();
  for (const auto& m : gate_up) n += m.bytes();
  for (const auto& m : down) n += m.bytes();
  return n + shared_gate_up.bytes() + shared_down.bytes() +
         static_cast<int64_t>(score_bias.size() * sizeof(float));
}

namespace {
bool IsMixtral(const ModelConfig& c) {
  return c.architecture == "MixtralForCausalLM";
}
}  // namespace

std::string MoeRouterTensor(const ModelConfig& c, int64_t layer) {
  return absl::StrCat("model.layers.", layer,
                      IsMixtral(c) ? ".block_sparse_moe.gate" : ".mlp.gate");
}

std::string MoeExpertTensor(const ModelConfig& c, int64_t layer, int64_t expert,
                            ExpertProj proj) {
  if (IsMixtral(c)) {
    // Mixtral's expert: w2(silu(w1 x) * w3 x).
    const char* name = proj == ExpertProj::kGate ? "w1"
                       : proj == ExpertProj::kUp ? "w3"
                                                 : "w2";
    return absl::StrCat("model.layers.", layer, ".block_sparse_moe.experts.",
                        expert, ".", name);
  }
  const char* name = proj == ExpertProj::kGate ? "gate_proj"
                     : proj == ExpertProj::kUp ? "up_proj"
                                               : "down_proj";
  return absl::StrCat("model.layers.", layer, ".mlp.experts.", expert, ".",
                      name);
}

void RouteTopK(const float* router_logits, int64_t m, int64_t num_experts,
               int64_t k, bool renormalize, int32_t* experts, float* weights) {
  std::vector<float> prob(num_experts);
  std::vector<int32_t> order(num_experts);
  for (int64_t t = 0; t < m; ++t) {
    const float* z = router_logits + t * num_experts;
    float max = z[0];
    for (int64_t e = 1; e < num_experts; ++e) max = std::max(max, z[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < num_experts; ++e) {
      prob[e] = std::exp(z[e] - max);
      sum += prob[e];
    }
    for (int64_t e = 0; e < num_experts; ++e) prob[e] /= sum;
    for (int64_t e = 0; e < num_experts; ++e)
      order[e] = static_cast<int32_t>(e);
    // Descending probability; equal probabilities keep the lower id first.
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int32_t a, int32_t b) {
                        return prob[a] != prob[b] ? prob[a] > prob[b] : a < b;
                      });
    float chosen = 0.0f;
    for (int64_t r = 0; r < k; ++r) chosen += prob[order[r]];
    for (int64_t r = 0; r < k; ++r) {
      experts[t * k + r] = order[r];
      weights[t * k + r] =
          renormalize ? prob[order[r]] / chosen : prob[order[r]];
    }
  }
}

void RouteDeepseek(const float* router_logits, int64_t m, const ModelConfig& c,
                   const float* score_bias, int32_t* experts, float* weights) {
  using Topk = ModelConfig::MoeTopk;
  const int64_t n = c.num_experts, k = c.num_experts_per_tok;
  const bool v3 = c.architecture == "DeepseekV3ForCausalLM";
  const bool grouped = c.moe_topk != Topk::kGreedy;
  const int64_t groups = grouped ? c.n_group : 1, per_group = n / groups;
  std::vector<float> score(n), choice(n), group_score(groups);
  std::vector<int32_t> order(n), group_order(groups);
  std::vector<char> kept(groups);
  auto by = [](const std::vector<float>& v) {
    // Descending; equal values keep the lower id first.
    return [&v](int32_t a, int32_t b) {
      return v[a] != v[b] ? v[a] > v[b] : a < b;
    };
  };
  for (int64_t t = 0; t < m; ++t) {
    const float* z = router_logits + t * n;
    if (c.moe_scoring == ModelConfig::MoeScoring::kSigmoid) {
      for (int64_t e = 0; e < n; ++e)
        score[e] = 1.0f / (1.0f + std::exp(-z[e]));
    } else {
      float max = z[0];
      for (int64_t e = 1; e < n; ++e) max = std::max(max, z[e]);
      float sum = 0.0f;
      for (int64_t e = 0; e < n; ++e) {
        score[e] = std::exp(z[e] - max);
        sum += score[e];
      }
      for (int64_t e = 0; e < n; ++e) score[e] /= sum;
    }
    const bool biased = c.moe_topk == Topk::kNoauxTc && score_bias != nullptr;
    for (int64_t e = 0; e < n; ++e)
      choice[e] = biased ? score[e] + score_bias[e] : score[e];
    if (grouped) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* v = &choice[g * per_group];
        if (c.moe_topk == Topk::kGroupLimitedGreedy) {
          float best = v[0];
          for (int64_t i = 1; i < per_group; ++i) best = std::max(best, v[i]);
          group_score[g] = best;
        } else {  // noaux_tc: the sum of the group's two best
          float a = std::max(v[0], v[1]), b = std::min(v[0], v[1]);
          for (int64_t i = 2; i < per_group; ++i) {
            if (v[i] > a) {
              b = a;
              a = v[i];
            } else if (v[i] > b) {
              b = v[i];
            }
          }
          group_score[g] = a + b;
        }
        group_order[g] = static_cast<int32_t>(g);
      }
      std::partial_sort(group_order.begin(), group_order.begin() + c.topk_group,
                        group_order.end(), by(group_score));
      std::fill(kept.begin(), kept.end(), 0);
      for (int64_t r = 0; r < c.topk_group; ++r) kept[group_order[r]] = 1;
      // As masked_fill(~mask, 0.0) in the reference code.
      for (int64_t e = 0; e < n; ++e) {
        if (!kept[e / per_group]) choice[e] = 0.0f;
      }
    }
    for (int64_t e = 0; e < n; ++e) order[e] = static_cast<int32_t>(e);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      by(choice));
    float* w = weights + t * k;
    for (int64_t r = 0; r < k; ++r) {
      experts[t * k + r] = order[r];
      // noaux_tc weighs by the unbiased score; V2's top-k returns the
      // (masked) score it ranked by.
      w[r] = c.moe_topk == Topk::kNoauxTc ? score[order[r]] : choice[order[r]];
    }
    const float scale = static_cast<float>(c.routed_scaling_factor);
    if (k > 1 && c.norm_topk_prob) {
      float sum = 0.0f;
      for (int64_t r = 0; r < k; ++r) sum += w[r];
      sum += 1e-20f;
      for (int64_t r = 0; r < k; ++r) w[r] /= sum;
      if (v3) {
        for (int64_t r = 0; r < k; ++r) w[r] *= scale;
      }
    } else {
      for (int64_t r = 0; r < k; ++r) w[r] *= scale;
    }
  }
}

void MoeMlp::Swiglu(const kernels::WeightMatrix& gate_up,
                    const kernels::WeightMatrix& down, const float* x,
                    int64_t n, int64_t hidden, int64_t inter,
                    kernels::MatMulMode mode, float* out) {
  gate_up_.resize(n * 2 * inter);
  act_.resize(n * inter);
  kernels::MatMulNT(x, n, hidden, gate_up, gate_up_.data(), mode);
  kernels::SiluAndMul(gate_up_.data(), n, inter, act_.data());
  kernels::MatMulNT(act_.data(), n, inter, down, out, mode);
}

void MoeMlp::Forward(const MoeWeights& w, const ModelConfig& c, const float* x,
                     int64_t m, kernels::MatMulMode mode, float* y) {
  const int64_t hidden = c.hidden_size, inter = c.moe_intermediate_size;
  const int64_t num_experts = c.num_experts, k = c.num_experts_per_tok;
  logits_.resize(m * num_experts);
  experts_.resize(m * k);
  weights_.resize(m * k);
  slots_.resize(m * k * hidden);
  kernels::MatMulNT(x, m, hidden, w.router, logits_.data(), mode);
  if (c.IsDeepseek()) {
    RouteDeepseek(logits_.data(), m, c,
                  w.score_bias.empty() ? nullptr : w.score_bias.data(),
                  experts_.data(), weights_.data());
  } else {
    RouteTopK(logits_.data(), m, num_experts, k, c.norm_topk_prob,
              experts_.data(), weights_.data());
  }

  // One GEMM pair per expert over the tokens it was chosen by; each output
  // row lands in its (token, rank) slot.
  for (int64_t e = 0; e < num_experts; ++e) {
    group_.clear();
    for (int64_t s = 0; s < m * k; ++s) {
      if (experts_[s] == e) group_.push_back(s);
    }
    if (group_.empty()) continue;
    const int64_t n = static_cast<int64_t>(group_.size());
    gathered_.resize(n * hidden);
    expert_out_.resize(n * hidden);
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(&gathered_[i * hidden], x + (group_[i] / k) * hidden,
                  hidden * sizeof(float));
    }
    Swiglu(w.gate_up[e], w.down[e], gathered_.data(), n, hidden, inter, mode,
           expert_out_.data());
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(&slots_[group_[i] * hidden], &expert_out_[i * hidden],
                  hidden * sizeof(float));
    }
  }

  // The weighted sum in rank order, the same for every batch.
  for (int64_t t = 0; t < m; ++t) {
    float* out = y + t * hidden;
    const float* first = &slots_[t * k * hidden];
    const float w0 = weights_[t * k];
    for (int64_t i = 0; i < hidden; ++i) out[i] = w0 * first[i];
    for (int64_t r = 1; r < k; ++r) {
      const float* s = &slots_[(t * k + r) * hidden];
      const float wr = weights_[t * k + r];
      for (int64_t i = 0; i < hidden; ++i) out[i] += wr * s[i];
    }
  }
  // DeepSeek's shared experts: every token, added after the routed sum (the
  // GEMM rows, hence the sums, are batch-invariant as above).
  if (!w.shared_down.empty()) {
    const int64_t shared_inter = c.n_shared_experts * inter;
    shared_.resize(m * hidden);
    Swiglu(w.shared_gate_up, w.shared_down, x, m, hidden, shared_inter, mode,
           shared_.data());
    for (int64_t i = 0; i < m * hidden; ++i) y[i] += shared_[i];
  }
}

}  // namespace pdserve::engine
