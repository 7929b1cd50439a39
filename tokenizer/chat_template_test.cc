#include "tokenizer/chat_template.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace pdserve::engine {
namespace {

using ::testing::HasSubstr;

class ChatTemplateTest : public ::testing::Test {
 protected:
  static std::string Render(const ChatTemplate& t,
                            const std::vector<ChatMessage>& m,
                            bool gen = true) {
    auto out = ApplyChatTemplate(t, m, gen);
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? *out : "";
  }
  static ChatTemplate FromJinja(const std::string& jinja) {
    auto t = ChatTemplateFromJinja(jinja);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *t : ChatTemplate{};
  }
  std::string WriteModel(const std::string& name, const std::string& config,
                         const std::string& tokenizer_config) {
    const std::string dir = testing::TempDir() + "/chat_" + name;
    std::filesystem::create_directories(dir);
    if (!config.empty()) std::ofstream(dir + "/config.json") << config;
    if (!tokenizer_config.empty())
      std::ofstream(dir + "/tokenizer_config.json") << tokenizer_config;
    return dir;
  }
};

TEST_F(ChatTemplateTest, Llama3WritesHeadersTrimsContentAndStartsWithBos) {
  ChatTemplate t = FromJinja("{{ '<|start_header_id|>' + message['role'] }}");
  EXPECT_EQ(t.FamilyName(), "llama3");
  EXPECT_EQ(Render(t, {{"system", "Be brief. "}, {"user", "\n hi"}}),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe "
            "brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(Render(t, {{"user", "hi"}}, false),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|"
            "eot_id|>");
}

TEST_F(ChatTemplateTest, Llama31AddsTheKnowledgeDateSystemHeader) {
  ChatTemplate t =
      FromJinja("<|start_header_id|> Cutting Knowledge Date: December 2023");
  EXPECT_EQ(Render(t, {{"system", "S"}, {"user", "U"}}),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
            "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul "
            "2024\n\nS<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST_F(ChatTemplateTest, Qwen25AddsItsDefaultSystemPrompt) {
  ChatTemplate t = FromJinja(
      "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
      "helpful assistant.");
  EXPECT_EQ(
      Render(t, {{"user", "hi"}, {"assistant", "hello"}, {"user", "bye"}}),
      "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
      "helpful "
      "assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>"
      "assistant\nhello"
      "<|im_end|>\n<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n");
}

TEST_F(ChatTemplateTest, Qwen3KeepsReasoningOnlyAfterTheLastQuery) {
  ChatTemplate t = FromJinja("<|im_start|> ... </think>");
  EXPECT_TRUE(t.reasoning);
  EXPECT_TRUE(t.default_system.empty());
  EXPECT_EQ(
      Render(t,
             {{"user", "q1"},
              {"assistant", "<think>\nr1\n</think>\n\na1"},
              {"user", "q2"},
              {"assistant", "<think>r2</think>a2"}},
             false),
      "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
      "<|im_start|>user\nq2<|im_end|>\n"
      "<|im_start|>assistant\n<think>\nr2\n</think>\n\na2<|im_end|>\n");
  t.enable_thinking = false;
  EXPECT_EQ(Render(t, {{"user", "q"}}),
            "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n\n<"
            "/think>\n\n");
}

TEST_F(ChatTemplateTest, ChatMlGroupsToolResponsesIntoOneUserTurn) {
  ChatTemplate t = FromJinja("<|im_start|></think>");
  EXPECT_EQ(Render(t, {{"user", "q"}, {"tool", "A"}, {"tool", "B"}}, false),
            "<|im_start|>user\nq<|im_end|>\n<|im_start|>user\n<tool_response>"
            "\nA\n</tool_response>\n"
            "<tool_response>\nB\n</tool_response><|im_end|>\n");
}

TEST_F(ChatTemplateTest, MistralV3PutsTheSystemPromptIntoTheLastUserTurn) {
  ChatTemplate t = FromJinja(
      "{{ bos_token }}{{ '[INST] ' + message['content'] + '[/INST]' }}");
  EXPECT_EQ(t.FamilyName(), "mistral");
  EXPECT_EQ(Render(t, {{"system", "S"},
                       {"user", "a"},
                       {"assistant", " b "},
                       {"user", "c"}}),
            "<s>[INST] a[/INST] b</s>[INST] S\n\nc[/INST]");
}

TEST_F(ChatTemplateTest, MistralV1SpacingAndRoleChecks) {
  ChatTemplate t =
      FromJinja("{{ '[INST] ' + message['content'] + ' [/INST]' }}");
  EXPECT_TRUE(t.mistral_v1_spacing);
  EXPECT_EQ(Render(t, {{"user", "a"}, {"assistant", "b"}, {"user", "c"}}),
            "<s>[INST] a [/INST]b</s>[INST] c [/INST]");
  EXPECT_THAT(
      std::string(ApplyChatTemplate(t, {{"user", "a"}, {"user", "b"}}, true)
                      .status()
                      .message()),
      HasSubstr("alternating"));
  EXPECT_FALSE(
      ApplyChatTemplate(t, {{"system", "s"}, {"user", "b"}}, true).ok());
}

TEST_F(ChatTemplateTest, UnknownTemplatesAndRolesAreErrors) {
  auto t =
      ChatTemplateFromJinja("{% for m in messages %}<<SYS>>[INST]{% endfor %}");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  const std::string dir =
      WriteModel("unknown", "", R"({"chat_template": "{{ messages }}"})");
  auto from_dir = ChatTemplateForModel(dir);
  EXPECT_EQ(from_dir.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(from_dir.status().message()),
              HasSubstr("not one pdserve implements"));
  ChatTemplate chatml = FromJinja("<|im_start|>");
  EXPECT_THAT(std::string(ApplyChatTemplate(chatml, {{"narrator", "x"}}, true)
                              .status()
                              .message()),
              HasSubstr("role \"narrator\""));
  EXPECT_FALSE(ApplyChatTemplate(chatml, {}, true).ok());
}

TEST_F(ChatTemplateTest, ModelDirectoryFallsBackOnTheArchitecture) {
  auto qwen3 = ChatTemplateForModel(
      WriteModel("qwen3", R"({"architectures": ["Qwen3ForCausalLM"]})", ""));
  ASSERT_TRUE(qwen3.ok()) << qwen3.status();
  EXPECT_TRUE(qwen3->reasoning);
  auto mistral = ChatTemplateForModel(
      WriteModel("mistral", R"({"architectures": ["MistralForCausalLM"]})",
                 R"({"bos_token": "<s>", "eos_token": "</s>"})"));
  ASSERT_TRUE(mistral.ok()) << mistral.status();
  EXPECT_EQ(mistral->FamilyName(), "mistral");
  auto llama = ChatTemplateForModel(
      WriteModel("llama2", R"({"architectures": ["LlamaForCausalLM"]})", ""));
  EXPECT_EQ(llama.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(llama.status().message()),
              HasSubstr("LlamaForCausalLM"));
}

TEST_F(ChatTemplateTest, ParsesMessagesFromJson) {
  auto m = ParseChatMessages(
      R"([{"role": "user", "content": "hi"}, {"role": "assistant"}])");
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->size(), 2u);
  EXPECT_EQ((*m)[0].content, "hi");
  EXPECT_EQ((*m)[1].content, "");
  EXPECT_FALSE(ParseChatMessages(R"({"role": "user"})").ok());
}

json::OrderedValue WeatherTool() {
  return json::OrderedValue::parse(
      R"({"type": "function", "function": {"name": "get_weather",
          "description": "Weather", "parameters": {"type": "object",
          "properties": {"city": {"type": "string"}}}}})");
}

