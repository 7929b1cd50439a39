#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/kv_copy.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kThreads = 256;
// Enough thread blocks per span to keep large spans (tens of KiB) busy
// without launching idle blocks for small ones.
constexpr int64_t kMaxBlocksPerSpan = 64;
constexpr int64_t kVectorBytes = sizeof(uint4);

// Copies `bytes` bytes with the threads of one span's grid column: 16-byte
// words when both ends are 16-byte aligned (then a byte tail), bytes
// otherwise. Alignment is uniform per span, so warps do not diverge.
__device__ __forceinline__ void CopySpan(
    const uint8_t* __restrict__ src,  // [bytes]
    uint8_t* __restrict__ dst,        // [bytes]
    int64_t bytes) {
  const int64_t tid =
      static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.y) * blockDim.x;
  int64_t done = 0;
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) &
       (kVectorBytes - 1)) == 0) {
    const int64_t words = bytes / kVectorBytes;
    const uint4* __restrict__ src4 = reinterpret_cast<const uint4*>(src);
    uint4* __restrict__ dst4 = reinterpret_cast<uint4*>(dst);
    for (int64_t i = tid; i < words; i += stride) dst4[i] = src4[i];
    done = words * kVectorBytes;
  }
  for (int64_t i = done + tid; i < bytes; i += stride) dst[i] = src[i];
}

// grid: (num_spans, blocks per span); block: kThreads.
__global__ void GatherKvBlocksKernel(
    const uint8_t* const* __restrict__ layer_bases,  // [num_layers] ->
                                                     // [num_blocks][span_bytes]
    int32_t num_layers, int64_t num_blocks, int64_t span_bytes,
    const KvBlockSpan* __restrict__ spans,  // [num_spans]
    uint8_t* __restrict__ staging) {        // [num_spans][span_bytes]
  const int64_t i = blockIdx.x;
  const KvBlockSpan span = spans[i];
  if (span.layer < 0 || span.layer >= num_layers || span.block < 0 ||
      span.block >= num_blocks) {
    return;
  }
  CopySpan(layer_bases[span.layer] + span.block * span_bytes,
           staging + i * span_bytes, span_bytes);
}

// grid: (num_spans, blocks per span); block: kThreads.
__global__ void ScatterKvBlocksKernel(
    uint8_t* const* __restrict__ layer_bases,  // [num_layers] ->
                                               // [num_blocks][span_bytes]
    int32_t num_layers, int64_t num_blocks, int64_t span_bytes,
    const KvBlockSpan* __restrict__ spans,  // [num_spans]
    const uint8_t* __restrict__ staging) {  // [num_spans][span_bytes]
  const int64_t i = blockIdx.x;
  const KvBlockSpan span = spans[i];
  if (span.layer < 0 || span.layer >= num_layers || span.block < 0 ||
      span.block >= num_blocks) {
    return;
  }
  CopySpan(staging + i * span_bytes,
           layer_bases[span.layer] + span.block * span_bytes, span_bytes);
}

absl::Status CheckArguments(const void* layer_bases, int32_t num_layers,
                            int64_t num_blocks, int64_t span_bytes,
                            const void* spans, int32_t num_spans,
                            const void* staging) {
  if (num_layers <= 0 || num_blocks <= 0 || span_bytes <= 0 || num_spans < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV block copy: num_layers=", num_layers,
                     " num_blocks=", num_blocks, " span_bytes=", span_bytes,
                     " num_spans=", num_spans, " (all positive, spans >= 0)"));
  }
  if (num_spans > 0 &&
      (layer_bases == nullptr || spans == nullptr || staging == nullptr)) {
    return absl::InvalidArgumentError(
        "KV block copy: null layer table, span list or staging");
  }
  return absl::OkStatus();
}

dim3 GridFor(int32_t num_spans, int64_t span_bytes) {
  const int64_t words = (span_bytes + kVectorBytes - 1) / kVectorBytes;
  const int64_t per_span = std::clamp<int64_t>(
      (words + kThreads - 1) / kThreads, 1, kMaxBlocksPerSpan);
  return dim3(static_cast<unsigned>(num_spans), static_cast<unsigned>(per_span),
              1);
}

}  // namespace

absl::Status InvokeGatherKvBlocks(const uint8_t* const* layer_bases,
                                  int32_t num_layers, int64_t num_blocks,
                                  int64_t span_bytes, const KvBlockSpan* spans,
                                  int32_t num_spans, uint8_t* staging,
                                  cudaStream_t stream) {
  if (absl::Status s = CheckArguments(layer_bases, num_layers, num_blocks,
                                      span_bytes, spans, num_spans, staging);
      !s.ok() || num_spans == 0) {
    return s;
  }
  GatherKvBlocksKernel<<<GridFor(num_spans, span_bytes), kThreads, 0, stream>>>(
      layer_bases, num_layers, num_blocks, span_bytes, spans, staging);
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status InvokeScatterKvBlocks(uint8_t* const* layer_bases,
                                   int32_t num_layers, int64_t num_blocks,
                                   int64_t span_bytes, const KvBlockSpan* spans,
                                   int32_t num_spans, const uint8_t* staging,
                                   cudaStream_t stream) {
  if (absl::Status s = CheckArguments(layer_bases, num_layers, num_blocks,
                                      span_bytes, spans, num_spans, staging);
      !s.ok() || num_spans == 0) {
    return s;
  }
  ScatterKvBlocksKernel<<<GridFor(num_spans, span_bytes), kThreads, 0,
                          stream>>>(layer_bases, num_layers, num_blocks,
                                    span_bytes, spans, staging);
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace pdserve::kernels::cuda
