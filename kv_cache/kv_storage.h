// Where a worker's KV blocks live, as transports see them: the backend owns
// the storage (host memory for the CPU backend, GPU memory for the CUDA one)
// and exposes each (layer, block) as a span that names its memory kind.
//
// A span is one layer of one block, contiguous in the storage's memory:
//   data:   [2 (K,V)][kv_heads][block_size][head_dim] of the KV dtype
//   scales: [2 (K,V)][kv_heads] fp32, for int8 only (else null, 0 bytes)
// Transports (kv_transfer/) and the layer streamer read and write spans in
// place through this interface: host memory with memcpy, device memory with
// the device's own copies (CopyToHost / CopyFromHost, or device pointers
// handed to NCCL / CUDA IPC). None of them sees KvPool or a backend. KvPool
// (kv_cache/kv_cache.h) is the CPU reference implementation.
//
// Thread-safety: Span() and the copies touch no shared state of their own
// and may be called from transfer threads; what a span's bytes mean is owned
// by the engine thread (blocks must be pinned or reserved while a transfer
// reads or writes them, see kv_cache/block_manager.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace pdserve::engine {

struct KvCacheSpec;  // kv_cache/kv_cache.h

enum class MemoryKind { kHost, kDevice };

struct KvMemory {
  MemoryKind kind = MemoryKind::kHost;
  int device = -1;  // CUDA device ordinal for kDevice, -1 for kHost
  bool operator==(const KvMemory&) const = default;
};
std::string KvMemoryName(const KvMemory& m);  // "host" | "cuda:N"

struct KvSpan {
  void* data = nullptr;  // in `memory`: a host or a device pointer
  size_t data_bytes = 0;
  float* scales = nullptr;  // int8 only, in `memory`
  size_t scale_bytes = 0;
  KvMemory memory;
};

// A host buffer for moving spans in and out of storage: page-locked (pinned)
// when the storage is on a device, so device copies run at full speed.
class HostStagingBuffer {
 public:
  virtual ~HostStagingBuffer() = default;
  virtual void* data() = 0;
  virtual size_t size() const = 0;
};

// A piece of a storage's memory that another process on the same node may
// map: the shm and cuda_ipc transports (kv_transfer/ipc/) write the spans a
// decode worker reserved straight through such a mapping.
// INVALID_ARGUMENT for CopyToHost / CopyFromHost given no scale buffer for
// a span that has scales.
absl::Status MissingScales(int32_t layer, int64_t block);

struct KvSharedRegion {
  void* base = nullptr;  // in the storage's memory(): host or device
  size_t bytes = 0;
  // Unused by pdserve's storages (empty): host regions are shared by fd, and
  // a device region is one whole cudaMalloc allocation, so
  // cudaIpcGetMemHandle(base) exports it.
  std::string path;
  // Host memory: the sealed memfd that holds the region (KvPool: created
  // with MFD_ALLOW_SEALING, named "pdserve-kv-pool-<pid of its creator>",
  // sealed against shrinking and growing), owned by the storage. The shm
  // transport passes it to peers over a Unix socket (SCM_RIGHTS). -1 for
  // device memory.
  int fd = -1;
};

class KvStorage {
 public:
  virtual ~KvStorage() = default;
  virtual const KvCacheSpec& spec() const = 0;
  virtual int64_t num_blocks() const = 0;
  virtual KvMemory memory() const = 0;
  // The span of (layer, block). Requires 0 <= layer < spec().num_layers and
  // 0 <= block < num_blocks() (callers validate untrusted indices first).
  virtual KvSpan Span(int32_t layer, int64_t block) = 0;
  // Copies a span's bytes to host memory / from host memory. `scales` may be
  // null when the dtype has none; null for a dtype with scales (int8, fp8) is
  // INVALID_ARGUMENT and nothing is copied, never data without its scales. Host
  // storage: memcpy. Device storage: a synchronous device copy (the transfer
  // thread waits, not the engine).
  virtual absl::Status CopyToHost(int32_t layer, int64_t block, void* data,
                                  void* scales) = 0;
  virtual absl::Status CopyFromHost(int32_t layer, int64_t block,
                                    const void* data, const void* scales) = 0;
  // A staging buffer of `bytes` suited to this storage's copies.
  virtual std::unique_ptr<HostStagingBuffer> AllocateStaging(size_t bytes);
  // The regions that together hold every span (data and scales), when this
  // storage can be mapped by another process on the node; empty (the
  // default) when it cannot. Stable for the storage's lifetime.
  virtual std::vector<KvSharedRegion> SharedRegions() { return {}; }
};

}  // namespace pdserve::engine
