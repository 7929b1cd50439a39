#include "common/json.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

namespace pdserve::json {
namespace {

using ::testing::HasSubstr;

TEST(JsonTest, ParsesObjectsAndReadsTypedFields) {
  auto v = Parse(R"({"a": 3, "b": 2.5, "c": true, "d": "x", "e": null})", "t");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*GetInt(*v, "a", "t"), 3);
  EXPECT_DOUBLE_EQ(*GetDouble(*v, "b", "t"), 2.5);
  EXPECT_DOUBLE_EQ(*GetDouble(*v, "a", "t"), 3.0);  // integers are numbers
  EXPECT_TRUE(*GetBool(*v, "c", "t"));
  EXPECT_EQ(*GetString(*v, "d", "t"), "x");
  EXPECT_EQ(*GetInt(*v, "e", "t", 7), 7);  // null counts as absent
  EXPECT_EQ(*GetInt(*v, "zz", "t", 9), 9);
  EXPECT_EQ(Find(*v, "e"), nullptr);
  EXPECT_EQ(Find(Value::array(), "a"), nullptr);  // not an object
}

TEST(JsonTest, RejectsMalformedAndMistypedInputWithNamedSource) {
  auto bad = Parse("{\"a\": ", "config.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("config.json: invalid JSON"));
  for (const char* text : {"", "[1,]", "{\"a\" 1}", "\"\xff\"", "nul", "1 2",
                           "{\"a\": 1}}", "[\"\\ud800\"]"}) {
    EXPECT_FALSE(Parse(text, "t").ok()) << text;
  }
  auto v = Parse(R"({"a": 2.5, "s": "x", "big": 1e30, "b": true})", "t");
  ASSERT_TRUE(v.ok());
  EXPECT_FALSE(GetInt(*v, "a", "t").ok());
  EXPECT_FALSE(GetInt(*v, "s", "t").ok());
  EXPECT_FALSE(GetInt(*v, "big", "t").ok());
  EXPECT_FALSE(GetString(*v, "a", "t").ok());
  EXPECT_FALSE(GetBool(*v, "s", "t").ok());
  EXPECT_FALSE(GetDouble(*v, "b", "t").ok());
  EXPECT_EQ(GetInt(*v, "missing", "t").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_FALSE(GetInt(*v, "a", "t", std::nullopt, 0, 1).ok());
}

TEST(JsonTest, IntegersAreExactOverTheirWholeRange) {
  auto v = Parse(
      R"({"max": 9223372036854775807, "min": -9223372036854775808,
          "u": 18446744073709551615, "whole": 3.0, "odd": 9007199254740993})",
      "t");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*GetInt(*v, "max", "t", std::nullopt, INT64_MIN, INT64_MAX),
            INT64_MAX);
  EXPECT_EQ(*GetInt(*v, "min", "t", std::nullopt, INT64_MIN, INT64_MAX),
            INT64_MIN);
  // 2^53 + 1 is not representable as a double; it must survive as written.
  EXPECT_EQ(*GetInt(*v, "odd", "t"), 9007199254740993);
  EXPECT_FALSE(GetInt(*v, "u", "t", std::nullopt, INT64_MIN, INT64_MAX).ok());
  EXPECT_FALSE(GetInt(*v, "max", "t").ok());  // default max is INT64_MAX / 2
  EXPECT_EQ(*GetInt(*v, "whole", "t"), 3);
  auto negative = AsInt(Value(-1), "t", 0, 10);
  EXPECT_FALSE(negative.ok());
  EXPECT_THAT(negative.status().message(), HasSubstr("got -1"));
}

TEST(JsonTest, DeepNestingIsAnErrorNotACrash) {
  const std::string deep(100000, '[');
  EXPECT_FALSE(Parse(deep + std::string(100000, ']'), "t").ok());
  std::string ok_depth(kMaxDepth, '[');
  ok_depth += std::string(kMaxDepth, ']');
  EXPECT_TRUE(Parse(ok_depth, "t").ok());
  // Brackets inside strings do not nest.
  EXPECT_TRUE(Parse("[\"" + deep + "\\\"\"]", "t").ok());
}

