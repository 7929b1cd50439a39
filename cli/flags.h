// Declarations of the ABSL_FLAGs shared across cli/ files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "engine/engine.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(std::string, kv_dtype);
ABSL_DECLARE_FLAG(int32_t, block_size);
ABSL_DECLARE_FLAG(std::string, kv_cache_memory);
ABSL_DECLARE_FLAG(int32_t, max_num_seqs);
ABSL_DECLARE_FLAG(int32_t, max_num_batched_tokens);
ABSL_DECLARE_FLAG(int32_t, long_prefill_chunk);
ABSL_DECLARE_FLAG(int32_t, max_model_len);
ABSL_DECLARE_FLAG(bool, enable_prefix_caching);
ABSL_DECLARE_FLAG(std::string, kv_offload_dir);
ABSL_DECLARE_FLAG(std::string, kv_offload_bytes);
ABSL_DECLARE_FLAG(std::string, kv_offload_memory);
ABSL_DECLARE_FLAG(std::string, matmul);
ABSL_DECLARE_FLAG(std::string, weight_dtype);
ABSL_DECLARE_FLAG(int32_t, threads);
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(double, gpu_memory_utilization);
ABSL_DECLARE_FLAG(bool, gpu_reference_math);
ABSL_DECLARE_FLAG(bool, json);

namespace pdserve::cli {

// Parses sizes such as "512MiB", "2GiB", "1e9" or "1073741824" into bytes.
absl::StatusOr<int64_t> ParseBytes(const std::string& text);

// --long-prefill-chunk's value on prefill workers when it is -1 (auto). On
// a prefill worker every request is a prompt, and without a limit a short
// prompt that arrives during a long one's step waits for all of it.
inline constexpr int32_t kPrefillWorkerChunk = 128;

// EngineConfig from the shared engine flags (validated). prefill_worker:
// the engine serves a prefill-role worker (--long-prefill-chunk's auto).
absl::StatusOr<engine::EngineConfig> EngineConfigFromFlags(
    bool prefill_worker = false);

// Where `pdserve up` and `./pdserve.sh serve` keep the default model.
std::string DefaultModelDir();

}  // namespace pdserve::cli
