#include "model/model_config.h"

#include "absl/strings/str_cat.h"
#include "common/json.h"
#include "common/status_macros.h"

namespace pdserve::engine {
namespace {

absl::StatusOr<std::vector<int64_t>> EosIds(const json::Value& value,
                                            const std::string& what) {
  std::vector<int64_t> ids;
  if (value.is_array()) {
    for (const json::Value& v : value) {
      ASSIGN_OR_RETURN(int64_t id,
                       json::AsInt(v, absl::StrCat(what, ": eos_token_id")));
      ids.push_back(id);
    }
  } else {
    ASSIGN_OR_RETURN(int64_t id,
                     json::AsInt(value, absl::StrCat(what, ": eos_token_id")));
    ids.push_back(id);
  }
  return ids;
}

// DeepSeek-V2/V3 fields, defaults as their DeepseekV2Config/V3Config.
absl::Status ParseDeepseek(const json::Value& root, const std::string& path,
                           ModelConfig* c) {
  const bool v3 = c->architecture == "DeepseekV3ForCausalLM";
  ASSIGN_OR_RETURN(c->q_lora_rank, json::GetInt(root, "q_lora_rank", path, 0));
  ASSIGN_OR_RETURN(c->kv_lora_rank,
                   json::GetInt(root, "kv_lora_rank", path, 512));
  ASSIGN_OR_RETURN(c->qk_nope_head_dim,
                   json::GetInt(root, "qk_nope_head_dim", path, 128));
  ASSIGN_OR_RETURN(c->qk_rope_head_dim,
                   json::GetInt(root, "qk_rope_head_dim", path, 64));
  ASSIGN_OR_RETURN(c->v_head_dim, json::GetInt(root, "v_head_dim", path, 128));
  ASSIGN_OR_RETURN(c->rope_interleave,
                   json::GetBool(root, "rope_interleave", path, true));
  c->head_dim = c->qk_nope_head_dim + c->qk_rope_head_dim;
  ASSIGN_OR_RETURN(c->num_experts,
                   json::GetInt(root, "n_routed_experts", path, 0));
  ASSIGN_OR_RETURN(c->num_experts_per_tok,
                   json::GetInt(root, "num_experts_per_tok", path, 0));
  ASSIGN_OR_RETURN(c->moe_intermediate_size,
                   json::GetInt(root, "moe_intermediate_size", path, 1407));
  ASSIGN_OR_RETURN(c->n_shared_experts,
                   json::GetInt(root, "n_shared_experts", path, 0));
  ASSIGN_OR_RETURN(c->routed_scaling_factor,
                   json::GetDouble(root, "routed_scaling_factor", path, 1.0));
  ASSIGN_OR_RETURN(c->n_group, json::GetInt(root, "n_group", path, 1));
  ASSIGN_OR_RETURN(c->topk_group, json::GetInt(root, "topk_group", path, 1));
  ASSIGN_OR_RETURN(c->norm_topk_prob,
                   json::GetBool(root, "norm_topk_prob", path, v3));
  ASSIGN_OR_RETURN(c->first_k_dense_replace,
                   json::GetInt(root, "first_k_dense_replace", path, 0));
  ASSIGN_OR_RETURN(c->moe_layer_freq,
                   json::GetInt(root, "moe_layer_freq", path, 1));
  ASSIGN_OR_RETURN(
      std::string topk,
      json::GetString(root, "topk_method", path, v3 ? "noaux_tc" : "greedy"));
  if (topk == "greedy") {
    c->moe_topk = ModelConfig::MoeTopk::kGreedy;
  } else if (topk == "group_limited_greedy") {
    c->moe_topk = ModelConfig::MoeTopk::kGroupLimitedGreedy;
  } else if (topk == "noaux_tc") {
    c->moe_topk = ModelConfig::MoeTopk::kNoauxTc;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": unsupported topk_method \"", topk,
                     "\" (supported: greedy, group_limited_greedy, noaux_tc)"));
  }
  ASSIGN_OR_RETURN(
      std::string scoring,
      json::GetString(root, "scoring_func", path, v3 ? "sigmoid" : "softmax"));
  if (scoring == "softmax") {
    c->moe_scoring = ModelConfig::MoeScoring::kSoftmax;
  } else if (scoring == "sigmoid") {
    c->moe_scoring = ModelConfig::MoeScoring::kSigmoid;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": unsupported scoring_func \"", scoring,
                     "\" (supported: softmax, sigmoid)"));
  }
  if (c->moe_topk == ModelConfig::MoeTopk::kNoauxTc &&
      c->moe_scoring != ModelConfig::MoeScoring::kSigmoid) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": topk_method noaux_tc needs scoring_func sigmoid"));
  }
  ASSIGN_OR_RETURN(std::string act,
                   json::GetString(root, "hidden_act", path, "silu"));
  if (act != "silu") {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": unsupported hidden_act \"", act, "\" (supported: silu)"));
  }
  return absl::OkStatus();
}

