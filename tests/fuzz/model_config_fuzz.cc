// Fuzzes config.json (and generation_config.json) parsing in
// model/model_config.h. Input: config.json, then optionally
// kPartSeparator and generation_config.json. A config that parses must
// validate, and its ToJson() must parse back to the same dimensions.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "model/model_config.h"
#include "tests/fuzz/fuzz_util.h"

using pdserve::engine::ModelConfig;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = pdserve::fuzz::SplitParts(data, size, 2);
  auto config = ModelConfig::FromJson(parts[0], "config.json");
  if (!config.ok()) return 0;
  if (!config->Validate().ok()) std::abort();
  auto again = ModelConfig::FromJson(config->ToJson(), "round trip");
  if (!again.ok() || again->vocab_size != config->vocab_size ||
      again->hidden_size != config->hidden_size ||
      again->num_layers != config->num_layers ||
      again->num_kv_heads != config->num_kv_heads ||
      again->head_dim != config->head_dim) {
    std::abort();
  }
  if (!parts[1].empty()) {
    (void)config->AddGenerationConfig(parts[1], "generation_config.json");
    for (int64_t id : config->eos_token_ids) config->IsEos(id);
  }
  return 0;
}
