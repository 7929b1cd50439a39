// Row-wise and element-wise transformer ops on fp32 activations on the GPU,
// mirroring kernels/cpu/ops.h operation for operation (no fused multiply-add
// where the CPU has none, RMSNorm's sum of squares in double), so that the
// CUDA backend tracks the CPU reference closely. All pointers are device
// pointers. Thread-safe; ordered by `stream`.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace pdserve::kernels::cuda {

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight. When `residual` is not
// null it is first updated in place (residual += x) and normalised instead
// (fused add). out may alias x.
absl::Status InvokeRmsNorm(const float* x,       // [rows, dim]
                           float* residual,      // [rows, dim] or nullptr
                           const float* weight,  // [dim]
                           int64_t rows, int64_t dim, float eps,
                           float* out,  // [rows, dim]
                           cudaStream_t stream);

// Rotary embedding, Hugging Face rotate_half pairing (i, i + head_dim / 2),
// in place. inv_freq comes from kernels::RopeInvFreq, so every scaling the
// CPU supports (none, Llama-3) is covered by construction.
absl::Status InvokeRope(float* x,  // [rows, heads, head_dim]
                        int64_t rows, int64_t heads, int64_t head_dim,
                        const int32_t* positions,  // [rows]
                        const float* inv_freq,     // [head_dim / 2]
                        cudaStream_t stream);

// out = silu(gate) * up with gate_up = [gate | up] per row.
absl::Status InvokeSiluAndMul(const float* gate_up,  // [rows, 2 * inter]
                              int64_t rows, int64_t inter,
                              float* out,  // [rows, inter]
                              cudaStream_t stream);

// Splits fused q|k|v rows (adding the bias when given).
absl::Status InvokeSplitQkv(const float* qkv,   // [rows, q_dim + 2 * kv_dim]
                            const float* bias,  // [q_dim + 2 * kv_dim] or null
                            int64_t rows, int64_t q_dim, int64_t kv_dim,
                            float* q,  // [rows, q_dim]
                            float* k,  // [rows, kv_dim]
                            float* v,  // [rows, kv_dim]
                            cudaStream_t stream);

// out[r] = table[ids[r]]; ids outside [0, table_rows) give zero rows.
absl::Status InvokeGatherRows(const float* table,  // [table_rows, dim]
                              int64_t table_rows, int64_t dim,
                              const int32_t* ids,  // [rows]
                              int64_t rows,
                              float* out,  // [rows, dim]
                              cudaStream_t stream);

// fp32 -> bf16 (round to nearest even), for bf16 GEMM inputs.
absl::Status InvokeFloatToBf16(const float* in, int64_t n,
                               uint16_t* out,  // bf16 bits
                               cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
