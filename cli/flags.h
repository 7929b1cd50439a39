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

// EngineConfig from the shared engine flags (validated).
absl::StatusOr<engine::EngineConfig> EngineConfigFromFlags();

// Where `pdserve up` and `./pdserve.sh serve` keep the default model.
std::string DefaultModelDir();

}  // namespace pdserve::cli
