#include "router/openai/structured_request.h"

#include <nlohmann/json.hpp>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pdserve::router::openai {
namespace {

using json::Value;
using Kind = structured::ConstraintSpec::Kind;

// Every key the request parser reads (request.cc and this file), per
// endpoint; the rest are unknown.
bool Known(Endpoint endpoint, const std::string& key) {
  static const auto* common =
      new absl::flat_hash_set<std::string>{"model",
                                           "max_tokens",
                                           "temperature",
                                           "top_p",
                                           "top_k",
                                           "seed",
                                           "stop",
                                           "ignore_eos",
                                           "cache_salt",
                                           "stream",
                                           "stream_options",
                                           "logprobs",
                                           "n",
                                           "best_of",
                                           "presence_penalty",
                                           "frequency_penalty",
                                           "repetition_penalty",
                                           "logit_bias",
                                           "user",
                                           "response_format",
                                           "guided_json",
                                           "guided_regex",
                                           "guided_choice",
                                           "guided_grammar",
                                           "guided_whitespace_pattern",
                                           "guided_decoding_backend"};
  static const auto* completions =
      new absl::flat_hash_set<std::string>{"prompt", "echo", "suffix"};
  static const auto* chat =
      new absl::flat_hash_set<std::string>{"messages",
                                           "max_completion_tokens",
                                           "top_logprobs",
                                           "tools",
                                           "tool_choice",
                                           "parallel_tool_calls",
                                           "functions",
                                           "function_call",
                                           "audio",
                                           "modalities",
                                           "prediction",
                                           "web_search_options",
                                           "reasoning_effort",
                                           "store",
                                           "metadata",
                                           "service_tier"};
  return common->contains(key) ||
         (endpoint == Endpoint::kCompletions ? completions : chat)
             ->contains(key);
}

ApiError Error(std::string param, std::string message) {
  return ApiError{std::move(message), std::move(param)};
}

// OpenAI (chat) fields pdserve knows but does not implement: refused unless
// they carry the value that means "off".
std::optional<ApiError> RejectUnimplemented(Endpoint endpoint,
                                            const Value& root) {
  for (const char* key :
       {"guided_whitespace_pattern", "guided_decoding_backend"}) {
    if (json::Find(root, key) != nullptr) {
      return Error(key, absl::StrCat("'", key,
                                     "' is not supported: pdserve constrains "
                                     "output with response_format, "
                                     "guided_json, guided_regex, "
                                     "guided_choice or guided_grammar"));
    }
  }
  if (endpoint != Endpoint::kChatCompletions) return std::nullopt;
  for (const char* key : {"functions", "function_call", "audio", "prediction",
                          "web_search_options", "reasoning_effort"}) {
    if (json::Find(root, key) != nullptr) {
      return Error(key, absl::StrCat("'", key, "' is not supported"));
    }
  }
  if (const Value* m = json::Find(root, "modalities"); m != nullptr) {
    if (!(m->is_array() && m->size() == 1 && (*m)[0].is_string() &&
          (*m)[0].get<std::string>() == "text")) {
      return Error("modalities",
                   "'modalities' other than [\"text\"] is not supported");
    }
  }
  return std::nullopt;
}

// The schema at `path` of the body, re-read keeping key order.
std::string OrderedDump(absl::string_view body,
                        const std::vector<const char*>& path) {
  nlohmann::ordered_json doc = nlohmann::ordered_json::parse(
      body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  const nlohmann::ordered_json* cur = &doc;
  for (const char* key : path) {
    if (!cur->is_object()) return "";
    auto it = cur->find(key);
    if (it == cur->end()) return "";
    cur = &*it;
  }
  return cur->dump(-1, ' ', false,
                   nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace

std::optional<ApiError> ParseStructuredOutput(Endpoint endpoint,
                                              absl::string_view body,
                                              const Value& root,
                                              CompletionRequest* r) {
  for (const auto& [key, value] : root.items()) {
    if (!Known(endpoint, key)) r->unknown_fields.push_back(key);
  }
  if (auto e = RejectUnimplemented(endpoint, root)) return e;

  structured::ConstraintSpec& c = r->constraint;
  std::vector<std::string> given;  // the fields that set a constraint
  if (const Value* rf = json::Find(root, "response_format")) {
    const std::string* type = json::StringOrNull(json::Find(*rf, "type"));
    if (!rf->is_object() || type == nullptr) {
      return Error("response_format",
                   "'response_format' must be an object with a string 'type'");
    }
    if (*type == "json_object") {
      c.kind = Kind::kJsonObject;
      given.push_back("response_format");
    } else if (*type == "json_schema") {
      const Value* js = json::Find(*rf, "json_schema");
      if (js == nullptr || !js->is_object()) {
        return Error("response_format",
                     "'response_format' of type json_schema needs a "
                     "'json_schema' object");
      }
      const std::string* name = json::StringOrNull(json::Find(*js, "name"));
      if (name == nullptr || name->empty()) {
        return Error("response_format",
                     "'response_format.json_schema.name' is required");
      }
      const Value* strict = json::Find(*js, "strict");
      if (strict != nullptr && !strict->is_boolean()) {
        return Error("response_format",
                     "'response_format.json_schema.strict' must be a boolean");
      }
      const Value* schema = json::Find(*js, "schema");
      if (schema == nullptr || !(schema->is_object() || schema->is_boolean())) {
        return Error("response_format",
                     "'response_format.json_schema.schema' must be a JSON "
                     "schema object");
      }
      c.kind = Kind::kJsonSchema;
      c.text = OrderedDump(body, {"response_format", "json_schema", "schema"});
      given.push_back("response_format");
    } else if (*type != "text") {
      return Error(
          "response_format",
          absl::StrCat("unknown response_format type ", json::Quote(*type),
                       " (text, json_object or json_schema)"));
    }
  }
  if (const Value* gj = json::Find(root, "guided_json")) {
    if (gj->is_string()) {
      c.text = gj->get<std::string>();
    } else if (gj->is_object()) {
      c.text = OrderedDump(body, {"guided_json"});
    } else {
      return Error("guided_json",
                   "'guided_json' must be a JSON schema (object or string)");
    }
    c.kind = Kind::kJsonSchema;
    given.push_back("guided_json");
  }
  if (const Value* gr = json::Find(root, "guided_regex")) {
    if (!gr->is_string()) {
      return Error("guided_regex", "'guided_regex' must be a string");
    }
    c.kind = Kind::kRegex;
    c.text = gr->get<std::string>();
    given.push_back("guided_regex");
  }
  if (const Value* gc = json::Find(root, "guided_choice")) {
    if (!gc->is_array() || gc->empty()) {
      return Error("guided_choice",
                   "'guided_choice' must be a non-empty array of strings");
    }
    c.choices.clear();
    for (const Value& s : *gc) {
      if (!s.is_string()) {
        return Error("guided_choice",
                     "'guided_choice' must be a non-empty array of strings");
      }
      c.choices.push_back(s.get<std::string>());
    }
    c.kind = Kind::kChoice;
    given.push_back("guided_choice");
  }
  if (const Value* gg = json::Find(root, "guided_grammar")) {
    if (!gg->is_string()) {
      return Error("guided_grammar",
                   "'guided_grammar' must be a string (a GBNF grammar)");
    }
    c.kind = Kind::kGrammar;
    c.text = gg->get<std::string>();
    given.push_back("guided_grammar");
  }
  if (given.size() > 1) {
    return Error(given[1], absl::StrCat("only one output constraint may be "
                                        "given, not ",
                                        absl::StrJoin(given, " and ")));
  }
  return std::nullopt;
}

}  // namespace pdserve::router::openai