// DeepSeek's rope_scaling: {"type": "yarn", "factor", "beta_fast",
// "beta_slow", "mscale", "mscale_all_dim", "original_max_position_embeddings"}.
absl::Status ParseYarn(const json::Value& rs, const std::string& path,
                       ModelConfig* c) {
  ASSIGN_OR_RETURN(std::string type,
                   json::GetString(rs, "rope_type", path, ""));
  if (type.empty()) {
    ASSIGN_OR_RETURN(type, json::GetString(rs, "type", path, ""));
  }
  if (type != "yarn") {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": unsupported rope_scaling type \"", type,
                     "\" for DeepSeek (supported: yarn)"));
  }
  ModelConfig::Yarn& y = c->yarn;
  ASSIGN_OR_RETURN(y.factor, json::GetDouble(rs, "factor", path));
  ASSIGN_OR_RETURN(
      y.original_max_position_embeddings,
      json::GetInt(rs, "original_max_position_embeddings", path, 4096));
  ASSIGN_OR_RETURN(y.beta_fast, json::GetDouble(rs, "beta_fast", path, 32.0));
  ASSIGN_OR_RETURN(y.beta_slow, json::GetDouble(rs, "beta_slow", path, 1.0));
  ASSIGN_OR_RETURN(y.mscale, json::GetDouble(rs, "mscale", path, 1.0));
  ASSIGN_OR_RETURN(y.mscale_all_dim,
                   json::GetDouble(rs, "mscale_all_dim", path, 0.0));
  return absl::OkStatus();
}

}  // namespace

