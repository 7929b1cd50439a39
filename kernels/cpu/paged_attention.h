// Paged KV-cache kernels for the CPU: writing new K/V into blocks (with
// quantisation for int8) and causal attention over a block table.
//
// Layout of one layer's cache (ARCHITECTURE.md, recommended):
//   data:   [num_blocks][2 (K,V)][kv_heads][block_size][head_dim] of `dtype`
//   scales: [num_blocks][2 (K,V)][kv_heads] fp32, int8 only
// One (layer, block) is one contiguous span, so transfer needs no gather.
// Kernels are stateless; callers must not write the same block concurrently.
#pragma once

#include <cstdint>
#include <span>

#include "common/dtype.h"

namespace pdserve::kernels {

struct KvLayerView {
  void* data = nullptr;     // see layout above
  float* scales = nullptr;  // int8 only
  DType dtype = DType::kF32;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_size = 0;

  int64_t ElementsPerBlock() const {
    return int64_t{2} * num_kv_heads * block_size * head_dim;
  }
  // Element offset of (block, kv, head, slot=0, dim=0).
  int64_t Offset(int64_t block, int kv, int head) const {
    return ((block * 2 + kv) * num_kv_heads + head) * int64_t{block_size} *
           head_dim;
  }
  // The int8 scale of (block, kv, head).
  float& Scale(int64_t block, int kv, int head) const {
    return scales[(block * 2 + kv) * num_kv_heads + head];
  }
};

// Writes K and V of `num_tokens` tokens: k, v: [num_tokens, kv_heads,
// head_dim]; slots[t] = block * block_size + offset_in_block. For int8 the
// per-(block, head) scale grows when a new value exceeds it and the block's
// earlier entries are requantised, so a scale never clips. A token at offset 0
// starts a fresh scale (the block was just allocated to this sequence). Tokens
// are written in order, so the result is the same whether they arrive one per
// decode step or all in one prefill chunk.
void WriteKv(const float* k, const float* v, int64_t num_tokens,
             const int64_t* slots, const KvLayerView& cache);

// Reads one (block, kv, head) span of `count` slots as fp32 into out
// [count][head_dim]. Used by attention and tests.
void ReadKvBlock(const KvLayerView& cache, int64_t block, int kv, int head,
                 int count, float* out);

// One sequence's part of a batched attention call. Its queries are rows
// [q_row, q_row + num_q) of q/out, at positions start_pos .. start_pos+num_q-1;
// query i attends to positions 0 .. start_pos + i (causal), whose K/V must
// already be in the blocks listed by block_table.
struct AttentionSeq {
  int64_t q_row = 0;
  int32_t num_q = 0;
  int32_t start_pos = 0;
  const int32_t* block_table = nullptr;
};

// q, out: [rows, num_heads, head_dim] fp32. GQA: query head h reads KV head
// h / (num_heads / kv_heads), and each KV block is dequantised once per
// (sequence, KV head, query chunk) and shared by the whole query group.
// Online softmax in fp32 over blocks in order, so a query's result does not
// depend on how many other queries share the call (prefill == decode).
// Scores, exp and the weighted V sum run in AVX-512 or AVX2 where the CPU has
// them, else portably; all give the same bits (the arithmetic is written out
// in paged_attention.cc).
void PagedAttention(const float* q, int32_t num_heads,
                    std::span<const AttentionSeq> seqs,
                    const KvLayerView& cache, float scale, float* out);

// For tests and benchmarks: the instruction set attention uses (kBest: the
// best this CPU has, the default). All give the same bits. False if the CPU
// lacks it. Not synchronised with running attention calls.
enum class PagedAttentionIsa { kBest, kPortable, kAvx2, kAvx512 };
bool SetPagedAttentionIsa(PagedAttentionIsa isa);

// Where the software prefetch of the K and V a task reads next puts its
// lines. kBest: L1 (T0) on AMD CPUs and L2 (T2) elsewhere. Measured with
// `attention_bench`, caches flushed: on an AMD EPYC (Zen 5) T2 requests of
// scattered 4 KiB KV units came in at 5-7 GB/s a thread against 20-26 with
// T0 (2 threads, one 168-token sequence of `small`: 25-39 us a call
// against 7-9); on an Intel Xeon T2 was 12% faster than T0 (32 sequences x
// 256 tokens). The hint never changes a result. For tests and benchmarks;
// not synchronised with running attention calls.
enum class KvPrefetchHint { kBest, kL1, kL2 };
void SetKvPrefetchHint(KvPrefetchHint hint);

// The exp attention's softmax uses (x <= 0), for tests.
float AttentionExpForTesting(float x);

}  // namespace pdserve::kernels
