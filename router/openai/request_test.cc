#include "router/openai/request.h"

#include <gtest/gtest.h>

namespace pdserve::router::openai {
namespace {

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

TEST(OpenAiRequestTest, CompletionDefaultsAreOpenAis) {
  CompletionRequest r = Ok(kCmpl, R"({"model": "m", "prompt": "hi"})");
  EXPECT_EQ(r.model, "m");
  EXPECT_EQ(std::get<std::string>(r.prompt), "hi");
  EXPECT_EQ(r.max_tokens, 16u);
  EXPECT_FLOAT_EQ(r.temperature, 1.0f);
  EXPECT_FALSE(r.seed.has_value());
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.logprobs.has_value());
}

TEST(OpenAiRequestTest, AllSamplingFieldsMapAcross) {
  CompletionRequest r = Ok(kCmpl, R"({"model": "m", "prompt": [1, 2, 3],
      "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 4,
      "seed": 18446744073709551615, "stop": ["a", "bc"], "ignore_eos": true,
      "cache_salt": "s", "stream": true,
      "stream_options": {"include_usage": true}, "logprobs": 3, "n": 1})");
  EXPECT_EQ(std::get<std::vector<uint32_t>>(r.prompt),
            (std::vector<uint32_t>{1, 2, 3}));
  EXPECT_EQ(r.max_tokens, 7u);
  EXPECT_FLOAT_EQ(r.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.top_p, 0.9f);
  EXPECT_EQ(r.top_k, 4u);
  EXPECT_EQ(*r.seed, UINT64_MAX);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"a", "bc"}));
  EXPECT_TRUE(r.ignore_eos);
  EXPECT_EQ(r.cache_salt, "s");
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(*r.logprobs, 3);
}

TEST(OpenAiRequestTest, SinglePromptInAnArrayIsAccepted) {
  EXPECT_EQ(std::get<std::string>(
                Ok(kCmpl, R"({"model": "m", "prompt": ["x"]})").prompt),
            "x");
  EXPECT_EQ(std::get<std::vector<uint32_t>>(
                Ok(kCmpl, R"({"model": "m", "prompt": [[5, 6]]})").prompt),
            (std::vector<uint32_t>{5, 6}));
  EXPECT_EQ(Bad(kCmpl, R"({"model": "m", "prompt": ["x", "y"]})").param,
            "prompt");
}

TEST(OpenAiRequestTest, ChatMessagesAndMaxCompletionTokens) {
  CompletionRequest r = Ok(kChat, R"({"model": "m", "messages": [
      {"role": "system", "content": "be brief"},
      {"role": "user", "content": [{"type": "text", "text": "hi"},
                                   {"type": "text", "text": "!"}]}],
      "max_tokens": 3, "max_completion_tokens": 9,
      "logprobs": true, "top_logprobs": 2})");
  ASSERT_EQ(r.messages.size(), 2u);
  EXPECT_EQ(r.messages[1].role, "user");
  EXPECT_EQ(r.messages[1].content, "hi!");
  EXPECT_EQ(r.max_tokens, 9u);
  EXPECT_EQ(*r.logprobs, 2);
  EXPECT_EQ(Ok(kChat, R"({"model": "m", "messages": [{"role": "user",
      "content": "x"}]})")
                .max_tokens,
            kDefaultChatMaxTokens);
}

TEST(OpenAiRequestTest, BadValuesNameTheirField) {
  struct Case {
    const char* body;
    const char* param;
  } cases[] = {
      {R"({"model": "m", "prompt": "x", "n": 2})", "n"},
      {R"({"model": "m", "prompt": "x", "max_tokens": 0})", "max_tokens"},
      {R"({"model": "m", "prompt": "x", "max_tokens": 1.5})", "max_tokens"},
      {R"({"model": "m", "prompt": "x", "temperature": -1})", "temperature"},
      {R"({"model": "m", "prompt": "x", "temperature": "hot"})", "temperature"},
      {R"({"model": "m", "prompt": "x", "top_p": 0})", "top_p"},
      {R"({"model": "m", "prompt": "x", "stop": [1]})", "stop"},
      {R"({"model": "m", "prompt": "x", "logprobs": 6})", "logprobs"},
      {R"({"model": "m", "prompt": "x", "echo": true})", "echo"},
      {R"({"model": "m", "prompt": "x", "presence_penalty": 1})",
       "presence_penalty"},
      {R"({"model": "m", "prompt": "x", "stream_options": {}})",
       "stream_options"},
      {R"({"model": "m", "prompt": [-1]})", "prompt"},
      {R"({"model": "m", "prompt": []})", "prompt"},
      {R"({"model": "m"})", "prompt"},
      {R"({"prompt": "x"})", "model"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(Bad(kCmpl, c.body).param, c.param) << c.body;
  }
  EXPECT_EQ(Bad(kChat, R"({"model": "m", "messages": []})").param, "messages");
  EXPECT_EQ(Bad(kChat, R"({"model": "m", "messages": [{"role": "wizard",
      "content": "x"}]})")
                .param,
            "messages");
  EXPECT_EQ(Bad(kChat, R"({"model": "m", "messages": [{"role": "user",
      "content": "x"}], "top_logprobs": 2})")
                .param,
            "top_logprobs");
}

TEST(OpenAiRequestTest, MalformedJsonIsAnErrorNotACrash) {
  for (const char* body : {"", "{", "[]", "null", "{\"model\": }", "\xff\xfe",
                           "{\"model\": \"m\", \"prompt\": \"\\ud800\"}"}) {
    auto r = ParseCompletionRequest(kCmpl, body);
    if (const auto* err = std::get_if<ApiError>(&r)) {
      EXPECT_FALSE(err->message.empty());
    }
  }
  std::string deep(10000, '[');
  EXPECT_TRUE(
      std::holds_alternative<ApiError>(ParseCompletionRequest(kCmpl, deep)));
}

}  // namespace
}  // namespace pdserve::router::openai
