// Token sampling on the GPU with the CPU's exact rules (engine/sampling.h):
// greedy takes the first maximum; otherwise logits / temperature, top_k
// (ties by lower id), softmax in double, the smallest (prob desc, id asc)
// prefix whose mass reaches top_p, and CDF inversion at the same
// counter-based Philox4x32-10 uniform keyed by (seed, position). The same
// logits therefore give the same token on either device, except when the
// uniform or top_p falls within double rounding (~1e-15) of a CDF boundary:
// the GPU forms prefix sums in parallel, the CPU sequentially. A row that
// holds a NaN logit gets kInvalidToken, greedy or random, as the CPU's
// SampleToken returns engine::kInvalidLogitsToken (the same value): the
// engine ends that request with an error.
//
// Random rows sort each row (CUB segmented radix sort, stable, so equal
// values keep id order) and scan it in one thread block. Thread-safe;
// ordered by `stream`.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>

#include "absl/status/status.h"

namespace pdserve::kernels::cuda {

// The token of a row whose logits hold a NaN (engine::kInvalidLogitsToken).
inline constexpr int32_t kInvalidToken = -1;

struct SampleParams {
  float temperature = 0.0f;  // <= 0: greedy
  float top_p = 1.0f;        // (0, 1]; 0 means 1
  uint32_t top_k = 0;        // 0: off
  uint32_t reserved = 0;
  uint64_t seed = 0;
  int64_t position = 0;  // position of the token being sampled
};

// Philox4x32-10 and the uniform in [0, 1) for (seed, position), host and
// device, bit-identical to engine/sampling.h (tests compare them).
std::array<uint32_t, 4> PhiloxHost(std::array<uint32_t, 4> counter,
                                   std::array<uint32_t, 2> key);
float UniformForPositionHost(uint64_t seed, int64_t position);

// Device workspace for InvokeSample over `rows` x `vocab` logits.
int64_t SamplingWorkspaceBytes(int32_t rows, int64_t vocab);

// tokens[r] = the token for logits row r under params[r]. `params` is a host
// array (copied into the workspace); logits, tokens and workspace are device
// memory. rows * vocab must fit in an int (CUB's item count).
absl::Status InvokeSample(const float* logits,  // [rows, vocab]
                          int32_t rows, int64_t vocab,
                          const SampleParams* params,  // [rows], host
                          int32_t* tokens,             // [rows]
                          void* workspace, int64_t workspace_bytes,
                          cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
