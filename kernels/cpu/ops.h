// Element-wise and row-wise transformer ops on fp32 activations (CPU).
// Stateless and thread-safe. Each op's per-row result depends only on that
// row's inputs, so batching never changes a token's numbers.
#pragma once

#include <cstdint>
#include <vector>

namespace pdserve::kernels {

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for `rows` rows of `dim`.
// When `residual` is non-null it is first updated in place (residual += x) and
// the normalised value is computed from the updated residual (fused add).
void RmsNorm(const float* x, float* residual, const float* weight, int64_t rows,
             int64_t dim, float eps, float* out);

// Splits the rows of a fused projection qkv [rows, q_dim + 2 * kv_dim] into
// q [rows, q_dim], k and v [rows, kv_dim], first adding bias
// [q_dim + 2 * kv_dim] to qkv in place when it is non-null.
void SplitQkv(float* qkv, const float* bias, int64_t rows, int64_t q_dim,
              int64_t kv_dim, float* q, float* k, float* v);

// Rotary embedding, Hugging Face "rotate_half" (NeoX) pairing of element i with
// i + head_dim/2. x: [rows, heads, head_dim], in place; positions: [rows];
// inv_freq: [head_dim / 2].
void ApplyRope(float* x, int64_t rows, int64_t heads, int64_t head_dim,
               const int32_t* positions, const float* inv_freq);
// The same on queries q [rows, q_heads, head_dim] and keys k [rows, k_heads,
// head_dim] (null: none) in one pass, each row's angles computed once for
// both.
void ApplyRope(float* q, int64_t q_heads, float* k, int64_t k_heads,
               int64_t rows, int64_t head_dim, const int32_t* positions,
               const float* inv_freq);

// gate_up: [rows, 2 * inter] (gate then up); out: [rows, inter] = silu(gate) *
// up.
void SiluAndMul(const float* gate_up, int64_t rows, int64_t inter, float* out);

// The instruction set RmsNorm and SiluAndMul use (kBest: the best this CPU
// has, the default); all give the same bits. False if the CPU lacks it. For
// tests and benchmarks; not synchronised with running calls.
enum class OpsIsa { kBest, kPortable, kAvx2, kAvx512 };
bool SetOpsIsa(OpsIsa isa);

// In-place numerically stable softmax over n values.
void SoftmaxInPlace(float* x, int64_t n);

// Rotary inverse frequencies, including the Llama-3 long-context scaling when
// factor > 0 (factor, low/high frequency factors, original context length).
struct RopeScaling {
  float factor = 0;  // 0: no scaling
  float low_freq_factor = 1;
  float high_freq_factor = 4;
  int64_t original_max_position_embeddings = 8192;
};
std::vector<float> RopeInvFreq(int64_t head_dim, double theta,
                               const RopeScaling& scaling);

}  // namespace pdserve::kernels
