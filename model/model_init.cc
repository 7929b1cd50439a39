#include "model/model_init.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/json.h"
#include "common/status_macros.h"
#include "model/moe.h"
#include "model/safetensors.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::engine {
namespace {

// SplitMix64 + Box-Muller: fully specified here, so the weights do not depend
// on the standard library's distribution implementations.
class NormalGenerator {
 public:
  explicit NormalGenerator(uint64_t seed)
      : state_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  float Next() {
    const double u1 = (static_cast<double>(NextU64() >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(NextU64() >> 11) * 0x1.0p-53;
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) *
                              std::cos(2 * M_PI * u2));
  }

 private:
  uint64_t NextU64() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint64_t state_;
};

absl::Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.close();
  if (!out)
    return absl::PermissionDeniedError(absl::StrCat(path, ": cannot write"));
  return absl::OkStatus();
}

}  // namespace

namespace {

// A preset's shape. The family presets copy their family's config at tiny
// size: which attention layout, RoPE, bias, norms and embedding tying it has.
struct PresetShape {
  const char* name;
  const char* architecture;
  int64_t hidden, intermediate, layers, heads, kv_heads, head_dim, max_position;
  double rope_theta, rms_norm_eps;
  bool qkv_bias = false, qk_norm = false, tied = false;
  // "llama3" RoPE scaling: factor 8, low/high frequency factors 1 and 4, and
  // an original context of 256 (8192 in Llama 3.1) so that every frequency
  // band is exercised at test lengths.
  bool llama3_rope = false;
  int64_t vocab = 0;  // 0: the byte vocabulary
  // Written in this dtype unless --dtype says otherwise.
  DType default_dtype = DType::kF32;
  // Mixture of experts (0: dense); moe_intermediate 0: `intermediate`.
  int64_t experts = 0, experts_per_tok = 0, moe_intermediate = 0;
  bool norm_topk_prob = false;
  int64_t dense_layer = -1;  // Qwen3-MoE mlp_only_layers = [dense_layer]
  // DeepSeek MLA (kv_lora > 0) and MoE: ranks and head widths, routing.
  int64_t q_lora = 0, kv_lora = 0, qk_nope = 0, qk_rope = 0, v_head = 0;
  int64_t shared_experts = 0, first_dense = 0, n_group = 1, topk_group = 1;
  double routed_scale = 1.0;
  ModelConfig::MoeTopk topk = ModelConfig::MoeTopk::kGreedy;
  // DeepSeek YaRN: factor 40 from an original 4096 context, as the real
  // configs; mscale == mscale_all_dim (so the cos/sin factor is 1 and the
  // softmax scale grows by mscale(40, m)^2).
  double yarn_mscale = 0;  // 0: no rope_scaling
};

constexpr PresetShape kPresets[] = {
    // Tests and the demo.
    {"tiny", "LlamaForCausalLM", 64, 160, 2, 4, 2, 16, 2048, 1e4, 1e-5},
    {"small", "LlamaForCausalLM", 512, 1408, 8, 8, 2, 64, 4096, 1e4, 1e-5},
    // Llama 2: multi-head attention (no GQA), untied embeddings.
    {"llama2", "LlamaForCausalLM", 64, 172, 2, 4, 4, 16, 4096, 1e4, 1e-5},
    // Llama 3: GQA 4:1, rope_theta 5e5; 3.1 adds the llama3 RoPE scaling.
    {"llama3", "LlamaForCausalLM", 64, 224, 2, 8, 2, 8, 2048, 5e5, 1e-5},
    {"llama3.1", "LlamaForCausalLM", 64, 224, 2, 8, 2, 8, 2048, 5e5, 1e-5,
     false, false, false, true},
    // Mistral 7B: GQA 4:1, rope_theta 1e6.
    {"mistral", "MistralForCausalLM", 64, 224, 2, 8, 2, 8, 4096, 1e6, 1e-5},
    // Qwen2.5: q/k/v bias, GQA, rms eps 1e-6, tied embeddings.
    {"qwen2", "Qwen2ForCausalLM", 64, 192, 2, 4, 1, 16, 4096, 1e6, 1e-6, true,
     false, true},
    // Qwen3: RMSNorm on each q/k head, head_dim larger than hidden / heads,
    // no bias, tied embeddings.
    {"qwen3", "Qwen3ForCausalLM", 64, 192, 2, 4, 2, 32, 4096, 1e6, 1e-6, false,
     true, true},
    // Llama 3.2 1B at full size (random weights, byte tokenizer over the
    // real 128256-entry vocabulary): for benchmarks and accuracy figures.
    {"llama3.2-1b", "LlamaForCausalLM", 2048, 8192, 16, 32, 8, 64, 131072, 5e5,
     1e-5, false, false, true, false, 128256, DType::kBF16},
    // Mixtral 8x7B: 8 experts of intermediate_size, softmax top-2
    // renormalised, GQA 4:1, rope_theta 1e6, untied.
    {.name = "mixtral",
     .architecture = "MixtralForCausalLM",
     .hidden = 64,
     .intermediate = 96,
     .layers = 2,
     .heads = 8,
     .kv_heads = 2,
     .head_dim = 8,
     .max_position = 4096,
     .rope_theta = 1e6,
     .rms_norm_eps = 1e-5,
     .experts = 8,
     .experts_per_tok = 2},
    // Qwen3-MoE (30B-A3B's shape): Qwen3 attention (q/k norm), 8 experts of
    // moe_intermediate_size, top-3 with norm_topk_prob; the middle layer is
    // dense (mlp_only_layers) with the larger intermediate_size.
    {.name = "qwen3-moe",
     .architecture = "Qwen3MoeForCausalLM",
     .hidden = 64,
     .intermediate = 192,
     .layers = 3,
     .heads = 4,
     .kv_heads = 2,
     .head_dim = 32,
     .max_position = 4096,
     .rope_theta = 1e6,
     .rms_norm_eps = 1e-6,
     .qk_norm = true,
     .experts = 8,
     .experts_per_tok = 3,
     .moe_intermediate = 48,
     .norm_topk_prob = true,
     .dense_layer = 1},
    // DeepSeek-V2 (the full model's routing at tiny size): MLA without q
    // LoRA (as V2-Lite), v_head_dim != qk_nope_head_dim, a dense first layer,
    // 8 softmax-scored experts in 4 groups, group_limited_greedy top-3 from
    // the best 2 groups, no renormalisation, routed_scaling_factor 2, two
    // shared experts, YaRN with mscale 0.707.
    {.name = "deepseek-v2",
     .architecture = "DeepseekV2ForCausalLM",
     .hidden = 64,
     .intermediate = 160,
     .layers = 3,
     .heads = 4,
     .kv_heads = 4,
     .head_dim = 24,
     .max_position = 4096,
     .rope_theta = 1e4,
     .rms_norm_eps = 1e-6,
     .experts = 8,
     .experts_per_tok = 3,
     .moe_intermediate = 32,
     .kv_lora = 32,
     .qk_nope = 16,
     .qk_rope = 8,
     .v_head = 12,
     .shared_experts = 2,
     .first_dense = 1,
     .n_group = 4,
     .topk_group = 2,
     .routed_scale = 2.0,
     .topk = ModelConfig::MoeTopk::kGroupLimitedGreedy,
     .yarn_mscale = 0.707},
    // DeepSeek-V3: MLA with q LoRA, sigmoid scores with
    // e_score_correction_bias, noaux_tc top-2 from the best 2 of 4 groups
    // (groups ranked by their two best biased scores), renormalised then
    // scaled by 2.5, one shared expert, a dense first layer, YaRN mscale 1.
    {.name = "deepseek-v3",
     .architecture = "DeepseekV3ForCausalLM",
     .hidden = 64,
     .intermediate = 160,
     .layers = 3,
     .heads = 4,
     .kv_heads = 4,
     .head_dim = 24,
     .max_position = 4096,
     .rope_theta = 1e4,
     .rms_norm_eps = 1e-6,
     .experts = 8,
     .experts_per_tok = 2,
     .moe_intermediate = 32,
     .norm_topk_prob = true,
     .q_lora = 48,
     .kv_lora = 32,
     .qk_nope = 16,
     .qk_rope = 8,
     .v_head = 12,
     .shared_experts = 1,
     .first_dense = 1,
     .n_group = 4,
     .topk_group = 2,
     .routed_scale = 2.5,
     .topk = ModelConfig::MoeTopk::kNoauxTc,
     .yarn_mscale = 1.0},
};

}  // namespace

