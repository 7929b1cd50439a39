// Fuzzes the OpenAI request body parser of the router's HTTP front
// (router/openai/request.h), which reads untrusted JSON off the network.
// Input: one selector byte (even: /v1/completions, odd: /v1/chat/completions)
// then the body. Parsing must never crash; a request that parses must hold
// the invariants the server relies on when it builds a GenerateRequest.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <variant>

#include "router/openai/request.h"

using pdserve::router::openai::ApiError;
using pdserve::router::openai::CompletionRequest;
using pdserve::router::openai::Endpoint;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0 || size > 1 << 20) return 0;
  const Endpoint endpoint =
      data[0] % 2 == 0 ? Endpoint::kCompletions : Endpoint::kChatCompletions;
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  auto parsed = pdserve::router::openai::ParseCompletionRequest(endpoint, body);
  if (const auto* err = std::get_if<ApiError>(&parsed)) {
    if (err->message.empty()) std::abort();
    return 0;
  }
  const CompletionRequest& r = std::get<CompletionRequest>(parsed);
  if (r.model.empty() || r.max_tokens < 1 || !(r.temperature >= 0) ||
      r.temperature > 2 || !(r.top_p > 0) || r.top_p > 1)
    std::abort();
  if (r.logprobs && (*r.logprobs < 0 ||
                     *r.logprobs > pdserve::router::openai::kMaxTopLogprobs))
    std::abort();
  if (r.include_usage && !r.stream) std::abort();
  for (const std::string& s : r.stop) {
    if (s.empty()) std::abort();
  }
  if (endpoint == Endpoint::kChatCompletions) {
    if (r.messages.empty()) std::abort();
  } else if (const auto* ids = std::get_if<std::vector<uint32_t>>(&r.prompt)) {
    if (ids->empty()) std::abort();
  }
  return 0;
}
