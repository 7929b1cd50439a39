#include "router/openai/tool_request.h"

#include <gtest/gtest.h>

#include "common/json.h"
#include "router/openai/request.h"

namespace pdserve::router::openai {
namespace {

constexpr Endpoint kChat = Endpoint::kChatCompletions;

constexpr const char* kWeather =
    R"({"type": "function", "function": {"name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {
          "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
          "required": ["city", "unit"], "additionalProperties": false}}})";
constexpr const char* kTime =
    R"({"type": "function", "function": {"name": "get_time",
        "parameters": {"$defs": {"zone": {"type": "string", "maxLength": 8}},
          "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}},
          "required": ["zone"], "additionalProperties": false}}})";

std::string Body(const std::string& extra) {
  return std::string(R"({"model": "m", "messages": [{"role": "user",
      "content": "hi"}], "tools": [)") +
         kWeather + ", " + kTime + "]" + extra + "}";
}

CompletionRequest Ok(const std::string& body) {
  auto r = ParseCompletionRequest(kChat, body);
  if (const auto* err = std::get_if<ApiError>(&r)) {
    ADD_FAILURE() << body << ": " << err->message;
    return {};
  }
  return std::get<CompletionRequest>(r);
}

ApiError Bad(const std::string& body) {
  auto r = ParseCompletionRequest(kChat, body);
  if (!std::holds_alternative<ApiError>(r)) {
    ADD_FAILURE() << body << " parsed";
    return {};
  }
  return std::get<ApiError>(r);
}

TEST(ToolRequestTest, ToolsDefaultToAutoWithoutAConstraint) {
  CompletionRequest r = Ok(Body(""));
  ASSERT_EQ(r.tools.size(), 2u);
  EXPECT_EQ(r.tools[0].name, "get_weather");
  EXPECT_EQ(r.tool_choice, ToolChoice::kAuto);
  EXPECT_FALSE(r.constraint.active());
  EXPECT_TRUE(r.parallel_tool_calls);
  // The definition keeps the request's key order for the chat template.
  EXPECT_EQ(r.tools[0].definition["function"].begin().key(), "name");
  EXPECT_LT(r.tools[0].parameters.find("\"city\""),
            r.tools[0].parameters.find("\"unit\""))
      << r.tools[0].parameters;
  EXPECT_EQ(Ok(Body(R"(, "tool_choice": "none")")).tool_choice,
            ToolChoice::kNone);
}

TEST(ToolRequestTest, NamedFunctionIsConstrainedToItsParameters) {
  CompletionRequest r = Ok(Body(
      R"(, "tool_choice": {"type": "function", "function": {"name": "get_time"}})"));
  EXPECT_EQ(r.tool_choice, ToolChoice::kNamed);
  EXPECT_EQ(r.tool_choice_name, "get_time");
  EXPECT_EQ(r.constraint.kind, structured::ConstraintSpec::Kind::kJsonSchema);
  EXPECT_EQ(r.constraint.text, r.tools[1].parameters);
}

TEST(ToolRequestTest, RequiredBuildsAnArrayOfCallsSchema) {
  CompletionRequest r = Ok(Body(R"(, "tool_choice": "required")"));
  EXPECT_EQ(r.tool_choice, ToolChoice::kRequired);
  auto schema = json::Parse(r.constraint.text, "schema");
  ASSERT_TRUE(schema.ok());
  EXPECT_EQ((*schema)["type"], "array");
  EXPECT_EQ((*schema)["minItems"], 1);
  EXPECT_EQ((*schema)["maxItems"], kMaxParallelToolCalls);
  const json::Value& alt = (*schema)["items"]["anyOf"][1];
  EXPECT_EQ(alt["properties"]["name"]["const"], "get_time");
  EXPECT_EQ(alt["properties"]["arguments"]["$ref"], "#/$defs/tool_1");
  EXPECT_EQ(alt["additionalProperties"], false);
  // The tool's own $ref now points into its new place.
  EXPECT_EQ((*schema)["$defs"]["tool_1"]["properties"]["zone"]["$ref"],
            "#/$defs/tool_1/$defs/zone");

  CompletionRequest one =
      Ok(Body(R"(, "tool_choice": "required", "parallel_tool_calls": false)"));
  EXPECT_FALSE(one.parallel_tool_calls);
  EXPECT_EQ((*json::Parse(one.constraint.text, "s"))["maxItems"], 1);
}

