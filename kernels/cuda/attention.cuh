// Attention over the paged KV cache on the GPU (host launchers).
//
//  - Decode (one query per row, all earlier positions visible): flash-decoding.
//    The context is cut into partitions of DecodePartitionTokens() tokens;
//    one thread block per (query, KV head, partition) reads each K/V row once
//    with 16-byte loads and serves every query head of the KV head's group
//    (GQA). With more than one partition a second kernel merges the
//    partitions' softmax statistics. fp32 arithmetic throughout.
//  - Prefill (a chunk of new queries after a cached prefix, causal): tiled
//    flash attention with an online softmax, QK^T and PV on the tensor cores
//    (wmma m16n16k16, fp16 operands, fp32 accumulation).
//
// Both read K/V that reshape_and_cache already wrote, including the new
// tokens' own, like the CPU kernel (kernels/cpu/paged_attention.h).
// head_dim must be 16, 32, 64 or 128; other values return INVALID_ARGUMENT.
// Launchers are thread-safe; work is ordered only by `stream`.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/paged_kv.cuh"

namespace pdserve::kernels::cuda {

// Tokens per split-K partition of the decode kernel.
int32_t DecodePartitionTokens();

// Bytes of device workspace InvokePagedDecodeAttention needs (0 when every
// context fits in one partition).
int64_t PagedDecodeAttentionWorkspaceBytes(int32_t num_queries,
                                           int32_t num_heads, int32_t head_dim,
                                           int32_t max_context_len);

// Query row r attends to positions [0, context_lens[r]) of sequence
// query_seq[r] (r itself when query_seq is null). context_lens[r] may be 0
// (the output row is then 0). A context_lens[r] above max_context_len or
// below 0 makes row r's output NaN (the lengths live on the device, so the
// launcher cannot check them without a sync; NaN reaches the logits, where
// the engine ends that request with INTERNAL). All pointers are device
// pointers.
absl::Status InvokePagedDecodeAttention(
    const float* q,  // [num_queries, num_heads, head_dim]
    const PagedKvView& cache,
    const int32_t* block_tables,  // [num_seqs, max_blocks_per_seq]
    int32_t max_blocks_per_seq,
    const int32_t* context_lens,  // [num_queries], each <= max_context_len
    const int32_t* query_seq,     // [num_queries] or nullptr
    int32_t num_queries, int32_t num_heads, int32_t max_context_len,
    float scale,
    float* out,  // [num_queries, num_heads, head_dim]
    void* workspace, int64_t workspace_bytes, cudaStream_t stream);

// One sequence of a prefill call: its queries are rows [q_row, q_row + num_q)
// of q/out at positions start_pos .. start_pos + num_q - 1. A sequence whose
// last position lies past its block-table row (max_blocks_per_seq *
// block_size) gets NaN output rows, as the decode launcher's bad contexts.
struct PrefillSeq {
  int32_t q_row = 0;
  int32_t num_q = 0;
  int32_t start_pos = 0;
  int32_t reserved = 0;
};

absl::Status InvokePagedPrefillAttention(
    const float* q,  // [rows, num_heads, head_dim]
    const PagedKvView& cache,
    const PrefillSeq* seqs,  // [num_seqs], device
    int32_t num_seqs,
    const int32_t* block_tables,  // [num_seqs, max_blocks_per_seq]
    int32_t max_blocks_per_seq, int32_t num_heads,
    int32_t max_num_q,  // largest num_q among seqs
    float scale,
    float* out,  // [rows, num_heads, head_dim]
    cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