absl::StatusOr<ModelConfig> PresetConfig(const std::string& preset) {
  for (const PresetShape& p : kPresets) {
    if (preset != p.name) continue;
    ModelConfig c;
    c.vocab_size = p.vocab > 0 ? p.vocab : ByteTokenizer::kVocab;
    c.bos_token_id = ByteTokenizer::kBos;
    c.eos_token_id = ByteTokenizer::kEos;
    c.architecture = p.architecture;
    c.hidden_size = p.hidden;
    c.intermediate_size = p.intermediate;
    c.num_layers = p.layers;
    c.num_heads = p.heads;
    c.num_kv_heads = p.kv_heads;
    c.head_dim = p.head_dim;
    c.max_position_embeddings = p.max_position;
    c.rope_theta = p.rope_theta;
    c.rms_norm_eps = p.rms_norm_eps;
    c.attention_bias = p.qkv_bias;
    c.qk_norm = p.qk_norm;
    c.tie_word_embeddings = p.tied;
    if (p.experts > 0) {
      c.num_experts = p.experts;
      c.num_experts_per_tok = p.experts_per_tok;
      c.moe_intermediate_size =
          p.moe_intermediate > 0 ? p.moe_intermediate : p.intermediate;
      c.norm_topk_prob =
          p.norm_topk_prob || c.architecture == "MixtralForCausalLM";
      if (p.dense_layer >= 0) c.mlp_only_layers = {p.dense_layer};
    }
    if (p.kv_lora > 0) {
      c.q_lora_rank = p.q_lora;
      c.kv_lora_rank = p.kv_lora;
      c.qk_nope_head_dim = p.qk_nope;
      c.qk_rope_head_dim = p.qk_rope;
      c.v_head_dim = p.v_head;
      c.head_dim = p.qk_nope + p.qk_rope;
      c.n_shared_experts = p.shared_experts;
      c.first_k_dense_replace = p.first_dense;
      c.n_group = p.n_group;
      c.topk_group = p.topk_group;
      c.routed_scaling_factor = p.routed_scale;
      c.moe_topk = p.topk;
      c.moe_scoring = p.topk == ModelConfig::MoeTopk::kNoauxTc
                          ? ModelConfig::MoeScoring::kSigmoid
                          : ModelConfig::MoeScoring::kSoftmax;
      if (p.yarn_mscale > 0) {
        c.yarn.factor = 40;
        c.yarn.original_max_position_embeddings = 4096;
        c.yarn.mscale = p.yarn_mscale;
        c.yarn.mscale_all_dim = p.yarn_mscale;
      }
    }
    if (p.llama3_rope) {
      c.rope_scaling.factor = 8.0;
      c.rope_scaling.low_freq_factor = 1.0;
      c.rope_scaling.high_freq_factor = 4.0;
      c.rope_scaling.original_max_position_embeddings = 256;
    }
    return c;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown preset \"", preset,
      "\" (choose one of: ", absl::StrJoin(PresetNames(), ", "), ")"));
}