TEST(ToolRequestTest, BadToolsAre400sNamingTheField) {
  struct Case {
    std::string body;
    std::string param;
    std::string message;
  };
  const std::string user =
      R"({"model": "m", "messages": [{"role": "user", "content": "x"}], )";
  const std::vector<Case> cases = {
      {user + R"("tools": {}})", "tools", "must be an array"},
      {user + R"("tools": [{"type": "function", "function": {}}]})", "tools",
       "name' is required"},
      {user +
           R"("tools": [{"type": "function", "function": {"name": "a b"}}]})",
       "tools", "^[a-zA-Z0-9_-]{1,64}$"},
      {user + R"("tools": [{"type": "retrieval"}]})", "tools", "\"function\""},
      {user + R"("tools": [{"type": "function", "function": {"name": "f",
          "parameters": {"type": "object", "oneOf": []}}}]})",
       "tools", "unsupported keyword 'oneOf'"},
      {user + R"("tools": [{"type": "function", "function": {"name": "f",
          "parameters": "x"}}]})",
       "tools", "JSON schema object"},
      {user + R"("tools": [{"type": "function", "function": {"name": "f"}},
          {"type": "function", "function": {"name": "f"}}]})",
       "tools", "two tools are named 'f'"},
      {Body(
           R"(, "tool_choice": {"type": "function", "function": {"name": "nope"}})"),
       "tool_choice", "not in 'tools'"},
      {user + R"("tool_choice": "required"})", "tool_choice", "needs 'tools'"},
      {Body(R"(, "tool_choice": "sometimes")"), "tool_choice",
       "unknown tool_choice"},
      {Body(R"(, "tool_choice": "required", "guided_regex": "a")"),
       "tool_choice", "cannot be combined"},
      {Body(R"(, "parallel_tool_calls": 1)"), "parallel_tool_calls", "boolean"},
  };
  for (const Case& c : cases) {
    ApiError e = Bad(c.body);
    EXPECT_EQ(e.param, c.param) << c.body;
    EXPECT_NE(e.message.find(c.message), std::string::npos)
        << c.body << ": " << e.message;
  }
}

TEST(ToolRequestTest, ToolMessagesParse) {
  CompletionRequest r = Ok(R"({"model": "m", "messages": [
      {"role": "user", "content": "weather?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
        "type": "function", "function": {"name": "get_weather",
        "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
       "content": "sunny"}]})");
  ASSERT_EQ(r.messages.size(), 3u);
  ASSERT_EQ(r.messages[1].tool_calls.size(), 1u);
  EXPECT_EQ(r.messages[1].tool_calls[0].id, "call_1");
  EXPECT_EQ(r.messages[1].tool_calls[0].name, "get_weather");
  EXPECT_EQ(r.messages[1].tool_calls[0].arguments, R"({"city": "Paris"})");
  EXPECT_EQ(r.messages[2].tool_call_id, "call_1");
  EXPECT_EQ(r.messages[2].name, "get_weather");
  EXPECT_EQ(Bad(R"({"model": "m", "messages": [{"role": "assistant",
      "tool_calls": [{"type": "function", "function": {"name": "f",
      "arguments": "{not json"}}]}]})")
                .param,
            "messages");
  EXPECT_EQ(Bad(R"({"model": "m", "messages": [{"role": "user",
      "tool_calls": []}]})")
                .param,
            "messages");
}

}  // namespace
}  // namespace pdserve::router::openai
