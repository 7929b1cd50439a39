#include "engine/model_config.h"

#include "absl/strings/str_cat.h"
#include "common/json.h"
#include "common/status_macros.h"

namespace pdserve::engine {

absl::Status ModelConfig::Validate() const {
  auto bad = [](const std::string& m) {
    return absl::InvalidArgumentError(absl::StrCat("model config: ", m));
  };
  if (vocab_size <= 0 || hidden_size <= 0 || intermediate_size <= 0 ||
      num_layers <= 0 || num_heads <= 0 || num_kv_heads <= 0 || head_dim <= 0) {
    return bad("vocab_size, hidden_size, intermediate_size, num_hidden_layers, "
               "num_attention_heads, num_key_value_heads and head_dim must be positive");
  }
  if (num_heads % num_kv_heads != 0) {
    return bad(absl::StrCat("num_attention_heads (", num_heads,
                            ") must be a multiple of num_key_value_heads (",
                            num_kv_heads, ")"));
  }
  if (head_dim % 2 != 0 || head_dim > 1024) {
    return bad(absl::StrCat("head_dim must be even and at most 1024, got ", head_dim));
  }
  if (vocab_size > (int64_t{1} << 31) || hidden_size > (1 << 20) ||
      intermediate_size > (1 << 22) || num_layers > 1024 || num_heads > 1024) {
    return bad("dimensions are implausibly large");
  }
  if (rms_norm_eps <= 0 || rope_theta <= 0 || max_position_embeddings <= 0) {
    return bad("rms_norm_eps, rope_theta and max_position_embeddings must be positive");
  }
  if (bos_token_id >= vocab_size || eos_token_id >= vocab_size) {
    return bad("bos_token_id/eos_token_id out of vocabulary");
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ModelConfig::FromJson(const std::string& text,
                                                  const std::string& path) {
  ASSIGN_OR_RETURN(json::Value root, json::Parse(text, path));
  if (root.kind_case() != json::Value::kStructValue) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": expected a JSON object"));
  }
  ModelConfig c;
  if (const json::Value* archs = json::Find(root, "architectures")) {
    if (archs->kind_case() != json::Value::kListValue ||
        archs->list_value().values_size() == 0 ||
        archs->list_value().values(0).kind_case() != json::Value::kStringValue) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": \"architectures\" must be a list of strings"));
    }
    c.architecture = archs->list_value().values(0).string_value();
  }
  if (c.architecture != "LlamaForCausalLM" && c.architecture != "MistralForCausalLM" &&
      c.architecture != "Qwen2ForCausalLM") {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": unsupported architecture \"", c.architecture,
        "\" in \"architectures\" (supported: LlamaForCausalLM, MistralForCausalLM, "
        "Qwen2ForCausalLM)"));
  }
  ASSIGN_OR_RETURN(c.vocab_size, json::GetInt(root, "vocab_size", path));
  ASSIGN_OR_RETURN(c.hidden_size, json::GetInt(root, "hidden_size", path));
  ASSIGN_OR_RETURN(c.intermediate_size, json::GetInt(root, "intermediate_size", path));
  ASSIGN_OR_RETURN(c.num_layers, json::GetInt(root, "num_hidden_layers", path));
  ASSIGN_OR_RETURN(c.num_heads, json::GetInt(root, "num_attention_heads", path));
  ASSIGN_OR_RETURN(c.num_kv_heads,
                   json::GetInt(root, "num_key_value_heads", path, c.num_heads));
  if (c.num_heads <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": num_attention_heads must be positive"));
  }
  ASSIGN_OR_RETURN(c.head_dim, json::GetInt(root, "head_dim", path, c.hidden_size / c.num_heads));
  ASSIGN_OR_RETURN(c.max_position_embeddings,
                   json::GetInt(root, "max_position_embeddings", path, 2048));
  ASSIGN_OR_RETURN(c.rms_norm_eps, json::GetDouble(root, "rms_norm_eps", path, 1e-5));
  ASSIGN_OR_RETURN(c.rope_theta, json::GetDouble(root, "rope_theta", path, 10000.0));
  ASSIGN_OR_RETURN(c.attention_bias, json::GetBool(root, "attention_bias", path,
                                                   c.architecture == "Qwen2ForCausalLM"));
  ASSIGN_OR_RETURN(c.tie_word_embeddings,
                   json::GetBool(root, "tie_word_embeddings", path, false));
  ASSIGN_OR_RETURN(c.bos_token_id, json::GetInt(root, "bos_token_id", path, -1));
  if (const json::Value* eos = json::Find(root, "eos_token_id")) {
    // Some configs list several EOS ids; the first is the primary one.
    if (eos->kind_case() == json::Value::kListValue && eos->list_value().values_size() > 0) {
      ASSIGN_OR_RETURN(c.eos_token_id, json::AsInt(eos->list_value().values(0), path));
    } else {
      ASSIGN_OR_RETURN(c.eos_token_id, json::AsInt(*eos, absl::StrCat(path, ": eos_token_id")));
    }
  }
  if (const json::Value* rs = json::Find(root, "rope_scaling")) {
    ASSIGN_OR_RETURN(std::string type, json::GetString(*rs, "rope_type", path, ""));
    if (type.empty()) {
      ASSIGN_OR_RETURN(type, json::GetString(*rs, "type", path, ""));
    }
    if (type != "llama3") {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": unsupported rope_scaling type \"", type, "\" (supported: llama3)"));
    }
    ASSIGN_OR_RETURN(double factor, json::GetDouble(*rs, "factor", path));
    ASSIGN_OR_RETURN(double low, json::GetDouble(*rs, "low_freq_factor", path, 1.0));
    ASSIGN_OR_RETURN(double high, json::GetDouble(*rs, "high_freq_factor", path, 4.0));
    ASSIGN_OR_RETURN(c.rope_scaling.original_max_position_embeddings,
                     json::GetInt(*rs, "original_max_position_embeddings", path, 8192));
    if (factor <= 0 || low <= 0 || high <= low) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": rope_scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0"));
    }
    c.rope_scaling.factor = static_cast<float>(factor);
    c.rope_scaling.low_freq_factor = static_cast<float>(low);
    c.rope_scaling.high_freq_factor = static_cast<float>(high);
  }
  RETURN_IF_ERROR(c.Validate());
  return c;
}

