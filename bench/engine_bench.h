// `pdserve bench engine`: prefill and decode throughput of the local engine,
// with the limits they are judged against measured in the same run:
//  - a STREAM triad over a working set of at least 4x the last-level cache
//    (size read from sysfs), so it measures DRAM, not cache; decode's
//    roofline ratio is bytes read per step / step time / triad bandwidth;
//  - the peak of the active GEMM path (kernels/cpu/fma_peak.h: fp32 FMA, or
//    VDPBF16PS, VPDPBUSD or AMX-INT8 TDPBSSD for the dot-product paths);
//    prefill's and each decode batch's achieved FLOP/s are reported as a
//    fraction of it;
//  - a read of the step's weights alone, a join after each matrix, which
//    decode's "of read" ratio divides by (what the weight stream reaches
//    without arithmetic or attention).
// Optionally the accuracy of compact weight dtypes against the fp32 model.
// Single-threaded driver; not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
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
  // Triad working set (3 arrays); 0: max(4 x LLC, 1 GiB).
  int64_t stream_bytes = 0;
  // > 0: also compare every weight dtype's logits with fp32 over this many
  // positions (one prompt, prefilled in chunks of 256).
  int32_t accuracy_positions = 0;
  // Also time every phase of the forward pass and the engine step (extra
  // prefill and decode steps after the timed ones, under the same conditions:
  // kernels/cpu/step_profile.h), so the figures above carry no timers.
  bool profile = false;
  // What is cold when a timed decode step starts. kAll: every cache, as the
  // triad before it leaves them (weights, KV, and also code, page tables and
  // activations). kWeightsKv: an untimed step runs after the triad, then the
  // weights and the KV cache are flushed from every cache level, so the
  // timed step streams those from memory with the rest warm, as
  // back-to-back steps of a model larger than the last-level cache do.
  enum class Cold { kAll, kWeightsKv };
  Cold cold = Cold::kAll;
  absl::Status Validate() const;
};
// "all" | "weights-kv".
const char* ColdName(EngineBenchConfig::Cold cold);
std::optional<EngineBenchConfig::Cold> ParseCold(std::string_view name);

struct DecodeFigure {
  int32_t batch = 0;
  double tokens_per_s = 0;
  double step_ms = 0;
  double bytes_per_step = 0;  // weights + KV read by one step
  double roofline_ratio = 0;  // (bytes_per_step / step time) / stream bandwidth
  // (bytes_per_step / step time) / decode_weight_read_gb_per_s.
  double weight_read_ratio = 0;
  double flops_per_step = 0;  // matrices + attention
  double gflops = 0;
  double fma_peak_fraction = 0;
  double speedup_vs_batch1 = 0;  // tokens/s over the batch-1 figure (if run)
};

// Logits of one weight dtype against the fp32 model at the same positions.
// Relative error of a position: max |Δlogit| / max |fp32 logit|.
struct AccuracyFigure {
  std::string dtype;
  int32_t positions = 0;
  double max_rel_error = 0;
  double mean_rel_error = 0;
  double top1_agreement = 0;  // fraction of positions with the same argmax
};

// One profiled kind of step (the prefill, or decode at one batch size):
// means per step. Phases overlap nothing but the "of which" GEMM parts.
struct StepProfileFigure {
  std::string step;  // "prefill 512", "decode batch 1"
  int32_t steps = 0;
  double step_ms = 0;  // wall time of Engine::Step, profiled
  // The same steps unprofiled, from the timed rounds (decode only; 0 for
  // prefill): what the timers cost is the difference.
  double unprofiled_step_ms = 0;
  struct Phase {
    std::string name;
    double ms = 0;
    double share = 0;  // of step_ms
    double calls = 0;  // spans per step
  };
  std::vector<Phase> phases;  // every phase with time, then "other"
  double gemm_calls = 0, parallel_regions = 0, barriers = 0;  // per step
  double fork_ms = 0, join_ms = 0, barrier_ms = 0, pack_ms = 0;
};

struct EngineBenchResult {
  std::string weight_dtype;  // as stored
  std::string gemm_path;     // portable | avx2 | avx512
  std::string cpu_features;
  int threads = 0;
  std::string cold;          // ColdName of the config
  int64_t llc_bytes = 0;     // from sysfs (0 if unknown)
  int64_t stream_bytes = 0;  // triad working set used
  double stream_gb_per_s = 0;
  double fma_peak_gflops = 0;  // of gemm_path, all threads, around prefill
  // --matmul int8dot: the smallest batch that runs on AMX-INT8 (0: AMX not
  // used), VPDPBUSD's peak, and TDPBSSD's at 32 k per instruction (as the
  // kernel uses it; fma_peak_gflops is then its full 64-k peak).
  int64_t int8dot_amx_min_rows = 0;
  double int8dot_vnni_peak_gops = 0;
  double amx_int8_block_peak_gops = 0;
  // Means of the measurements taken in each decode round (what the decode
  // roofline ratios and peak fractions divide by).
  double decode_stream_gb_per_s = 0;
  // The step's weights alone read by the kernel threads in each round, a
  // join after each matrix (no arithmetic, no attention): what a batch-1
  // step's weight stream is compared with (a reference, not a bound).
  double decode_weight_read_gb_per_s = 0;
  double decode_fma_peak_gflops = 0;
  // int8dot on AMX: the VPDPBUSD peak of the same rounds, which the batch
  // sizes below int8dot_amx_min_rows (run on VNNI) are divided by.
  double decode_int8dot_vnni_peak_gops = 0;
  double load_average_1m = 0;  // /proc/loadavg at the start
  int32_t prefill_tokens = 0;
  double prefill_tokens_per_s = 0;
  double prefill_gflops = 0;
  double prefill_fma_peak_fraction = 0;
  int64_t weight_bytes = 0;
  std::vector<DecodeFigure> decode;
  std::vector<AccuracyFigure> accuracy;
  std::vector<StepProfileFigure> profile;  // with EngineBenchConfig::profile
  std::string ToJson() const;
  std::string ToTable() const;
};

// STREAM triad a = b + s*c with the kernel threads (3 arrays x 4 bytes per
// element per pass). The arrays are allocated and written once and measured as
// often as needed (a triad before every decode round), so that the rounds
// neither map nor unmap a GiB each time: on a virtual machine unmapping that
// much can drop the guest's page mappings, and the next decode step then pays a
// fault on the first touch of every KV and activation page it uses.
class TriadArrays {
 public:
  explicit TriadArrays(int64_t bytes);
  double Measure(int passes);  // GB/s, best of `passes`

 private:
  int64_t n_;
  std::unique_ptr<float[]> a_, b_, c_;
};

// Size of the last-level (highest index level) CPU cache from
// /sys/devices/system/cpu/cpu0/cache/index*/{level,size}; 0 if unreadable.
int64_t LastLevelCacheBytes(
    const std::string& sysfs_cpu0_cache = "/sys/devices/system/cpu/cpu0/cache");

// Evicts [p, p + bytes) from every cache level (CLFLUSH is in every x86-64
// CPU and writes dirty lines back first).
void FlushFromCaches(const void* p, size_t bytes);

absl::StatusOr<EngineBenchResult> RunEngineBench(
    const EngineBenchConfig& config);

}  // namespace pdserve::bench
