#include "bench/trace.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/json.h"
#include "common/status_macros.h"

namespace pdserve::bench {
namespace {

// One request from one line; `what` names the file and line for errors.
absl::StatusOr<TraceRequest> ParseLine(absl::string_view line,
                                       const std::string& what,
                                       int32_t block_tokens) {
  ASSIGN_OR_RETURN(const json::Value v, json::Parse(line, what));
  if (!v.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": expected a JSON object"));
  }
  TraceRequest r;
  ASSIGN_OR_RETURN(r.timestamp_ms,
                   json::GetInt(v, "timestamp", what, std::nullopt, 0));
  ASSIGN_OR_RETURN(r.input_length,
                   json::GetInt(v, "input_length", what, std::nullopt, 1));
  ASSIGN_OR_RETURN(r.output_length,
                   json::GetInt(v, "output_length", what, std::nullopt, 0));
  const json::Value* ids = json::Find(v, "hash_ids");
  if (ids == nullptr || !ids->is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": \"hash_ids\" must be an array"));
  }
  const int64_t want = (r.input_length + block_tokens - 1) / block_tokens;
  if (static_cast<int64_t>(ids->size()) != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", ids->size(), " hash_ids for input_length ", r.input_length,
        " (want ", want, ", one per ", block_tokens, "-token block)"));
  }
  r.hash_ids.reserve(want);
  for (const json::Value& id : *ids) {
    ASSIGN_OR_RETURN(const int64_t h,
                     json::AsInt(id, absl::StrCat(what, ": hash_ids"), 0));
    r.hash_ids.push_back(h);
  }
  return r;
}

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

absl::StatusOr<std::vector<TraceRequest>> ParseMooncakeTrace(
    absl::string_view text, absl::string_view what, int32_t block_tokens) {
  if (block_tokens <= 0)
    return absl::InvalidArgumentError("trace block size must be positive");
  std::vector<TraceRequest> out;
  int64_t line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    absl::StatusOr<TraceRequest> r =
        ParseLine(line, absl::StrCat(what, ":", line_no), block_tokens);
    // A missing field is as malformed as a bad one.
    if (!r.ok()) return absl::InvalidArgumentError(r.status().message());
    out.push_back(*std::move(r));
  }
  return out;
}

absl::StatusOr<std::vector<TraceRequest>> LoadMooncakeTrace(
    const std::string& path, int32_t block_tokens) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open trace ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad())
    return absl::DataLossError(absl::StrCat("cannot read trace ", path));
  return ParseMooncakeTrace(ss.str(), path, block_tokens);
}

std::vector<int32_t> SynthesizePrompt(const TraceRequest& request,
                                      uint64_t seed, int32_t vocab_size,
                                      int32_t block_tokens) {
  std::vector<int32_t> tokens(static_cast<size_t>(request.input_length));
  for (size_t start = 0, block = 0; start < tokens.size();
       start += block_tokens, ++block) {
    const uint64_t id = block < request.hash_ids.size()
                            ? static_cast<uint64_t>(request.hash_ids[block])
                            : ~0ULL;
    const uint64_t base = SplitMix64(seed ^ (id * 0x100000001b3ULL));
    const size_t end = std::min(tokens.size(), start + block_tokens);
    for (size_t i = start; i < end; ++i) {
      tokens[i] = static_cast<int32_t>(SplitMix64(base + (i - start)) %
                                       static_cast<uint64_t>(vocab_size));
    }
  }
  return tokens;
}

}  // namespace pdserve::bench
