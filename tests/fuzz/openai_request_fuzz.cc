// Fuzzes the OpenAI request body parser of the router's HTTP front
// (router/openai/request.h), which reads untrusted JSON off the network.
// Input: one selector byte (even: /v1/completions, odd: /v1/chat/completions)
// then the body. Parsing must never crash; a request that parses must hold
// the invariants the server relies on when it builds a GenerateRequest.
// A chat request with tools also feeds the body, as if it were the model's
// output, to the tool-call reader of every template family: read whole or in
// two pieces it must give the same answer.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <variant>

#include "router/openai/request.h"
#include "router/openai/tool_calls.h"

using pdserve::router::openai::ApiError;
using pdserve::router::openai::CompletionRequest;
using pdserve::router::openai::Endpoint;

namespace {

using pdserve::engine::ChatTemplate;
using pdserve::router::openai::ToolCallAnswer;
using pdserve::router::openai::ToolCallDelta;
using pdserve::router::openai::ToolCallStream;

ToolCallAnswer Read(const CompletionRequest& r, ChatTemplate::Family family,
                    const std::string& text, size_t split, bool* tool_calls) {
  ToolCallStream s(r, family, 1);
  std::vector<ToolCallDelta> deltas = s.Push(text.substr(0, split));
  for (ToolCallDelta& d : s.Push(text.substr(split))) deltas.push_back(d);
  for (ToolCallDelta& d : s.Finish(true, tool_calls)) deltas.push_back(d);
  return pdserve::router::openai::AssembleToolCalls(deltas);
}

void CheckToolCallReader(const CompletionRequest& r, const std::string& text) {
  for (auto family :
       {ChatTemplate::Family::kChatMl, ChatTemplate::Family::kLlama3,
        ChatTemplate::Family::kMistral}) {
    bool whole_calls = false, split_calls = false;
    const ToolCallAnswer whole =
        Read(r, family, text, text.size(), &whole_calls);
    const ToolCallAnswer split =
        Read(r, family, text, text.size() / 2, &split_calls);
    if (whole_calls != split_calls || whole.content != split.content ||
        whole.calls.size() != split.calls.size())
      std::abort();
    for (size_t i = 0; i < whole.calls.size(); ++i) {
      if (whole.calls[i].name != split.calls[i].name ||
          whole.calls[i].arguments != split.calls[i].arguments)
        std::abort();
    }
  }
}

}  // namespace

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
    if (!r.tools.empty()) CheckToolCallReader(r, body);
  } else if (const auto* ids = std::get_if<std::vector<uint32_t>>(&r.prompt)) {
    if (ids->empty()) std::abort();
  }
  return 0;
}
