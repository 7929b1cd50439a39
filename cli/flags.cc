#include "cli/flags.h"

#include <cstdlib>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/backend.h"
#if defined(PDSERVE_HAVE_CUDA_BACKEND)
#include "engine/cuda_backend.h"
#endif
#include "kernels/cpu/matmul.h"

ABSL_FLAG(std::string, model, "", "model directory (Hugging Face layout)");
ABSL_FLAG(std::string, kv_dtype, "fp32",
          "KV cache dtype: fp32, bf16, fp16, int8, or fp8 (e4m3; --device "
          "cuda only)");
ABSL_FLAG(int32_t, block_size, 16, "KV cache block size in tokens");
ABSL_FLAG(std::string, kv_cache_memory, "256MiB",
          "KV cache memory budget (e.g. 512MiB, 2GiB)");
ABSL_FLAG(int32_t, max_num_seqs, 64, "maximum running sequences per step");
ABSL_FLAG(int32_t, max_num_batched_tokens, 512,
          "token budget per engine step (chunked prefill)");
ABSL_FLAG(int32_t, long_prefill_chunk, -1,
          "most prompt tokens one sequence computes per engine step, so that "
          "short prompts are admitted beside a long one's chunks (0: the step "
          "budget; -1: 128 on prefill workers, 0 elsewhere)");
ABSL_FLAG(int32_t, max_model_len, 0,
          "maximum prompt + output tokens (0: model's limit)");
ABSL_FLAG(bool, enable_prefix_caching, true,
          "reuse cached prefix blocks across requests");
ABSL_FLAG(std::string, kv_offload_dir, "",
          "CPU workers: a directory (one per worker) for a local-file KV tier: "
          "prefix blocks evicted from the pool are written there and read "
          "back on a prefix hit; emptied at start-up. Off when empty");
ABSL_FLAG(std::string, kv_offload_bytes, "1GiB",
          "with --kv-offload-dir: the tier's byte cap (e.g. 4GiB)");
ABSL_FLAG(std::string, kv_offload_memory, "",
          "a host-memory KV tier of this many bytes below the pool (e.g. "
          "8GiB; pinned memory with --device cuda): evicted prefix blocks "
          "are copied there and back on a prefix hit. Off when empty or 0; "
          "not with --kv-offload-dir");
ABSL_FLAG(std::string, matmul, "deterministic",
          "linear-layer kernel: deterministic (batch-invariant, default), "
          "bf16dot (bf16 weights with bf16 activations on AVX512-BF16; "
          "batch-invariant, other numbers), int8dot (int8 weights with int8 "
          "activations: per 32 values with int8-b32 weights, per row with "
          "int8 weights; exact integer sums on AVX512-VNNI, AMX-INT8 and, "
          "without AVX512-VNNI, AVX-VNNI (int8) or AVX2; "
          "batch-invariant, other numbers) or blas (OpenBLAS)");
ABSL_FLAG(std::string, weight_dtype, "auto",
          "how weight matrices are kept in memory: auto (the checkpoint's "
          "dtype), fp32, bf16, fp16, int8 (quantized at load, one fp32 scale "
          "per output row) or int8-b32 (one fp16 scale per block of 32 "
          "inputs of a row); --matmul blas needs fp32 or auto");
ABSL_FLAG(int32_t, threads, 0, "kernel threads (0: all cores)");
ABSL_FLAG(
    std::string, device, "cpu",
    "where the forward pass and the KV pool live: cpu, or cuda (one GPU; KV "
    "pool sized by --gpu-memory-utilization; every worker role)");
ABSL_FLAG(double, gpu_memory_utilization, 0.9,
          "--device cuda: fraction of GPU memory for weights, activations and "
          "the KV pool (which takes the rest)");
ABSL_FLAG(bool, gpu_reference_math, false,
          "--device cuda: fp32 GEMMs (no TF32) and fp32 attention, so GPU "
          "tokens follow the CPU reference (slower; for equivalence checks)");
ABSL_FLAG(bool, json, false, "print JSON instead of text");

