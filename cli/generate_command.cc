// `pdserve generate --model DIR`: the in-process reference path. Streams
// exactly the generated text to stdout (or JSON with --json).
#include <cstdio>
#include <memory>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/command.h"
#include "cli/flags.h"
#include "common/file_util.h"
#include "common/json.h"
#include "common/status_macros.h"
#include "engine/engine.h"
#include "model/weights.h"
#include "structured/token_guide.h"
#include "tokenizer/tokenizer.h"

ABSL_FLAG(std::string, prompt, "", "prompt text");
ABSL_FLAG(uint32_t, max_tokens, 16, "maximum tokens to generate");
ABSL_FLAG(float, temperature, 0.0f, "sampling temperature (0 = greedy)");
ABSL_FLAG(float, top_p, 1.0f, "nucleus sampling mass in (0, 1]");
ABSL_FLAG(uint32_t, top_k, 0, "keep the k most likely tokens (0 = off)");
ABSL_FLAG(std::string, stop, "", "stop string (repeatable)");
ABSL_FLAG(bool, ignore_eos, false, "keep generating after EOS");
ABSL_FLAG(std::string, cache_salt, "", "prefix-cache isolation salt");
ABSL_FLAG(bool, logprobs, false,
          "with --json: each generated token's log-probability");
ABSL_FLAG(uint32_t, top_logprobs, 0,
          "with --logprobs: also the N (<= 5) most likely alternatives");
ABSL_FLAG(std::string, json_schema, "",
          "constrain the output to JSON valid under the JSON schema in this "
          "file");
ABSL_FLAG(std::string, regex, "",
          "constrain the output to match this regular expression");
ABSL_FLAG(std::string, grammar, "",
          "constrain the output to the GBNF grammar in this file (from its "
          "rule 'root')");
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(std::string, router);

namespace pdserve::cli {

engine::SamplingParams SamplingParamsFromFlags() {
  engine::SamplingParams p;
  p.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  p.temperature = absl::GetFlag(FLAGS_temperature);
  p.top_p = absl::GetFlag(FLAGS_top_p);
  p.top_k = absl::GetFlag(FLAGS_top_k);
  p.seed = absl::GetFlag(FLAGS_seed);
  p.ignore_eos = absl::GetFlag(FLAGS_ignore_eos);
  p.logprobs = absl::GetFlag(FLAGS_logprobs);
  p.top_logprobs = absl::GetFlag(FLAGS_top_logprobs);
  if (!absl::GetFlag(FLAGS_stop).empty()) {
    p.stop = absl::StrSplit(absl::GetFlag(FLAGS_stop), '\x1f');
  }
  return p;
}

absl::StatusOr<structured::ConstraintSpec> ConstraintFromFlags() {
  const std::string schema_file = absl::GetFlag(FLAGS_json_schema);
  const std::string regex = absl::GetFlag(FLAGS_regex);
  const std::string grammar_file = absl::GetFlag(FLAGS_grammar);
  if (!schema_file.empty() + !regex.empty() + !grammar_file.empty() > 1) {
    return absl::InvalidArgumentError(
        "--json-schema, --regex and --grammar are mutually exclusive");
  }
  if (!regex.empty()) return structured::ConstraintSpec::Regex(regex);
  if (!grammar_file.empty()) {
    ASSIGN_OR_RETURN(std::string grammar, ReadFileIfExists(grammar_file));
    if (grammar.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--grammar: cannot read ", grammar_file));
    }
    return structured::ConstraintSpec::Grammar(std::move(grammar));
  }
  if (schema_file.empty()) return structured::ConstraintSpec();
  ASSIGN_OR_RETURN(std::string schema, ReadFileIfExists(schema_file));
  if (schema.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--json-schema: cannot read ", schema_file));
  }
  return structured::ConstraintSpec::JsonSchema(std::move(schema));
}

int RunGenerate(const std::vector<std::string>&) {
  if (!absl::GetFlag(FLAGS_router).empty()) return RunGenerateRemote();
  const std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty())
    return ReportError(
        absl::InvalidArgumentError("--model DIR or --router ADDR is required"));
  auto config = EngineConfigFromFlags();
  if (!config.ok()) return ReportError(config.status());
  engine::SamplingParams sampling = SamplingParamsFromFlags();
  if (auto s = sampling.Validate(); !s.ok()) return ReportError(s);
  auto constraint = ConstraintFromFlags();
  if (!constraint.ok()) return ReportError(constraint.status());
  auto tokenizer = engine::Tokenizer::Load(dir);
  if (!tokenizer.ok()) return ReportError(tokenizer.status());
  auto weights =
      engine::ModelWeights::Load(dir, config->weight_dtype, config->matmul);
  if (!weights.ok()) return ReportError(weights.status());
  auto engine = engine::Engine::Create(
      std::make_shared<const engine::ModelWeights>(std::move(*weights)),
      *config);
  if (!engine.ok()) return ReportError(engine.status());
  (*engine)->set_guide_cache(std::make_shared<structured::GuideCache>(
      structured::GuideCacheConfig{},
      structured::TokenTrie::Build(**tokenizer)));

