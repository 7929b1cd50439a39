// The internal protos' enums (WorkerRole, KvDtype, FinishReason) and their
// names and C++ counterparts. The names are what users see: flags
// (--role prefill), the public ListWorkers role string, metric labels and the
// public finish_reason string. Header-only, stateless, thread-safe.
#pragma once

#include <optional>
#include <string_view>

#include "common/dtype.h"
#include "pdserve/v1/internal.pb.h"

namespace pdserve::wire {

// "prefill" | "decode" | "both"; "" for UNSPECIFIED or an unknown number.
inline const char* RoleName(v1::WorkerRole role) {
  switch (role) {
    case v1::WORKER_ROLE_PREFILL:
      return "prefill";
    case v1::WORKER_ROLE_DECODE:
      return "decode";
    case v1::WORKER_ROLE_BOTH:
      return "both";
    default:
      return "";
  }
}

// The role a name spells, or nullopt.
inline std::optional<v1::WorkerRole> ParseRole(std::string_view name) {
  if (name == "prefill") return v1::WORKER_ROLE_PREFILL;
  if (name == "decode") return v1::WORKER_ROLE_DECODE;
  if (name == "both") return v1::WORKER_ROLE_BOTH;
  return std::nullopt;
}

// True for the three roles this release serves; false for UNSPECIFIED and for
// numbers it does not know (a proto3 enum field keeps unknown numbers).
inline bool IsKnownRole(v1::WorkerRole role) { return *RoleName(role) != '\0'; }

inline bool ServesPrefill(v1::WorkerRole role) {
  return role == v1::WORKER_ROLE_PREFILL || role == v1::WORKER_ROLE_BOTH;
}
inline bool ServesDecode(v1::WorkerRole role) {
  return role == v1::WORKER_ROLE_DECODE || role == v1::WORKER_ROLE_BOTH;
}

// The public finish_reason string: "" | "length" | "stop" | "eos" |
// "cancelled" (router.proto's contract).
inline const char* FinishReasonName(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_STOP:
      return "stop";
    case v1::FINISH_REASON_EOS:
      return "eos";
    case v1::FINISH_REASON_CANCELLED:
      return "cancelled";
    default:
      return "";
  }
}

inline v1::KvDtype DTypeToProto(DType t) {
  switch (t) {
    case DType::kF32:
      return v1::KV_DTYPE_FP32;
    case DType::kF16:
      return v1::KV_DTYPE_FP16;
    case DType::kBF16:
      return v1::KV_DTYPE_BF16;
    case DType::kI8:
      return v1::KV_DTYPE_INT8;
    case DType::kFp8E4M3:
      return v1::KV_DTYPE_FP8_E4M3;
  }
  return v1::KV_DTYPE_UNSPECIFIED;
}

// nullopt for UNSPECIFIED or an unknown number: such a layout matches none.
inline std::optional<DType> DTypeFromProto(v1::KvDtype t) {
  switch (t) {
    case v1::KV_DTYPE_FP32:
      return DType::kF32;
    case v1::KV_DTYPE_FP16:
      return DType::kF16;
    case v1::KV_DTYPE_BF16:
      return DType::kBF16;
    case v1::KV_DTYPE_INT8:
      return DType::kI8;
    case v1::KV_DTYPE_FP8_E4M3:
      return DType::kFp8E4M3;
    default:
      return std::nullopt;
  }
}

}  // namespace pdserve::wire
