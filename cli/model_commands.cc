// `pdserve model init`, `pdserve model logits` and `pdserve kv-budget`.
#include <cstdio>
#include <memory>
#include <numeric>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/command.h"
#include "cli/flags.h"
#include "common/json.h"
#include "kernels/cpu/matmul.h"
#include "kv_cache/kv_cache.h"
#include "model/llama_model.h"
#include "model/model_init.h"
#include "model/weights.h"

ABSL_FLAG(std::string, preset, "small",
          "model init: the preset (its choices come from the preset table, "
          "model/model_init.h)");
ABSL_FLAG(std::string, out, "", "output directory");
ABSL_FLAG(uint64_t, seed, 0,
          "random seed (weights for model init; sampling for generate)");
ABSL_FLAG(std::string, dtype, "",
          "storage dtype (model init: fp32|fp16|bf16; kv-budget: KV dtype)");
ABSL_FLAG(std::string, tokens, "",
          "model logits: comma-separated token ids; kv-budget: a token count");
ABSL_FLAG(bool, all_positions, false, "print logits for every position");
ABSL_FLAG(int64_t, layers, 0, "number of layers");
ABSL_FLAG(int64_t, kv_heads, 0, "number of KV heads");
ABSL_FLAG(int64_t, head_dim, 0, "head dimension");
ABSL_FLAG(int64_t, kv_lora_rank, 0,
          "kv-budget: MLA latent rank (DeepSeek kv_lora_rank); with "
          "--qk-rope-head-dim the cache holds one latent row per token, and "
          "--kv-heads/--head-dim then describe the MHA cache to compare with");
ABSL_FLAG(int64_t, qk_rope_head_dim, 0,
          "kv-budget: MLA shared rope key width (DeepSeek qk_rope_head_dim)");
ABSL_FLAG(std::string, memory, "",
          "memory budget in bytes (suffixes KiB, MiB, GiB allowed)");

namespace pdserve::cli {

int RunModelInit(const std::vector<std::string>&) {
  engine::ModelInitOptions opts;
  opts.preset = absl::GetFlag(FLAGS_preset);
  opts.out_dir = absl::GetFlag(FLAGS_out);
  opts.seed = absl::GetFlag(FLAGS_seed);
  if (opts.out_dir.empty())
    return ReportError(absl::InvalidArgumentError("--out is required"));
  auto dtype =
      absl::GetFlag(FLAGS_dtype).empty()
          ? absl::StatusOr<DType>(engine::PresetDefaultDtype(opts.preset))
          : engine::ParseModelFileDtype(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return ReportError(dtype.status());
  opts.weight_dtype = *dtype;
  if (auto s = engine::WriteRandomModel(opts); !s.ok()) return ReportError(s);
  std::fprintf(stderr, "pdserve: wrote %s model (seed %llu) to %s\n",
               opts.preset.c_str(), static_cast<unsigned long long>(opts.seed),
               opts.out_dir.c_str());
  return 0;
}

absl::StatusOr<std::vector<int32_t>> ParseTokenList(const std::string& text) {
  std::vector<int32_t> ids;
  for (absl::string_view part :
       absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int32_t v;
    if (!absl::SimpleAtoi(part, &v) || v < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tokens: \"", part, "\" is not a token id"));
    }
    ids.push_back(v);
  }
  if (ids.empty())
    return absl::InvalidArgumentError("--tokens needs at least one token id");
  return ids;
}

int RunModelLogits(const std::vector<std::string>&) {
  const std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty())
    return ReportError(absl::InvalidArgumentError("--model is required"));
  auto tokens = ParseTokenList(absl::GetFlag(FLAGS_tokens));
  if (!tokens.ok()) return ReportError(tokens.status());
  kernels::SetKernelThreads(absl::GetFlag(FLAGS_threads));
  auto weight_dtype =
      engine::ParseWeightDtype(absl::GetFlag(FLAGS_weight_dtype));
  if (!weight_dtype) {
    return ReportError(absl::InvalidArgumentError(
        "--weight-dtype must be auto, fp32, bf16, fp16 or int8"));
  }
  auto weights = engine::ModelWeights::Load(dir, *weight_dtype);
  if (!weights.ok()) return ReportError(weights.status());
  auto shared =
      std::make_shared<const engine::ModelWeights>(std::move(*weights));
  const auto& c = shared->config;
  if (static_cast<int64_t>(tokens->size()) > c.max_position_embeddings) {
    return ReportError(
        absl::InvalidArgumentError("more tokens than max_position_embeddings"));
  }
  // fp32 KV: this command is the accuracy reference.
  engine::KvCacheSpec spec = c.KvSpec(16, DType::kF32);
  const int64_t blocks = (static_cast<int64_t>(tokens->size()) + 15) / 16;
  auto pool = engine::KvPool::Create(spec, blocks);
  if (!pool.ok()) return ReportError(pool.status());
  std::vector<int32_t> table(blocks);
  std::iota(table.begin(), table.end(), 0);
  engine::LlamaModel model(shared, kernels::MatMulMode::kDeterministic);
  const bool all = absl::GetFlag(FLAGS_all_positions);
  engine::LlamaModel::SeqInput in{*tokens, 0, table,
                                  all ? engine::LlamaModel::Logits::kAll
                                      : engine::LlamaModel::Logits::kLast};
  std::vector<float> logits;
  if (auto s = model.Forward({&in, 1}, pool->get(), &logits); !s.ok())
    return ReportError(s);
  // Each float is written as the double it converts to exactly (shortest
  // round-trip text), so a reader recovers the bits pdserve computed.
  auto row = [&](size_t p) {
    const float* begin = logits.data() + p * c.vocab_size;
    return json::OrderedValue(std::vector<double>(begin, begin + c.vocab_size));
  };
  json::OrderedValue rows;
  if (all) {
    rows = json::OrderedValue::array();
    for (size_t p = 0; p < tokens->size(); ++p) rows.push_back(row(p));
  } else {
    rows = row(0);
  }
  const std::string out =
      json::Dump(json::OrderedValue{{"logits", std::move(rows)}}) + "\n";
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

