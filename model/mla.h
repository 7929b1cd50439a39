// Multi-head Latent Attention (DeepSeek-V2/V3) on the CPU over a paged
// latent KV cache.
//
// Cache: per (layer, block) one contiguous span
//   [block_size][kv_lora_rank + qk_rope_head_dim] of the KV dtype
// holding, per token, the latent c = kv_a_layernorm(kv_a_proj(x)[:R]) and the
// shared rope key k_pe = RoPE(kv_a_proj(x)[R:]); no per-head K or V. int8
// keeps two fp32 scales per (layer, block): [0] the latent part, [1] the rope
// part (their magnitudes differ), grown and requantised as in
// kernels/cpu/paged_attention.h so that a block's bytes do not depend on how
// its tokens were chunked.
//
// Attention, in every step (prefill chunks and decode alike), runs in the
// weight-absorbed form over the latents: W_UK (kv_b_proj's k rows) is folded
// into the query, q_lat_h = W_UK_h^T q_nope_h, scores are
// (q_lat_h . c_j + q_pe_h . k_pe_j) * softmax_scale, and W_UV (the v rows)
// is applied after the softmax to the weighted latent sum. Why not expand K/V
// from the latent for prefill (fewer FLOPs per score at DeepSeek's sizes:
// qk_nope + qk_rope = 192 vs kv_lora_rank + qk_rope = 576 per head)? One
// arithmetic for every step makes a token's result independent of whether
// it arrived in a prefill chunk, a decode step, after a prefix-cache hit or in
// another batch, bit for bit (the equivalence contract), and a prefill over a
// cached prefix reads the latents without re-expanding it. The independent
// PyTorch reference (tests/reference/llama_ref.py) uses the expanded form.
//
// RoPE follows modeling_deepseek.py: the rope part is read as interleaved
// pairs (x[2i], x[2i+1]) rotated by position * inv_freq[i] and written out
// de-interleaved ([all first elements | all second elements]); with
// rope_interleave false (transformers' option) the pairs are (x[i], x[i+d/2])
// as in Llama. With YaRN's
// inv_freq and its cos/sin multiplier mscale(factor, mscale) /
// mscale(factor, mscale_all_dim); the softmax scale is (qk_nope + qk_rope)^-0.5
// times mscale(factor, mscale_all_dim)^2 when mscale_all_dim is set.
//
// MlaWeights is immutable after load; MlaAttention reuses scratch buffers and
// is not thread-safe (one per LlamaModel).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/packed_gemm.h"
#include "kernels/cpu/paged_attention.h"
#include "kv_cache/kv_cache.h"
#include "model/model_config.h"

namespace pdserve::engine {

struct MlaWeights {
  // Without q LoRA: q_proj [H * (nope + rope), hidden]. With it: q_a_proj
  // [q_lora_rank, hidden], q_a_layernorm [q_lora_rank], q_b_proj
  // [H * (nope + rope), q_lora_rank].
  kernels::WeightMatrix q_proj, q_a_proj, q_b_proj;
  std::vector<float> q_a_norm;
  kernels::WeightMatrix kv_a_proj;  // [kv_lora_rank + rope, hidden]
  std::vector<float> kv_a_norm;     // [kv_lora_rank]
  // kv_b_proj [H * (nope + v), kv_lora_rank] split per head for absorption:
  // uk_t[h] = W_UK_h^T [kv_lora_rank, nope], uv[h] = W_UV_h [v, kv_lora_rank].
  std::vector<kernels::WeightMatrix> uk_t, uv;

  bool empty() const { return kv_a_proj.empty(); }
  int64_t bytes() const;
};

// Loads layer `layer`'s MLA tensors ("model.layers.L.self_attn.*") through
// `fetch` (appends a checkpoint tensor of exactly `shape` as fp32) and
// `pack` (turns rows x cols fp32 into the storage matrix); the o_proj
// [hidden, H * v_head_dim] goes to *o_proj.
using TensorFetch = std::function<absl::Status(
    const std::string& name, const std::vector<int64_t>& shape,
    std::vector<float>* out)>;
using MatrixPack = std::function<kernels::WeightMatrix(
    const float* data, int64_t rows, int64_t cols)>;
absl::Status LoadMlaWeights(const ModelConfig& c, int64_t layer,
                            const TensorFetch& fetch, const MatrixPack& pack,
                            MlaWeights* w, kernels::WeightMatrix* o_proj);

// DeepSeek's YaRN helpers (modeling_deepseek.py): yarn_get_mscale, and the
// rope inverse frequencies [qk_rope_head_dim / 2] (plain RoPE without yarn).
double YarnMscale(double factor, double mscale);
std::vector<double> MlaRopeInvFreq(const ModelConfig& c);
float MlaSoftmaxScale(const ModelConfig& c);

// Writes latent rows rows[t] [kv_lora_rank + rope] into slot slots[t]
// (block * block_size + offset) of one layer's latent storage, in token
// order. data: the layer's [num_blocks][block_size][width] storage; scales:
// [num_blocks][2] for int8, else null.
void WriteLatentRows(const float* rows, int64_t num_tokens,
                     const int64_t* slots, const KvCacheSpec& spec, void* data,
                     float* scales);
// Reads `count` rows of one block as fp32 into out [count][width].
void ReadLatentBlock(const KvCacheSpec& spec, const void* data,
                     const float* scales, int64_t block, int count, float* out);

class MlaAttention {
 public:
  explicit MlaAttention(const ModelConfig& c);

  // x: [total, hidden] (the input-normed hidden states of every sequence's
  // new tokens, in seqs' row order); positions and slots per row. Writes the
  // rows' latents into `pool`'s layer, calls on_written(), attends causally
  // over each sequence's block table and writes the o_proj output
  // out [total, hidden].
  void Forward(const MlaWeights& w, const kernels::WeightMatrix& o_proj,
               const float* x, int64_t total, const int32_t* positions,
               const int64_t* slots,
               std::span<const kernels::AttentionSeq> seqs, KvPool* pool,
               int32_t layer, kernels::MatMulMode mode,
               const std::function<void()>& on_written, float* out);

 private:
  const ModelConfig& c_;
  std::vector<double> inv_freq_;
  float rope_mscale_ = 1.0f;  // YaRN cos/sin multiplier
  float scale_ = 1.0f;        // softmax scale
  std::vector<float> qa_, q_, kv_a_, latent_, rows_, qabs_, gather_, part_,
      ctx_, out_lat_, attn_;
};

}  // namespace pdserve::engine
