// The structured-output fields of an OpenAI request body, and the handling of
// fields pdserve does not know.
//
//  - response_format: {"type": "text" | "json_object" | "json_schema",
//    "json_schema": {"name", "schema", "strict", "description"}}, on chat and
//    completions;
//  - vLLM's extras: guided_json (a schema), guided_regex, guided_choice,
//    guided_grammar (GBNF). guided_whitespace_pattern and
//    guided_decoding_backend are known but not implemented, so they are
//    refused (HTTP 400 naming them),
//    as are OpenAI's own known-but-unimplemented fields (tool_choice other
//    than "none", functions, audio, ...): never silently dropped.
//  - Any other key is unknown: ignored (SDKs send fields a server may not
//    know), but listed in CompletionRequest::unknown_fields so the server
//    logs and counts it (router/openai/unknown_field_log.h).
//
// The schema keeps the request's key order (properties are generated in the
// order the schema declares them). Whether a constraint compiles is checked
// by the router (structured/), which answers INVALID_ARGUMENT -> HTTP 400.
// Thread-safe.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/json.h"
#include "router/openai/request.h"

namespace pdserve::router::openai {

// Reads the structured-output fields of `root` (the parsed body; `body` is
// its text, re-read where key order matters) into r->constraint, and the
// keys of `root` that no part of the parser knows into r->unknown_fields.
// Returns the first error.
std::optional<ApiError> ParseStructuredOutput(Endpoint endpoint,
                                              absl::string_view body,
                                              const json::Value& root,
                                              CompletionRequest* r);

}  // namespace pdserve::router::openai