absl::Status ModelConfig::Validate() const {
  auto bad = [](const std::string& m) {
    return absl::InvalidArgumentError(absl::StrCat("model config: ", m));
  };
  if (vocab_size <= 0 || hidden_size <= 0 || intermediate_size <= 0 ||
      num_layers <= 0 || num_heads <= 0 || num_kv_heads <= 0 || head_dim <= 0) {
    return bad(
        "vocab_size, hidden_size, intermediate_size, num_hidden_layers, "
        "num_attention_heads, num_key_value_heads and head_dim must be "
        "positive");
  }
  if (num_heads % num_kv_heads != 0) {
    return bad(absl::StrCat("num_attention_heads (", num_heads,
                            ") must be a multiple of num_key_value_heads (",
                            num_kv_heads, ")"));
  }
  if (head_dim % 2 != 0 || head_dim > 1024) {
    return bad(
        absl::StrCat("head_dim must be even and at most 1024, got ", head_dim));
  }
  if (vocab_size > (int64_t{1} << 31) || hidden_size > (1 << 20) ||
      intermediate_size > (1 << 22) || num_layers > 1024 || num_heads > 1024) {
    return bad("dimensions are implausibly large");
  }
  if (rms_norm_eps <= 0 || rope_theta <= 0 || max_position_embeddings <= 0) {
    return bad(
        "rms_norm_eps, rope_theta and max_position_embeddings must be "
        "positive");
  }
  if (bos_token_id >= vocab_size || eos_token_id >= vocab_size) {
    return bad("bos_token_id/eos_token_id out of vocabulary");
  }
  for (int64_t id : eos_token_ids) {
    if (id < 0 || id >= vocab_size)
      return bad("eos_token_id out of vocabulary");
  }
  if (num_experts < 0 || num_experts > 4096) {
    return bad(
        absl::StrCat("num_experts must be in [0, 4096], got ", num_experts));
  }
  if (num_experts > 0) {
    if (num_experts_per_tok < 1 || num_experts_per_tok > num_experts) {
      return bad(absl::StrCat("num_experts_per_tok must be in [1, num_experts ",
                              num_experts, "], got ", num_experts_per_tok));
    }
    if (moe_intermediate_size <= 0 || moe_intermediate_size > (1 << 22)) {
      return bad("the experts' intermediate size must be in [1, 2^22]");
    }
    if (decoder_sparse_step < 1) {
      return bad("decoder_sparse_step must be at least 1");
    }
  }
  if (IsDeepseek()) {
    if (kv_lora_rank <= 0 || kv_lora_rank > 8192 || q_lora_rank < 0 ||
        q_lora_rank > 65536 || qk_nope_head_dim <= 0 ||
        qk_nope_head_dim > 1024 || v_head_dim <= 0 || v_head_dim > 1024 ||
        qk_rope_head_dim <= 0 || qk_rope_head_dim % 2 != 0 ||
        qk_rope_head_dim > 1024) {
      return bad(
          "MLA needs kv_lora_rank in [1, 8192], q_lora_rank in [0, 65536] "
          "(0: none), qk_nope_head_dim and v_head_dim in [1, 1024] and an "
          "even qk_rope_head_dim in [2, 1024]");
    }
    if (first_k_dense_replace < 0 || moe_layer_freq < 1) {
      return bad("first_k_dense_replace must be >= 0 and moe_layer_freq >= 1");
    }
    if (n_shared_experts < 0 || n_shared_experts > 64) {
      return bad("n_shared_experts must be in [0, 64]");
    }
    if (!(routed_scaling_factor > 0) || routed_scaling_factor > 1e6) {
      return bad("routed_scaling_factor must be in (0, 1e6]");
    }
    if (attention_bias) {
      return bad("DeepSeek attention_bias is not supported");
    }
    if (num_experts > 0) {
      if (moe_topk != MoeTopk::kGreedy) {
        if (n_group < 1 || num_experts % n_group != 0 || topk_group < 1 ||
            topk_group > n_group) {
          return bad(absl::StrCat(
              "grouped top-k needs n_group dividing n_routed_experts (",
              num_experts, ") and topk_group in [1, n_group], got n_group ",
              n_group, ", topk_group ", topk_group));
        }
        const int64_t per_group = num_experts / n_group;
        if (num_experts_per_tok > topk_group * per_group ||
            (moe_topk == MoeTopk::kNoauxTc && per_group < 2)) {
          return bad(
              "grouped top-k: the chosen groups must hold num_experts_per_tok "
              "experts (noaux_tc: at least 2 per group)");
        }
      }
    }
    if (yarn.factor < 0 || yarn.factor > 1e6 ||
        yarn.original_max_position_embeddings <= 0 || !(yarn.beta_fast > 0) ||
        !(yarn.beta_slow > 0)) {
      return bad(
          "yarn rope_scaling needs factor in [0, 1e6], beta_fast and "
          "beta_slow > 0 and a positive original_max_position_embeddings");
    }
  }
  return absl::OkStatus();
}

bool ModelConfig::IsDeepseek() const {
  return architecture == "DeepseekV2ForCausalLM" ||
         architecture == "DeepseekV3ForCausalLM";
}

KvCacheSpec ModelConfig::KvSpec(int32_t block_size, DType dtype) const {
  KvCacheSpec spec{static_cast<int32_t>(num_layers),
                   static_cast<int32_t>(num_kv_heads),
                   static_cast<int32_t>(head_dim), block_size, dtype};
  if (IsMla()) {
    spec.num_kv_heads = 1;
    spec.head_dim = static_cast<int32_t>(kv_lora_rank + qk_rope_head_dim);
    spec.kv_lora_rank = static_cast<int32_t>(kv_lora_rank);
    spec.qk_rope_head_dim = static_cast<int32_t>(qk_rope_head_dim);
  }
  return spec;
}

bool ModelConfig::IsMoeLayer(int64_t layer) const {
  if (num_experts <= 0) return false;
  if (IsDeepseek()) {
    return layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
  }
  for (int64_t l : mlp_only_layers) {
    if (l == layer) return false;
  }
  return (layer + 1) % decoder_sparse_step == 0;
}

bool ModelConfig::IsEos(int64_t token) const {
  if (token == eos_token_id) return true;
  for (int64_t id : eos_token_ids) {
    if (id == token) return true;
  }
  return false;
}