ChatMessage CallTurn(const std::string& id, const std::string& args) {
  ChatMessage m{"assistant", ""};
  m.tool_calls.push_back(ChatToolCall{id, "get_weather", args});
  return m;
}

ChatMessage ToolResult(const std::string& id, const std::string& content) {
  ChatMessage m{"tool", content};
  m.tool_call_id = id;
  return m;
}

TEST_F(ChatTemplateTest, JinjaToJsonWritesPythonsSeparators) {
  const auto v = json::OrderedValue::parse(
      R"({"b": [1, 2.5, {"x": "a\"\n\u0001ü"}], "a": {}, "c": []})");
  EXPECT_EQ(JinjaToJson(v),
            R"({"b": [1, 2.5, {"x": "a\"\n\u0001ü"}], "a": {}, "c": []})");
  EXPECT_EQ(JinjaToJson(v, 2),
            "{\n  \"b\": [\n    1,\n    2.5,\n    {\n      \"x\": "
            "\"a\\\"\\n\\u0001ü\"\n    }\n  ],\n  \"a\": {},\n  \"c\": []\n}");
}

TEST_F(ChatTemplateTest, Llama31ListsToolsInTheFirstUserTurn) {
  ChatTemplate t = FromJinja(
      "<|start_header_id|> Cutting Knowledge Date: December 2023 "
      "Environment: ipython");
  EXPECT_TRUE(t.tools);
  auto out = ApplyChatTemplate(t,
                               {{"system", "S"},
                                {"user", " weather? "},
                                CallTurn("call_1", R"({"city":"Oslo"})"),
                                ToolResult("call_1", "sunny")},
                               true, {WeatherTool()});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(
      *out,
      "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
      "Environment: ipython\nCutting Knowledge Date: December 2023\nToday "
      "Date: 26 Jul 2024\n\nS<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nGiven the following "
      "functions, please respond with a JSON for a function call with its "
      "proper arguments that best answers the given prompt.\n\nRespond in the "
      "format {\"name\": function name, \"parameters\": dictionary of "
      "argument name and its value}.Do not use variables.\n\n"
      "{\n    \"type\": \"function\",\n    \"function\": {\n        "
      "\"name\": \"get_weather\",\n        \"description\": \"Weather\",\n"
      "        \"parameters\": {\n            \"type\": \"object\",\n"
      "            \"properties\": {\n                \"city\": {\n"
      "                    \"type\": \"string\"\n                }\n"
      "            }\n        }\n    }\n}\n\nweather?<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": "
      "\"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}<|eot_id|>"
      "<|start_header_id|>ipython<|end_header_id|>\n\n\"sunny\"<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n");
  ChatMessage two = CallTurn("a", "{}");
  two.tool_calls.push_back(two.tool_calls[0]);
  EXPECT_FALSE(ApplyChatTemplate(t, {{"user", "x"}, two}, true).ok());
}

