// `pdserve bench transfer`: throughput of the `grpc` KV transport on
// loopback, against raw loopback TCP moving the same number of bytes in the
// same run, and of the same-node `shm` transport into the same pool. Both ends
// live in this process: a GrpcKvTransport sender session reading one
// engine::KvPool, and a KvTransferService + KvReceiver on 127.0.0.1 (port 0)
// writing another. Every (layout, tokens) measurement gets pools sized for
// exactly its blocks (2 x tokens x BytesPerToken in all), freed before the next
// one, starts with one untimed warm-up transfer, and checks byte for byte that
// its first timed transfer delivered what was sent.
//
// Single-threaded driver (it starts its own server and socket threads);
// not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "kv_cache/kv_cache.h"

namespace pdserve::bench {

// One KV geometry to transfer, e.g. "8b-bf16".
struct TransferLayout {
  std::string name;
  engine::KvCacheSpec spec;
};

// The `small` preset (8 layers, 2 KV heads, head_dim 64) with `small_dtype`,
// named "small-<dtype>", and an 8B-shaped layout (32 layers, 8 KV heads,
// head_dim 128, bf16) named "8b-bf16"; both with `block_size` tokens/block.
std::vector<TransferLayout> DefaultTransferLayouts(
    DType small_dtype = DType::kF32, int32_t block_size = 16);

struct TransferBenchConfig {
  std::vector<TransferLayout> layouts = DefaultTransferLayouts();
  // Sequence lengths in tokens; each is rounded up to whole blocks.
  std::vector<int32_t> tokens = {1024, 4096, 16384};
  // Timed transfers per (layout, tokens), for grpc and for raw TCP each. The
  // reported GB/s and the ratio use the best (fastest) repetition; the median
  // is reported beside it.
  int32_t repetitions = 3;
  // Limit for one transfer: the gRPC deadline and the receiver's wait.
  absl::Duration transfer_timeout = absl::Seconds(120);
  absl::Status Validate() const;
};

// Goal the users care about: grpc reaches this fraction of raw loopback TCP
// for sequences of at least kTransferGoalMinTokens.
inline constexpr double kTransferGoalRatio = 0.5;
inline constexpr int32_t kTransferGoalMinTokens = 4096;

struct TransferFigure {
  std::string layout;
  int32_t tokens = 0;  // rounded up to whole blocks
  int64_t blocks = 0;
  // (layer, block) spans sent by one transfer, int8 scales included.
  int64_t bytes = 0;
  double grpc_gb_per_s = 0;  // best repetition; GB = 1e9 bytes
  double grpc_median_gb_per_s = 0;
  double tcp_gb_per_s = 0;  // best repetition
  double tcp_median_gb_per_s = 0;
  double ratio = 0;  // grpc_gb_per_s / tcp_gb_per_s (best vs best)
  // Process CPU seconds (both ends, all threads, user + system) per GB moved,
  // least of the repetitions. Less disturbed than GB/s by other load on
  // shared cores; the grpc/raw gap here is the transport's own overhead.
  double grpc_cpu_s_per_gb = 0;
  double tcp_cpu_s_per_gb = 0;
  // The `shm` transport (kv_transfer/ipc) into the same receiver pool.
  double shm_gb_per_s = 0;  // best repetition
  double shm_median_gb_per_s = 0;
  double shm_cpu_s_per_gb = 0;
  double shm_over_grpc = 0;  // shm_gb_per_s / grpc_gb_per_s
};

struct TransferBenchResult {
  int32_t repetitions = 0;
  std::vector<TransferFigure> figures;
  // True when every figure with tokens >= kTransferGoalMinTokens has
  // ratio >= kTransferGoalRatio.
  bool MeetsGoal() const;
  std::string ToJson() const;
  std::string ToTable() const;
};

// Runs every (layout, tokens) measurement. Fails with INTERNAL (naming the
// layout, layer and block) if the bytes a receiver holds after a transfer
// differ from the bytes sent, and with RESOURCE_EXHAUSTED before measuring
// anything if a measurement's two pools would not fit in physical memory.
// Progress goes to stderr as "[bench] transfer ..." lines.
absl::StatusOr<TransferBenchResult> RunTransferBench(
    const TransferBenchConfig& config);

}  // namespace pdserve::bench
