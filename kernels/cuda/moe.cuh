// Grouped-expert SwiGLU Mixture-of-Experts on the GPU (host launcher): the
// routed (token, rank) slots are grouped by expert (stably, in slot order),
// each expert's gate|up and down projections run over its group only, and
// each token's output is the weighted sum of its k expert outputs in rank
// order, as model/moe.h does on the CPU, so a token's output depends only on
// its own row. Routing (top-k and weights) is the caller's. fp32 weights and
// arithmetic. Launchers are thread-safe; work is ordered only by `stream`.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace pdserve::kernels::cuda {

// Bytes of device workspace InvokeGroupedMoe needs.
int64_t GroupedMoeWorkspaceBytes(int32_t m, int32_t k, int32_t hidden,
                                 int32_t inter, int32_t num_experts);

absl::Status InvokeGroupedMoe(
    const float* __restrict__ x,          // [m, hidden]
    const int32_t* __restrict__ experts,  // [m, k], each in [0, num_experts)
    const float* __restrict__ weights,    // [m, k]
    const float* __restrict__ gate_up,    // [num_experts, 2 * inter, hidden]
    const float* __restrict__ down,       // [num_experts, hidden, inter]
    int32_t m, int32_t k, int32_t hidden, int32_t inter, int32_t num_experts,
    void* workspace, int64_t workspace_bytes,
    float* __restrict__ y,  // [m, hidden]
    cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