  engine::EngineRequest req;
  req.id = "local-0";
  req.prompt = (*tokenizer)->Encode(absl::GetFlag(FLAGS_prompt));
  req.sampling = sampling;
  req.constraint = *std::move(constraint);
  req.cache_salt = absl::GetFlag(FLAGS_cache_salt);
  const bool as_json = absl::GetFlag(FLAGS_json);
  if (auto s = (*engine)->AddRequest(req); !s.ok()) return ReportError(s);

  engine::TextStream text(tokenizer->get(), sampling.stop);
  std::vector<int32_t> ids;
  std::string all_text;
  engine::StepOutput last;
  json::OrderedValue logprobs = json::OrderedValue::array();
  auto emit = [&](const std::string& t) {
    all_text += t;
    if (!as_json && !t.empty()) {
      std::fwrite(t.data(), 1, t.size(), stdout);
      std::fflush(stdout);
    }
  };
  bool done = false;
  while (!done) {
    auto step = (*engine)->Step();
    if (!step.ok()) return ReportError(step.status());
    for (const auto& out : *step) {
      if (!out.error.ok()) return ReportError(out.error);
      ids.insert(ids.end(), out.new_tokens.begin(), out.new_tokens.end());
      for (const engine::TokenLogprobs& lp : out.logprobs) {
        json::OrderedValue top = json::OrderedValue::array();
        for (const auto& [token, logprob] : lp.top)
          top.push_back({{"token_id", token}, {"logprob", logprob}});
        logprobs.push_back({{"token_id", lp.token},
                            {"logprob", lp.logprob},
                            {"top", std::move(top)}});
      }
      last.prompt_tokens = std::max(last.prompt_tokens, out.prompt_tokens);
      last.cached_prompt_tokens =
          std::max(last.cached_prompt_tokens, out.cached_prompt_tokens);
      last.completion_tokens = static_cast<int32_t>(ids.size());
      auto delta = text.Push(out.new_tokens);
      emit(delta.text);
      if (delta.stopped) {
        (*engine)->Abort(req.id, engine::FinishReason::kStop);
        last.finish = engine::FinishReason::kStop;
      } else if (out.finish != engine::FinishReason::kNone) {
        if (last.finish == engine::FinishReason::kNone)
          last.finish = out.finish;
        emit(text.Finish().text);
        done = true;
      }
    }
    if (!(*engine)->HasWork()) done = true;
  }
  if (as_json) {
    json::OrderedValue out = {
        {"request_id", req.id},
        {"token_ids", ids},
        {"text", all_text},
        {"finish_reason", engine::FinishReasonName(last.finish)},
        {"usage",
         {{"prompt_tokens", req.prompt.size()},
          {"completion_tokens", ids.size()},
          {"cached_prompt_tokens", last.cached_prompt_tokens}}}};
    if (sampling.logprobs) out["logprobs"] = std::move(logprobs);
    std::printf("%s\n", json::Dump(out, json::ArraySpacing::kCompact).c_str());
  } else {
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace pdserve::cli
