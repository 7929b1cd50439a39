// Request traces in the Mooncake FAST'25 JSONL format, one object a line:
//   {"timestamp": 27482, "input_length": 6955, "output_length": 52,
//    "hash_ids": [46, 47, ...]}
// timestamp is the arrival in ms from the trace start; hash_ids name the
// prompt's 512-token blocks (the last may be partial), and requests that share
// leading ids share that prefix. Used by the router simulation and the serving
// benchmark's replay. Functions are thread-compatible (no shared state).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pdserve::bench {

// Tokens per trace block in the Mooncake traces.
inline constexpr int32_t kTraceBlockTokens = 512;

struct TraceRequest {
  int64_t timestamp_ms = 0;
  int64_t input_length = 0;       // tokens
  int64_t output_length = 0;      // tokens
  std::vector<int64_t> hash_ids;  // ceil(input_length / block_tokens) ids
};

// Parses JSONL text. Blank lines are skipped; unknown fields are ignored. A
// malformed line (bad JSON, a missing or negative field, input_length < 1, or
// a hash_ids count other than ceil(input_length / block_tokens)) is
// INVALID_ARGUMENT naming `what` and the 1-based line number.
absl::StatusOr<std::vector<TraceRequest>> ParseMooncakeTrace(
    absl::string_view text, absl::string_view what,
    int32_t block_tokens = kTraceBlockTokens);
absl::StatusOr<std::vector<TraceRequest>> LoadMooncakeTrace(
    const std::string& path, int32_t block_tokens = kTraceBlockTokens);

// Token ids for a request's prompt (input_length of them), synthesized from
// its hash ids: block k holds tokens f(hash_ids[k], j) for j in the block, so
// requests with the same leading ids get the same leading tokens, whatever
// their lengths, and prefix caches see exactly the trace's sharing. Ids are in
// [0, vocab_size); `seed` varies the mapping.
std::vector<int32_t> SynthesizePrompt(const TraceRequest& request,
                                      uint64_t seed, int32_t vocab_size = 32000,
                                      int32_t block_tokens = kTraceBlockTokens);

}  // namespace pdserve::bench
