#include "engine/backend.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pdserve::engine {
namespace {

// LlamaModel over a host KvPool: the reference path, unchanged.
class CpuBackend : public Backend {
 public:
  CpuBackend(std::shared_ptr<const ModelWeights> weights,
             kernels::MatMulMode mode, std::unique_ptr<KvPool> pool)
      : pool_(std::move(pool)), model_(std::move(weights), mode) {}
  Device device() const override { return Device::kCpu; }
  const KvCacheSpec& kv_spec() const override { return pool_->spec(); }
  int64_t num_blocks() const override { return pool_->num_blocks(); }
  absl::Status Forward(
      std::span<const LlamaModel::SeqInput> seqs, std::vector<float>* logits,
      const LlamaModel::LayerWrittenFn& on_layer_written) override {
    return model_.Forward(seqs, pool_.get(), logits, on_layer_written);
  }
  KvStorage* kv_storage() override { return pool_.get(); }

 private:
  std::unique_ptr<KvPool> pool_;
  LlamaModel model_;
};

std::atomic<BackendFactory> cuda_factory{nullptr};

}  // namespace

std::optional<Device> ParseDevice(std::string_view s) {
  if (s == "cpu") return Device::kCpu;
  if (s == "cuda" || s == "gpu") return Device::kCuda;
  return std::nullopt;
}

const char* DeviceName(Device d) { return d == Device::kCuda ? "cuda" : "cpu"; }

absl::Status CheckKvDtypeForDevice(Device device, DType kv_dtype) {
  if (kv_dtype == DType::kFp8E4M3 && device != Device::kCuda) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-dtype fp8 (e4m3) needs --device cuda: the ", DeviceName(device),
        " backend has no fp8 kernels; on the CPU use --kv-dtype int8 for "
        "1-byte KV with per-(block, head) scales"));
  }
  return absl::OkStatus();
}

absl::Status BackendConfig::Validate() const {
  RETURN_IF_ERROR(kv.Validate());
  RETURN_IF_ERROR(CheckKvDtypeForDevice(device, kv.dtype));
  if (!(gpu_memory_utilization > 0.0 && gpu_memory_utilization <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu_memory_utilization must be in (0, 1], got ",
                     gpu_memory_utilization));
  }
  if (cuda_device < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_device must be >= 0, got ", cuda_device));
  }
  if (max_num_batched_tokens < 1) {
    return absl::InvalidArgumentError(
        "max_num_batched_tokens must be at least 1");
  }
  return absl::OkStatus();
}

void SetBackendFactory(Device device, BackendFactory factory) {
  if (device == Device::kCuda) cuda_factory.store(factory);
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(
    std::shared_ptr<const ModelWeights> weights, const BackendConfig& config) {
  RETURN_IF_ERROR(config.Validate());
  if (config.device == Device::kCuda) {
    BackendFactory factory = cuda_factory.load();
    if (factory == nullptr) {
      return absl::FailedPreconditionError(
          "--device cuda: this pdserve was built without CUDA (or the CUDA "
          "backend is not registered)");
    }
    return factory(std::move(weights), config);
  }
  ASSIGN_OR_RETURN(auto pool,
                   KvPool::Create(config.kv, config.kv.BlocksForMemory(
                                                 config.kv_cache_bytes)));
  return std::unique_ptr<Backend>(
      new CpuBackend(std::move(weights), config.matmul, std::move(pool)));
}

}  // namespace pdserve::engine
