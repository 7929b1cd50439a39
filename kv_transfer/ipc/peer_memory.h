// "Map the peer's KV storage and copy into it": the one seam between the
// same-node KV transports (ipc_transport.h) and the memory they move.
//
// A decode worker exports the regions that hold its KV pool
// (engine::KvStorage::SharedRegions) as a KvExport: per region its size and
// an opaque handle, and per layer where that layer's spans start. A prefill
// worker maps a peer's export once (PeerMapping, cached per peer by the
// transport) and copies spans of its own storage into the peer's reserved
// blocks with PeerMapping::Copy. Two implementations (STYLE.md: interfaces
// where there are real alternatives):
//
//   shm       host pools: the decode pool lives in a sealed memfd (KvPool
//             with KvCacheSpec::host_shared); the decode worker passes the
//             memfd itself over a Unix socket (SCM_RIGHTS, pool_fd_socket.h)
//             and its handle names that socket and a token. The prefill
//             worker checks what it received (a pool memfd of the process
//             that passed it, the declared file, sealed against shrinking,
//             of the claimed size, not its own pool) before it mmaps it;
//             copies are memcpy.
//   cuda_ipc  device pools: handles are cudaIpcMemHandle_t bytes of each
//             cudaMalloc region; the prefill worker cudaIpcOpenMemHandle's
//             them once, and copies are cudaMemcpyAsync device to device on
//             its own stream with a CUDA event for completion.
//
// Everything above this seam (handshake, reservations, block validation,
// deadlines, abort) is shared, so CPU tests over shm cover the logic of the
// GPU path.
//
// Thread-safety: backends are thread-safe; a PeerMapping may be used by
// several sessions at once (Copy calls are serialised internally where the
// implementation needs it).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kv_cache/kv_cache.h"
#include "kv_cache/kv_storage.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv_transfer::ipc {

enum class PeerMemoryKind : uint8_t { kShm = 1, kCudaIpc = 2 };
const char* PeerMemoryName(PeerMemoryKind kind);  // "shm" | "cuda_ipc"

struct ExportedRegion {
  uint64_t bytes = 0;
  std::string handle;  // opaque to everything but the backend
  bool operator==(const ExportedRegion&) const = default;
};

// Where layer l's spans lie: block b's data at regions[data_region] +
// data_offset + b * data_bytes, its scales (scale_bytes > 0 only) at
// regions[scale_region] + scale_offset + b * scale_bytes.
struct LayerPlacement {
  uint32_t data_region = 0;
  uint64_t data_offset = 0;
  uint32_t scale_region = 0;
  uint64_t scale_offset = 0;
  bool operator==(const LayerPlacement&) const = default;
};

// A decode worker's KV pool as a peer sees it.
struct KvExport {
  // Random per export: a peer that restarts on the same address exports a
  // new id, so senders drop a stale mapping instead of writing through it.
  uint64_t export_id = 0;
  PeerMemoryKind kind = PeerMemoryKind::kShm;
  int32_t device = -1;  // CUDA device of the pool; -1 for host memory
  int64_t num_blocks = 0;
  uint64_t data_bytes = 0;   // one (layer, block) span's data
  uint64_t scale_bytes = 0;  // its scales (int8/fp8), else 0
  std::vector<ExportedRegion> regions;
  std::vector<LayerPlacement> layers;
  bool operator==(const KvExport&) const = default;

  // OK if the geometry is that of `spec` (span sizes, layer count: the
  // sender's own storage, whose layout the handshake matched) and every
  // layer's spans lie inside their regions; FAILED_PRECONDITION naming the
  // first difference otherwise. Senders check this before mapping, so no
  // later copy can leave a region.
  absl::Status Validate(const engine::KvCacheSpec& spec) const;
};

// One copy into a mapped peer region. `dst` lies in a PeerMapping region,
// `src` in the sender's own storage (host memory for shm, device memory
// for cuda_ipc).
struct CopyOp {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
};

// A peer's regions mapped into this process (sender side). Unmapped when
// destroyed.
class PeerMapping {
 public:
  virtual ~PeerMapping() = default;
  // Region i's first byte in this process (a host or a device pointer).
  virtual uint8_t* base(size_t region) = 0;
  // Runs every op and returns once all are complete, or DEADLINE_EXCEEDED
  // once `deadline` passed (cuda_ipc: copies already enqueued may still
  // land; the receiver keeps the reservation claimed until it hears back or
  // its own timeout passes, see ipc_transport.h).
  virtual absl::Status Copy(std::span<const CopyOp> ops,
                            absl::Time deadline) = 0;
  // False once the exporting storage is known to be gone (shm: its socket
  // is gone or no longer exports the pool), so the sender can unmap it: a
  // mapping keeps a dead peer's pool memory allocated. Cheap (shm: one local
  // socket round trip per region, bounded by a short timeout; a peer that
  // does not answer counts as alive).
  virtual bool PeerAlive() { return true; }
};

class PeerMemoryBackend {
 public:
  virtual ~PeerMemoryBackend() = default;
  virtual PeerMemoryKind kind() const = 0;
  // The storage memory this backend moves (both ends): host for shm, a
  // device for cuda_ipc.
  virtual engine::MemoryKind memory_kind() const = 0;
  // Receiver side: the handle a peer maps `region` with.
  virtual absl::StatusOr<std::string> ExportHandle(
      const engine::KvSharedRegion& region) = 0;
  // Receiver side: stops serving a handle ExportHandle returned (its storage
  // is going away). Default: nothing to stop.
  virtual void Unexport(const std::string& handle) { (void)handle; }
  // Sender side: maps a peer's regions. UNAVAILABLE (mapping failed: peer
  // gone, other namespace, no permission) or FAILED_PRECONDITION (handles
  // of another kind, or memory that is not the peer's pool), naming the
  // region.
  virtual absl::StatusOr<std::unique_ptr<PeerMapping>> Map(
      const KvExport& peer) = 0;
  // As Map, and also refuses (FAILED_PRECONDITION) a region that is part of
  // `own`, the sender's own storage (a peer must not make a worker write
  // into its own pool). `own` may be null. Default: Map (a backend whose
  // handles cannot name local memory).
  virtual absl::StatusOr<std::unique_ptr<PeerMapping>> MapPeer(
      const KvExport& peer, engine::KvStorage* own) {
    (void)own;
    return Map(peer);
  }
};

// Receiver side: describes `storage` for peers. FAILED_PRECONDITION when
// the storage exports no regions (a host pool not created with
// host_shared), when its memory kind is not the backend's, or when a span
// lies outside every region.
absl::StatusOr<KvExport> ExportStorage(engine::KvStorage* storage,
                                       PeerMemoryBackend* backend);

// The shm backend (host memory). Thread-safe.
std::unique_ptr<PeerMemoryBackend> NewShmBackend();
// The cuda_ipc backend on `device`: FAILED_PRECONDITION where this build
// has no CUDA or no device is visible.
absl::StatusOr<std::unique_ptr<PeerMemoryBackend>> NewCudaIpcBackend(
    int device);

}  // namespace pdserve::kv_transfer::ipc