absl::StatusOr<ModelConfig> ModelConfig::FromJson(const std::string& text,
                                                  const std::string& path) {
  ASSIGN_OR_RETURN(json::Value root, json::Parse(text, path));
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": expected a JSON object"));
  }
  ModelConfig c;
  if (const json::Value* archs = json::Find(root, "architectures")) {
    const std::string* first = archs->is_array() && !archs->empty()
                                   ? json::StringOrNull(&archs->front())
                                   : nullptr;
    if (first == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": \"architectures\" must be a list of strings"));
    }
    c.architecture = *first;
  }
  if (c.architecture != "LlamaForCausalLM" &&
      c.architecture != "MistralForCausalLM" &&
      c.architecture != "Qwen2ForCausalLM" &&
      c.architecture != "Qwen3ForCausalLM" &&
      c.architecture != "MixtralForCausalLM" &&
      c.architecture != "Qwen3MoeForCausalLM" && !c.IsDeepseek()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": unsupported architecture \"", c.architecture,
        "\" in \"architectures\" (supported: LlamaForCausalLM, "
        "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
        "MixtralForCausalLM, Qwen3MoeForCausalLM, DeepseekV2ForCausalLM, "
        "DeepseekV3ForCausalLM)"));
  }
  c.qk_norm = c.architecture == "Qwen3ForCausalLM" ||
              c.architecture == "Qwen3MoeForCausalLM";
  ASSIGN_OR_RETURN(c.vocab_size, json::GetInt(root, "vocab_size", path));
  ASSIGN_OR_RETURN(c.hidden_size, json::GetInt(root, "hidden_size", path));
  ASSIGN_OR_RETURN(c.intermediate_size,
                   json::GetInt(root, "intermediate_size", path));
  ASSIGN_OR_RETURN(c.num_layers, json::GetInt(root, "num_hidden_layers", path));
  ASSIGN_OR_RETURN(c.num_heads,
                   json::GetInt(root, "num_attention_heads", path));
  ASSIGN_OR_RETURN(c.num_kv_heads, json::GetInt(root, "num_key_value_heads",
                                                path, c.num_heads));
  if (c.num_heads <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": num_attention_heads must be positive"));
  }
  ASSIGN_OR_RETURN(c.head_dim, json::GetInt(root, "head_dim", path,
                                            c.hidden_size / c.num_heads));
  ASSIGN_OR_RETURN(c.max_position_embeddings,
                   json::GetInt(root, "max_position_embeddings", path, 2048));
  // Defaults as transformers' MixtralConfig and Qwen3MoeConfig.
  if (c.architecture == "MixtralForCausalLM") {
    ASSIGN_OR_RETURN(c.num_experts,
                     json::GetInt(root, "num_local_experts", path, 8));
    ASSIGN_OR_RETURN(c.num_experts_per_tok,
                     json::GetInt(root, "num_experts_per_tok", path, 2));
    c.moe_intermediate_size = c.intermediate_size;
    c.norm_topk_prob = true;
  } else if (c.architecture == "Qwen3MoeForCausalLM") {
    ASSIGN_OR_RETURN(c.num_experts,
                     json::GetInt(root, "num_experts", path, 128));
    ASSIGN_OR_RETURN(c.num_experts_per_tok,
                     json::GetInt(root, "num_experts_per_tok", path, 8));
    ASSIGN_OR_RETURN(c.moe_intermediate_size,
                     json::GetInt(root, "moe_intermediate_size", path, 768));
    ASSIGN_OR_RETURN(c.norm_topk_prob,
                     json::GetBool(root, "norm_topk_prob", path, false));
    ASSIGN_OR_RETURN(c.decoder_sparse_step,
                     json::GetInt(root, "decoder_sparse_step", path, 1));
    if (const json::Value* only = json::Find(root, "mlp_only_layers")) {
      if (!only->is_array()) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": \"mlp_only_layers\" must be a list"));
      }
      for (const json::Value& v : *only) {
        ASSIGN_OR_RETURN(
            int64_t layer,
            json::AsInt(v, absl::StrCat(path, ": mlp_only_layers"), 0));
        c.mlp_only_layers.push_back(layer);
      }
    }
  }
  if (c.IsDeepseek()) RETURN_IF_ERROR(ParseDeepseek(root, path, &c));
  // Sliding-window attention (Mistral v0.1) equals full attention while a
  // sequence fits in the window, so the context is capped at the window.
  // Qwen2/Qwen3 configs name a window but switch it off (use_sliding_window).
  if (json::Find(root, "sliding_window") != nullptr) {
    ASSIGN_OR_RETURN(bool use_window,
                     json::GetBool(root, "use_sliding_window", path, true));
    ASSIGN_OR_RETURN(int64_t window,
                     json::GetInt(root, "sliding_window", path));
    if (use_window && window > 0 && window < c.max_position_embeddings) {
      c.max_position_embeddings = window;
    }
  }
  ASSIGN_OR_RETURN(c.rms_norm_eps,
                   json::GetDouble(root, "rms_norm_eps", path, 1e-5));
  ASSIGN_OR_RETURN(c.rope_theta,
                   json::GetDouble(root, "rope_theta", path, 10000.0));
  ASSIGN_OR_RETURN(c.attention_bias,
                   json::GetBool(root, "attention_bias", path,
                                 c.architecture == "Qwen2ForCausalLM"));
  ASSIGN_OR_RETURN(c.tie_word_embeddings,
                   json::GetBool(root, "tie_word_embeddings", path, false));
  ASSIGN_OR_RETURN(c.bos_token_id,
                   json::GetInt(root, "bos_token_id", path, -1));
  if (const json::Value* eos = json::Find(root, "eos_token_id")) {
    // Some configs list several EOS ids; the first is the primary one.
    ASSIGN_OR_RETURN(c.eos_token_ids, EosIds(*eos, path));
    if (!c.eos_token_ids.empty()) c.eos_token_id = c.eos_token_ids[0];
  }
  const json::Value* rs = json::Find(root, "rope_scaling");
  if (rs != nullptr && c.IsDeepseek()) {
    RETURN_IF_ERROR(ParseYarn(*rs, path, &c));
  } else if (rs != nullptr) {
    ASSIGN_OR_RETURN(std::string type,
                     json::GetString(*rs, "rope_type", path, ""));
    if (type.empty()) {
      ASSIGN_OR_RETURN(type, json::GetString(*rs, "type", path, ""));
    }
    if (type != "llama3") {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": unsupported rope_scaling type \"", type,
                       "\" (supported: llama3)"));
    }
    ASSIGN_OR_RETURN(double factor, json::GetDouble(*rs, "factor", path));
    ASSIGN_OR_RETURN(double low,
                     json::GetDouble(*rs, "low_freq_factor", path, 1.0));
    ASSIGN_OR_RETURN(double high,
                     json::GetDouble(*rs, "high_freq_factor", path, 4.0));
    ASSIGN_OR_RETURN(
        c.rope_scaling.original_max_position_embeddings,
        json::GetInt(*rs, "original_max_position_embeddings", path, 8192));
    // The factors are stored as float: larger values would become infinite.
    const double kMaxFactor = 1e30;
    if (factor <= 0 || low <= 0 || high <= low || factor > kMaxFactor ||
        high > kMaxFactor) {
      return absl::InvalidArgumentError(
          absl::StrCat(path,
                       ": rope_scaling needs factor > 0 and high_freq_factor > "
                       "low_freq_factor > 0, all at most 1e30"));
    }
    c.rope_scaling.factor = static_cast<float>(factor);
    c.rope_scaling.low_freq_factor = static_cast<float>(low);
    c.rope_scaling.high_freq_factor = static_cast<float>(high);
  }
  RETURN_IF_ERROR(c.Validate());
  return c;
}