int RunKvBudget(const std::vector<std::string>&) {
  engine::KvCacheSpec spec;
  spec.num_layers = static_cast<int32_t>(absl::GetFlag(FLAGS_layers));
  spec.num_kv_heads = static_cast<int32_t>(absl::GetFlag(FLAGS_kv_heads));
  spec.head_dim = static_cast<int32_t>(absl::GetFlag(FLAGS_head_dim));
  spec.block_size = absl::GetFlag(FLAGS_block_size);
  // MLA: one latent row [kv_lora_rank + qk_rope_head_dim] per token and
  // layer. --kv-heads H --head-dim D, if given, are the attention heads of
  // the same model, whose MHA cache (K and V per head) is reported beside it.
  const int64_t lora = absl::GetFlag(FLAGS_kv_lora_rank);
  const int64_t rope = absl::GetFlag(FLAGS_qk_rope_head_dim);
  const bool mla = lora != 0 || rope != 0;
  const int64_t mha_heads = spec.num_kv_heads, mha_dim = spec.head_dim;
  if (mla) {
    if (lora <= 0 || rope <= 0 || lora > (1 << 20) || rope > (1 << 20)) {
      return ReportError(absl::InvalidArgumentError(
          "--kv-lora-rank and --qk-rope-head-dim go together and must be "
          "positive"));
    }
    spec.kv_lora_rank = static_cast<int32_t>(lora);
    spec.qk_rope_head_dim = static_cast<int32_t>(rope);
    spec.num_kv_heads = 1;
    spec.head_dim = static_cast<int32_t>(lora + rope);
  }
  const std::string dt =
      absl::GetFlag(FLAGS_dtype).empty() ? "fp16" : absl::GetFlag(FLAGS_dtype);
  auto dtype = ParseDType(dt);
  if (!dtype)
    return ReportError(absl::InvalidArgumentError(
        "--dtype must be fp32, bf16, fp16, int8 or fp8"));
  // fp8 (e4m3, a CUDA KV dtype) and int8: 1 byte an element plus fp32
  // scales per (block, K/V, head), which bytes_per_block counts.
  spec.dtype = *dtype;
  if (auto s = spec.Validate(); !s.ok()) return ReportError(s);
  json::OrderedValue out = {{"layers", spec.num_layers},
                            {"kv_heads", spec.num_kv_heads},
                            {"head_dim", spec.head_dim},
                            {"dtype", DTypeName(spec.dtype)},
                            {"block_size", spec.block_size},
                            {"bytes_per_token", spec.BytesPerToken()},
                            {"bytes_per_block", spec.BytesPerBlock()}};
  if (mla) {
    out["kv_heads"] = nullptr;
    out["head_dim"] = nullptr;
    out["kv_lora_rank"] = lora;
    out["qk_rope_head_dim"] = rope;
    out["formula"] = "layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes";
    if (mha_heads > 0 && mha_dim > 0) {
      // As DeepSeek-V2's Table 1: 2 n_h d_h l elements per token.
      const int64_t mha = 2 * int64_t{spec.num_layers} * mha_heads * mha_dim *
                          static_cast<int64_t>(DTypeBytes(spec.dtype));
      out["mha_heads"] = mha_heads;
      out["mha_head_dim"] = mha_dim;
      out["mha_bytes_per_token"] = mha;
      out["mha_formula"] = "2 x layers x heads x head_dim x dtype bytes";
      out["mha_over_mla"] =
          static_cast<double>(mha) / static_cast<double>(spec.BytesPerToken());
    }
  }
  int64_t tokens = 0;
  if (!absl::GetFlag(FLAGS_tokens).empty() &&
      (!absl::SimpleAtoi(absl::GetFlag(FLAGS_tokens), &tokens) ||
       tokens <= 0)) {
    return ReportError(
        absl::InvalidArgumentError("--tokens must be a positive token count"));
  }
  if (tokens > 0) {
    const int64_t blocks = (tokens + spec.block_size - 1) / spec.block_size;
    out["tokens"] = tokens;
    out["bytes"] = tokens * spec.BytesPerToken();
    out["blocks"] = blocks;
    out["block_bytes"] = blocks * spec.BytesPerBlock();
  }
  if (!absl::GetFlag(FLAGS_memory).empty()) {
    auto mem = ParseBytes(absl::GetFlag(FLAGS_memory));
    if (!mem.ok()) return ReportError(mem.status());
    const int64_t fit = spec.BlocksForMemory(*mem);
    out["memory"] = *mem;
    out["blocks_fit"] = fit;
    out["tokens_fit"] = fit * spec.block_size;
  }
  std::printf("%s\n", json::Dump(out).c_str());
  return 0;
}

}  // namespace pdserve::cli
