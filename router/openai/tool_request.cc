#include "router/openai/tool_request.h"

#include <nlohmann/json.hpp>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "structured/byte_regex.h"
#include "structured/json_schema.h"

namespace pdserve::router::openai {
namespace {

using json::OrderedValue;
using json::Value;

ApiError Error(std::string param, std::string message) {
  return ApiError{std::move(message), std::move(param)};
}

// OpenAI's rule for function names; it also keeps names free of characters
// that JSON or the chat templates would have to escape.
bool ValidToolName(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

// The schema of a function without declared parameters: an empty object.
constexpr const char* kNoParameters =
    R"({"type":"object","properties":{},"additionalProperties":false})";

// Points the local "$ref"s of a schema moved to `prefix` (a JSON pointer such
// as "#/$defs/tool_0") at their new place. Values of keywords that hold data
// rather than schemas (const, enum, default, examples) are left alone.
void RewriteRefs(OrderedValue& schema, const std::string& prefix) {
  if (schema.is_array()) {
    for (OrderedValue& item : schema) RewriteRefs(item, prefix);
    return;
  }
  if (!schema.is_object()) return;
  for (auto it = schema.begin(); it != schema.end(); ++it) {
    const std::string& key = it.key();
    if (key == "const" || key == "enum" || key == "default" ||
        key == "examples") {
      continue;
    }
    if (key == "$ref" && it->is_string()) {
      const std::string ref = it->get<std::string>();
      if (ref == "#") {
        *it = prefix;
      } else if (ref.rfind("#/", 0) == 0) {
        *it = prefix + ref.substr(1);
      }
      continue;
    }
    RewriteRefs(*it, prefix);
  }
}

// tools[i]: the function's name and parameters, checked.
std::optional<ApiError> ParseTool(const OrderedValue& tool, size_t i,
                                  FunctionTool* out) {
  const std::string where = absl::StrCat("tools[", i, "]");
  if (!tool.is_object()) {
    return Error("tools", absl::StrCat("'", where, "' must be an object"));
  }
  auto type = tool.find("type");
  if (type == tool.end() || !type->is_string() ||
      type->get<std::string>() != "function") {
    return Error("tools", absl::StrCat("'", where,
                                       ".type' must be \"function\" (the only "
                                       "tool type)"));
  }
  auto fn = tool.find("function");
  if (fn == tool.end() || !fn->is_object()) {
    return Error("tools",
                 absl::StrCat("'", where, ".function' must be an object"));
  }
  auto name = fn->find("name");
  if (name == fn->end() || !name->is_string() ||
      !ValidToolName(name->get<std::string>())) {
    return Error("tools", absl::StrCat("'", where,
                                       ".function.name' is required and must "
                                       "match ^[a-zA-Z0-9_-]{1,64}$"));
  }
  out->name = name->get<std::string>();
  if (auto d = fn->find("description");
      d != fn->end() && !d->is_null() && !d->is_string()) {
    return Error("tools", absl::StrCat("'", where,
                                       ".function.description' must be a "
                                       "string"));
  }
  if (auto s = fn->find("strict");
      s != fn->end() && !s->is_null() && !s->is_boolean()) {
    return Error("tools", absl::StrCat("'", where,
                                       ".function.strict' must be a boolean"));
  }
  auto params = fn->find("parameters");
  if (params == fn->end() || params->is_null()) {
    out->parameters = kNoParameters;
  } else if (!params->is_object()) {
    return Error("tools", absl::StrCat("'", where,
                                       ".function.parameters' must be a JSON "
                                       "schema object"));
  } else {
    out->parameters = params->dump(
        -1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
    // Compiled to a regex only (cheap): unsupported keywords and bad values
    // are named here; automaton caps are checked when the router compiles
    // the request's constraint.
    structured::ByteRegex re;
    auto node = structured::CompileJsonSchema(
        out->parameters, structured::JsonSchemaOptions{}, &re);
    if (!node.ok()) {
      return Error("tools", absl::StrCat("'", where, ".function.parameters': ",
                                         node.status().message()));
    }
  }
  out->definition = tool;
  return std::nullopt;
}

}  // namespace

std::string RequiredToolCallsSchema(const std::vector<FunctionTool>& tools,
                                    bool parallel) {
  OrderedValue alternatives = OrderedValue::array();
  OrderedValue defs = OrderedValue::object();
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string key = absl::StrCat("tool_", i);
    OrderedValue params = OrderedValue::parse(tools[i].parameters, nullptr,
                                              /*allow_exceptions=*/false);
    RewriteRefs(params, "#/$defs/" + key);
    defs[key] = std::move(params);
    alternatives.push_back(
        OrderedValue{{"type", "object"},
                     {"properties",
                      {{"name", {{"const", tools[i].name}}},
                       {"arguments", {{"$ref", "#/$defs/" + key}}}}},
                     {"required", {"name", "arguments"}},
                     {"additionalProperties", false}});
  }
  OrderedValue schema = {{"type", "array"},
                         {"items", {{"anyOf", std::move(alternatives)}}},
                         {"minItems", 1}};
  schema["maxItems"] = parallel ? kMaxParallelToolCalls : 1;
  schema["$defs"] = std::move(defs);
  return schema.dump(-1, ' ', false,
                     nlohmann::ordered_json::error_handler_t::replace);
}

std::optional<ApiError> ParseToolFields(absl::string_view body,
                                        const Value& root,
                                        CompletionRequest* r) {
  if (const Value* p = json::Find(root, "parallel_tool_calls")) {
    if (!p->is_boolean()) {
      return Error("parallel_tool_calls",
                   "'parallel_tool_calls' must be a boolean");
    }
    r->parallel_tool_calls = p->get<bool>();
  }
  if (const Value* tools = json::Find(root, "tools")) {
    if (!tools->is_array()) {
      return Error("tools", "'tools' must be an array of function tools");
    }
    // Re-read in the request's key order: the chat template shows each tool
    // as sent, and arguments are generated in the schema's property order.
    const OrderedValue doc = OrderedValue::parse(
        body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
    auto ordered = doc.find("tools");
    if (ordered == doc.end() || !ordered->is_array() ||
        ordered->size() != tools->size()) {
      return Error("tools", "'tools' must be an array of function tools");
    }
    absl::flat_hash_set<std::string> names;
    for (size_t i = 0; i < ordered->size(); ++i) {
      FunctionTool tool;
      if (auto e = ParseTool((*ordered)[i], i, &tool)) return e;
      if (!names.insert(tool.name).second) {
        return Error("tools",
                     absl::StrCat("two tools are named '", tool.name, "'"));
      }
      r->tools.push_back(std::move(tool));
    }
  }
  r->tool_choice = r->tools.empty() ? ToolChoice::kNone : ToolChoice::kAuto;
  if (const Value* tc = json::Find(root, "tool_choice")) {
    if (tc->is_string()) {
      const std::string& choice = tc->get_ref<const std::string&>();
      if (choice == "none") {
        r->tool_choice = ToolChoice::kNone;
      } else if (choice == "auto") {
        r->tool_choice = ToolChoice::kAuto;
      } else if (choice == "required") {
        r->tool_choice = ToolChoice::kRequired;
      } else {
        return Error("tool_choice",
                     absl::StrCat("unknown tool_choice ", json::Quote(choice),
                                  " (none, auto, required or {\"type\": "
                                  "\"function\", \"function\": {\"name\": "
                                  "...}})"));
      }
    } else if (tc->is_object()) {
      const std::string* type = json::StringOrNull(json::Find(*tc, "type"));
      const Value* fn = json::Find(*tc, "function");
      const std::string* name =
          fn == nullptr ? nullptr : json::StringOrNull(json::Find(*fn, "name"));
      if (type == nullptr || *type != "function" || name == nullptr) {
        return Error("tool_choice",
                     "a named 'tool_choice' must be {\"type\": \"function\", "
                     "\"function\": {\"name\": ...}}");
      }
      r->tool_choice = ToolChoice::kNamed;
      r->tool_choice_name = *name;
    } else {
      return Error("tool_choice",
                   "'tool_choice' must be a string or a named function");
    }
    if (r->tools.empty() && (r->tool_choice == ToolChoice::kRequired ||
                             r->tool_choice == ToolChoice::kNamed)) {
      return Error("tool_choice",
                   "'tool_choice' required or a named function needs 'tools'");
    }
  }
  if (r->tool_choice == ToolChoice::kAuto && r->tools.empty()) {
    r->tool_choice = ToolChoice::kNone;
  }
  if (r->tool_choice != ToolChoice::kRequired &&
      r->tool_choice != ToolChoice::kNamed) {
    return std::nullopt;
  }
  if (r->constraint.active()) {
    return Error("tool_choice",
                 "a named or required 'tool_choice' constrains the output "
                 "itself and cannot be combined with response_format or "
                 "guided_* fields");
  }
  if (r->tool_choice == ToolChoice::kRequired) {
    r->constraint = structured::ConstraintSpec::JsonSchema(
        RequiredToolCallsSchema(r->tools, r->parallel_tool_calls));
    return std::nullopt;
  }
  for (const FunctionTool& tool : r->tools) {
    if (tool.name == r->tool_choice_name) {
      r->constraint = structured::ConstraintSpec::JsonSchema(tool.parameters);
      return std::nullopt;
    }
  }
  return Error("tool_choice", absl::StrCat("'tool_choice' names function ",
                                           json::Quote(r->tool_choice_name),
                                           ", which is not in 'tools'"));
}

}  // namespace pdserve::router::openai
