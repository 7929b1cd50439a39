// Llama-family weights loaded from a Hugging Face model directory
// (config.json + model.safetensors, or shards listed in
// model.safetensors.index.json; generation_config.json adds EOS ids). The
// matrices (embedding, q|k|v and gate|up fused, o, down, lm_head) stay in a
// compact dtype, packed for the CPU GEMM (kernels/cpu/packed_gemm.h): the
// checkpoint's own dtype by default, or fp32/bf16/fp16, or int8 quantized at
// load (one fp32 scale per output row, or one fp16 scale per block of 32).
// Norms and biases are fp32. Immutable after Load; safe to share across
// threads.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/packed_gemm.h"
#include "model/mla.h"
#include "model/model_config.h"
#include "model/moe.h"

namespace pdserve::engine {

// How matrices are kept in memory; kAuto is the checkpoint's dtype (of the
// token embedding). kI8 ("int8") has one scale per output row, kI8B32
// ("int8-b32") one fp16 scale per block of 32 input features of a row.
enum class WeightDtype { kAuto, kF32, kBF16, kF16, kI8, kI8B32 };
std::optional<WeightDtype> ParseWeightDtype(
    std::string_view s);  // auto|fp32|bf16|fp16|int8|int8-b32
const char* WeightDtypeName(WeightDtype d);

struct LayerWeights {
  std::vector<float> input_norm;  // [hidden]
  kernels::WeightMatrix qkv;      // [(heads + 2 * kv_heads) * head_dim, hidden]
  std::vector<float> qkv_bias;    // same rows, or empty
  std::vector<float> q_norm;      // [head_dim], or empty (Qwen3 q/k norm)
  std::vector<float> k_norm;      // [head_dim], or empty
  kernels::WeightMatrix o_proj;   // [hidden, heads * head_dim]
  std::vector<float> post_norm;   // [hidden]
  kernels::WeightMatrix gate_up;  // [2 * intermediate, hidden]
  kernels::WeightMatrix down;     // [hidden, intermediate]
  // Sparse layers (ModelConfig::IsMoeLayer): router and experts, and the
  // dense gate_up/down above stay empty.
  MoeWeights moe;
  // DeepSeek MLA (ModelConfig::IsMla): its projections; qkv and the q/k
  // norms stay empty, o_proj is [hidden, heads * v_head_dim].
  MlaWeights mla;
};

// 128-bit identity of the weights, used in the prefix-cache block hash.
using Fingerprint = std::array<uint64_t, 2>;

struct ModelWeights {
  ModelConfig config;
  kernels::WeightMatrix embed;  // [vocab, hidden]; rows read per token
  std::vector<LayerWeights> layers;
  std::vector<float> norm;        // [hidden]
  kernels::WeightMatrix lm_head;  // [vocab, hidden]; empty when tied to embed
  DType dtype = DType::kF32;      // what the matrices are stored in
  // With dtype kI8: how the int8 matrices are scaled.
  kernels::Int8Scaling int8_scaling = kernels::Int8Scaling::kPerRow;
  // "int8-b32" for block int8, else DTypeName(dtype).
  std::string StorageName() const;
  // config + storage dtype + tensor metadata + sampled tensor bytes
  Fingerprint fingerprint{};

  const kernels::WeightMatrix& output_matrix() const {
    return lm_head.empty() ? embed : lm_head;
  }
  // Bytes one decode step reads from weights (for the roofline figure): every
  // matrix but the embedding (of which it reads a row per token), norms and
  // biases.
  int64_t ParameterBytes() const;

  // `dtype` picks the storage (kAuto: the checkpoint's). MatMulMode::kBlas
  // needs fp32 row-major matrices for OpenBLAS: it accepts kAuto or kF32 only.
  static absl::StatusOr<ModelWeights> Load(
      const std::string& dir, WeightDtype dtype = WeightDtype::kAuto,
      kernels::MatMulMode mode = kernels::MatMulMode::kDeterministic);
};

}  // namespace pdserve::engine
