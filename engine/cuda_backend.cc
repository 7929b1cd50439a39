#include "engine/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "engine/layer_ready.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/cache.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gemm.cuh"
#include "kernels/cuda/ops.cuh"

namespace pdserve::engine {
namespace {

namespace kc = ::pdserve::kernels::cuda;

// Device allocations owned by the backend, freed together.
class DeviceArena {
 public:
  DeviceArena() = default;
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  ~DeviceArena() { Reset(); }
  // Frees everything (cudaFree waits for the device to finish using it).
  void Reset() {
    for (void* p : ptrs_) cudaFree(p);
    ptrs_.clear();
  }
  absl::StatusOr<void*> Alloc(int64_t bytes) {
    void* p = nullptr;
    PDSERVE_CUDA_RETURN_IF_ERROR(
        cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(bytes, 1))));
    ptrs_.push_back(p);
    return p;
  }
  template <typename T>
  absl::StatusOr<T*> Array(int64_t n) {
    ASSIGN_OR_RETURN(void* p, Alloc(n * static_cast<int64_t>(sizeof(T))));
    return static_cast<T*>(p);
  }

 private:
  std::vector<void*> ptrs_;
};

// Page-locked host memory, so device copies of KV spans run at full speed
// and asynchronously (double-buffered staging of the grpc transport).
class PinnedStaging final : public HostStagingBuffer {
 public:
  static absl::StatusOr<std::unique_ptr<HostStagingBuffer>> Create(
      size_t bytes) {
    void* p = nullptr;
    PDSERVE_CUDA_RETURN_IF_ERROR(
        cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocPortable));
    return std::unique_ptr<HostStagingBuffer>(new PinnedStaging(p, bytes));
  }
  ~PinnedStaging() override { cudaFreeHost(data_); }
  void* data() override { return data_; }
  size_t size() const override { return size_; }

 private:
  PinnedStaging(void* p, size_t n) : data_(p), size_(n) {}
  void* data_;
  size_t size_;
};

// The CUDA backend's paged pool as KvStorage: spans are device pointers on
// `device`. Copies run on their own stream from whatever thread calls them
// (transfer threads), after setting that thread's current device; the
// engine thread's stream is not involved. The blocks a transfer touches are
// pinned or reserved by the engine, and a transfer reads a (layer, block)
// only after the engine saw that layer's write complete (its layer hook ran
// after the layer's event, or the step ended with a stream synchronize), so
// its bytes are final when a copy reads them; later layers of the same pass
// write other memory.
class CudaKvStorage final : public KvStorage {
 public:
  CudaKvStorage(const KvCacheSpec& spec, int64_t num_blocks, int device,
                std::vector<kc::PagedKvView> layers)
      : spec_(spec),
        num_blocks_(num_blocks),
        device_(device),
        layers_(std::move(layers)) {}
  ~CudaKvStorage() override {
    if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
  }
  const KvCacheSpec& spec() const override { return spec_; }
  int64_t num_blocks() const override { return num_blocks_; }
  KvMemory memory() const override { return {MemoryKind::kDevice, device_}; }
  KvSpan Span(int32_t layer, int64_t block) override {
    const kc::PagedKvView& v = layers_[layer];
    KvSpan s;
    s.data_bytes = static_cast<size_t>(spec_.LayerBlockBytes());
    s.data = static_cast<uint8_t*>(v.data) + block * s.data_bytes;
    if (v.scales != nullptr) {
      s.scale_bytes =
          2 * static_cast<size_t>(spec_.num_kv_heads) * sizeof(float);
      s.scales = v.scales + block * 2 * spec_.num_kv_heads;
    }
    s.memory = memory();
    return s;
  }
  absl::Status CopyToHost(int32_t layer, int64_t block, void* data,
                          void* scales) override {
    const KvSpan s = Span(layer, block);
    if (s.scale_bytes > 0 && scales == nullptr)
      return MissingScales(layer, block);
    return Copy(data, s.data, s.data_bytes, scales, s.scales, s.scale_bytes,
                cudaMemcpyDeviceToHost);
  }
  absl::Status CopyFromHost(int32_t layer, int64_t block, const void* data,
                            const void* scales) override {
    const KvSpan s = Span(layer, block);
    if (s.scale_bytes > 0 && scales == nullptr)
      return MissingScales(layer, block);
    return Copy(s.data, data, s.data_bytes, s.scales, scales, s.scale_bytes,
                cudaMemcpyHostToDevice);
  }
  std::unique_ptr<HostStagingBuffer> AllocateStaging(size_t bytes) override {
    auto pinned = PinnedStaging::Create(bytes);
    if (pinned.ok()) return *std::move(pinned);
    return KvStorage::AllocateStaging(bytes);  // pageable: slower, correct
  }
  // Each layer's data and scales are whole cudaMalloc allocations
  // (DeviceArena), so cudaIpcGetMemHandle(base) exports each (cuda_ipc).
  std::vector<KvSharedRegion> SharedRegions() override {
    std::vector<KvSharedRegion> out;
    for (const kc::PagedKvView& v : layers_) {
      out.push_back({v.data, static_cast<size_t>(v.LayerBytes()), ""});
      if (v.scales != nullptr) {
        out.push_back({v.scales,
                       static_cast<size_t>(v.ScaleCount()) * sizeof(float),
                       ""});
      }
    }
    return out;
  }