absl::Status ModelConfig::AddGenerationConfig(const std::string& text,
                                              const std::string& path) {
  ASSIGN_OR_RETURN(json::Value root, json::Parse(text, path));
  if (const json::Value* eos = json::Find(root, "eos_token_id")) {
    ASSIGN_OR_RETURN(std::vector<int64_t> ids, EosIds(*eos, path));
    for (int64_t id : ids) {
      if (id < 0 || id >= vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": eos_token_id ", id, " out of vocabulary"));
      }
      if (!IsEos(id)) eos_token_ids.push_back(id);
    }
    if (eos_token_id < 0 && !ids.empty()) eos_token_id = ids[0];
    if (eos_token_ids.empty() && eos_token_id >= 0)
      eos_token_ids.push_back(eos_token_id);
  }
  if (bos_token_id < 0) {
    ASSIGN_OR_RETURN(bos_token_id, json::GetInt(root, "bos_token_id", path, -1,
                                                -1, vocab_size - 1));
  }
  return absl::OkStatus();
}

std::string ModelConfig::ToJson() const {
  json::OrderedValue rope;  // null without rope scaling
  if (rope_scaling.factor > 0) {
    rope = {{"rope_type", "llama3"},
            {"factor", rope_scaling.factor},
            {"low_freq_factor", rope_scaling.low_freq_factor},
            {"high_freq_factor", rope_scaling.high_freq_factor},
            {"original_max_position_embeddings",
             rope_scaling.original_max_position_embeddings}};
  }
  const char* model_type =
      architecture == "Qwen2ForCausalLM"        ? "qwen2"
      : architecture == "Qwen3ForCausalLM"      ? "qwen3"
      : architecture == "MistralForCausalLM"    ? "mistral"
      : architecture == "MixtralForCausalLM"    ? "mixtral"
      : architecture == "Qwen3MoeForCausalLM"   ? "qwen3_moe"
      : architecture == "DeepseekV2ForCausalLM" ? "deepseek_v2"
      : architecture == "DeepseekV3ForCausalLM" ? "deepseek_v3"
                                                : "llama";
  // No EOS is written as null: -1 would read back as an out-of-vocabulary id.
  json::OrderedValue eos;
  if (eos_token_ids.size() > 1) {
    eos = eos_token_ids;
  } else if (eos_token_id >= 0) {
    eos = eos_token_id;
  }
  json::OrderedValue config = {
      {"architectures", json::OrderedValue::array({architecture})},
      {"model_type", model_type},
      {"vocab_size", vocab_size},
      {"hidden_size", hidden_size},
      {"intermediate_size", intermediate_size},
      {"num_hidden_layers", num_layers},
      {"num_attention_heads", num_heads},
      {"num_key_value_heads", num_kv_heads},
      {"head_dim", head_dim},
      {"max_position_embeddings", max_position_embeddings},
      {"rms_norm_eps", rms_norm_eps},
      {"rope_theta", rope_theta},
      {"rope_scaling", rope},
      {"attention_bias", attention_bias},
      {"tie_word_embeddings", tie_word_embeddings},
      {"bos_token_id", bos_token_id},
      {"eos_token_id", eos},
      {"torch_dtype", "float32"}};
  if (architecture == "MixtralForCausalLM") {
    config["num_local_experts"] = num_experts;
    config["num_experts_per_tok"] = num_experts_per_tok;
  } else if (architecture == "Qwen3MoeForCausalLM") {
    config["num_experts"] = num_experts;
    config["num_experts_per_tok"] = num_experts_per_tok;
    config["moe_intermediate_size"] = moe_intermediate_size;
    config["norm_topk_prob"] = norm_topk_prob;
    config["decoder_sparse_step"] = decoder_sparse_step;
    config["mlp_only_layers"] = mlp_only_layers;
  } else if (IsDeepseek()) {
    // head_dim is derived (qk_nope + qk_rope); DeepSeek configs carry none.
    config.erase("head_dim");
    if (yarn.factor > 0) {
      config["rope_scaling"] = {{"type", "yarn"},
                                {"factor", yarn.factor},
                                {"original_max_position_embeddings",
                                 yarn.original_max_position_embeddings},
                                {"beta_fast", yarn.beta_fast},
                                {"beta_slow", yarn.beta_slow},
                                {"mscale", yarn.mscale},
                                {"mscale_all_dim", yarn.mscale_all_dim}};
    }
    json::OrderedValue q_lora;  // null: no q LoRA
    if (q_lora_rank > 0) q_lora = q_lora_rank;
    config["q_lora_rank"] = q_lora;
    config["kv_lora_rank"] = kv_lora_rank;
    config["qk_nope_head_dim"] = qk_nope_head_dim;
    config["qk_rope_head_dim"] = qk_rope_head_dim;
    config["v_head_dim"] = v_head_dim;
    if (!rope_interleave) config["rope_interleave"] = false;
    config["n_routed_experts"] = num_experts;
    config["n_shared_experts"] = n_shared_experts;
    config["num_experts_per_tok"] = num_experts_per_tok;
    config["moe_intermediate_size"] = moe_intermediate_size;
    config["routed_scaling_factor"] = routed_scaling_factor;
    config["topk_method"] = moe_topk == MoeTopk::kNoauxTc ? "noaux_tc"
                            : moe_topk == MoeTopk::kGroupLimitedGreedy
                                ? "group_limited_greedy"
                                : "greedy";
    config["scoring_func"] =
        moe_scoring == MoeScoring::kSigmoid ? "sigmoid" : "softmax";
    config["n_group"] = n_group;
    config["topk_group"] = topk_group;
    config["norm_topk_prob"] = norm_topk_prob;
    config["first_k_dense_replace"] = first_k_dense_replace;
    config["moe_layer_freq"] = moe_layer_freq;
    config["hidden_act"] = "silu";
  }
  return json::DumpLines(config) + "\n";
}

}  // namespace pdserve::engine
