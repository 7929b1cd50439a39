#include "structured/json_schema.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/json.h"
#include "gtest/gtest.h"
#include "structured/constraint.h"
#include "structured/test_util.h"

namespace pdserve::structured {
namespace {

absl::StatusOr<std::shared_ptr<const Dfa>> Schema(const std::string& text) {
  ConstraintSpec spec;
  spec.kind = ConstraintSpec::Kind::kJsonSchema;
  spec.text = text;
  return CompileConstraint(spec, {});
}

// Schemas of the kinds OpenAI's structured-output examples use, plus the
// extra keywords pdserve supports.
const std::vector<std::string>& Schemas() {
  static const auto* k = new std::vector<std::string>{
      // Nested objects, strict-mode style (everything required).
      R"({"type":"object","properties":{"name":{"type":"string","maxLength":12},
          "age":{"type":"integer","minimum":0,"maximum":150},
          "address":{"type":"object","properties":{"city":{"type":"string","maxLength":8},
            "zip":{"type":"string","pattern":"^[0-9]{5}$"}},
            "required":["city","zip"],"additionalProperties":false}},
          "required":["name","age","address"],"additionalProperties":false})",
      // Arrays with bounds, enums, const, booleans and null.
      R"({"type":"object","properties":{"tags":{"type":"array","items":{"enum":["a","b","c d",1,null]},
            "minItems":1,"maxItems":4},
          "kind":{"const":"event"},"ok":{"type":"boolean"},"none":{"type":"null"},
          "score":{"type":"number"}},
          "required":["tags","kind","ok","none","score"],"additionalProperties":false})",
      // $ref/$defs with recursion, anyOf and optional properties.
      R"({"$defs":{"node":{"type":"object","properties":{"value":{"type":"integer","minimum":-20,"maximum":20},
            "children":{"type":"array","items":{"$ref":"#/$defs/node"},"maxItems":2}},
            "required":["value"],"additionalProperties":false}},
          "anyOf":[{"$ref":"#/$defs/node"},{"type":"string","format":"date"}]})",
      // Optional properties only, patterns with escapes, type lists.
      R"({"type":"object","properties":{"id":{"type":"string","pattern":"^[a-f0-9]{4}-\"q\\\\$"},
          "n":{"type":["integer","null"],"exclusiveMinimum":5,"exclusiveMaximum":10},
          "u":{"type":"string","format":"uuid"},"s":{"type":"string","minLength":2,"maxLength":3}},
          "additionalProperties":false})",
      // A map of bounded strings, an open object and a top-level array.
      R"({"type":"array","items":{"anyOf":[{"type":"object","additionalProperties":{"type":"string","maxLength":3}},
          {"type":"object"}]},"maxItems":3})",
  };
  return *k;
}

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/pdserve_structured_",
                      ::getpid(), "_", name);
}

// Runs the independent validator (python3-jsonschema) over `texts`.
int Validate(const std::string& schema, const std::vector<std::string>& texts) {
  const std::string schema_path = TempPath("schema.json");
  const std::string texts_path = TempPath("texts.jsonl");
  std::ofstream(schema_path) << schema;
  {
    std::ofstream out(texts_path);
    for (const auto& t : texts) out << json::Dump(json::Value(t)) << "\n";
  }
  const std::string cmd = absl::StrCat(PDSERVE_PYTHON, " ", PDSERVE_VALIDATOR,
                                       " ", schema_path, " ", texts_path);
  const int rc = std::system(cmd.c_str());
  std::remove(schema_path.c_str());
  std::remove(texts_path.c_str());
  return rc;
}

TEST(JsonSchemaTest, SampledTextsValidateIndependently) {
  std::mt19937_64 rng(11);
  for (const std::string& schema : Schemas()) {
    auto dfa = Schema(schema);
    ASSERT_TRUE(dfa.ok()) << dfa.status() << "\n" << schema;
    std::vector<std::string> texts;
    for (int i = 0; i < 60; ++i) texts.push_back(DfaSample(**dfa, &rng, 0.5));
    EXPECT_EQ(Validate(schema, texts), 0) << schema;
  }
}

TEST(JsonSchemaTest, ValidatorRejectsWhatTheSchemaForbids) {
  // The check above can fail: texts outside the language are reported.
  const std::string schema = Schemas()[0];
  auto dfa = Schema(schema);
  ASSERT_TRUE(dfa.ok());
  const std::string bad =
      R"({"name":"x","age":151,"address":{"city":"a","zip":"12345"}})";
  EXPECT_FALSE(DfaMatches(**dfa, bad));
  EXPECT_NE(Validate(schema, {bad}), 0);
  const std::string good =
      R"({"name": "x", "age": 150, "address": {"city": "a", "zip": "12345"}})";
  EXPECT_TRUE(DfaMatches(**dfa, good));
  EXPECT_EQ(Validate(schema, {good}), 0);
}

