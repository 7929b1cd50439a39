// The control messages of the same-node KV transports (shm, cuda_ipc) and
// their byte encoding. They ride on the KvTransfer.Control stream (one
// KvControlFrame each, kv_transfer/nccl/grpc_control_channel.h), one stream
// per transfer; KV bytes never travel here, they are copied through the
// peer's mapped memory (peer_memory.h).
//
//   sender (prefill)                 receiver (decode)
//   Open{kind, sender, reservation,
//        request, layout}        ->  KvReceiver::Begin (the handshake)
//                                <-  Reply{export}   (regions to map, once)
//   Manifest{spans}              ->  KvReceiver::WriteSpans claims the spans
//                                <-  Reply{blocks}   (physical block per span)
//   ... copies into those blocks through the mapping ...
//   Copied{ok}                   ->  the claimed spans count as written
//   End{ok}                      ->  KvReceiver::End
//                                <-  Reply
//
// Little-endian, length-prefixed, versionless (both ends ship in one
// binary). Decoding treats its input as untrusted: any byte string yields a
// message or INVALID_ARGUMENT, never a crash or an unbounded allocation.
// Stateless functions, thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kv_transfer/ipc/peer_memory.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv_transfer::ipc {

struct OpenMessage {
  PeerMemoryKind kind = PeerMemoryKind::kShm;  // the sender's backend
  std::string sender_id;
  uint64_t reservation_id = 0;
  std::string request_id;
  KvLayout layout;
  bool operator==(const OpenMessage&) const = default;
};

// A span as the wire names it: layer and logical block index in the
// request's block table.
struct SpanName {
  int32_t layer = 0;
  int32_t block_index = 0;
  bool operator==(const SpanName&) const = default;
};

struct ManifestMessage {
  std::vector<SpanName> spans;
  bool operator==(const ManifestMessage&) const = default;
};

struct CopiedMessage {
  bool ok = false;  // false: the sender's copy failed; the spans are lost
  bool operator==(const CopiedMessage&) const = default;
};

struct EndMessage {
  bool ok = false;  // false: the sender abandons the transfer
  bool operator==(const EndMessage&) const = default;
};

struct ReplyMessage {
  absl::StatusCode code = absl::StatusCode::kOk;
  std::string message;
  std::optional<KvExport> exported;  // in the reply to Open
  std::vector<int32_t> blocks;       // in the reply to Manifest, per span
  bool operator==(const ReplyMessage&) const = default;
};

using IpcMessage = std::variant<OpenMessage, ManifestMessage, CopiedMessage,
                                EndMessage, ReplyMessage>;

std::string EncodeMessage(const IpcMessage& message);
// INVALID_ARGUMENT for anything that is not exactly one encoded message.
absl::StatusOr<IpcMessage> DecodeMessage(std::string_view bytes);

ReplyMessage ReplyFor(const absl::Status& status);
absl::Status StatusOf(const ReplyMessage& reply);

}  // namespace pdserve::kv_transfer::ipc
