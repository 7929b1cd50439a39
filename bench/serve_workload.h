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
