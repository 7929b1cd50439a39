// The tool-calling fields of an OpenAI chat request: "tools", "tool_choice"
// and "parallel_tool_calls", and the output constraint they imply.
//
//  - tools: [{"type": "function", "function": {"name", "description",
//    "parameters", "strict"}}]. Names follow OpenAI's rule
//    (^[a-zA-Z0-9_-]{1,64}$) and are unique; "parameters" is a JSON schema
//    that structured/ compiles (checked here, so a bad one is a 400 naming
//    "tools", not a failure at generation time).
//  - tool_choice: "none" | "auto" | "required" |
//    {"type": "function", "function": {"name"}}. Default: "auto" with tools,
//    "none" without.
//  - A named function constrains the output to its parameters' schema;
//    "required" constrains it to a JSON array of 1..8 calls
//    (RequiredToolCallsSchema), exactly one with parallel_tool_calls false.
//    Neither combines with another output constraint (response_format,
//    guided_*).
//
// Plain functions; thread-safe.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/json.h"
#include "router/openai/request.h"

namespace pdserve::router::openai {

// Reads the tool fields of `root` (the parsed chat body; `body` is its text,
// re-read where key order matters) into `r`, and for a named or required
// tool_choice sets r->constraint. Returns the first error.
std::optional<ApiError> ParseToolFields(absl::string_view body,
                                        const json::Value& root,
                                        CompletionRequest* r);

// Calls one "required" answer may hold: a bound keeps generation finite
// (a model that never closes the array ends at this many) and the automaton
// small.
inline constexpr int kMaxParallelToolCalls = 8;

// The JSON schema of tool_choice "required": an array (1..
// kMaxParallelToolCalls items, or exactly one when !parallel) of {"name":
// <const>, "arguments": <that tool's parameters>} objects, one anyOf
// alternative per tool, without other properties. Each tool's parameters sit in
// "$defs" under "tool_<i>" with their own local "$ref"s rewritten to point
// there.
std::string RequiredToolCallsSchema(const std::vector<FunctionTool>& tools,
                                    bool parallel);

}  // namespace pdserve::router::openai
