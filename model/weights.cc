#include "model/weights.h"

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include <xxhash.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/json.h"
#include "common/status_macros.h"
#include "model/safetensors.h"

namespace pdserve::engine {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The set of safetensors files of a model directory, indexed by tensor name.
class TensorSource {
 public:
  static absl::StatusOr<TensorSource> Open(const std::string& dir) {
    TensorSource src;
    const std::string index_path = dir + "/model.safetensors.index.json";
    if (std::filesystem::exists(index_path)) {
      ASSIGN_OR_RETURN(std::string text, ReadFile(index_path));
      ASSIGN_OR_RETURN(json::Value index, json::Parse(text, index_path));
      const json::Value* map = json::Find(index, "weight_map");
      if (map == nullptr || !map->is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, ": missing \"weight_map\" object"));
      }
      for (const auto& [name, file_value] : map->items()) {
        const std::string* file = json::StringOrNull(&file_value);
        if (file == nullptr || file->find('/') != std::string::npos) {
          return absl::InvalidArgumentError(absl::StrCat(
              index_path, ": bad file name for tensor \"", name, "\""));
        }
        const std::string path = dir + "/" + *file;
        if (!src.files_.count(path)) {
          ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(path));
          src.files_.emplace(path, std::move(f));
        }
        src.where_[name] = src.files_.at(path).get();
      }
    } else {
      const std::string path = dir + "/model.safetensors";
      ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(path));
      for (const auto& [name, t] : f->tensors()) src.where_[name] = f.get();
      src.files_.emplace(path, std::move(f));
    }
    return src;
  }

  bool Has(const std::string& name) const { return where_.count(name) > 0; }

  // Storage dtype of `name` in the checkpoint (F32 when absent).
  DType DtypeOf(const std::string& name) const {
    auto it = where_.find(name);
    if (it == where_.end()) return DType::kF32;
    auto t = it->second->Find(name);
    return t.ok() ? (*t)->dtype : DType::kF32;
  }

  // Loads `name` as fp32, checking the shape; appends to `out`.
  absl::Status Append(const std::string& name,
                      const std::vector<int64_t>& shape,
                      std::vector<float>* out) {
    auto it = where_.find(name);
    if (it == where_.end()) {
      return absl::NotFoundError(
          absl::StrCat("model is missing tensor \"", name, "\""));
    }
    ASSIGN_OR_RETURN(const TensorView* t, it->second->Find(name));
    if (t->shape != shape) {
      auto fmt = [](const std::vector<int64_t>& s) {
        std::string r = "[";
        for (size_t i = 0; i < s.size(); ++i)
          absl::StrAppend(&r, i ? ", " : "", s[i]);
        return r + "]";
      };
      return absl::InvalidArgumentError(
          absl::StrCat(it->second->path(), ": tensor \"", name, "\" has shape ",
                       fmt(t->shape), ", expected ", fmt(shape)));
    }
    std::vector<float> tmp;
    TensorToFloat(*t, &tmp);
    out->insert(out->end(), tmp.begin(), tmp.end());
    // Identity: name, dtype, shape and up to 4 KiB from the start, middle and
    // end of the data. Cheap for large checkpoints, yet random-weight models
    // with different seeds get different fingerprints.
    XXH3_128bits_update(&hash_, name.data(), name.size());
    XXH3_128bits_update(&hash_, &t->dtype, 1);
    XXH3_128bits_update(&hash_, t->shape.data(),
                        t->shape.size() * sizeof(int64_t));
    const size_t sample = std::min<size_t>(4096, t->nbytes);
    XXH3_128bits_update(&hash_, t->data, sample);
    XXH3_128bits_update(&hash_, t->data + (t->nbytes - sample) / 2, sample);
    XXH3_128bits_update(&hash_, t->data + t->nbytes - sample, sample);
    return absl::OkStatus();
  }

  XXH3_state_t* hash() { return &hash_; }

 private:
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, SafetensorsFile*> where_;
  XXH3_state_t hash_;
};

}  // namespace

std::optional<WeightDtype> ParseWeightDtype(std::string_view s) {
  if (s == "auto") return WeightDtype::kAuto;
  if (s == "fp32") return WeightDtype::kF32;
  if (s == "bf16") return WeightDtype::kBF16;
  if (s == "fp16") return WeightDtype::kF16;
  if (s == "int8") return WeightDtype::kI8;
  if (s == "int8-b32") return WeightDtype::kI8B32;
  return std::nullopt;
}

const char* WeightDtypeName(WeightDtype d) {
  switch (d) {
    case WeightDtype::kAuto:
      return "auto";
    case WeightDtype::kF32:
      return "fp32";
    case WeightDtype::kBF16:
      return "bf16";
    case WeightDtype::kF16:
      return "fp16";
    case WeightDtype::kI8:
      return "int8";
    case WeightDtype::kI8B32:
      return "int8-b32";
  }
  return "?";
}

std::string ModelWeights::StorageName() const {
  if (dtype == DType::kI8 && int8_scaling == kernels::Int8Scaling::kBlock32)
    return "int8-b32";
  return DTypeName(dtype);
}

