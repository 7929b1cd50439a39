// absl::Status <-> grpc::Status. The codes are numerically identical; this is
// the only place the conversion happens (RPC handlers and clients).
//
// A typed cause (common/status_cause.h) travels in grpc::Status's
// error_details (the grpc-status-details-bin trailer) as the serialized
// google.protobuf.Struct {"cause": N}, so the receiving process gets the
// same StatusCause back from FromGrpc. Message text is never parsed.
#pragma once

#include <google/protobuf/struct.pb.h>
#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"
#include "common/status_cause.h"

namespace pdserve {

inline grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  const StatusCause cause = CauseOf(s);
  if (cause == StatusCause::kNone) {
    return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                        std::string(s.message()));
  }
  google::protobuf::Struct details;
  (*details.mutable_fields())["cause"].set_number_value(
      static_cast<double>(static_cast<int32_t>(cause)));
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                      std::string(s.message()), details.SerializeAsString());
}

// The cause carried by a grpc::Status, or kNone (no or malformed details).
inline StatusCause CauseOf(const grpc::Status& s) {
  if (s.ok() || s.error_details().empty()) return StatusCause::kNone;
  google::protobuf::Struct details;
  if (!details.ParseFromString(s.error_details())) return StatusCause::kNone;
  auto it = details.fields().find("cause");
  if (it == details.fields().end() || !it->second.has_number_value())
    return StatusCause::kNone;
  const double v = it->second.number_value();
  if (!(v >= 0 && v <= static_cast<double>(StatusCause::kPeerLost)) ||
      v != static_cast<double>(static_cast<int32_t>(v))) {
    return StatusCause::kNone;
  }
  return static_cast<StatusCause>(static_cast<int32_t>(v));
}

inline absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(s.error_code()),
                   s.error_message());
  const StatusCause cause = CauseOf(s);
  return cause == StatusCause::kNone ? out : WithCause(std::move(out), cause);
}

// Returns `s` with `cause` in its details (keeps code and message).
inline grpc::Status WithCause(const grpc::Status& s, StatusCause cause) {
  return ToGrpc(WithCause(FromGrpc(s), cause));
}

}  // namespace pdserve
