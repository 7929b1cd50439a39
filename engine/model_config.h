// Llama-family model configuration read from a Hugging Face config.json:
// Llama 2/3/3.1, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k RMSNorm), and the
// Mixture-of-Experts Mixtral and Qwen3-MoE (engine/moe.h).
// Plain value type; thread-compatible.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cpu/ops.h"

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
