// OpenAI-shaped errors for the HTTP front: the HTTP status that fits a gRPC
// status from the Router service, and the {"error": {...}} body.
//
// Mapping (docs/openai-api.md):
//   INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION -> 400
//   UNAUTHENTICATED -> 401, PERMISSION_DENIED -> 403, NOT_FOUND -> 404
//   RESOURCE_EXHAUSTED -> 429 with Retry-After (tenant limits, shedding)
//   UNAVAILABLE -> 503 (no workers), DEADLINE_EXCEEDED -> 504
//   CANCELLED -> 499 (client closed request); anything else -> 500
//
// Plain values and free functions; thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <string>

namespace pdserve::router::openai {

struct HttpError {
  int status = 500;
  std::string type;  // OpenAI's error "type"
  std::string code;  // OpenAI's error "code"; empty -> null
  std::string message;
  std::string param;  // empty -> null
  // Seconds for the Retry-After header; 0: no header.
  int64_t retry_after_s = 0;
};

HttpError BadRequest(std::string message, std::string param = "");
HttpError NotFound(std::string message, std::string code);
// 401 authentication_error / invalid_api_key, as the router's UNAUTHENTICATED.
HttpError Unauthorized(std::string message);

// `retry_after_ms`: the router's "retry-after-ms" trailing metadata, 0 when
// absent; rounded up to whole seconds (at least 1) for 429.
HttpError FromGrpc(const grpc::Status& status, int64_t retry_after_ms);

// {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
std::string ErrorJson(const HttpError& error);

}  // namespace pdserve::router::openai