TEST_F(ChatTemplateTest, MistralToolsCallsAndResults) {
  ChatTemplate t = FromJinja("[INST] [AVAILABLE_TOOLS] [TOOL_CALLS]");
  EXPECT_TRUE(t.tools);
  auto out = ApplyChatTemplate(
      t,
      {{"user", "weather?"},
       CallTurn("call_abcdefghijklmnopqrstuv12345", R"({"city": "Oslo"})"),
       ToolResult("call_abcdefghijklmnopqrstuv12345", "{\"t\": 3}"),
       {"assistant", "Cold. "},
       {"user", "thanks"}},
      true, {WeatherTool()});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out,
            "<s>[INST] weather?[/INST][TOOL_CALLS] [{\"name\": "
            "\"get_weather\", \"arguments\": {\"city\": \"Oslo\"}, \"id\": "
            "\"stuv12345\"}]</s>"
            "[TOOL_RESULTS] {\"content\": {\"t\": 3}, \"call_id\": "
            "\"stuv12345\"}[/TOOL_RESULTS] Cold.</s>"
            "[AVAILABLE_TOOLS] [{\"type\": \"function\", \"function\": "
            "{\"name\": \"get_weather\", \"description\": \"Weather\", "
            "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": "
            "{\"type\": \"string\"}}}}}][/AVAILABLE_TOOLS][INST] "
            "thanks[/INST]");
  // Ids shorter than Mistral's 9 characters cannot be rendered.
  EXPECT_FALSE(
      ApplyChatTemplate(t, {{"user", "x"}, CallTurn("c1", "{}")}, true).ok());
}

TEST_F(ChatTemplateTest, Qwen25ToolsBlockAndCallsOnTheirOwnLines) {
  ChatTemplate t = FromJinja(
      "<|im_start|> <tools> You are Qwen, created by Alibaba Cloud. You are a "
      "helpful assistant.");
  auto out = ApplyChatTemplate(t,
                               {{"user", "w?"},
                                CallTurn("c", R"({"city":"Oslo"})"),
                                ToolResult("c", "sunny")},
                               true, {WeatherTool()});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(*out, HasSubstr("<|im_start|>system\nYou are Qwen, created by "
                              "Alibaba Cloud. You are a helpful assistant."
                              "\n\n# Tools\n\n"));
  EXPECT_THAT(*out, HasSubstr("<tools>\n{\"type\": \"function\", "
                              "\"function\": {\"name\": \"get_weather\""));
  EXPECT_THAT(*out, HasSubstr("<|im_start|>assistant\n<tool_call>\n{\"name\": "
                              "\"get_weather\", \"arguments\": {\"city\": "
                              "\"Oslo\"}}\n</tool_call><|im_end|>\n"
                              "<|im_start|>user\n<tool_response>\nsunny\n"
                              "</tool_response><|im_end|>\n"));
  // A template without a tool format shows no tool list.
  ChatTemplate plain = FromJinja("<|im_start|>");
  EXPECT_FALSE(plain.tools);
  auto no_list =
      ApplyChatTemplate(plain, {{"user", "w?"}}, true, {WeatherTool()});
  ASSERT_TRUE(no_list.ok());
  EXPECT_EQ(*no_list,
            "<|im_start|>user\nw?<|im_end|>\n<|im_start|>assistant\n");
}

TEST_F(ChatTemplateTest, ParsesToolCallsAndResultsFromJson) {
  auto m = ParseChatMessages(
      R"([{"role": "assistant", "tool_calls": [{"id": "c", "function":
          {"name": "f", "arguments": {"b": 1, "a": 2}}}]},
          {"role": "tool", "tool_call_id": "c", "content": "r"}])");
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ((*m)[0].tool_calls.size(), 1u);
  EXPECT_EQ((*m)[0].tool_calls[0].arguments, R"({"b":1,"a":2})");
  EXPECT_EQ((*m)[1].tool_call_id, "c");
}

}  // namespace
}  // namespace pdserve::engine
