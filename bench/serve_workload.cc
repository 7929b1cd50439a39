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

int32_t NumConversations(const WorkloadConfig& c) {
  return (c.num_requests + kMultiturnTurns - 1) / kMultiturnTurns;
}

// Request `i` of the multiturn workload: turn i / C of conversation i % C
// (C conversations, round-robin), so that between two turns of a
// conversation every other conversation has one: the KV working set is all
// of them at once, as on a server with many users. Turn 0 is `input_len`
// bytes; turn k + 1 is turn k's prompt, then an answer-like text (up to
// `output_len` bytes: what the chat history keeps of the reply), then a new
// user message. Its new bytes are drawn so that the previous prompt is a
// fraction r of it, r uniform in [kMultiturnMinReuse, kMultiturnMaxReuse]
// (median 0.85, the
// Mooncake conversation trace's follow-up turns). `prompts` holds each
// conversation's latest prompt.
std::string MultiturnPrompt(const WorkloadConfig& c, int32_t i,
                            std::vector<std::string>* prompts) {
  const int32_t num_conv = NumConversations(c);
  const int32_t conv = i % num_conv, turn = i / num_conv;
  // One generator per (seed, conversation, turn): a turn does not depend on
  // how many conversations there are or on other requests' draws.
  std::mt19937_64 rng(c.seed * 0x9E3779B97F4A7C15ull +
                      static_cast<uint64_t>(conv) * 1000003 + turn);
  if (prompts->size() < static_cast<size_t>(num_conv))
    prompts->resize(static_cast<size_t>(num_conv));
  std::string& p = (*prompts)[static_cast<size_t>(conv)];
  if (turn == 0) {
    // A distinct head per conversation: no two share a first KV block.
    p = absl::StrCat("Conversation ", conv, ". User: ");
    p += Text(rng(), c.input_len - static_cast<int64_t>(p.size()));
    p.resize(static_cast<size_t>(c.input_len));
    return p;
  }
  // Uniform in [min, max) from 53 random bits (std:: distributions are not
  // the same on every standard library).
  const double r =
      kMultiturnMinReuse + (kMultiturnMaxReuse - kMultiturnMinReuse) *
                               static_cast<double>(rng() >> 11) * 0x1p-53;
  const int64_t prev = static_cast<int64_t>(p.size());
  const int64_t added = std::max<int64_t>(
      2, std::llround(static_cast<double>(prev) * (1 - r) / r));
  const int64_t answer = std::min<int64_t>(c.output_len, added / 2);
  std::string text = "\nAssistant: " + Text(rng(), answer) + "\nUser: ";
  text += Text(rng(), added - static_cast<int64_t>(text.size()));
  text.resize(static_cast<size_t>(added));
  p += text;
  return p;
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
  std::vector<std::string> conversations;  // multiturn: each one's last prompt
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
      r.prompt = MultiturnPrompt(c, i, &conversations);
      r.prefix_group = absl::StrCat("conv", i % NumConversations(c));
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
