// Forward pass of a Llama-family decoder over a batch of sequences whose
// K/V live in a paged KvPool (for DeepSeek's MLA, latent rows: model/mla.h).
// Each sequence contributes a run of new tokens (a prefill chunk or one decode
// token) at consecutive positions; their K/V are written into the sequence's
// blocks and attention reads the whole prefix through its block table.
//
// With MatMulMode::kDeterministic a token's hidden states and logits depend
// only on its own sequence, never on what else is in the batch.
// Not thread-safe (reuses scratch buffers); one instance per engine thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/paged_attention.h"
#include "kv_cache/kv_cache.h"
#include "model/mla.h"
#include "model/moe.h"
#include "model/weights.h"

namespace pdserve::engine {

class LlamaModel {
 public:
  enum class Logits { kNone, kLast, kAll };
  struct SeqInput {
    std::span<const int32_t> tokens;  // new tokens of this step
    int32_t start_pos = 0;            // position of tokens[0]
    std::span<const int32_t>
        block_table;  // covers positions < start_pos + tokens.size()
    Logits logits = Logits::kLast;
  };

  LlamaModel(std::shared_ptr<const ModelWeights> weights,
             kernels::MatMulMode mode);

  const ModelConfig& config() const { return weights_->config; }
  const ModelWeights& weights() const { return *weights_; }
  // Called once per layer, in order, as soon as that layer's K/V of every
  // sequence in the batch is in the pool (before the layer's attention).
  using LayerWrittenFn = std::function<void(int32_t layer)>;
  // Runs the batch and leaves *logits holding its logits rows [rows, vocab]
  // in sequence order (one row per kLast sequence, one per token for kAll),
  // and nothing else. The vector is resized, not cleared first, so one kept
  // between calls is not zero-filled again (16 MB a step at batch 32 with a
  // 128K vocabulary); only growth past its last size is.
  absl::Status Forward(std::span<const SeqInput> seqs, KvPool* pool,
                       std::vector<float>* logits,
                       const LayerWrittenFn& on_layer_written = nullptr);

 private:
  // Layer l's GQA attention of normed_ into proj_ (o_proj output).
  void Attention(const LayerWeights& w, int64_t total,
                 std::span<const kernels::AttentionSeq> attn_seqs, KvPool* pool,
                 int32_t l, const LayerWrittenFn& on_layer_written);
  // The final norm and the logits rows.
  absl::Status Finish(std::span<const SeqInput> seqs, int64_t total,
                      std::vector<float>* logits);

  std::shared_ptr<const ModelWeights> weights_;
  kernels::MatMulMode mode_;
  std::vector<float> inv_freq_;
  MoeMlp moe_;  // sparse layers' MLP (Mixtral, Qwen3-MoE, DeepSeek)
  std::unique_ptr<MlaAttention> mla_;  // DeepSeek-V2/V3 attention, else null
  // Scratch, grown as needed.
  std::vector<float> residual_, normed_, qkv_, q_, k_, v_, attn_, proj_,
      gate_up_, act_, rows_;
  std::vector<int32_t> positions_;
  std::vector<int64_t> slots_;
};

}  // namespace pdserve::engine