 private:
  absl::Status Copy(void* dst, const void* src, size_t bytes, void* dst_scales,
                    const void* src_scales, size_t scale_bytes,
                    cudaMemcpyKind kind) {
    absl::MutexLock l(&mu_);  // one copy stream, shared by transfer threads
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (copy_stream_ == nullptr) {
      PDSERVE_CUDA_RETURN_IF_ERROR(
          cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
    }
    PDSERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src, bytes, kind, copy_stream_));
    if (scale_bytes > 0) {  // both non-null: checked by the callers
      PDSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
          dst_scales, src_scales, scale_bytes, kind, copy_stream_));
    }
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(copy_stream_));
    return absl::OkStatus();
  }

  const KvCacheSpec spec_;
  const int64_t num_blocks_;
  const int device_;
  const std::vector<kc::PagedKvView> layers_;
  absl::Mutex mu_;
  cudaStream_t copy_stream_ ABSL_GUARDED_BY(mu_) = nullptr;
};

// One cudaEvent per layer, recorded on the compute stream right after the
// layer's KV write (LayerReadySequencer's markers). Created once; each pass
// re-records them.
class CudaLayerEvents final : public LayerReadyEvents {
 public:
  CudaLayerEvents() = default;
  CudaLayerEvents(const CudaLayerEvents&) = delete;
  CudaLayerEvents& operator=(const CudaLayerEvents&) = delete;
  ~CudaLayerEvents() override {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  absl::Status Init(int32_t num_layers, cudaStream_t stream) {
    stream_ = stream;
    for (int32_t l = 0; l < num_layers; ++l) {
      cudaEvent_t e = nullptr;
      PDSERVE_CUDA_RETURN_IF_ERROR(
          cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      events_.push_back(e);
    }
    return absl::OkStatus();
  }
  absl::Status Record(int32_t layer) override {
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[layer], stream_));
    return absl::OkStatus();
  }
  absl::StatusOr<bool> Ready(int32_t layer) override {
    const cudaError_t e = cudaEventQuery(events_[layer]);
    if (e == cudaErrorNotReady) return false;
    PDSERVE_CUDA_RETURN_IF_ERROR(e);
    return true;
  }
  absl::Status Wait(int32_t layer) override {
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(events_[layer]));
    return absl::OkStatus();
  }

 private:
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> events_;
};

struct DeviceLayer {
  const float* input_norm = nullptr;
  const void* qkv = nullptr;
  const float* qkv_bias = nullptr;  // or null
  const float* q_norm = nullptr;    // or null
  const float* k_norm = nullptr;
  const void* o_proj = nullptr;
  const float* post_norm = nullptr;
  const void* gate_up = nullptr;
  const void* down = nullptr;
  kc::PagedKvView kv;
};

