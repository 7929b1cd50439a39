#include "router/openai/tool_calls.h"

#include <gtest/gtest.h>

#include "common/json.h"
#include "router/openai/request.h"

namespace pdserve::router::openai {
namespace {

using Family = engine::ChatTemplate::Family;

CompletionRequest Request(ToolChoice choice, const std::string& named = "") {
  CompletionRequest r;
  r.endpoint = Endpoint::kChatCompletions;
  for (const char* name : {"get_weather", "get_time"}) {
    FunctionTool t;
    t.name = name;
    r.tools.push_back(t);
  }
  r.tool_choice = choice;
  r.tool_choice_name = named;
  return r;
}

struct Outcome {
  std::vector<ToolCallDelta> deltas;
  bool tool_calls = false;
  ToolCallAnswer answer;
};

// Feeds `pieces` one by one, then ends the output.
Outcome Feed(const CompletionRequest& r, Family family,
             const std::vector<std::string>& pieces, bool complete = true) {
  ToolCallStream s(r, family, 7);
  Outcome run;
  for (const std::string& p : pieces) {
    for (ToolCallDelta& d : s.Push(p)) run.deltas.push_back(std::move(d));
  }
  for (ToolCallDelta& d : s.Finish(complete, &run.tool_calls))
    run.deltas.push_back(std::move(d));
  run.answer = AssembleToolCalls(run.deltas);
  return run;
}

// Every split of `text` into single bytes, and the text whole.
std::vector<std::string> Bytes(const std::string& text) {
  std::vector<std::string> out;
  for (char c : text) out.push_back(std::string(1, c));
  return out;
}

TEST(ToolCallStreamTest, NamedStreamsArgumentsAsTheyCome) {
  CompletionRequest r = Request(ToolChoice::kNamed, "get_time");
  Outcome run = Feed(r, Family::kChatMl, {"{\"zone\"", ": \"UTC\"}"});
  ASSERT_TRUE(run.tool_calls);
  ASSERT_EQ(run.deltas.size(), 3u);
  // The first delta names the call; then each piece is a fragment at once.
  EXPECT_EQ(run.deltas[0].index, 0);
  EXPECT_EQ(run.deltas[0].name, "get_time");
  EXPECT_EQ(run.deltas[0].id.rfind("call_", 0), 0u);
  EXPECT_EQ(run.deltas[0].id.size(), 29u);
  EXPECT_EQ(run.deltas[1].arguments, "{\"zone\"");
  EXPECT_EQ(run.deltas[2].arguments, ": \"UTC\"}");
  ASSERT_EQ(run.answer.calls.size(), 1u);
  EXPECT_EQ(run.answer.calls[0].arguments, "{\"zone\": \"UTC\"}");
  EXPECT_TRUE(run.answer.content.empty());
}

TEST(ToolCallStreamTest, NamedCutShortIsNoToolCall) {
  Outcome run = Feed(Request(ToolChoice::kNamed, "get_time"), Family::kChatMl,
                     {"{\"zone\": \"U"}, /*complete=*/false);
  EXPECT_FALSE(run.tool_calls);
}

TEST(ToolCallStreamTest, RequiredStreamedByteByByteEqualsWhole) {
  const std::string text =
      R"([{"name": "get_weather", "arguments": {"city": "Par\"is", "n": [1, {"a": "]"}]}}, {"name":"get_time","arguments":{}}])";
  CompletionRequest r = Request(ToolChoice::kRequired);
  Outcome whole = Feed(r, Family::kChatMl, {text});
  Outcome bytes = Feed(r, Family::kChatMl, Bytes(text));
  ASSERT_TRUE(whole.tool_calls);
  ASSERT_TRUE(bytes.tool_calls);
  ASSERT_EQ(whole.answer.calls.size(), 2u);
  EXPECT_EQ(whole.answer.calls[0].name, "get_weather");
  EXPECT_EQ(whole.answer.calls[0].arguments,
            R"({"city": "Par\"is", "n": [1, {"a": "]"}]})");
  EXPECT_EQ(whole.answer.calls[1].name, "get_time");
  EXPECT_EQ(whole.answer.calls[1].arguments, "{}");
  ASSERT_EQ(bytes.answer.calls.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(bytes.answer.calls[i].name, whole.answer.calls[i].name);
    EXPECT_EQ(bytes.answer.calls[i].arguments, whole.answer.calls[i].arguments);
  }
  // Byte by byte, the name goes out once its string closes, and then every
  // argument byte in the push that brought it: nothing attributable waits.
  size_t name_at = 0, pushed = 0;
  for (const ToolCallDelta& d : bytes.deltas) {
    if (!d.id.empty() && d.name == "get_weather") break;
    ++name_at;
  }
  ASSERT_LT(name_at, bytes.deltas.size());
  for (const ToolCallDelta& d : bytes.deltas) pushed += d.arguments.size();
  EXPECT_EQ(pushed, whole.answer.calls[0].arguments.size() + 2);
  EXPECT_EQ(bytes.deltas[name_at + 1].arguments, "{");
  EXPECT_EQ(bytes.deltas[name_at + 1].index, 0);
}

