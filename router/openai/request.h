// Typed OpenAI request bodies (POST /v1/completions, /v1/chat/completions)
// parsed from untrusted JSON. Parsing never throws and never crashes: every
// malformed or unsupported field becomes an ApiError naming the field, which
// the server answers with HTTP 400 in OpenAI's error shape.
//
// Plain values and free functions; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/json.h"
#include "structured/constraint.h"
#include "tokenizer/chat_template.h"

namespace pdserve::router::openai {

enum class Endpoint { kCompletions, kChatCompletions };

// One entry of "tools": {"type": "function", "function": {"name",
// "description", "parameters", "strict"}}.
struct FunctionTool {
  std::string name;
  // The parameters' JSON schema as JSON text in the request's key order
  // (arguments are generated in the order the schema declares them); an
  // object without properties when the tool declares none.
  std::string parameters;
  // The tool object as sent, for the chat template (which shows it to the
  // model in the family's own format).
  json::OrderedValue definition;
};

// "tool_choice": none (tools shown, output free), auto (the model decides;
// its native tool-call text is parsed), required (at least one call,
// constrained), or one named function (constrained to its parameters).
enum class ToolChoice { kNone, kAuto, kRequired, kNamed };

struct CompletionRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;
  // Completions: text, or token ids. Chat: empty (see messages).
  std::variant<std::string, std::vector<uint32_t>> prompt;
  std::vector<engine::ChatMessage> messages;  // chat only
  // OpenAI's default for completions is 16; chat has no documented bound, so
  // it gets kDefaultChatMaxTokens (the router still caps prompt + max_tokens
  // at the workers' max_model_len).
  uint32_t max_tokens = 16;
  float temperature = 1.0f;  // OpenAI's default
  float top_p = 1.0f;
  uint32_t top_k = 0;            // vLLM extra; 0 = off
  std::optional<uint64_t> seed;  // absent: the server picks one
  std::vector<std::string> stop;
  bool ignore_eos = false;  // vLLM extra
  std::string cache_salt;   // vLLM extra
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // Top alternatives per generated token (0..kMaxTopLogprobs), or absent for
  // no logprobs. Completions: "logprobs": N. Chat: "logprobs": true with
  // "top_logprobs": N (0 when absent).
  std::optional<int32_t> logprobs;
  // response_format / guided_* (router/openai/structured_request.h).
  structured::ConstraintSpec constraint;
  // Chat only: "tools", "tool_choice" (default auto when tools are given) and
  // "parallel_tool_calls" (router/openai/tool_request.h).
  std::vector<FunctionTool> tools;
  ToolChoice tool_choice = ToolChoice::kNone;
  std::string tool_choice_name;  // kNamed: the function
  bool parallel_tool_calls = true;
  // Top-level keys no part of the parser knows (ignored, logged, counted).
  std::vector<std::string> unknown_fields;
};

inline constexpr uint32_t kDefaultChatMaxTokens = 256;
inline constexpr int32_t kMaxTopLogprobs = 5;

struct ApiError {
  std::string message;
  std::string param;  // the offending field, or empty
};

// Parses `body` for `endpoint`. Unknown fields are ignored (as OpenAI's SDKs
// send fields a server may not know); fields pdserve cannot honour with the
// value given (n != 1, echo, penalties, logit_bias, best_of > 1, suffix) are
// errors rather than silently ignored.
std::variant<CompletionRequest, ApiError> ParseCompletionRequest(
    Endpoint endpoint, absl::string_view body);

}  // namespace pdserve::router::openai
