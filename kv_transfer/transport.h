// Moving paged KV blocks from a prefill worker's pool into the blocks a
// decode worker reserved for the same request.
//
// One interface, several backends (STYLE.md): `grpc` (any host, CPU pools)
// and `nccl` (GPU pools). A sender opens a session for one request, sends
// layer ranges as they become ready (layer-wise streaming), and finishes; the
// receiving side is the transport-independent KvReceiver (receiver.h).
//
// Chunks address blocks by their logical index in the request's block table,
// never by a physical block of the receiver, so a sender cannot write outside
// what the receiver reserved.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "kv_cache/kv_cache.h"
#include "kv_cache/kv_storage.h"

namespace pdserve::kv_transfer {

// What both ends must agree on before any bytes move (contract: handshake).
struct KvLayout {
  std::string fingerprint;  // hex of the engine cache identity
  int32_t num_layers = 0;
  int32_t kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_size = 0;
  // nullopt: a dtype this release does not know (from a peer); it matches
  // nothing, so the handshake fails.
  std::optional<DType> dtype;
  // MLA latent geometry (engine::KvCacheSpec); 0 for MHA/GQA.
  int32_t kv_lora_rank = 0;
  int32_t qk_rope_head_dim = 0;

  static KvLayout FromSpec(const engine::KvCacheSpec& spec,
                           const std::string& fingerprint);
  std::string DebugString() const;
  bool operator==(const KvLayout&) const = default;
};

// OK if equal; otherwise FAILED_PRECONDITION naming every field that differs
// with both values ("block_size: sender 16 vs receiver 32").
absl::Status CheckLayouts(const KvLayout& sender, const KvLayout& receiver);

// (logical block index in the request, physical block in the sender's pool)
using BlockRef = std::pair<int32_t, int32_t>;

struct SendPlan {
  std::string destination;  // host:port of the receiver
  std::string request_id;
  uint64_t reservation_id = 0;
  std::string sender_id;
  KvLayout layout;
  // What SendLayers sends; may be empty when the sender uses SendBlocks.
  std::vector<BlockRef> blocks;
};

struct SendStats {
  uint64_t bytes = 0;
  uint64_t spans = 0;
};

// One request's transfer. Not thread-safe; used by one sending thread. The
// sender's blocks must stay referenced (pinned) until Finish or Cancel returns.
class KvSendSession {
 public:
  virtual ~KvSendSession() = default;
  // Sends layers [first, last) of every planned block. May be called several
  // times with consecutive ranges as prefill produces layers.
  virtual absl::Status SendLayers(int32_t first, int32_t last) = 0;
  // Sends layers [first, last) of `blocks` ((logical index, physical block in
  // the sender's pool); need not be in the plan), so a sender can stream
  // blocks as a chunked prefill completes them. Each (layer, logical block)
  // must be sent once per transfer.
  virtual absl::Status SendBlocks(int32_t first, int32_t last,
                                  std::span<const BlockRef> blocks) = 0;
  // Completes the transfer and waits for the receiver's acknowledgement.
  virtual absl::StatusOr<SendStats> Finish() = 0;
  // Abandons the transfer; the receiver frees its reservation. Idempotent.
  virtual void Cancel() = 0;
};

// Which KvTransport a worker uses (--kv-transport). kShm and kCudaIpc are
// the same-node transports (kv_transfer/ipc/): the prefill worker writes
// into the decode worker's mapped pool, host memory (shm) or GPU memory
// (cuda_ipc).
enum class KvTransportKind { kGrpc, kNccl, kShm, kCudaIpc };
// "grpc" | "nccl" | "shm" | "cuda_ipc".
const char* KvTransportName(KvTransportKind kind);
// The kind a name spells, or INVALID_ARGUMENT naming the choices.
absl::StatusOr<KvTransportKind> ParseKvTransport(absl::string_view name);

class KvTransport {
 public:
  virtual ~KvTransport() = default;
  virtual const char* name() const = 0;
  // Opens a session; reads blocks from `storage` (host or device spans,
  // never written by the session).
  virtual absl::StatusOr<std::unique_ptr<KvSendSession>> Open(
      const SendPlan& plan, engine::KvStorage* storage) = 0;
};

}  // namespace pdserve::kv_transfer
