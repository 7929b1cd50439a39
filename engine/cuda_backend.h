// The CUDA backend (engine/backend.h): Llama-family forward pass on one GPU
// with cuBLAS GEMMs (bf16 weights, or fp32 with gpu_reference_math) and the
// kernels of kernels/cuda/ over a paged KV pool in device memory. The pool
// takes what is left of gpu_memory_utilization x total GPU memory after the
// weights and activation buffers. Activations are fp32, as on the CPU.
//
// Attention per step: all-decode batches use the split-K decode kernel;
// batches with a prefill chunk use the tensor-core prefill kernel for every
// sequence (or, with gpu_reference_math, the fp32 decode kernel with one row
// per query). Logits are copied back to the host, where the engine samples.
// A cudaEvent is recorded after each layer's KV write; the layer hooks
// (Backend::Forward) run on the engine thread as those events complete,
// during the pass (engine/layer_ready.h), so layer-wise KV sends overlap the
// remaining layers' compute.
//
// The KV lives on the GPU: kv_storage() exposes device spans (cuda:N), with
// device copies on their own stream and pinned staging for the grpc
// transport; NCCL and CUDA IPC use the device pointers directly.
//
// Not thread-safe (one engine thread). Built only with CUDA.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/backend.h"

namespace pdserve::engine {

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(
    std::shared_ptr<const ModelWeights> weights, const BackendConfig& config);

// Makes CreateBackend(device = kCuda) use CreateCudaBackend.
void RegisterCudaBackend();

}  // namespace pdserve::engine
