// Typed causes carried on an absl::Status, so that callers decide on a code
// and a cause, never on an error's message text.
//
// A cause is attached as a Status payload (type URL kCausePayloadUrl, value
// the cause's decimal number). common/grpc_status.h carries it across
// processes in grpc::Status::error_details, so a router can tell "the prefill
// worker failed" from "the decode worker failed" without parsing messages.
//
// Thread-safety: stateless; every function is thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"

namespace pdserve {

// Why a request failed, where the code alone does not say enough to act on.
// Values are part of the internal wire format: append, never renumber.
enum class StatusCause : int32_t {
  kNone = 0,
  // The prefill worker named in the request failed (unreachable, crashed,
  // refused); the decode worker itself is healthy. The router retries with
  // another prefill worker and does not mark the decode worker failed.
  kPrefillFailed = 1,
  // The request needs more KV blocks than the pool holds even when empty:
  // waiting would never help, so admission refuses at once.
  kNeverFits = 2,
  // KV blocks are busy now; the request may fit later.
  kPoolBusy = 3,
  // A KV transfer passed its deadline or stalled.
  kTransferTimeout = 4,
  // The peer of a KV transfer went away mid-transfer.
  kPeerLost = 5,
};

inline constexpr char kCausePayloadUrl[] =
    "type.pdserve.dev/pdserve.StatusCause";

inline std::string_view StatusCauseName(StatusCause c) {
  switch (c) {
    case StatusCause::kNone:
      return "none";
    case StatusCause::kPrefillFailed:
      return "prefill_failed";
    case StatusCause::kNeverFits:
      return "never_fits";
    case StatusCause::kPoolBusy:
      return "pool_busy";
    case StatusCause::kTransferTimeout:
      return "transfer_timeout";
    case StatusCause::kPeerLost:
      return "peer_lost";
  }
  return "unknown";
}

// Returns `s` with `cause` attached (an OK status stays OK: it carries no
// payloads).
inline absl::Status WithCause(absl::Status s, StatusCause cause) {
  if (s.ok()) return s;
  s.SetPayload(kCausePayloadUrl,
               absl::Cord(std::to_string(static_cast<int32_t>(cause))));
  return s;
}

// The cause attached to `s`, or kNone. Unknown numbers (a newer peer) read
// as kNone.
inline StatusCause CauseOf(const absl::Status& s) {
  auto p = s.GetPayload(kCausePayloadUrl);
  if (!p) return StatusCause::kNone;
  int32_t v = 0;
  if (!absl::SimpleAtoi(std::string(*p), &v)) return StatusCause::kNone;
  if (v < 0 || v > static_cast<int32_t>(StatusCause::kPeerLost))
    return StatusCause::kNone;
  return static_cast<StatusCause>(v);
}

}  // namespace pdserve
