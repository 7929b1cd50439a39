// Mixture-of-Experts MLP (Mixtral, Qwen3-MoE, DeepSeek-V2/V3) on the CPU: a
// linear router scores the experts, each token picks its top-k, and the chosen
// experts' SwiGLU MLPs are summed with the routing weights; DeepSeek adds its
// grouped top-k, routed_scaling_factor and always-on shared experts
// (model/model_config.h states each family's rule).
//
// Batch invariance (the equivalence contract): a token's output depends only
// on its own hidden state. Experts run grouped, one GEMM per expert over the
// tokens routed to it; the GEMM's order contract (kernels/cpu/packed_gemm.h)
// gives each row the same bits whatever the group size. The weighted sum runs
// over a token's experts in rank order (highest probability first, ties to
// the lower expert id), never in the order the groups happen to finish.
//
// MoeWeights is immutable after load; MoeMlp reuses scratch buffers and is
// not thread-safe (one per LlamaModel).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/packed_gemm.h"
#include "model/model_config.h"

namespace pdserve::engine {

struct MoeWeights {
  kernels::WeightMatrix router;                // [num_experts, hidden]
  std::vector<kernels::WeightMatrix> gate_up;  // per expert [2 * inter, hidden]
  std::vector<kernels::WeightMatrix> down;     // per expert [hidden, inter]
  // DeepSeek-V3 noaux_tc: e_score_correction_bias [num_experts], else empty.
  std::vector<float> score_bias;
  // DeepSeek shared experts, one SwiGLU of n_shared * moe_intermediate;
  // empty without.
  kernels::WeightMatrix shared_gate_up;  // [2 * shared_inter, hidden]
  kernels::WeightMatrix shared_down;     // [hidden, shared_inter]

  bool empty() const { return router.empty(); }
  int64_t bytes() const;
};

// Hugging Face tensor names of a sparse layer's router and experts:
// Mixtral "model.layers.L.block_sparse_moe.gate" and "...experts.E.w1|w3|w2";
// Qwen3-MoE and DeepSeek "model.layers.L.mlp.gate" and
// "...experts.E.gate_proj|up_proj|down_proj" (DeepSeek's shared experts:
// "model.layers.L.mlp.shared_experts.gate_proj|..."). Each without the
// ".weight" suffix.
enum class ExpertProj { kGate, kUp, kDown };
std::string MoeRouterTensor(const ModelConfig& c, int64_t layer);
std::string MoeExpertTensor(const ModelConfig& c, int64_t layer, int64_t expert,
                            ExpertProj proj);

// Top-k routing of m tokens. router_logits: [m, num_experts]. Softmax over
// all experts (max-subtracted, summed in expert order), then the k largest
// probabilities, ties broken by the lower expert id; with `renormalize` the
// chosen k are divided by their sum (Mixtral always, Qwen3-MoE with
// norm_topk_prob). experts, weights: [m, k], rank order.
void RouteTopK(const float* router_logits, int64_t m, int64_t num_experts,
               int64_t k, bool renormalize, int32_t* experts, float* weights);

// DeepSeek's gate (MoEGate of modeling_deepseek.py) for m tokens:
// softmax or sigmoid scores; greedy, group_limited_greedy or noaux_tc top-k
// (score_bias: e_score_correction_bias, noaux_tc only); V2/V3 weight rules
// with norm_topk_prob and routed_scaling_factor. Ranks are ordered by the
// selection score, descending, ties to the lower expert (group) id, so the
// choice is a pure function of one token's logits. experts, weights: [m, k].
void RouteDeepseek(const float* router_logits, int64_t m, const ModelConfig& c,
                   const float* score_bias, int32_t* experts, float* weights);

class MoeMlp {
 public:
  // y[m, hidden] = Σ_rank weight · expert(x) over each token's top-k.
  // x: [m, hidden] (the post-attention normed hidden states).
  void Forward(const MoeWeights& w, const ModelConfig& c, const float* x,
               int64_t m, kernels::MatMulMode mode, float* y);

 private:
  void Swiglu(const kernels::WeightMatrix& gate_up,
              const kernels::WeightMatrix& down, const float* x, int64_t n,
              int64_t hidden, int64_t inter, kernels::MatMulMode mode,
              float* out);
  std::vector<float> logits_, weights_, gathered_, gate_up_, act_, expert_out_,
      slots_, shared_;
  std::vector<int32_t> experts_;
  std::vector<int64_t> group_;  // (token * k + rank) routed to one expert
};

}  // namespace pdserve::engine
