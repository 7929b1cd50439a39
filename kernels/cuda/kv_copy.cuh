// Gathering paged KV spans into one contiguous staging buffer and scattering
// a staging buffer back into paged blocks, on the GPU. KV transfer stages the
// spans of one batch this way so that the wire sees one large buffer instead
// of thousands of block-sized pieces.
//
// Paged layout (kv_cache/kv_cache.h): each layer is one buffer of num_blocks
// spans of `span_bytes`, so span (layer, block) starts at
// layer_bases[layer] + block * span_bytes. The same launchers move the KV
// data (span_bytes = KvCacheSpec::LayerBlockBytes()) and, for int8, the
// per-block scales (span_bytes = 2 * kv_heads * sizeof(float)): one launch
// per call, covering every span.
//
// Staging layout: [num_spans][span_bytes], span i at staging + i * span_bytes.
//
// All pointers are device pointers (or pointers the device can access);
// `layer_bases` and `spans` are device arrays the caller keeps alive until
// the stream has run the copy. Spans naming a layer or block outside
// [0, num_layers) x [0, num_blocks) are skipped: callers validate spans on the
// host, and the check only keeps a corrupt table from writing out of bounds.
// Scatter spans must name distinct blocks; gather spans may repeat.
//
// Launchers are thread-safe; work is ordered only by `stream`.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace pdserve::kernels::cuda {

// One (layer, physical block) span of a paged KV buffer.
struct KvBlockSpan {
  int32_t layer = 0;
  int32_t block = 0;
};

// staging[i] = span spans[i] of the paged buffers.
absl::Status InvokeGatherKvBlocks(
    const uint8_t* const* layer_bases,  // [num_layers]
    int32_t num_layers, int64_t num_blocks, int64_t span_bytes,
    const KvBlockSpan* spans,  // [num_spans]
    int32_t num_spans,
    uint8_t* staging,  // [num_spans][span_bytes]
    cudaStream_t stream);

// Span spans[i] of the paged buffers = staging[i].
absl::Status InvokeScatterKvBlocks(
    uint8_t* const* layer_bases,  // [num_layers]
    int32_t num_layers, int64_t num_blocks, int64_t span_bytes,
    const KvBlockSpan* spans,  // [num_spans]
    int32_t num_spans,
    const uint8_t* staging,  // [num_spans][span_bytes]
    cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