namespace pdserve::cli {

absl::StatusOr<int64_t> ParseBytes(const std::string& text) {
  std::string s = absl::AsciiStrToLower(text);
  struct Unit {
    const char* suffix;
    double factor;
  };
  const Unit units[] = {{"kib", 1024.0},       {"mib", 1048576.0},
                        {"gib", 1073741824.0}, {"kb", 1e3},
                        {"mb", 1e6},           {"gb", 1e9},
                        {"k", 1024.0},         {"m", 1048576.0},
                        {"g", 1073741824.0},   {"b", 1.0}};
  double factor = 1;
  for (const Unit& u : units) {
    const std::string suf = u.suffix;
    if (s.size() > suf.size() &&
        s.compare(s.size() - suf.size(), suf.size(), suf) == 0) {
      factor = u.factor;
      s.resize(s.size() - suf.size());
      break;
    }
  }
  double value;
  if (!absl::SimpleAtod(s, &value) || !(value >= 0) || value * factor > 9e18) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot parse \"", text, "\" as a byte size"));
  }
  return static_cast<int64_t>(value * factor);
}

absl::StatusOr<engine::EngineConfig> EngineConfigFromFlags(
    bool prefill_worker) {
  engine::EngineConfig c;
  auto dtype = ParseDType(absl::GetFlag(FLAGS_kv_dtype));
  if (!dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-dtype must be fp32, bf16, fp16, int8 or fp8, got \"",
                     absl::GetFlag(FLAGS_kv_dtype), "\""));
  }
  c.kv_dtype = *dtype;
  c.block_size = absl::GetFlag(FLAGS_block_size);
  ASSIGN_OR_RETURN(c.kv_cache_bytes,
                   ParseBytes(absl::GetFlag(FLAGS_kv_cache_memory)));
  c.max_num_seqs = absl::GetFlag(FLAGS_max_num_seqs);
  c.max_num_batched_tokens = absl::GetFlag(FLAGS_max_num_batched_tokens);
  const int32_t chunk = absl::GetFlag(FLAGS_long_prefill_chunk);
  if (chunk < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--long-prefill-chunk must be -1 (auto), 0 (no limit) or a token "
        "count, got ",
        chunk));
  }
  c.long_prefill_chunk =
      chunk >= 0 ? chunk : (prefill_worker ? kPrefillWorkerChunk : 0);
  c.max_model_len = absl::GetFlag(FLAGS_max_model_len);
  c.enable_prefix_caching = absl::GetFlag(FLAGS_enable_prefix_caching);
  c.kv_offload.dir = absl::GetFlag(FLAGS_kv_offload_dir);
  if (!c.kv_offload.dir.empty()) {
    ASSIGN_OR_RETURN(c.kv_offload.capacity_bytes,
                     ParseBytes(absl::GetFlag(FLAGS_kv_offload_bytes)));
  }
  if (!absl::GetFlag(FLAGS_kv_offload_memory).empty()) {
    ASSIGN_OR_RETURN(c.kv_offload.memory_bytes,
                     ParseBytes(absl::GetFlag(FLAGS_kv_offload_memory)));
  }
  auto mode = kernels::ParseMatMulMode(absl::GetFlag(FLAGS_matmul));
  if (!mode) {
    return absl::InvalidArgumentError(
        absl::StrCat("--matmul must be deterministic, bf16dot, int8dot or "
                     "blas, got \"",
                     absl::GetFlag(FLAGS_matmul), "\""));
  }
  c.matmul = *mode;
  auto weight_dtype =
      engine::ParseWeightDtype(absl::GetFlag(FLAGS_weight_dtype));
  if (!weight_dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--weight-dtype must be auto, fp32, bf16, fp16, int8 or int8-b32, got "
        "\"",
        absl::GetFlag(FLAGS_weight_dtype), "\""));
  }
  c.weight_dtype = *weight_dtype;
  kernels::SetKernelThreads(absl::GetFlag(FLAGS_threads));
  auto device = engine::ParseDevice(absl::GetFlag(FLAGS_device));
  if (!device) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device must be cpu or cuda, got \"",
                     absl::GetFlag(FLAGS_device), "\""));
  }
  c.device = *device;
  c.gpu_memory_utilization = absl::GetFlag(FLAGS_gpu_memory_utilization);
  c.gpu_reference_math = absl::GetFlag(FLAGS_gpu_reference_math);
#if defined(PDSERVE_HAVE_CUDA_BACKEND)
  if (c.device == engine::Device::kCuda) engine::RegisterCudaBackend();
#endif
  RETURN_IF_ERROR(c.Validate());
  return c;
}

std::string DefaultModelDir() {
  if (const char* env = std::getenv("PDSERVE_MODEL_DIR")) return env;
  const char* home = std::getenv("HOME");
  return absl::StrCat(home ? home : "/tmp",
                      "/.cache/pdserve/models/small-seed0");
}

}  // namespace pdserve::cli
