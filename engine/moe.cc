#include "engine/moe.h"

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
  return n;
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

void MoeMlp::Forward(const MoeWeights& w, const ModelConfig& c, const float* x,
                     int64_t m, kernels::MatMulMode mode, float* y) {
  const int64_t hidden = c.hidden_size, inter = c.moe_intermediate_size;
  const int64_t num_experts = c.num_experts, k = c.num_experts_per_tok;
  logits_.resize(m * num_experts);
  experts_.resize(m * k);
  weights_.resize(m * k);
  slots_.resize(m * k * hidden);
  kernels::MatMulNT(x, m, hidden, w.router, logits_.data(), mode);
  RouteTopK(logits_.data(), m, num_experts, k, c.norm_topk_prob,
            experts_.data(), weights_.data());

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
    gate_up_.resize(n * 2 * inter);
    act_.resize(n * inter);
    expert_out_.resize(n * hidden);
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(&gathered_[i * hidden], x + (group_[i] / k) * hidden,
                  hidden * sizeof(float));
    }
    kernels::MatMulNT(gathered_.data(), n, hidden, w.gate_up[e],
                      gate_up_.data(), mode);
    kernels::SiluAndMul(gate_up_.data(), n, inter, act_.data());
    kernels::MatMulNT(act_.data(), n, inter, w.down[e], expert_out_.data(),
                      mode);
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
}

}  // namespace pdserve::engine