TEST(ToolCallStreamTest, RequiredRejectsUnknownNamesAndCutOutput) {
  CompletionRequest r = Request(ToolChoice::kRequired);
  EXPECT_FALSE(
      Feed(r, Family::kChatMl, {R"([{"name": "rm_rf", "arguments": {}}])"})
          .tool_calls);
  Outcome cut = Feed(r, Family::kChatMl,
                     {R"([{"name": "get_time", "arguments": {"zone": )"},
                     /*complete=*/false);
  EXPECT_FALSE(cut.tool_calls);
  EXPECT_FALSE(
      Feed(r, Family::kChatMl, {R"([{"name": "get_time", "arguments": {}})"})
          .tool_calls);
}

TEST(ToolCallStreamTest, AutoHermesParsesCallsAndStreamsContentBefore) {
  CompletionRequest r = Request(ToolChoice::kAuto);
  const std::string text =
      "Let me check.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
      "{\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": "
      "\"get_time\", \"arguments\": {}}\n</tool_call>";
  for (const auto& pieces : {std::vector<std::string>{text}, Bytes(text)}) {
    Outcome run = Feed(r, Family::kChatMl, pieces);
    ASSERT_TRUE(run.tool_calls);
    EXPECT_EQ(run.answer.content, "Let me check.");
    ASSERT_EQ(run.answer.calls.size(), 2u);
    EXPECT_EQ(run.answer.calls[0].name, "get_weather");
    EXPECT_EQ(run.answer.calls[0].arguments, R"({"city":"Oslo"})");
    EXPECT_EQ(run.answer.calls[1].arguments, "{}");
    // No part of the marker went out as content.
    for (const ToolCallDelta& d : run.deltas)
      EXPECT_EQ(d.content.find('<'), std::string::npos) << d.content;
  }
}

TEST(ToolCallStreamTest, AutoPlainTextAndBadCallsAreContent) {
  CompletionRequest r = Request(ToolChoice::kAuto);
  for (const std::string& text :
       {std::string("Just text, a < b."),
        std::string("<tool_call>{\"name\": \"nope\", \"arguments\": {}}"),
        std::string("<tool_call>{\"name\": \"get_time\", \"arguments\": 3}"),
        std::string("<tool_call>{not json</tool_call>")}) {
    Outcome run = Feed(r, Family::kChatMl, Bytes(text));
    EXPECT_FALSE(run.tool_calls) << text;
    EXPECT_EQ(run.answer.content, text);
    EXPECT_TRUE(run.answer.calls.empty());
  }
  // A call cut short by max_tokens stays text.
  Outcome cut = Feed(r, Family::kChatMl,
                     {"<tool_call>{\"name\": \"get_time\", \"arguments\": {}}"},
                     /*complete=*/false);
  EXPECT_FALSE(cut.tool_calls);
}

TEST(ToolCallStreamTest, AutoLlamaAndMistralFormats) {
  CompletionRequest r = Request(ToolChoice::kAuto);
  Outcome llama =
      Feed(r, Family::kLlama3,
           Bytes(" {\"name\": \"get_time\", \"parameters\": {\"zone\": "
                 "\"CET\"}}; {\"name\": \"get_weather\", "
                 "\"parameters\": {}}"));
  ASSERT_TRUE(llama.tool_calls);
  ASSERT_EQ(llama.answer.calls.size(), 2u);
  EXPECT_EQ(llama.answer.calls[0].arguments, R"({"zone":"CET"})");
  EXPECT_EQ(llama.answer.calls[1].name, "get_weather");
  Outcome llama_text = Feed(r, Family::kLlama3, Bytes("Hello {there}"));
  EXPECT_FALSE(llama_text.tool_calls);
  EXPECT_EQ(llama_text.answer.content, "Hello {there}");
  // Plain text that does not start like a call streams at once.
  ToolCallStream s(r, Family::kLlama3, 1);
  EXPECT_EQ(s.Push("Hi").size(), 1u);

  Outcome mistral =
      Feed(r, Family::kMistral,
           {"[TOOL_CALLS] [{\"name\": \"get_time\", \"arguments\": "
            "{\"zone\": \"UTC\"}}]"});
  ASSERT_TRUE(mistral.tool_calls);
  EXPECT_EQ(mistral.answer.calls[0].name, "get_time");
  Outcome mistral_bare = Feed(
      r, Family::kMistral,
      Bytes("[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"X\"}}]"));
  ASSERT_TRUE(mistral_bare.tool_calls);
  EXPECT_EQ(mistral_bare.answer.calls[0].arguments, R"({"city":"X"})");
  EXPECT_FALSE(Feed(r, Family::kMistral, {"[1, 2]"}).tool_calls);
}

TEST(ToolCallStreamTest, WithoutToolsOrWithNoneEverythingIsContent) {
  CompletionRequest none = Request(ToolChoice::kNone);
  ToolCallStream s(none, Family::kChatMl, 1);
  EXPECT_FALSE(s.active());
  Outcome run = Feed(none, Family::kChatMl, {"<tool_call>{}</tool_call>"});
  EXPECT_FALSE(run.tool_calls);
  EXPECT_EQ(run.answer.content, "<tool_call>{}</tool_call>");
}

}  // namespace
}  // namespace pdserve::router::openai
