// Token sampling. Randomness comes from a counter-based RNG (Philox4x32-10)
// keyed by (seed, position of the token being sampled), never by worker or
// batch state, so the same request yields the same tokens on every path
// (ARCHITECTURE.md, equivalence contract). Stateless and thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace pdserve::engine {

struct SamplingParams {
  uint32_t max_tokens = 16;
  float temperature = 0.0f;  // 0 = greedy
  float top_p = 1.0f;        // (0, 1]; 0 is treated as 1
  uint32_t top_k = 0;        // 0 = off
  uint64_t seed = 0;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  // Report each sampled token's log-probability and the top_logprobs most
  // likely alternatives (ComputeLogprobs).
  bool logprobs = false;
  uint32_t top_logprobs = 0;  // <= kMaxTopLogprobs

  // INVALID_ARGUMENT for max_tokens 0, temperature outside [0, 100], top_p
  // outside [0, 1], NaNs, empty stop strings, or top_logprobs above
  // kMaxTopLogprobs.
  absl::Status Validate() const;
};

inline constexpr uint32_t kMaxTopLogprobs = 5;

// A sampled token's log-probability and the most likely alternatives.
struct TokenLogprobs {
  int32_t token = 0;
  float logprob = 0;
  // (token, logprob), highest first, ties by lower id.
  std::vector<std::pair<int32_t, float>> top;
};

// Log-softmax of the raw fp32 logits [vocab] (before temperature, top-k and
// top-p, as OpenAI and vLLM report them) at `token`, and the `top_n` largest.
// The normaliser is summed in double in index order, so equal logits give
// bit-identical results on every path.
TokenLogprobs ComputeLogprobs(const float* logits, int64_t vocab, int32_t token,
                              uint32_t top_n);

// Philox4x32 with 10 rounds (Salmon et al., SC'11).
std::array<uint32_t, 4> Philox4x32(std::array<uint32_t, 4> counter,
                                   std::array<uint32_t, 2> key);

// Uniform float in [0, 1) for (seed, position): 24 random bits.
float UniformForPosition(uint64_t seed, int64_t position);

// What SampleToken returns for a row of logits that holds a NaN: no token
// can be chosen from it (NaN comes from corrupt weights or KV, or a kernel
// fault), so the engine ends that request with INTERNAL naming the position
// and frees its blocks; other requests of the batch are unaffected. The GPU
// sampler (kernels/cuda/sampling.cuh) reports such rows the same way.
inline constexpr int32_t kInvalidLogitsToken = -1;

// Picks the next token from fp32 logits [vocab], or kInvalidLogitsToken when
// any logit is NaN (greedy and random alike). Greedy takes the first
// maximum. Otherwise: logits / temperature, keep the top_k largest (ties by
// lower id), softmax, keep the smallest prefix in (prob desc, id asc) order
// whose mass reaches top_p, and invert the CDF at UniformForPosition.
// -inf logits (masked tokens) have probability 0 and are never chosen.
// `scratch` avoids allocation per call.
int32_t SampleToken(const float* logits, int64_t vocab,
                    const SamplingParams& params, int64_t position,
                    std::vector<std::pair<float, int32_t>>* scratch);

}  // namespace pdserve::engine