class CudaBackend : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<Backend>> Create(
      std::shared_ptr<const ModelWeights> weights, const BackendConfig& config);
  ~CudaBackend() override {
    cudaSetDevice(device_);  // the destroying thread may have another device
    gemm_.reset();           // before the stream it uses
    layer_events_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  Device device() const override { return Device::kCuda; }
  const KvCacheSpec& kv_spec() const override { return spec_; }
  int64_t num_blocks() const override { return num_blocks_; }
  KvStorage* kv_storage() override { return storage_.get(); }
  absl::Status Forward(
      std::span<const LlamaModel::SeqInput> seqs, std::vector<float>* logits,
      const LlamaModel::LayerWrittenFn& on_layer_written) override;

 private:
  CudaBackend(std::shared_ptr<const ModelWeights> weights,
              const BackendConfig& config)
      : weights_(std::move(weights)), config_(config), spec_(config.kv) {}
  absl::Status Init();
  // Enqueues the pass on stream_; `layers` records each layer's event after
  // its KV write and runs the hooks of layers seen complete.
  absl::Status ForwardOnStream(std::span<const LlamaModel::SeqInput> seqs,
                               std::vector<float>* logits,
                               LayerReadySequencer& layers);
  // Uploads fp32 host data as fp32 or (for GEMM weights in bf16 mode) bf16.
  absl::StatusOr<const float*> UploadF32(const std::vector<float>& v);
  absl::StatusOr<const void*> UploadWeight(const kernels::WeightMatrix& m);
  template <typename T>
  absl::Status Upload(T* dst, const std::vector<T>& src) {
    PDSERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src.data(), src.size() * sizeof(T),
                        cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  }
  absl::Status Gemm(const float* x, int64_t m, int64_t k, const void* w,
                    int64_t n, float* y) {
    return gemm_->MatMulNT(x, m, k, w, n, gemm_dtype_, y);
  }

  std::shared_ptr<const ModelWeights> weights_;
  BackendConfig config_;
  KvCacheSpec spec_;
  int64_t num_blocks_ = 0;
  cudaStream_t stream_ = nullptr;
  DeviceArena arena_;
  std::unique_ptr<kc::GemmRunner> gemm_;
  kc::GemmDtype gemm_dtype_ = kc::GemmDtype::kBf16;

  const float* embed_ = nullptr;  // fp32 [vocab, hidden], for lookups
  const float* final_norm_ = nullptr;
  const void* lm_head_ = nullptr;  // gemm dtype [vocab, hidden]
  const float* inv_freq_ = nullptr;
  std::vector<DeviceLayer> layers_;

  // Activations, sized for max_tokens_ rows.
  int64_t max_tokens_ = 0;
  float *residual_ = nullptr, *normed_ = nullptr, *qkv_ = nullptr,
        *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *attn_ = nullptr,
        *proj_ = nullptr, *gate_up_ = nullptr, *act_ = nullptr,
        *rows_ = nullptr, *logits_ = nullptr;
  int32_t *tokens_ = nullptr, *positions_ = nullptr, *row_index_ = nullptr,
          *context_lens_ = nullptr, *query_seq_ = nullptr;
  int64_t* slots_ = nullptr;
  // Per-step metadata that grows with the batch (block tables, seqs).
  DeviceArena step_arena_;
  int32_t* tables_ = nullptr;
  int64_t tables_capacity_ = 0;
  kc::PrefillSeq* prefill_seqs_ = nullptr;
  int64_t prefill_capacity_ = 0;
  void* attn_workspace_ = nullptr;
  int64_t attn_workspace_bytes_ = 0;
  std::vector<float> host_logits_;
  int device_ = 0;
  std::unique_ptr<CudaKvStorage> storage_;
  std::unique_ptr<CudaLayerEvents> layer_events_;
};

absl::StatusOr<const float*> CudaBackend::UploadF32(
    const std::vector<float>& v) {
  if (v.empty()) return static_cast<const float*>(nullptr);
  ASSIGN_OR_RETURN(float* p,
                   arena_.Array<float>(static_cast<int64_t>(v.size())));
  RETURN_IF_ERROR(Upload(p, v));
  return p;
}