std::vector<std::string> PresetNames() {
  std::vector<std::string> names;
  for (const PresetShape& p : kPresets) names.push_back(p.name);
  return names;
}

absl::StatusOr<DType> ParseModelFileDtype(absl::string_view name) {
  const std::optional<DType> d =
      ParseDType(std::string_view(name.data(), name.size()));
  if (!d || (*d != DType::kF32 && *d != DType::kF16 && *d != DType::kBF16)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--dtype must be fp32, fp16 or bf16, got \"", name, "\""));
  }
  return *d;
}

const char* TorchDtypeName(DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return "float16";
    case DType::kBF16:
      return "bfloat16";
    default:
      return "float32";
  }
}

DType PresetDefaultDtype(const std::string& preset) {
  for (const PresetShape& p : kPresets) {
    if (preset == p.name) return p.default_dtype;
  }
  return DType::kF32;
}

namespace {

// DeepSeek MLA projections of one layer (prefix "model.layers.L."), each
// scaled by 1/sqrt(fan-in) as the dense ones.
template <typename AddFn>
void AddMlaTensors(const ModelConfig& c, const std::string& p, AddFn& add) {
  const int64_t h = c.hidden_size, heads = c.num_heads;
  const int64_t qh = c.qk_nope_head_dim + c.qk_rope_head_dim;
  auto inv_sqrt = [](int64_t n) {
    return 1.0f / std::sqrt(static_cast<float>(n));
  };
  const std::string a = p + "self_attn.";
  if (c.q_lora_rank > 0) {
    add(a + "q_a_proj.weight", {c.q_lora_rank, h}, inv_sqrt(h), 0.0f);
    add(a + "q_a_layernorm.weight", {c.q_lora_rank}, 0.1f, 1.0f);
    add(a + "q_b_proj.weight", {heads * qh, c.q_lora_rank},
        inv_sqrt(c.q_lora_rank), 0.0f);
  } else {
    add(a + "q_proj.weight", {heads * qh, h}, inv_sqrt(h), 0.0f);
  }
  add(a + "kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, h},
      inv_sqrt(h), 0.0f);
  add(a + "kv_a_layernorm.weight", {c.kv_lora_rank}, 0.1f, 1.0f);
  add(a + "kv_b_proj.weight",
      {heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank},
      inv_sqrt(c.kv_lora_rank), 0.0f);
  add(a + "o_proj.weight", {h, heads * c.v_head_dim},
      inv_sqrt(heads * c.v_head_dim), 0.0f);
}

// DeepSeek's e_score_correction_bias (noaux_tc) and shared experts.
template <typename AddFn>
void AddDeepseekMoeTensors(const ModelConfig& c, int64_t layer, AddFn& add) {
  const int64_t h = c.hidden_size;
  if (c.moe_topk == ModelConfig::MoeTopk::kNoauxTc) {
    // Small next to the sigmoid scores' spread, so it shifts but rarely
    // overturns the choice.
    add(MoeRouterTensor(c, layer) + ".e_score_correction_bias", {c.num_experts},
        0.05f, 0.0f);
  }
  if (c.n_shared_experts > 0) {
    const int64_t shared = c.n_shared_experts * c.moe_intermediate_size;
    const std::string sp =
        absl::StrCat("model.layers.", layer, ".mlp.shared_experts.");
    const float in_h = 1.0f / std::sqrt(static_cast<float>(h));
    add(sp + "gate_proj.weight", {shared, h}, in_h, 0.0f);
    add(sp + "up_proj.weight", {shared, h}, in_h, 0.0f);
    add(sp + "down_proj.weight", {h, shared},
        1.0f / std::sqrt(static_cast<float>(shared)), 0.0f);
  }
}

}  // namespace

