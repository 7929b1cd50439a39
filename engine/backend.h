// Where a worker's forward pass runs: the Backend interface (STYLE.md names
// it as one of pdserve's real interfaces) with a CPU implementation
// (LlamaModel over a host KvPool) and a CUDA one (engine/cuda_backend.h:
// cuBLAS GEMMs and kernels/cuda/ over a paged pool in GPU memory).
//
// A backend owns the KV storage of one worker (exposed to transports as
// KvStorage spans that name their memory) and runs LlamaModel::Forward's
// contract over it: append K/V of each sequence's new tokens into its blocks,
// attend causally over its block table, and append fp32 logits rows to the
// host vector (one per kLast sequence, one per token for kAll). Block ids are
// the BlockManager's; the backend never allocates blocks itself.
//
// Not thread-safe: one engine thread owns a backend.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cpu/matmul.h"
#include "kv_cache/kv_cache.h"
#include "kv_cache/kv_storage.h"
#include "model/llama_model.h"
#include "model/weights.h"

namespace pdserve::engine {

enum class Device { kCpu, kCuda };
std::optional<Device> ParseDevice(std::string_view s);  // "cpu" | "cuda"
const char* DeviceName(Device d);

// INVALID_ARGUMENT where `device` cannot hold KV of `kv_dtype`: fp8-e4m3 is
// a CUDA-only KV dtype (the CPU kernels have no fp8 path). The message names
// the fix (--device cuda, or --kv-dtype int8 for 1-byte KV on the CPU).
absl::Status CheckKvDtypeForDevice(Device device, DType kv_dtype);

struct BackendConfig {
  Device device = Device::kCpu;
  KvCacheSpec kv;  // geometry from the model; block size and dtype from flags
  // CPU: the KV pool's memory budget.
  int64_t kv_cache_bytes = int64_t{256} << 20;
  kernels::MatMulMode matmul = kernels::MatMulMode::kDeterministic;
  // CUDA: fraction of the GPU's total memory this worker may use (weights,
  // activations and the KV pool, which takes what the others leave).
  double gpu_memory_utilization = 0.9;
  // CUDA: GEMMs in fp32 (no TF32) instead of bf16, and prefill attention
  // through the fp32 decode kernel (one row per query) instead of the
  // tensor-core kernel. Together they make the GPU follow the CPU reference
  // to float rounding; slower, for equivalence checks.
  bool gpu_reference_math = false;
  // CUDA: activation buffers are sized for this many tokens per step.
  int32_t max_num_batched_tokens = 512;
  // CUDA: the device the backend runs on and keeps its KV pool in
  // (--kv-cuda-device, which NCCL and cuda_ipc use too); >= 0.
  int32_t cuda_device = 0;

  absl::Status Validate() const;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual const KvCacheSpec& kv_spec() const = 0;
  virtual int64_t num_blocks() const = 0;
  // `on_layer_written(l)` (may be null) runs on the calling thread, once per
  // layer and in layer order, once layer l's K/V of every sequence are in
  // their blocks and readable through kv_storage(): during the pass on both
  // backends (CUDA: as soon as the event recorded after layer l's KV write
  // completed, while later layers still compute; engine/layer_ready.h). A
  // failed pass runs no hook after the failure. After a pass that succeeded,
  // *logits holds its logits rows and nothing else (LlamaModel::Forward); a
  // vector kept between passes keeps its storage.
  virtual absl::Status Forward(
      std::span<const LlamaModel::SeqInput> seqs, std::vector<float>* logits,
      const LlamaModel::LayerWrittenFn& on_layer_written = nullptr) = 0;
  // The KV storage this backend owns, as per-(layer, block) spans in host or
  // device memory (kv_cache/kv_storage.h). Never null.
  virtual KvStorage* kv_storage() = 0;
};

// The CPU backend, or the CUDA one where pdserve was built with CUDA and a
// CUDA backend factory is registered (RegisterCudaBackend in
// engine/cuda_backend.h); FAILED_PRECONDITION otherwise.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(
    std::shared_ptr<const ModelWeights> weights, const BackendConfig& config);

using BackendFactory = absl::StatusOr<std::unique_ptr<Backend>> (*)(
    std::shared_ptr<const ModelWeights> weights, const BackendConfig& config);
// Installs the factory CreateBackend uses for `device` (not kCpu). Call at
// start-up, before any CreateBackend.
void SetBackendFactory(Device device, BackendFactory factory);

}  // namespace pdserve::engine
