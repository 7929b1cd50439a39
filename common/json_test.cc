#include "common/json.h"

#include <gtest/gtest.h>

namespace pdserve::json {
namespace {

TEST(JsonTest, ParsesObjectsAndReadsTypedFields) {
  auto v = Parse(R"({"a": 3, "b": 2.5, "c": true, "d": "x", "e": null})", "t");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*GetInt(*v, "a", "t"), 3);
  EXPECT_DOUBLE_EQ(*GetDouble(*v, "b", "t"), 2.5);
  EXPECT_TRUE(*GetBool(*v, "c", "t"));
  EXPECT_EQ(*GetString(*v, "d", "t"), "x");
  EXPECT_EQ(*GetInt(*v, "e", "t", 7), 7);  // null counts as absent
  EXPECT_EQ(*GetInt(*v, "zz", "t", 9), 9);
}

TEST(JsonTest, RejectsMalformedAndMistypedInputWithNamedSource) {
  auto bad = Parse("{\"a\": ", "config.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("config.json"), std::string::npos);
  auto v = Parse(R"({"a": 2.5, "s": "x", "big": 1e30})", "t");
  ASSERT_TRUE(v.ok());
  EXPECT_FALSE(GetInt(*v, "a", "t").ok());
  EXPECT_FALSE(GetInt(*v, "s", "t").ok());
  EXPECT_FALSE(GetInt(*v, "big", "t").ok());
  EXPECT_EQ(GetInt(*v, "missing", "t").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_FALSE(GetInt(*v, "a", "t", std::nullopt, 0, 1).ok());
}

TEST(JsonTest, QuotesControlCharactersAndWritesFiniteNumbers) {
  EXPECT_EQ(Quote("a\"b\\\n\x01"), "\"a\\\"b\\\\\\n\\u0001\"");
  EXPECT_EQ(Number(1.5), "1.5");
  EXPECT_EQ(Number(1.0 / 0.0), "null");
  float xs[] = {1.0f, -2.0f};
  EXPECT_EQ(FloatArray(xs, 2), "[1,-2]");
}

}  // namespace
}  // namespace pdserve::json
