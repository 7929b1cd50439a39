#include "router/openai/errors.h"

#include <algorithm>

#include "common/json.h"

namespace pdserve::router::openai {

HttpError BadRequest(std::string message, std::string param) {
  return HttpError{
      400, "invalid_request_error", "", std::move(message), std::move(param),
      0};
}

HttpError NotFound(std::string message, std::string code) {
  return HttpError{
      404, "invalid_request_error", std::move(code), std::move(message), "", 0};
}

HttpError Unauthorized(std::string message) {
  return HttpError{
      401, "authentication_error", "invalid_api_key", std::move(message), "",
      0};
}

HttpError FromGrpc(const grpc::Status& status, int64_t retry_after_ms) {
  HttpError e;
  e.message = status.error_message();
  switch (status.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::OUT_OF_RANGE:
    case grpc::StatusCode::FAILED_PRECONDITION:
      e.status = 400;
      e.type = "invalid_request_error";
      break;
    case grpc::StatusCode::UNAUTHENTICATED:
      e.status = 401;
      e.type = "authentication_error";
      e.code = "invalid_api_key";
      break;
    case grpc::StatusCode::PERMISSION_DENIED:
      e.status = 403;
      e.type = "permission_error";
      break;
    case grpc::StatusCode::NOT_FOUND:
      e.status = 404;
      e.type = "invalid_request_error";
      break;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      e.status = 429;
      e.type = "rate_limit_error";
      e.code = "rate_limit_exceeded";
      e.retry_after_s = std::max<int64_t>(1, (retry_after_ms + 999) / 1000);
      break;
    case grpc::StatusCode::UNAVAILABLE:
      e.status = 503;
      e.type = "server_error";
      e.code = "service_unavailable";
      break;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      e.status = 504;
      e.type = "timeout_error";
      e.code = "timeout";
      break;
    case grpc::StatusCode::CANCELLED:
      e.status = 499;
      e.type = "cancelled";
      break;
    default:
      e.status = 500;
      e.type = "server_error";
      break;
  }
  return e;
}

std::string ErrorJson(const HttpError& error) {
  auto or_null = [](const std::string& s) {
    return s.empty() ? json::OrderedValue() : json::OrderedValue(s);
  };
  return json::Dump(json::OrderedValue{{"error",
                                        {{"message", error.message},
                                         {"type", error.type},
                                         {"param", or_null(error.param)},
                                         {"code", or_null(error.code)}}}});
}

}  // namespace pdserve::router::openai