TEST(JsonTest, StreamedContainersGoToTheirSinksNotTheDocument) {
  std::vector<std::pair<std::string, std::string>> vocab;
  std::vector<std::string> merges;
  const std::vector<StreamedContainer> streamed = {
      {{"model", "vocab"},
       [&](std::string&& key, Value&& v) {
         vocab.emplace_back(key, Dump(v));
         return absl::OkStatus();
       }},
      {{"model", "merges"}, [&](std::string&& key, Value&& v) {
         EXPECT_EQ(key, "");
         merges.push_back(Dump(v));
         return absl::OkStatus();
       }}};
  auto v = Parse(R"({"vocab": {"top": 1},
                     "model": {"type": "BPE", "vocab": {"a": 0, "b": {"x": [1]}},
                               "merges": ["a b", ["a", "b"], {"k": 2}],
                               "other": [{"vocab": {"c": 1}}]}})",
                 "t", streamed);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(vocab, (std::vector<std::pair<std::string, std::string>>{
                       {"a", "0"}, {"b", R"({"x": [1]})"}}));
  EXPECT_EQ(merges, (std::vector<std::string>{R"("a b")", R"(["a", "b"])",
                                              R"({"k": 2})"}));
  // Empty containers stay in their place; everything else is stored.
  EXPECT_EQ(Dump(*v),
            R"({"model": {"merges": [], "other": [{"vocab": {"c": 1}}], )"
            R"("type": "BPE", "vocab": {}}, "vocab": {"top": 1}})");

  // A scalar at a streamed path is stored as usual; a sink's error ends the
  // parse.
  auto scalar = Parse(R"({"model": {"vocab": 3}})", "t", streamed);
  ASSERT_TRUE(scalar.ok());
  EXPECT_EQ(*GetInt(*Find(*scalar, "model"), "vocab", "t"), 3);
  const std::vector<StreamedContainer> failing = {
      {{"list"}, [](std::string&&, Value&&) {
         return absl::InvalidArgumentError("bad member");
       }}};
  auto failed = Parse(R"({"list": [1, 2]})", "t", failing);
  EXPECT_EQ(failed.status().message(), "bad member");
  EXPECT_FALSE(Parse(R"({"list": [1, )", "t", {}).ok());
}

TEST(JsonTest, DumpsOneLineWithPythonSeparators) {
  OrderedValue v = {{"ids", {1, 2}}, {"text", "a\"b\n"}, {"f", 1.5}};
  v["nan"] = std::nan("");
  v["empty"] = Value::object();
  EXPECT_EQ(Dump(v),
            R"({"ids": [1, 2], "text": "a\"b\n", "f": 1.5, "nan": null, )"
            R"("empty": {}})");
  EXPECT_EQ(Dump(OrderedValue{{"ids", {1, 2}}}, ArraySpacing::kCompact),
            R"({"ids": [1,2]})");
  // Sorted keys for Value; invalid UTF-8 becomes U+FFFD instead of throwing.
  Value sorted = {{"b", "\xff"}, {"a", true}};
  EXPECT_EQ(Dump(sorted), "{\"a\": true, \"b\": \"\xEF\xBF\xBD\"}");
  EXPECT_EQ(DumpLines(OrderedValue{{"b", {1, 2}}, {"a", {{"x", 1}}}}),
            "{\n  \"b\": [1, 2],\n  \"a\": {\"x\": 1}\n}");
  EXPECT_EQ(DumpLines(Value::object()), "{}");
  auto round_trip = Parse(Dump(v), "t");
  ASSERT_TRUE(round_trip.ok());
  EXPECT_EQ(*GetString(*round_trip, "text", "t"), "a\"b\n");
}

TEST(JsonTest, QuotesControlCharacters) {
  EXPECT_EQ(Quote("a\"b\\\n\x01"), "\"a\\\"b\\\\\\n\\u0001\"");
}

}  // namespace
}  // namespace pdserve::json
