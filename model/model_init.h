// Deterministic random-weight Llama-family models in Hugging Face layout, so
// that the whole pipeline runs without downloads. Stateless; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "model/model_config.h"

namespace pdserve::engine {

// Presets, all with the byte vocabulary:
//  - "tiny" (tests: 2 layers, hidden 64) and "small" (demo: 8 layers, hidden
//    512, 8 query heads, 2 KV heads, head_dim 64, intermediate 1408);
//  - one per supported family, in that family's config shape at tiny size:
//    "llama2" (MHA), "llama3" (GQA, rope_theta 5e5), "llama3.1" (plus llama3
//    RoPE scaling), "mistral", "qwen2" (q/k/v bias, tied embeddings), "qwen3"
//    (q/k RMSNorm, tied embeddings), "mixtral" (8 experts, top-2) and
//    "qwen3-moe" (8 experts, top-3 with norm_topk_prob, one dense layer),
//    "deepseek-v2" (MLA without q LoRA, group_limited_greedy top-3 of 8
//    experts, 2 shared experts, dense first layer, YaRN) and "deepseek-v3"
//    (MLA with q LoRA, sigmoid noaux_tc top-2, 1 shared expert, dense first
//    layer, YaRN);
//  - "llama3.2-1b": the Llama 3.2 1B shape at full size (hidden 2048, 16
//    layers, 32 heads, 8 KV heads, vocabulary 128256, tied), bf16 by default.
// Every preset's name, in the preset table's order.
std::vector<std::string> PresetNames();
absl::StatusOr<ModelConfig> PresetConfig(const std::string& preset);
// The dtype a preset is written in when none is asked for (fp32; bf16 for
// llama3.2-1b, as the real checkpoint).
DType PresetDefaultDtype(const std::string& preset);
// The dtypes a model file can be written in: "fp32", "fp16" or "bf16" (and
// their long spellings); anything else is INVALID_ARGUMENT.
absl::StatusOr<DType> ParseModelFileDtype(absl::string_view name);
// config.json's "torch_dtype" for weights stored as `dtype` ("float32",
// "float16", "bfloat16").
const char* TorchDtypeName(DType dtype);

// The config.json a preset is written with when its weights are stored as
// `weight_dtype` (torch_dtype names that dtype).
absl::StatusOr<std::string> PresetConfigJson(const std::string& preset,
                                             DType weight_dtype);

struct ModelInitOptions {
  std::string preset = "small";
  std::string out_dir;
  uint64_t seed = 0;
  DType weight_dtype = DType::kF32;  // F32, F16 or BF16 in the safetensors file
};

// Writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json
// and generation_config.json into out_dir (created if needed). The same
// options always produce byte-identical files. config.json's torch_dtype
// names the dtype the weights are written in.
absl::Status WriteRandomModel(const ModelInitOptions& options);

}  // namespace pdserve::engine
