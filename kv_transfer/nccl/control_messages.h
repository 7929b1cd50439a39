// The messages of the `nccl` KV transport's control channel and their byte
// encoding. Every sender message gets exactly one reply, in order.
//
//   sender                          receiver
//   Hello{unique_id}            ->  (joins the communicator after replying)
//                               <-  Reply{max_batch_bytes}
//   Begin{transfer, reservation,
//         request, layout}      ->  KvReceiver::Begin (handshake)
//                               <-  Reply
//   Manifest{transfer, spans}   ->  posts the grouped Recv for the spans
//                               <-  Reply (only then does the sender Send)
//   End{transfer, ok}           ->  writes are all applied; KvReceiver::End
//                               <-  Reply (the transfer's outcome)
//
// The encoding is little-endian, length-prefixed and versionless (both ends
// ship in one binary). Decoding treats its input as untrusted: any byte
// string yields a message or an error, never a crash or an unbounded
// allocation. Stateless functions, thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv_transfer::nccl {

// A span as the wire names it: the layer and the logical block index in the
// request's block table, never a physical block of either side.
struct SpanName {
  int32_t layer = 0;
  int32_t block_index = 0;
  bool operator==(const SpanName&) const = default;
};

struct HelloMessage {
  std::string unique_id;  // the communicator rendezvous id, opaque
  std::string sender_id;
  bool operator==(const HelloMessage&) const = default;
};

struct BeginMessage {
  uint64_t transfer_id = 0;  // chosen by the sender, unique per link
  uint64_t reservation_id = 0;
  std::string request_id;
  KvLayout layout;
  bool operator==(const BeginMessage&) const = default;
};

// The spans of one staged batch, in staging order. Their bytes follow over
// the communicator as one group: every span's data ([n][LayerBlockBytes]),
// then, for int8, every span's scales ([n][2 * kv_heads] fp32).
struct ManifestMessage {
  uint64_t transfer_id = 0;
  std::vector<SpanName> spans;
  bool operator==(const ManifestMessage&) const = default;
};

struct EndMessage {
  uint64_t transfer_id = 0;
  bool ok = false;  // false: the sender abandons the transfer
  bool operator==(const EndMessage&) const = default;
};

struct ReplyMessage {
  absl::StatusCode code = absl::StatusCode::kOk;
  std::string message;
  // In the reply to Hello: the largest batch (data + scales, bytes) the
  // receiver stages. 0 elsewhere.
  uint64_t max_batch_bytes = 0;
  bool operator==(const ReplyMessage&) const = default;
};

using ControlMessage = std::variant<HelloMessage, BeginMessage, ManifestMessage,
                                    EndMessage, ReplyMessage>;

std::string EncodeMessage(const ControlMessage& message);
// INVALID_ARGUMENT for anything that is not exactly one encoded message.
absl::StatusOr<ControlMessage> DecodeMessage(std::string_view bytes);

ReplyMessage ReplyFor(const absl::Status& status);
absl::Status StatusOf(const ReplyMessage& reply);

}  // namespace pdserve::kv_transfer::nccl
