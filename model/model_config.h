// Llama-family model configuration read from a Hugging Face config.json:
// Llama 2/3/3.1, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k RMSNorm), the
// Mixture-of-Experts Mixtral and Qwen3-MoE (model/moe.h), and DeepSeek-V2/V3
// (MLA attention, model/mla.h, with DeepSeek's MoE).
// Plain value type; thread-compatible.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "kernels/cpu/ops.h"
#include "kv_cache/kv_cache.h"

namespace pdserve::engine {

struct ModelConfig {
  std::string architecture = "LlamaForCausalLM";
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  kernels::RopeScaling rope_scaling;  // factor 0: none
  bool attention_bias = false;        // q/k/v bias (Qwen2)
  // RMSNorm over each head of q and k (weights [head_dim]) after the
  // projection, before RoPE (Qwen3).
  bool qk_norm = false;
  bool tie_word_embeddings = false;
  int64_t bos_token_id = -1;  // -1: none
  int64_t eos_token_id = -1;  // the first of eos_token_ids
  // Every id that ends generation (config.json's list, plus
  // generation_config.json's when the weights are loaded).
  std::vector<int64_t> eos_token_ids;
  // Mixture of experts (Mixtral, Qwen3-MoE); num_experts 0: every MLP dense.
  // Mixtral: num_local_experts, every layer sparse, experts of
  // intermediate_size, top-k always renormalised. Qwen3-MoE: num_experts,
  // moe_intermediate_size; layer i is sparse unless it is in mlp_only_layers
  // or (i + 1) % decoder_sparse_step != 0 (then a dense MLP of
  // intermediate_size), as transformers' Qwen3MoeDecoderLayer decides.
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;    // top-k
  int64_t moe_intermediate_size = 0;  // per expert
  bool norm_topk_prob = false;        // divide the chosen k by their sum
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;

  // DeepSeek-V2/V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM), as their
  // Hugging Face modeling_deepseek.py. MLA attention: q through q_proj, or
  // with q_lora_rank > 0 through q_a_proj -> q_a_layernorm -> q_b_proj, into
  // per head [qk_nope_head_dim | qk_rope_head_dim]; kv_a_proj_with_mqa gives
  // the latent [kv_lora_rank] (then kv_a_layernorm) and one shared rope key
  // [qk_rope_head_dim]; kv_b_proj expands the latent into per head
  // [qk_nope_head_dim (k) | v_head_dim (v)]. head_dim is set to
  // qk_nope_head_dim + qk_rope_head_dim (the q/k width of a head).
  int64_t q_lora_rank = 0;  // 0: no q LoRA (config null)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  // DeepSeek's RoPE pairs (x[2i], x[2i+1]) (config rope_interleave, default
  // true); false: the rotate_half pairing (x[i], x[i + d/2]).
  bool rope_interleave = true;
  // rope_scaling {"type": "yarn"} (DeepSeek's YaRN); factor 0: none.
  struct Yarn {
    double factor = 0;
    int64_t original_max_position_embeddings = 4096;
    double beta_fast = 32, beta_slow = 1;
    double mscale = 1, mscale_all_dim = 0;
  } yarn;
  // DeepSeek MoE: n_routed_experts go to num_experts. Scores are the
  // softmax (V2) or sigmoid (V3) of the router logits; top-k is greedy,
  // group_limited_greedy (V2: the topk_group groups of n_group with the
  // highest max score) or noaux_tc (V3: groups ranked by the sum of their two
  // best scores + e_score_correction_bias, experts chosen by that biased
  // score, weighted by the unbiased one). Weights: V2 renormalises with
  // norm_topk_prob, else multiplies by routed_scaling_factor; V3 renormalises
  // with norm_topk_prob, then always multiplies. n_shared_experts experts run
  // on every token (one MLP of n_shared_experts * moe_intermediate_size).
  // Layer i is sparse when i >= first_k_dense_replace and
  // i % moe_layer_freq == 0, else a dense MLP of intermediate_size.
  enum class MoeScoring { kSoftmax, kSigmoid };
  enum class MoeTopk { kGreedy, kGroupLimitedGreedy, kNoauxTc };
  MoeScoring moe_scoring = MoeScoring::kSoftmax;
  MoeTopk moe_topk = MoeTopk::kGreedy;
  int64_t n_group = 1, topk_group = 1;
  int64_t n_shared_experts = 0;
  double routed_scaling_factor = 1.0;
  int64_t first_k_dense_replace = 0, moe_layer_freq = 1;

  bool IsDeepseek() const;
  bool IsMla() const { return kv_lora_rank > 0; }
  // The paged KV geometry of this model: kv_heads x head_dim K and V, or for
  // MLA one latent row [kv_lora_rank + qk_rope_head_dim] per token.
  KvCacheSpec KvSpec(int32_t block_size, DType dtype) const;
  bool IsMoeLayer(int64_t layer) const;
  bool IsEos(int64_t token) const;

  // Checks internal consistency (heads divide evenly, sizes positive, ...).
  absl::Status Validate() const;
  // Parses config.json text; `path` names the file in errors.
  static absl::StatusOr<ModelConfig> FromJson(const std::string& text,
                                              const std::string& path);
  // Adds generation_config.json's EOS ids (Llama-3 Instruct stops on
  // <|eot_id|> as well as <|end_of_text|>) and its BOS when config.json has
  // none.
  absl::Status AddGenerationConfig(const std::string& text,
                                   const std::string& path);
  std::string ToJson() const;
};

}  // namespace pdserve::engine
