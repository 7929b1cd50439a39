#include "bench/serve_workload.h"

#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/json.h"
#include "common/status_macros.h"

namespace pdserve::bench {
namespace {

// Deterministic filler text of `n` bytes from a seed (readable ASCII).
std::string Text(uint64_t seed, int64_t n) {
  static const char* kWords[] = {"the ",     "model ",  "serves ", "tokens ",
                                 "quickly ", "and ",    "cache ",  "blocks ",
                                 "prefill ", "decode ", "router ", "answer ",
                                 "with ",    "care "};
  std::mt19937_64 rng(seed);
  std::string out;
  while (static_cast<int64_t>(out.size()) < n) out += kWords[rng() % 14];
  out.resize(static_cast<size_t>(std::max<int64_t>(n, 0)));
  return out;
}

}  // namespace

absl::Status WorkloadConfig::Validate() const {
  if (num_requests < 1)
    return absl::InvalidArgumentError("--num-requests must be at least 1");
  if (rate < 0)
    return absl::InvalidArgumentError("--rate must not be negative");
  if (input_len < 1 || output_len < 1)
    return absl::InvalidArgumentError(
        "--input-len and --output-len must be positive");
  if (name != "chat" && name != "multiturn" && name != "longdoc" &&
      name != "mixed" && name != "synthetic") {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown workload \"", name,
        "\" (chat, multiturn, longdoc, mixed, synthetic, or --trace FILE)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<RequestSpec>> MakeWorkload(const WorkloadConfig& c) {
  RETURN_IF_ERROR(c.Validate());
  std::mt19937_64 rng(c.seed);
  std::exponential_distribution<double> gap(c.rate > 0 ? c.rate : 1.0);
  std::vector<RequestSpec> out;
  double t = 0;
  constexpr int kSystemPrompts = 4;
  for (int32_t i = 0; i < c.num_requests; ++i) {
    RequestSpec r;
    r.arrival_s = c.rate > 0 ? t : 0;
    if (c.rate > 0) t += gap(rng);
    if (c.name == "synthetic") {
      r.prompt = Text(c.seed * 1000003 + i, c.input_len);
      r.max_tokens = static_cast<uint32_t>(c.output_len);
    } else if (c.name == "chat") {
      // Many users sharing a few long system prompts.
      const int g = static_cast<int>(rng() % kSystemPrompts);
      r.prefix_group = absl::StrCat("system", g);
      r.prompt = Text(977 + g, 4 * c.input_len) + " User " + std::to_string(i) +
                 ": " + Text(rng(), c.input_len / 4);
      r.max_tokens = static_cast<uint32_t>(c.output_len);
    } else if (c.name == "multiturn") {
      // Conversations of 4 turns; each turn extends the previous prompt.
      const int conv = i / 4, turn = i % 4;
      r.prefix_group = absl::StrCat("conv", conv);
      for (int k = 0; k <= turn; ++k)
        r.prompt += Text(conv * 131 + k, c.input_len) + "\n";
      r.max_tokens = static_cast<uint32_t>(c.output_len);
    } else if (c.name == "longdoc") {
      r.prompt = Text(rng(), 8 * c.input_len);
      r.max_tokens = static_cast<uint32_t>(std::max(1, c.output_len / 4));
    } else {  // mixed: every fourth request is a long prefill among steady
              // decodes
      const bool long_one = i % 4 == 0;
      r.prompt = Text(rng(), long_one ? 8 * c.input_len : c.input_len / 2);
      r.max_tokens = static_cast<uint32_t>(
          long_one ? std::max(1, c.output_len / 4) : 2 * c.output_len);
    }
    out.push_back(std::move(r));
  }
  return out;
}

absl::StatusOr<std::vector<RequestSpec>> ParseTrace(const std::string& text,
                                                    const std::string& path) {
  std::vector<RequestSpec> out;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    if (line.empty() ||
        line.find_first_not_of(" \t\r") == absl::string_view::npos)
      continue;
    const std::string where = absl::StrCat(path, ":", line_no);
    ASSIGN_OR_RETURN(json::Value v, json::Parse(std::string(line), where));
    if (!v.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expected a JSON object"));
    }
    RequestSpec r;
    ASSIGN_OR_RETURN(r.arrival_s, json::GetDouble(v, "arrival_s", where));
    if (!(r.arrival_s >= 0) || !std::isfinite(r.arrival_s)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": arrival_s must be a non-negative number"));
    }
    ASSIGN_OR_RETURN(
        int64_t max_tokens,
        json::GetInt(v, "max_tokens", where, std::nullopt, 1, 1 << 20));
    r.max_tokens = static_cast<uint32_t>(max_tokens);
    ASSIGN_OR_RETURN(r.prefix_group,
                     json::GetString(v, "prefix_group", where, ""));
    if (json::Find(v, "prompt") != nullptr) {
      ASSIGN_OR_RETURN(r.prompt, json::GetString(v, "prompt", where));
    } else if (json::Find(v, "prompt_tokens") != nullptr) {
      ASSIGN_OR_RETURN(int64_t n, json::GetInt(v, "prompt_tokens", where,
                                               std::nullopt, 1, 1 << 24));
      // Same group: same leading text, so prefixes are shared.
      uint64_t seed = static_cast<uint64_t>(line_no) * 7919;
      if (!r.prefix_group.empty()) {
        seed = 1469598103934665603ull;  // FNV-1a of the group name
        for (unsigned char ch : r.prefix_group)
          seed = (seed ^ ch) * 1099511628211ull;
      }
      r.prompt = Text(seed, n);
      if (!r.prefix_group.empty()) r.prompt += absl::StrCat(" #", line_no);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": needs \"prompt\" or \"prompt_tokens\""));
    }
    if (r.prompt.empty())
      return absl::InvalidArgumentError(absl::StrCat(where, ": empty prompt"));
    out.push_back(std::move(r));
  }
  if (out.empty())
    return absl::InvalidArgumentError(absl::StrCat(path, ": no requests"));
  return out;
}

}  // namespace pdserve::bench