int64_t ModelWeights::ParameterBytes() const {
  int64_t n = output_matrix().bytes();
  int64_t floats = static_cast<int64_t>(norm.size());
  for (const auto& l : layers) {
    n += l.qkv.bytes() + l.o_proj.bytes() + l.gate_up.bytes() + l.down.bytes() +
         l.moe.bytes() + l.mla.bytes();
    floats += l.input_norm.size() + l.qkv_bias.size() + l.q_norm.size() +
              l.k_norm.size() + l.post_norm.size();
  }
  return n + floats * static_cast<int64_t>(sizeof(float));
}

absl::StatusOr<ModelWeights> ModelWeights::Load(const std::string& dir,
                                                WeightDtype dtype,
                                                kernels::MatMulMode mode) {
  const bool blas = mode == kernels::MatMulMode::kBlas;
  if (blas && dtype != WeightDtype::kAuto && dtype != WeightDtype::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat("--matmul blas needs fp32 weights (OpenBLAS sgemm), not ",
                     WeightDtypeName(dtype), "; use --weight-dtype fp32"));
  }
  ModelWeights w;
  const std::string config_path = dir + "/config.json";
  ASSIGN_OR_RETURN(std::string config_text, ReadFile(config_path));
  ASSIGN_OR_RETURN(w.config, ModelConfig::FromJson(config_text, config_path));
  const std::string generation_path = dir + "/generation_config.json";
  if (std::filesystem::exists(generation_path)) {
    ASSIGN_OR_RETURN(std::string generation_text, ReadFile(generation_path));
    RETURN_IF_ERROR(
        w.config.AddGenerationConfig(generation_text, generation_path));
  }
  ASSIGN_OR_RETURN(TensorSource src, TensorSource::Open(dir));
  XXH3_128bits_reset(src.hash());
  XXH3_128bits_update(src.hash(), config_text.data(), config_text.size());
  switch (dtype) {
    case WeightDtype::kAuto:
      w.dtype = blas ? DType::kF32 : src.DtypeOf("model.embed_tokens.weight");
      break;
    case WeightDtype::kF32:
      w.dtype = DType::kF32;
      break;
    case WeightDtype::kBF16:
      w.dtype = DType::kBF16;
      break;
    case WeightDtype::kF16:
      w.dtype = DType::kF16;
      break;
    case WeightDtype::kI8:
      w.dtype = DType::kI8;
      break;
    case WeightDtype::kI8B32:
      w.dtype = DType::kI8;
      w.int8_scaling = kernels::Int8Scaling::kBlock32;
      break;
  }
  const bool bf16dot = mode == kernels::MatMulMode::kBf16Dot;
  if (bf16dot && w.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--matmul bf16dot needs bf16 weights (--weight-dtype bf16, or auto "
        "with a bf16 checkpoint), not ",
        DTypeName(w.dtype)));
  }
  const bool int8dot = mode == kernels::MatMulMode::kInt8Dot;
  if (int8dot && w.dtype != DType::kI8) {
    return absl::InvalidArgumentError(
        absl::StrCat("--matmul int8dot needs int8 weights (--weight-dtype "
                     "int8 or int8-b32), not ",
                     w.StorageName()));
  }
  // Different storage or arithmetic gives different logits, so both are
  // part of the identity.
  const std::string storage =
      absl::StrCat(w.StorageName(), blas      ? "/rowmajor"
                                    : bf16dot ? "/panel16/bf16dot"
                                    : int8dot ? "/panel16/int8dot"
                                              : "/panel16");
  XXH3_128bits_update(src.hash(), storage.data(), storage.size());
  // Matrices are read as fp32 one (fused) tensor at a time, then packed.
  std::vector<float> tmp;
  // int8dot reads per-row int8 in the dot-product operand order as stored
  // (kPanel16Dot; no effect on other dtypes and scalings).
  const auto layout = int8dot ? kernels::WeightMatrix::Layout::kPanel16Dot
                              : kernels::WeightMatrix::Layout::kPanel16;
  auto pack = [&](int64_t rows, int64_t cols) {
    kernels::WeightMatrix m =
        blas ? kernels::WeightMatrix::RowMajorF32(tmp.data(), rows, cols)
             : kernels::WeightMatrix::Pack(tmp.data(), rows, cols, w.dtype,
                                           w.int8_scaling, layout);
    tmp.clear();
    return m;
  };
  const ModelConfig& c = w.config;
  const int64_t h = c.hidden_size, hd = c.head_dim;
  const int64_t q_rows = c.num_heads * hd, kv_rows = c.num_kv_heads * hd;
  RETURN_IF_ERROR(
      src.Append("model.embed_tokens.weight", {c.vocab_size, h}, &tmp));
  w.embed = pack(c.vocab_size, h);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    LayerWeights l;
    RETURN_IF_ERROR(
        src.Append(p + "input_layernorm.weight", {h}, &l.input_norm));
    if (c.IsMla()) {
      RETURN_IF_ERROR(LoadMlaWeights(
          c, i,
          [&](const std::string& name, const std::vector<int64_t>& shape,
              std::vector<float>* out) { return src.Append(name, shape, out); },
          [&](const float* data, int64_t rows, int64_t cols) {
            return blas ? kernels::WeightMatrix::RowMajorF32(data, rows, cols)
                        : kernels::WeightMatrix::Pack(
                              data, rows, cols, w.dtype,
                              kernels::Int8Scaling::kPerRow, layout);
          },
          &l.mla, &l.o_proj));
    } else {
      RETURN_IF_ERROR(
          src.Append(p + "self_attn.q_proj.weight", {q_rows, h}, &tmp));
      RETURN_IF_ERROR(
          src.Append(p + "self_attn.k_proj.weight", {kv_rows, h}, &tmp));
      RETURN_IF_ERROR(
          src.Append(p + "self_attn.v_proj.weight", {kv_rows, h}, &tmp));
      l.qkv = pack(q_rows + 2 * kv_rows, h);
      if (c.attention_bias) {
        RETURN_IF_ERROR(
            src.Append(p + "self_attn.q_proj.bias", {q_rows}, &l.qkv_bias));
        RETURN_IF_ERROR(
            src.Append(p + "self_attn.k_proj.bias", {kv_rows}, &l.qkv_bias));
        RETURN_IF_ERROR(
            src.Append(p + "self_attn.v_proj.bias", {kv_rows}, &l.qkv_bias));
      }
      if (c.qk_norm) {
        RETURN_IF_ERROR(
            src.Append(p + "self_attn.q_norm.weight", {hd}, &l.q_norm));
        RETURN_IF_ERROR(
            src.Append(p + "self_attn.k_norm.weight", {hd}, &l.k_norm));
      }
      RETURN_IF_ERROR(
          src.Append(p + "self_attn.o_proj.weight", {h, q_rows}, &tmp));
      l.o_proj = pack(h, q_rows);
    }  // MLA
    RETURN_IF_ERROR(
        src.Append(p + "post_attention_layernorm.weight", {h}, &l.post_norm));
    if (c.IsMoeLayer(i)) {
      const int64_t inter = c.moe_intermediate_size;
      RETURN_IF_ERROR(src.Append(MoeRouterTensor(c, i) + ".weight",
                                 {c.num_experts, h}, &tmp));
      l.moe.router = pack(c.num_experts, h);
      for (int64_t e = 0; e < c.num_experts; ++e) {
        auto name = [&](ExpertProj proj) {
          return MoeExpertTensor(c, i, e, proj) + ".weight";
        };
        RETURN_IF_ERROR(src.Append(name(ExpertProj::kGate), {inter, h}, &tmp));
        RETURN_IF_ERROR(src.Append(name(ExpertProj::kUp), {inter, h}, &tmp));
        l.moe.gate_up.push_back(pack(2 * inter, h));
        RETURN_IF_ERROR(src.Append(name(ExpertProj::kDown), {h, inter}, &tmp));
        l.moe.down.push_back(pack(h, inter));
      }
      // DeepSeek-V3's selection bias and DeepSeek's shared experts.
      if (c.IsDeepseek() && c.moe_topk == ModelConfig::MoeTopk::kNoauxTc) {
        RETURN_IF_ERROR(
            src.Append(MoeRouterTensor(c, i) + ".e_score_correction_bias",
                       {c.num_experts}, &l.moe.score_bias));
      }
      if (c.IsDeepseek() && c.n_shared_experts > 0) {
        const int64_t shared = c.n_shared_experts * inter;
        const std::string sp = p + "mlp.shared_experts.";
        RETURN_IF_ERROR(src.Append(sp + "gate_proj.weight", {shared, h}, &tmp));
        RETURN_IF_ERROR(src.Append(sp + "up_proj.weight", {shared, h}, &tmp));
        l.moe.shared_gate_up = pack(2 * shared, h);
        RETURN_IF_ERROR(src.Append(sp + "down_proj.weight", {h, shared}, &tmp));
        l.moe.shared_down = pack(h, shared);
      }
      w.layers.push_back(std::move(l));
      continue;
    }
    RETURN_IF_ERROR(
        src.Append(p + "mlp.gate_proj.weight", {c.intermediate_size, h}, &tmp));
    RETURN_IF_ERROR(
        src.Append(p + "mlp.up_proj.weight", {c.intermediate_size, h}, &tmp));
    l.gate_up = pack(2 * c.intermediate_size, h);
    RETURN_IF_ERROR(
        src.Append(p + "mlp.down_proj.weight", {h, c.intermediate_size}, &tmp));
    l.down = pack(h, c.intermediate_size);
    w.layers.push_back(std::move(l));
  }
  RETURN_IF_ERROR(src.Append("model.norm.weight", {h}, &w.norm));
  if (!c.tie_word_embeddings) {
    RETURN_IF_ERROR(src.Append("lm_head.weight", {c.vocab_size, h}, &tmp));
    w.lm_head = pack(c.vocab_size, h);
  }
  const XXH128_hash_t digest = XXH3_128bits_digest(src.hash());
  w.fingerprint = {digest.high64, digest.low64};
  return w;
}

}  // namespace pdserve::engine
