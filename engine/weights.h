// Llama-family weights loaded from a Hugging Face model directory
// (config.json + model.safetensors, or shards listed in
// model.safetensors.index.json; generation_config.json adds EOS ids). Tensors
// of any supported storage dtype are converted to fp32 and fused for the CPU
// kernels (q|k|v and gate|up). Immutable after Load; safe to share across
// threads.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model_config.h"

namespace pdserve::engine {

struct LayerWeights {
  std::vector<float> input_norm;  // [hidden]
  std::vector<float> qkv;         // [(heads + 2 * kv_heads) * head_dim, hidden]
  std::vector<float> qkv_bias;    // same rows, or empty
  std::vector<float> q_norm;      // [head_dim], or empty (Qwen3 q/k norm)
  std::vector<float> k_norm;      // [head_dim], or empty
  std::vector<float> o_proj;      // [hidden, heads * head_dim]
  std::vector<float> post_norm;   // [hidden]
  std::vector<float> gate_up;     // [2 * intermediate, hidden]
  std::vector<float> down;        // [hidden, intermediate]
};

// 128-bit identity of the weights, used in the prefix-cache block hash.
using Fingerprint = std::array<uint64_t, 2>;

struct ModelWeights {
  ModelConfig config;
  std::vector<float> embed;  // [vocab, hidden]
  std::vector<LayerWeights> layers;
  std::vector<float> norm;     // [hidden]
  std::vector<float> lm_head;  // [vocab, hidden]; empty when tied to embed
  Fingerprint fingerprint{};  // config + tensor metadata + sampled tensor bytes

  const std::vector<float>& output_matrix() const {
    return lm_head.empty() ? embed : lm_head;
  }
  // Bytes one decode step reads from weights (for the roofline figure).
  int64_t ParameterBytes() const;

  static absl::StatusOr<ModelWeights> Load(const std::string& dir);
};

}  // namespace pdserve::engine