absl::StatusOr<const void*> CudaBackend::UploadWeight(
    const kernels::WeightMatrix& m) {
  // The host keeps its compact dtype; the GPU GEMM takes fp32 or bf16.
  const std::vector<float> v = m.ToFloat();
  if (gemm_dtype_ == kc::GemmDtype::kF32) {
    ASSIGN_OR_RETURN(const float* p, UploadF32(v));
    return static_cast<const void*>(p);
  }
  std::vector<uint16_t> bf(v.size());
  for (size_t i = 0; i < v.size(); ++i) bf[i] = FloatToBf16(v[i]);
  ASSIGN_OR_RETURN(uint16_t * p,
                   arena_.Array<uint16_t>(static_cast<int64_t>(bf.size())));
  RETURN_IF_ERROR(Upload(p, bf));
  // The host vector dies at return: wait for the copy from pageable memory.
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return static_cast<const void*>(p);
}

absl::Status CudaBackend::Init() {
  const ModelConfig& c = weights_->config;
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
    return absl::FailedPreconditionError("--device cuda: no CUDA device found");
  }
  if (config_.cuda_device >= device_count) {
    return absl::FailedPreconditionError(
        absl::StrCat("--kv-cuda-device ", config_.cuda_device,
                     ": this machine has ", device_count, " CUDA devices"));
  }
  device_ = config_.cuda_device;
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  // What this backend itself allocates (weights, activations) is measured as
  // the drop in free memory from here; other workers sharing the GPU (a P/D
  // pair on one device) are not charged to this one's budget.
  size_t free_at_start = 0, total_at_start = 0;
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_at_start, &total_at_start));
  PDSERVE_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  ASSIGN_OR_RETURN(gemm_, kc::GemmRunner::Create(stream_));
  layer_events_ = std::make_unique<CudaLayerEvents>();
  RETURN_IF_ERROR(
      layer_events_->Init(static_cast<int32_t>(c.num_layers), stream_));
  gemm_dtype_ =
      config_.gpu_reference_math ? kc::GemmDtype::kF32 : kc::GemmDtype::kBf16;

  ASSIGN_OR_RETURN(embed_, UploadF32(weights_->embed.ToFloat()));
  ASSIGN_OR_RETURN(final_norm_, UploadF32(weights_->norm));
  ASSIGN_OR_RETURN(lm_head_, UploadWeight(weights_->output_matrix()));
  ASSIGN_OR_RETURN(inv_freq_, UploadF32(kernels::RopeInvFreq(
                                  c.head_dim, c.rope_theta, c.rope_scaling)));
  for (const LayerWeights& w : weights_->layers) {
    DeviceLayer d;
    ASSIGN_OR_RETURN(d.input_norm, UploadF32(w.input_norm));
    ASSIGN_OR_RETURN(d.qkv, UploadWeight(w.qkv));
    ASSIGN_OR_RETURN(d.qkv_bias, UploadF32(w.qkv_bias));
    ASSIGN_OR_RETURN(d.q_norm, UploadF32(w.q_norm));
    ASSIGN_OR_RETURN(d.k_norm, UploadF32(w.k_norm));
    ASSIGN_OR_RETURN(d.o_proj, UploadWeight(w.o_proj));
    ASSIGN_OR_RETURN(d.post_norm, UploadF32(w.post_norm));
    ASSIGN_OR_RETURN(d.gate_up, UploadWeight(w.gate_up));
    ASSIGN_OR_RETURN(d.down, UploadWeight(w.down));
    layers_.push_back(d);
  }

  const int64_t hidden = c.hidden_size, hd = c.head_dim;
  const int64_t q_dim = c.num_heads * hd, kv_dim = c.num_kv_heads * hd;
  const int64_t qkv_dim = q_dim + 2 * kv_dim, inter = c.intermediate_size;
  const int64_t t = max_tokens_ = config_.max_num_batched_tokens;
  ASSIGN_OR_RETURN(residual_, arena_.Array<float>(t * hidden));
  ASSIGN_OR_RETURN(normed_, arena_.Array<float>(t * hidden));
  ASSIGN_OR_RETURN(qkv_, arena_.Array<float>(t * qkv_dim));
  ASSIGN_OR_RETURN(q_, arena_.Array<float>(t * q_dim));
  ASSIGN_OR_RETURN(k_, arena_.Array<float>(t * kv_dim));
  ASSIGN_OR_RETURN(v_, arena_.Array<float>(t * kv_dim));
  ASSIGN_OR_RETURN(attn_, arena_.Array<float>(t * q_dim));
  ASSIGN_OR_RETURN(proj_, arena_.Array<float>(t * hidden));
  ASSIGN_OR_RETURN(gate_up_, arena_.Array<float>(t * 2 * inter));
  ASSIGN_OR_RETURN(act_, arena_.Array<float>(t * inter));
  ASSIGN_OR_RETURN(rows_, arena_.Array<float>(t * hidden));
  ASSIGN_OR_RETURN(logits_, arena_.Array<float>(t * c.vocab_size));
  ASSIGN_OR_RETURN(tokens_, arena_.Array<int32_t>(t));
  ASSIGN_OR_RETURN(positions_, arena_.Array<int32_t>(t));
  ASSIGN_OR_RETURN(row_index_, arena_.Array<int32_t>(t));
  ASSIGN_OR_RETURN(context_lens_, arena_.Array<int32_t>(t));
  ASSIGN_OR_RETURN(query_seq_, arena_.Array<int32_t>(t));
  ASSIGN_OR_RETURN(slots_, arena_.Array<int64_t>(t));
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));

  // The KV pool gets what is left of this worker's share (utilization x
  // total, less what it allocated so far), and never more than is free.
  // Headroom of 256 MiB covers step metadata, attention/cuBLAS workspaces
  // and allocator slack.
  size_t free_bytes = 0, total_bytes = 0;
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  const int64_t headroom = int64_t{256} << 20;
  const int64_t used =
      static_cast<int64_t>(free_at_start) - static_cast<int64_t>(free_bytes);
  const int64_t budget =
      std::min(static_cast<int64_t>(config_.gpu_memory_utilization *
                                    static_cast<double>(total_bytes)) -
                   std::max<int64_t>(used, 0) - headroom,
               static_cast<int64_t>(free_bytes) - headroom);
  const int64_t per_block = spec_.BytesPerBlock();
  num_blocks_ = budget > 0 ? budget / per_block : 0;
  if (num_blocks_ <= 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "--device cuda: no GPU memory left for the KV cache (total ",
        total_bytes, " B, free ", free_bytes,
        " B, this worker's weights and "
        "buffers ",
        used, " B, gpu_memory_utilization ", config_.gpu_memory_utilization,
        ")"));
  }
  const kc::KvDtype kv_dtype = kc::KvDtypeFromDType(spec_.dtype);
  for (DeviceLayer& d : layers_) {
    d.kv.dtype = kv_dtype;
    d.kv.num_kv_heads = spec_.num_kv_heads;
    d.kv.head_dim = spec_.head_dim;
    d.kv.block_size = spec_.block_size;
    d.kv.num_blocks = num_blocks_;
    ASSIGN_OR_RETURN(d.kv.data, arena_.Alloc(d.kv.LayerBytes()));
    // Zeroed like the CPU pool, so never-written slots hold finite values.
    PDSERVE_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(d.kv.data, 0, d.kv.LayerBytes(), stream_));
    if (kc::KvDtypeHasScales(kv_dtype)) {
      ASSIGN_OR_RETURN(d.kv.scales, arena_.Array<float>(d.kv.ScaleCount()));
      PDSERVE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
          d.kv.scales, 0, d.kv.ScaleCount() * sizeof(float), stream_));
    }
  }
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  std::vector<kc::PagedKvView> views;
  for (const DeviceLayer& d : layers_) views.push_back(d.kv);
  storage_ = std::make_unique<CudaKvStorage>(spec_, num_blocks_, device_,
                                             std::move(views));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Backend>> CudaBackend::Create(
    std::shared_ptr<const ModelWeights> weights, const BackendConfig& config) {
  RETURN_IF_ERROR(config.Validate());
  const ModelConfig& c = weights->config;
  if (c.num_experts > 0) {
    return absl::UnimplementedError(
        absl::StrCat(c.architecture,
                     ": Mixture-of-Experts layers run on the CPU backend "
                     "only (no CUDA MoE path yet)"));
  }
  if (config.kv.num_layers != c.num_layers ||
      config.kv.num_kv_heads != c.num_kv_heads ||
      config.kv.head_dim != c.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv spec (", config.kv.DebugString(), ") does not match the model"));
  }
  if (c.head_dim != 16 && c.head_dim != 32 && c.head_dim != 64 &&
      c.head_dim != 128) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--device cuda supports head_dim 16, 32, 64 or 128, got ", c.head_dim));
  }
  std::unique_ptr<CudaBackend> b(new CudaBackend(std::move(weights), config));
  RETURN_IF_ERROR(b->Init());
  return std::unique_ptr<Backend>(std::move(b));
}

