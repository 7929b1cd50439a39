#include "router/openai/structured_request.h"

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "router/openai/request.h"
#include "router/openai/unknown_field_log.h"

namespace pdserve::router::openai {
namespace {

using Kind = structured::ConstraintSpec::Kind;

CompletionRequest Ok(Endpoint e, const std::string& body) {
  auto r = ParseCompletionRequest(e, body);
  if (const auto* err = std::get_if<ApiError>(&r)) {
    ADD_FAILURE() << body << ": " << err->message;
    return {};
  }
  return std::get<CompletionRequest>(r);
}

ApiError Bad(Endpoint e, const std::string& body) {
  auto r = ParseCompletionRequest(e, body);
  if (!std::holds_alternative<ApiError>(r)) {
    ADD_FAILURE() << body << " parsed";
    return {};
  }
  return std::get<ApiError>(r);
}

constexpr Endpoint kCmpl = Endpoint::kCompletions;
constexpr Endpoint kChat = Endpoint::kChatCompletions;
const char* kChatHead =
    R"("model": "m", "messages": [{"role": "user", "content": "hi"}])";

TEST(StructuredRequestTest, JsonSchemaKeepsTheSchemasKeyOrder) {
  CompletionRequest r = Ok(kChat, absl::StrCat("{", kChatHead, R"(,
      "response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": true,
        "schema": {"type": "object", "properties": {"zeta": {"type": "integer"},
                   "alpha": {"type": "string"}}, "required": ["zeta", "alpha"]}}}})"));
  EXPECT_EQ(r.constraint.kind, Kind::kJsonSchema);
  EXPECT_LT(r.constraint.text.find("zeta"), r.constraint.text.find("alpha"))
      << r.constraint.text;
  EXPECT_TRUE(r.unknown_fields.empty());
}

TEST(StructuredRequestTest, EveryConstraintFieldOnBothEndpoints) {
  for (Endpoint e : {kCmpl, kChat}) {
    const std::string head =
        e == kChat ? kChatHead : R"("model": "m", "prompt": "hi")";
    auto body = [&](const std::string& field) {
      return absl::StrCat("{", head, ", ", field, "}");
    };
    EXPECT_EQ(Ok(e, body(R"("response_format": {"type": "json_object"})"))
                  .constraint.kind,
              Kind::kJsonObject);
    EXPECT_EQ(
        Ok(e, body(R"("response_format": {"type": "text"})")).constraint.kind,
        Kind::kNone);
    CompletionRequest regex = Ok(e, body(R"("guided_regex": "[0-9]+")"));
    EXPECT_EQ(regex.constraint.kind, Kind::kRegex);
    EXPECT_EQ(regex.constraint.text, "[0-9]+");
    CompletionRequest choice = Ok(e, body(R"("guided_choice": ["yes", "no"])"));
    EXPECT_EQ(choice.constraint.kind, Kind::kChoice);
    EXPECT_EQ(choice.constraint.choices,
              (std::vector<std::string>{"yes", "no"}));
    CompletionRequest schema =
        Ok(e, body(R"("guided_json": {"type": "boolean"})"));
    EXPECT_EQ(schema.constraint.kind, Kind::kJsonSchema);
    EXPECT_EQ(schema.constraint.text, R"({"type":"boolean"})");
  }
}

TEST(StructuredRequestTest, KnownButUnimplementedFieldsAreRefusedByName) {
  const std::string head = absl::StrCat("{", kChatHead, ", ");
  struct Case {
    const char* field;
    const char* param;
  } cases[] = {
      {R"("guided_grammar": ["root ::= \"a\""])", "guided_grammar"},
      {R"("guided_grammar": "root ::= \"a\"", "guided_regex": "a")",
       "guided_grammar"},
      {R"("guided_whitespace_pattern": " ")", "guided_whitespace_pattern"},
      {R"("guided_decoding_backend": "xgrammar")", "guided_decoding_backend"},
      {R"("tool_choice": "required")", "tool_choice"},
      {R"("tools": [{"type": "function", "function": {"name": "f g"}}])",
       "tools"},
      {R"("functions": [])", "functions"},
      {R"("audio": {"voice": "x"})", "audio"},
      {R"("modalities": ["text", "audio"])", "modalities"},
      {R"("response_format": {"type": "xml"})", "response_format"},
      {R"("response_format": {"type": "json_schema", "json_schema": {"schema": {}}})",
       "response_format"},
      {R"("guided_regex": "a", "guided_choice": ["a"])", "guided_choice"},
      {R"("response_format": {"type": "json_object"}, "guided_regex": "a")",
       "guided_regex"},
      {R"("guided_choice": [])", "guided_choice"},
  };
  for (const Case& c : cases) {
    ApiError e = Bad(kChat, head + c.field + "}");
    EXPECT_EQ(e.param, c.param) << c.field << ": " << e.message;
    EXPECT_NE(
        e.message.find(c.param == std::string("tools") ? "tool" : c.param),
        std::string::npos)
        << e.message;
  }
  const CompletionRequest grammar = Ok(
      kCmpl,
      R"({"model": "m", "prompt": "x", "guided_grammar": "root ::= \"a\""})");
  EXPECT_EQ(grammar.constraint.kind, Kind::kGrammar);
  EXPECT_EQ(grammar.constraint.text, "root ::= \"a\"");
  // The values that mean "off" are accepted.
  Ok(kChat, head + R"("tool_choice": "none", "modalities": ["text"]})");
}

TEST(StructuredRequestTest, UnknownFieldsAreListedAndCounted) {
  CompletionRequest r = Ok(
      kCmpl,
      R"({"model": "m", "prompt": "hi", "made_up": 1, "top_k": 3, "other": null})");
  EXPECT_EQ(r.unknown_fields, (std::vector<std::string>{"made_up", "other"}));
  // A chat-only field on completions is unknown there.
  EXPECT_EQ(
      Ok(kCmpl, R"({"model": "m", "prompt": "hi", "max_completion_tokens": 3})")
          .unknown_fields,
      (std::vector<std::string>{"max_completion_tokens"}));
  metrics::Registry registry;
  UnknownFieldLog log(registry);
  log.Record(kCmpl, r.unknown_fields);
  log.Record(kChat, {"x"});
  const std::string text = registry.Render();
  EXPECT_NE(
      text.find(
          R"(pdserve_openai_unknown_fields_total{endpoint="/v1/completions"} 2)"),
      std::string::npos)
      << text;
  EXPECT_NE(
      text.find(
          R"(pdserve_openai_unknown_fields_total{endpoint="/v1/chat/completions"} 1)"),
      std::string::npos)
      << text;
}

}  // namespace
}  // namespace pdserve::router::openai
