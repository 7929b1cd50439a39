// Llama-family model configuration read from a Hugging Face config.json.
// Plain value type; thread-compatible.
#pragma once

#include <cstdint>
#include <string>

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
  bool tie_word_embeddings = false;
  int64_t bos_token_id = -1;  // -1: none
  int64_t eos_token_id = -1;

  // Checks internal consistency (heads divide evenly, sizes positive, ...).
  absl::Status Validate() const;
  // Parses config.json text; `path` names the file in errors.
  static absl::StatusOr<ModelConfig> FromJson(const std::string& text,
                                              const std::string& path);
  std::string ToJson() const;
};

}  // namespace pdserve::engine