absl::Status CudaBackend::Forward(
    std::span<const LlamaModel::SeqInput> seqs, std::vector<float>* logits,
    const LlamaModel::LayerWrittenFn& on_layer_written) {
  // Layer l's hook runs on this thread once its event completed: while
  // later layers are being enqueued and computed, so layer-wise sends from a
  // GPU overlap this pass's remaining layers. An error mid-pass runs no
  // later hook; the stream is synchronized so no work of the failed pass
  // outlives this call.
  // The engine thread may not be the one that created the backend, and
  // the current device is per thread.
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  LayerReadySequencer layers(layer_events_.get(), &on_layer_written);
  absl::Status s = ForwardOnStream(seqs, logits, layers);
  if (!s.ok()) cudaStreamSynchronize(stream_);
  return s;
}

absl::Status CudaBackend::ForwardOnStream(
    std::span<const LlamaModel::SeqInput> seqs, std::vector<float>* logits,
    LayerReadySequencer& layers) {
  const ModelConfig& c = weights_->config;
  const int64_t hidden = c.hidden_size, hd = c.head_dim,
                inter = c.intermediate_size;
  const int64_t q_dim = c.num_heads * hd, kv_dim = c.num_kv_heads * hd;
  const int64_t qkv_dim = q_dim + 2 * kv_dim;
  const int bs = spec_.block_size;

  // Host-side step description, validated like LlamaModel::Forward.
  std::vector<int32_t> tokens, positions, row_index, context_lens, query_seq;
  std::vector<int64_t> slots;
  std::vector<kc::PrefillSeq> prefill;
  int32_t max_blocks = 1, max_q = 0, max_ctx = 0;
  bool all_decode = true;
  for (const LlamaModel::SeqInput& s : seqs) {
    max_blocks =
        std::max(max_blocks, static_cast<int32_t>(s.block_table.size()));
  }
  std::vector<int32_t> tables(seqs.size() * max_blocks, 0);
  for (size_t i = 0; i < seqs.size(); ++i) {
    const LlamaModel::SeqInput& s = seqs[i];
    const int64_t n = static_cast<int64_t>(s.tokens.size());
    if (n == 0 || s.start_pos < 0 ||
        static_cast<int64_t>(s.block_table.size()) * bs < s.start_pos + n) {
      return absl::InvalidArgumentError(
          "forward: sequence without tokens or blocks");
    }
    std::copy(s.block_table.begin(), s.block_table.end(),
              tables.begin() + i * max_blocks);
    kc::PrefillSeq p;
    p.q_row = static_cast<int32_t>(tokens.size());
    p.num_q = static_cast<int32_t>(n);
    p.start_pos = s.start_pos;
    prefill.push_back(p);
    all_decode &= n == 1;
    max_q = std::max(max_q, static_cast<int32_t>(n));
    max_ctx = std::max(max_ctx, static_cast<int32_t>(s.start_pos + n));
    for (int64_t j = 0; j < n; ++j) {
      const int32_t t = s.tokens[j];
      if (t < 0 || t >= c.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("token id ", t, " is outside the vocabulary [0, ",
                         c.vocab_size, ")"));
      }
      const int32_t pos = s.start_pos + static_cast<int32_t>(j);
      const int32_t block = s.block_table[pos / bs];
      if (block < 0 || block >= num_blocks_) {
        return absl::InvalidArgumentError(
            absl::StrCat("block ", block, " is outside the pool"));
      }
      tokens.push_back(t);
      positions.push_back(pos);
      slots.push_back(int64_t{block} * bs + pos % bs);
      context_lens.push_back(pos + 1);
      query_seq.push_back(static_cast<int32_t>(i));
    }
    const int64_t last = static_cast<int64_t>(tokens.size()) - 1;
    if (s.logits == LlamaModel::Logits::kAll) {
      for (int64_t r = last - n + 1; r <= last; ++r)
        row_index.push_back(static_cast<int32_t>(r));
    } else if (s.logits == LlamaModel::Logits::kLast) {
      row_index.push_back(static_cast<int32_t>(last));
    }
  }
  const int64_t total = static_cast<int64_t>(tokens.size());
  if (total == 0) {
    logits->clear();
    return absl::OkStatus();
  }
  if (total > max_tokens_) {
    return absl::InvalidArgumentError(
        absl::StrCat("forward: ", total, " tokens exceed the CUDA backend's ",
                     max_tokens_, " per step (max_num_batched_tokens)"));
  }

  // Metadata buffers that grow with the batch.
  if (static_cast<int64_t>(tables.size()) > tables_capacity_ ||
      static_cast<int64_t>(prefill.size()) > prefill_capacity_) {
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    step_arena_.Reset();
    attn_workspace_ = nullptr;
    attn_workspace_bytes_ = 0;
    tables_capacity_ = std::max<int64_t>(tables.size(), 2 * tables_capacity_);
    prefill_capacity_ =
        std::max<int64_t>(prefill.size(), 2 * prefill_capacity_);
    ASSIGN_OR_RETURN(tables_, step_arena_.Array<int32_t>(tables_capacity_));
    ASSIGN_OR_RETURN(prefill_seqs_,
                     step_arena_.Array<kc::PrefillSeq>(prefill_capacity_));
  }
  const bool decode_kernel = all_decode || config_.gpu_reference_math;
  const int64_t ws_bytes =
      decode_kernel
          ? kc::PagedDecodeAttentionWorkspaceBytes(
                static_cast<int32_t>(total), static_cast<int32_t>(c.num_heads),
                static_cast<int32_t>(hd), max_ctx)
          : 0;
  if (ws_bytes > attn_workspace_bytes_) {
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    const int64_t grow = std::max(ws_bytes, 2 * attn_workspace_bytes_);
    ASSIGN_OR_RETURN(attn_workspace_, step_arena_.Alloc(grow));
    attn_workspace_bytes_ = grow;
  }
  RETURN_IF_ERROR(Upload(tokens_, tokens));
  RETURN_IF_ERROR(Upload(positions_, positions));
  RETURN_IF_ERROR(Upload(slots_, slots));
  RETURN_IF_ERROR(Upload(context_lens_, context_lens));
  RETURN_IF_ERROR(Upload(query_seq_, query_seq));
  RETURN_IF_ERROR(Upload(row_index_, row_index));
  RETURN_IF_ERROR(Upload(tables_, tables));
  RETURN_IF_ERROR(Upload(prefill_seqs_, prefill));

  const float eps = static_cast<float>(c.rms_norm_eps);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  RETURN_IF_ERROR(kc::InvokeGatherRows(embed_, c.vocab_size, hidden, tokens_,
                                       total, residual_, stream_));
  for (size_t l = 0; l < layers_.size(); ++l) {
    const DeviceLayer& w = layers_[l];
    if (l == 0) {
      RETURN_IF_ERROR(kc::InvokeRmsNorm(residual_, nullptr, w.input_norm, total,
                                        hidden, eps, normed_, stream_));
    } else {
      RETURN_IF_ERROR(kc::InvokeRmsNorm(proj_, residual_, w.input_norm, total,
                                        hidden, eps, normed_, stream_));
    }
    RETURN_IF_ERROR(Gemm(normed_, total, hidden, w.qkv, qkv_dim, qkv_));
    RETURN_IF_ERROR(kc::InvokeSplitQkv(qkv_, w.qkv_bias, total, q_dim, kv_dim,
                                       q_, k_, v_, stream_));
    if (w.q_norm != nullptr) {  // Qwen3: per-head RMSNorm before RoPE
      RETURN_IF_ERROR(kc::InvokeRmsNorm(
          q_, nullptr, w.q_norm, total * c.num_heads, hd, eps, q_, stream_));
      RETURN_IF_ERROR(kc::InvokeRmsNorm(
          k_, nullptr, w.k_norm, total * c.num_kv_heads, hd, eps, k_, stream_));
    }
    RETURN_IF_ERROR(kc::InvokeRope(q_, total, c.num_heads, hd, positions_,
                                   inv_freq_, stream_));
    RETURN_IF_ERROR(kc::InvokeRope(k_, total, c.num_kv_heads, hd, positions_,
                                   inv_freq_, stream_));
    RETURN_IF_ERROR(
        kc::InvokeReshapeAndCache(k_, v_, slots_, total, w.kv, stream_));
    RETURN_IF_ERROR(layers.LayerEnqueued(static_cast<int32_t>(l)));
    if (decode_kernel) {
      // One row per token: row r attends to its own position's prefix.
      RETURN_IF_ERROR(kc::InvokePagedDecodeAttention(
          q_, w.kv, tables_, max_blocks, context_lens_, query_seq_,
          static_cast<int32_t>(total), static_cast<int32_t>(c.num_heads),
          max_ctx, scale, attn_, attn_workspace_, attn_workspace_bytes_,
          stream_));
    } else {
      RETURN_IF_ERROR(kc::InvokePagedPrefillAttention(
          q_, w.kv, prefill_seqs_, static_cast<int32_t>(prefill.size()),
          tables_, max_blocks, static_cast<int32_t>(c.num_heads), max_q, scale,
          attn_, stream_));
    }
    RETURN_IF_ERROR(Gemm(attn_, total, q_dim, w.o_proj, hidden, proj_));
    RETURN_IF_ERROR(kc::InvokeRmsNorm(proj_, residual_, w.post_norm, total,
                                      hidden, eps, normed_, stream_));
    RETURN_IF_ERROR(
        Gemm(normed_, total, hidden, w.gate_up, 2 * inter, gate_up_));
    RETURN_IF_ERROR(
        kc::InvokeSiluAndMul(gate_up_, total, inter, act_, stream_));
    RETURN_IF_ERROR(Gemm(act_, total, inter, w.down, hidden, proj_));
    RETURN_IF_ERROR(layers.Poll());
  }
  RETURN_IF_ERROR(kc::InvokeRmsNorm(proj_, residual_, final_norm_, total,
                                    hidden, eps, normed_, stream_));
  const int64_t out_rows = static_cast<int64_t>(row_index.size());
  if (out_rows == 0) {
    logits->clear();
    RETURN_IF_ERROR(layers.Drain());
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(kc::InvokeGatherRows(normed_, total, hidden, row_index_,
                                       out_rows, rows_, stream_));
  RETURN_IF_ERROR(
      Gemm(rows_, out_rows, hidden, lm_head_, c.vocab_size, logits_));
  // The remaining hooks before the logits copy, which (to pageable memory)
  // blocks this thread until the whole pass is done.
  RETURN_IF_ERROR(layers.Drain());
  logits->resize(out_rows * c.vocab_size);
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
      logits->data(), logits_, out_rows * c.vocab_size * sizeof(float),
      cudaMemcpyDeviceToHost, stream_));
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(
    std::shared_ptr<const ModelWeights> weights, const BackendConfig& config) {
  return CudaBackend::Create(std::move(weights), config);
}

void RegisterCudaBackend() {
  SetBackendFactory(Device::kCuda, &CreateCudaBackend);
}

}  // namespace pdserve::engine