absl::StatusOr<std::string> PresetConfigJson(const std::string& preset,
                                             DType weight_dtype) {
  ASSIGN_OR_RETURN(ModelConfig c, PresetConfig(preset));
  // ModelConfig::ToJson describes the architecture; the dtype is the file's.
  // (Our own output: it parses; the key order is kept.)
  json::OrderedValue config = json::OrderedValue::parse(
      c.ToJson(), nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object())
    return absl::InternalError("config.json: ModelConfig::ToJson is not JSON");
  config["torch_dtype"] = TorchDtypeName(weight_dtype);
  return json::DumpLines(config) + "\n";
}

absl::Status WriteRandomModel(const ModelInitOptions& options) {
  ASSIGN_OR_RETURN(ModelConfig c, PresetConfig(options.preset));
  std::error_code ec;
  std::filesystem::create_directories(options.out_dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(absl::StrCat(
        options.out_dir, ": cannot create directory: ", ec.message()));
  }
  NormalGenerator rng(options.seed);
  // Keep storage alive until written: TensorToWrite points into it.
  std::vector<std::vector<float>> storage;
  std::vector<TensorToWrite> tensors;
  auto add = [&](const std::string& name, std::vector<int64_t> shape,
                 float std_dev, float mean) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> v(n);
    for (auto& x : v) x = mean + std_dev * rng.Next();
    storage.push_back(std::move(v));
    tensors.push_back({name, options.weight_dtype, std::move(shape), nullptr});
  };
  const int64_t h = c.hidden_size, hd = c.head_dim;
  // Scaled so activations stay O(1) and logits are decisive (few near-ties).
  const float in_h = 1.0f / std::sqrt(static_cast<float>(h));
  add("model.embed_tokens.weight", {c.vocab_size, h}, 1.0f, 0.0f);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    add(p + "input_layernorm.weight", {h}, 0.1f, 1.0f);
    if (c.IsMla()) AddMlaTensors(c, p, add);
    if (!c.IsMla()) {
      add(p + "self_attn.q_proj.weight", {c.num_heads * hd, h}, in_h, 0.0f);
      add(p + "self_attn.k_proj.weight", {c.num_kv_heads * hd, h}, in_h, 0.0f);
      add(p + "self_attn.v_proj.weight", {c.num_kv_heads * hd, h}, in_h, 0.0f);
      if (c.attention_bias) {
        add(p + "self_attn.q_proj.bias", {c.num_heads * hd}, 0.1f, 0.0f);
        add(p + "self_attn.k_proj.bias", {c.num_kv_heads * hd}, 0.1f, 0.0f);
        add(p + "self_attn.v_proj.bias", {c.num_kv_heads * hd}, 0.1f, 0.0f);
      }
      if (c.qk_norm) {
        add(p + "self_attn.q_norm.weight", {hd}, 0.1f, 1.0f);
        add(p + "self_attn.k_norm.weight", {hd}, 0.1f, 1.0f);
      }
      add(p + "self_attn.o_proj.weight", {h, c.num_heads * hd},
          1.0f / std::sqrt(static_cast<float>(c.num_heads * hd)), 0.0f);
    }  // !MLA
    add(p + "post_attention_layernorm.weight", {h}, 0.1f, 1.0f);
    if (c.IsMoeLayer(i)) {
      const int64_t inter = c.moe_intermediate_size;
      // A wider router spread than in_h, so that the top-k choices are
      // decisive rather than near-ties.
      add(MoeRouterTensor(c, i) + ".weight", {c.num_experts, h}, 2.0f * in_h,
          0.0f);
      for (int64_t e = 0; e < c.num_experts; ++e) {
        add(MoeExpertTensor(c, i, e, ExpertProj::kGate) + ".weight", {inter, h},
            in_h, 0.0f);
        add(MoeExpertTensor(c, i, e, ExpertProj::kUp) + ".weight", {inter, h},
            in_h, 0.0f);
        add(MoeExpertTensor(c, i, e, ExpertProj::kDown) + ".weight", {h, inter},
            1.0f / std::sqrt(static_cast<float>(inter)), 0.0f);
      }
      if (c.IsDeepseek()) AddDeepseekMoeTensors(c, i, add);
      continue;
    }
    add(p + "mlp.gate_proj.weight", {c.intermediate_size, h}, in_h, 0.0f);
    add(p + "mlp.up_proj.weight", {c.intermediate_size, h}, in_h, 0.0f);
    add(p + "mlp.down_proj.weight", {h, c.intermediate_size},
        1.0f / std::sqrt(static_cast<float>(c.intermediate_size)), 0.0f);
  }
  add("model.norm.weight", {h}, 0.1f, 1.0f);
  if (!c.tie_word_embeddings)
    add("lm_head.weight", {c.vocab_size, h}, 2.0f * in_h, 0.0f);
  for (size_t i = 0; i < tensors.size(); ++i)
    tensors[i].values = storage[i].data();

  const std::string dir = options.out_dir;
  ASSIGN_OR_RETURN(const std::string config,
                   PresetConfigJson(options.preset, options.weight_dtype));
  RETURN_IF_ERROR(WriteText(dir + "/config.json", config));
  RETURN_IF_ERROR(WriteSafetensors(dir + "/model.safetensors", tensors));
  RETURN_IF_ERROR(
      WriteText(dir + "/tokenizer.json", ByteTokenizer::TokenizerJson()));
  // With a ChatML chat template, so the OpenAI chat endpoint works on the
  // presets (tokenizer/chat_template.h recognises it by <|im_start|>; the byte
  // tokenizer spells the markers out as bytes).
  ASSIGN_OR_RETURN(json::Value tokenizer_config,
                   json::Parse(ByteTokenizer::TokenizerConfigJson(),
                               "tokenizer_config.json"));
  tokenizer_config["chat_template"] =
      "{% for message in messages %}{{'<|im_start|>' + message['role'] + "
      "'\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
      "{% endif %}";
  RETURN_IF_ERROR(WriteText(dir + "/tokenizer_config.json",
                            json::Dump(tokenizer_config) + "\n"));
  RETURN_IF_ERROR(WriteText(
      dir + "/generation_config.json",
      json::Dump(json::OrderedValue{{"bos_token_id", c.bos_token_id},
                                    {"eos_token_id", c.eos_token_id}}) +
          "\n"));
  return absl::OkStatus();
}

}  // namespace pdserve::engine
