// `pdserve bench engine`: prefill and decode throughput of the local engine,
// and the decode roofline ratio against a STREAM-triad bandwidth measured in
// the same run. Single-threaded driver; not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/engine.h"

namespace pdserve::bench {

struct EngineBenchConfig {
  std::string model_dir;
  engine::EngineConfig engine;
  int32_t prefill_tokens = 512;  // prompt length for the prefill figure
  int32_t decode_context = 128;  // prompt length before decode timing
  std::vector<int32_t> batch_sizes = {1, 8, 32};
  int32_t decode_steps = 32;  // timed decode steps per batch size
  int64_t stream_bytes = int64_t{256} << 20;  // triad working set (3 arrays)
  absl::Status Validate() const;
};

struct DecodeFigure {
  int32_t batch = 0;
  double tokens_per_s = 0;
  double step_ms = 0;
  double bytes_per_step = 0;  // weights + KV read by one step
  double roofline_ratio = 0;  // (bytes_per_step / step time) / stream bandwidth
};

struct EngineBenchResult {
  double stream_gb_per_s = 0;
  double prefill_tokens_per_s = 0;
  int64_t weight_bytes = 0;
  std::vector<DecodeFigure> decode;
  std::string ToJson() const;
  std::string ToTable() const;
};

// Measures STREAM triad a = b + s*c with the kernel threads; returns GB/s
// (3 arrays x 4 bytes per element per pass, best of several passes).
double MeasureTriadBandwidth(int64_t bytes);

absl::StatusOr<EngineBenchResult> RunEngineBench(
    const EngineBenchConfig& config);

}  // namespace pdserve::bench