TEST(JsonSchemaTest, IntegerRangesAreExact) {
  auto dfa = Schema(R"({"type":"integer","minimum":-37,"maximum":1204})");
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  for (int v = -60; v <= 1300; ++v) {
    EXPECT_EQ(DfaMatches(**dfa, std::to_string(v)), v >= -37 && v <= 1204) << v;
  }
  EXPECT_FALSE(DfaMatches(**dfa, "007"));
  EXPECT_FALSE(DfaMatches(**dfa, "-0"));
}

TEST(JsonSchemaTest, StringsEscapeAndCountCharacters) {
  auto dfa = Schema(R"({"type":"string","minLength":2,"maxLength":2})");
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  EXPECT_TRUE(DfaMatches(**dfa, R"("ab")"));
  EXPECT_TRUE(DfaMatches(**dfa, R"("\"é")"));  // escapes count as one
  EXPECT_TRUE(DfaMatches(**dfa, "\"\\u0001\\n\""));
  EXPECT_FALSE(DfaMatches(**dfa, R"("a")"));
  EXPECT_FALSE(DfaMatches(**dfa, "\"a\nb\""));  // raw control character
  EXPECT_FALSE(DfaMatches(**dfa, R"("a"b")"));
}

TEST(JsonSchemaTest, BadSchemasAreNamed) {
  struct Case {
    const char* schema;
    const char* message;
  } cases[] = {
      {R"({"type":"object","oneOf":[]})", "unsupported keyword 'oneOf' at #"},
      {R"({"properties":{"a":{"type":"strin"}}})",
       "unknown type 'strin' at #/properties/a"},
      {R"({"$ref":"#/$defs/missing"})",
       "$ref '#/$defs/missing' does not resolve"},
      {R"({"$ref":"http://example.com/s.json"})", "only local"},
      {R"({"type":"string","format":"hostname"})",
       "unsupported format 'hostname'"},
      {R"({"type":"string","pattern":"(a"})", "missing ')'"},
      {R"({"type":"integer","minimum":5,"maximum":4})",
       "integer range is empty"},
      {R"({"type":"object","properties":{},"required":["x"]})",
       "required property 'x'"},
      {R"({"type":"array","minItems":3,"maxItems":2})", "maxItems < minItems"},
      {R"({"type":"number","maximum":3})", "maximum on type number"},
      {R"({"type":)", "not valid JSON"},
      {R"([1,2])", "must be an object or a boolean"},
      {R"({"enum":[]})", "enum must be a non-empty array"},
      {R"({"type":"string","maxLength":100000})", "maxLength above 10000"},
  };
  for (const Case& c : cases) {
    auto dfa = Schema(c.schema);
    ASSERT_FALSE(dfa.ok()) << c.schema;
    EXPECT_EQ(dfa.status().code(), absl::StatusCode::kInvalidArgument)
        << c.schema;
    EXPECT_NE(dfa.status().message().find(c.message), std::string::npos)
        << c.schema << ": " << dfa.status();
  }
  // Deep nesting is refused before parsing.
  std::string deep;
  for (int i = 0; i < 5000; ++i) deep += "{\"items\":";
  EXPECT_EQ(Schema(deep).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(JsonSchemaTest, RecursionIsBounded) {
  // A list that must recurse forever cannot be generated at all.
  auto forever = Schema(
      R"({"$defs":{"l":{"type":"object","properties":{"next":{"$ref":"#/$defs/l"}},
      "required":["next"]}},"$ref":"#/$defs/l"})");
  ASSERT_FALSE(forever.ok());
  EXPECT_NE(forever.status().message().find("can never be generated"),
            std::string::npos)
      << forever.status();
  // Optional recursion is cut at the depth limit but still generates.
  auto tree = Schema(
      R"({"$defs":{"t":{"type":"object","properties":{"kid":{"$ref":"#/$defs/t"}}}},
      "$ref":"#/$defs/t"})");
  ASSERT_TRUE(tree.ok()) << tree.status();
  EXPECT_TRUE(DfaMatches(**tree, R"({"kid":{"kid":{}}})"));
}

TEST(JsonSchemaTest, JsonObjectModeIsAnyObject) {
  ConstraintSpec spec;
  spec.kind = ConstraintSpec::Kind::kJsonObject;
  auto dfa = CompileConstraint(spec, {});
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  EXPECT_TRUE(DfaMatches(**dfa, R"({"a": [1, {"b": null}], "c": "d"})"));
  EXPECT_FALSE(DfaMatches(**dfa, R"([1])"));
  EXPECT_FALSE(DfaMatches(**dfa, R"({"a":})"));
  std::mt19937_64 rng(3);
  std::vector<std::string> texts;
  for (int i = 0; i < 40; ++i) texts.push_back(DfaSample(**dfa, &rng, 0.5));
  EXPECT_EQ(Validate(R"({"type":"object"})", texts), 0);
}

}  // namespace
}  // namespace pdserve::structured
