// Request schedules for `pdserve bench serve`: the named workloads and the
// JSONL trace replay. Pure functions of (config, seed); thread-compatible.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve::bench {

struct RequestSpec {
  double arrival_s =
      0;  // offset from the start (open loop); ignored in closed loop
  std::string prompt;
  uint32_t max_tokens = 16;
  std::string prefix_group;  // requests of a group share a prefix (for reports)
};

struct WorkloadConfig {
  std::string name =
      "synthetic";  // chat | multiturn | longdoc | mixed | synthetic
  int32_t num_requests = 32;
  double rate = 0;  // requests/s for Poisson arrivals; 0: all at t=0
  int32_t input_len =
      128;  // synthetic: prompt length in bytes (byte tokenizer: tokens)
  int32_t output_len = 32;
  uint64_t seed = 1;
  absl::Status Validate() const;
};

// The named workloads (sizes in bytes; the byte tokenizer makes them tokens):
//   synthetic  independent prompts of input_len;
//   chat       4 shared system prompts of 4 x input_len, then a user line;
//   multiturn  ceil(num_requests / kMultiturnTurns) conversations of
//              kMultiturnTurns turns, interleaved round-robin (turn k of
//              every conversation, then turn k + 1): each turn is the previous
//              prompt + an answer-like text (<= output_len) + new user text,
//              sized so that it reuses a fraction uniform in
//              [kMultiturnMinReuse, kMultiturnMaxReuse] of its prompt; turn 0
//              is input_len bytes;
//   longdoc    independent prompts of 8 x input_len, output_len / 4;
//   mixed      every fourth a longdoc among input_len / 2 prompts decoding
//              2 x output_len.
// Deterministic for a seed.
inline constexpr int32_t kMultiturnTurns = 6;
inline constexpr double kMultiturnMinReuse = 0.75;
inline constexpr double kMultiturnMaxReuse = 0.95;
absl::StatusOr<std::vector<RequestSpec>> MakeWorkload(
    const WorkloadConfig& config);

// One JSON object per line: {"arrival_s": 0.5, "prompt": "..." |
// "prompt_tokens": 300, "max_tokens": 32, "prefix_group": "g1"}.
// `prompt_tokens` synthesises a prompt of that many bytes, shared across lines
// of the same prefix_group up to the group's first prompt length. Errors name
// the file and line number.
absl::StatusOr<std::vector<RequestSpec>> ParseTrace(const std::string& text,
                                                    const std::string& path);

}  // namespace pdserve::bench