std::string ModelConfig::ToJson() const {
  std::string rope = "null";
  if (rope_scaling.factor > 0) {
    rope = absl::StrCat("{\"rope_type\": \"llama3\", \"factor\": ", json::Number(rope_scaling.factor),
                        ", \"low_freq_factor\": ", json::Number(rope_scaling.low_freq_factor),
                        ", \"high_freq_factor\": ", json::Number(rope_scaling.high_freq_factor),
                        ", \"original_max_position_embeddings\": ",
                        rope_scaling.original_max_position_embeddings, "}");
  }
  return absl::StrCat(
      "{\n  \"architectures\": [", json::Quote(architecture), "],\n",
      "  \"model_type\": \"", architecture == "Qwen2ForCausalLM" ? "qwen2" : "llama", "\",\n",
      "  \"vocab_size\": ", vocab_size, ",\n  \"hidden_size\": ", hidden_size,
      ",\n  \"intermediate_size\": ", intermediate_size,
      ",\n  \"num_hidden_layers\": ", num_layers, ",\n  \"num_attention_heads\": ", num_heads,
      ",\n  \"num_key_value_heads\": ", num_kv_heads, ",\n  \"head_dim\": ", head_dim,
      ",\n  \"max_position_embeddings\": ", max_position_embeddings,
      ",\n  \"rms_norm_eps\": ", json::Number(rms_norm_eps),
      ",\n  \"rope_theta\": ", json::Number(rope_theta), ",\n  \"rope_scaling\": ", rope,
      ",\n  \"attention_bias\": ", attention_bias ? "true" : "false",
      ",\n  \"tie_word_embeddings\": ", tie_word_embeddings ? "true" : "false",
      ",\n  \"bos_token_id\": ", bos_token_id, ",\n  \"eos_token_id\": ", eos_token_id,
      ",\n  \"torch_dtype\": \"float32\"\n}\n");
}

}  // namespace pdserve::engine
