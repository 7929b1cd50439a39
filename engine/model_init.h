// Deterministic random-weight Llama-family models in Hugging Face layout, so
// that the whole pipeline runs without downloads. Stateless; thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "engine/model_config.h"

namespace pdserve::engine {

// "tiny" (tests: 2 layers, hidden 64) or "small" (demo: 8 layers, hidden 512,
// 8 query heads, 2 KV heads, head_dim 64, intermediate 1408). Byte vocabulary.
absl::StatusOr<ModelConfig> PresetConfig(const std::string& preset);

struct ModelInitOptions {
  std::string preset = "small";
  std::string out_dir;
  uint64_t seed = 0;
  DType weight_dtype = DType::kF32;  // F32, F16 or BF16 in the safetensors file
};

// Writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json
// and generation_config.json into out_dir (created if needed). The same
// options always produce byte-identical files.
absl::Status WriteRandomModel(const ModelInitOptions& options);

}  // namespace pdserve::engine
