#include "structured/dfa.h"

#include <random>
#include <string>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "structured/constraint.h"
#include "structured/regex_parser.h"
#include "structured/test_util.h"

namespace pdserve::structured {
namespace {

absl::StatusOr<std::shared_ptr<const Dfa>> Regex(const std::string& text,
                                                 ConstraintConfig config = {}) {
  ConstraintSpec spec;
  spec.kind = ConstraintSpec::Kind::kRegex;
  spec.text = text;
  return CompileConstraint(spec, config);
}

TEST(RegexTest, MatchesWholeText) {
  auto dfa = Regex("ab+c|d[0-9]{2,3}");
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  EXPECT_TRUE(DfaMatches(**dfa, "abc"));
  EXPECT_TRUE(DfaMatches(**dfa, "abbbc"));
  EXPECT_TRUE(DfaMatches(**dfa, "d12"));
  EXPECT_TRUE(DfaMatches(**dfa, "d123"));
  EXPECT_FALSE(DfaMatches(**dfa, "d1234"));
  EXPECT_FALSE(DfaMatches(**dfa, "ac"));
  EXPECT_FALSE(DfaMatches(**dfa, "xabc"));
  EXPECT_FALSE(DfaMatches(**dfa, ""));
}

TEST(RegexTest, ClassesEscapesAndAnchors) {
  auto dfa = Regex(R"(^[A-Za-z_]\w*\s?=\s?\d+(\.\d+)?;$)");
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  EXPECT_TRUE(DfaMatches(**dfa, "x_1 = 42;"));
  EXPECT_TRUE(DfaMatches(**dfa, "abc=4.25;"));
  EXPECT_FALSE(DfaMatches(**dfa, "1x=4;"));
  EXPECT_FALSE(DfaMatches(**dfa, "x=4.;"));
  auto neg = Regex(R"([^a-c\]]x\.\\)");
  ASSERT_TRUE(neg.ok()) << neg.status();
  EXPECT_TRUE(DfaMatches(**neg, "dx.\\"));
  EXPECT_FALSE(DfaMatches(**neg, "bx.\\"));
  EXPECT_FALSE(DfaMatches(**neg, "]x.\\"));
  EXPECT_FALSE(DfaMatches(**neg, "dxx\\"));
}

TEST(RegexTest, UnicodeIsMatchedAsUtf8) {
  auto dfa = Regex("[α-ω]{2}.é\\u00e8");
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  EXPECT_TRUE(DfaMatches(**dfa, "αβ€éè"));
  EXPECT_TRUE(DfaMatches(**dfa, "ωω😀éè"));
  EXPECT_FALSE(DfaMatches(**dfa, "αβ\xE2\x82éè"));  // a truncated character
  EXPECT_FALSE(DfaMatches(**dfa, "ab€éè"));
  // '.' is one character, not one byte, and never a surrogate encoding.
  auto dot = Regex(".");
  ASSERT_TRUE(dot.ok());
  EXPECT_TRUE(DfaMatches(**dot, "\xF0\x9F\x98\x80"));
  EXPECT_FALSE(DfaMatches(**dot, "\xED\xA0\x80"));
  EXPECT_FALSE(DfaMatches(**dot, "\xC0\xAF"));  // overlong
  EXPECT_FALSE(DfaMatches(**dot, "\n"));
}

TEST(RegexTest, UnsupportedConstructsAreNamed) {
  struct Case {
    const char* regex;
    const char* message;
  } cases[] = {
      {"(a)\\1", "backreferences"},
      {"a(?=b)", "lookaround"},
      {"\\bword", "word boundaries"},
      {"(ab", "missing ')'"},
      {"ab)", "unbalanced ')'"},
      {"*a", "nothing to repeat"},
      {"a{3,2}", "m < n"},
      {"[b-a]", "out of order"},
      {"a++", "possessive"},
      {"\\q", "unknown escape"},
      {"[abc", "missing ']'"},
      {"a{20000}", "above 10000"},
      {"(?i)abc", "inline flags"},
  };
  for (const Case& c : cases) {
    auto dfa = Regex(c.regex);
    ASSERT_FALSE(dfa.ok()) << c.regex;
    EXPECT_EQ(dfa.status().code(), absl::StatusCode::kInvalidArgument)
        << c.regex;
    EXPECT_NE(dfa.status().message().find(c.message), std::string::npos)
        << c.regex << ": " << dfa.status();
  }
}

TEST(RegexTest, EmptyLanguageIsAnError) {
  auto dfa = Regex("[^\\x00-\\u{10FFFF}]");
  ASSERT_FALSE(dfa.ok());
  EXPECT_EQ(dfa.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(dfa.status().message().find("matches no string"),
            std::string::npos);
}

TEST(RegexTest, BlowupsHitTheCapsQuickly) {
  const absl::Time start = absl::Now();
  // The classic exponential DFA: 2^20 subsets.
  auto wide = Regex("(a|b)*a(a|b){20}");
  ASSERT_FALSE(wide.ok());
  EXPECT_EQ(wide.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wide.status().message().find("DFA states"), std::string::npos);
  // Nested counted repetition: 10^12 NFA states if expanded.
  auto deep = Regex("((a{1000}){1000}){1000}");
  ASSERT_FALSE(deep.ok());
  EXPECT_EQ(deep.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // A tiny time budget stops a large but legal build.
  ConstraintConfig tight;
  tight.limits.max_build_time = absl::Microseconds(1);
  tight.limits.max_dfa_states = 1000000;
  auto slow = Regex("(a|b)*a(a|b){14}", tight);
  ASSERT_FALSE(slow.ok());
  EXPECT_EQ(slow.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(slow.status().message().find("exceeded"), std::string::npos);
}

TEST(RegexTest, EveryLiveStateCanStillFinish) {
  // Trimmed: from any state reachable without a dead byte, an accepting
  // state is reachable, so random walks always end.
  auto dfa = Regex("(x[0-9]{3}|y(ab)*c)z");
  ASSERT_TRUE(dfa.ok());
  std::mt19937_64 rng(7);
  for (int i = 0; i < 200; ++i) {
    const std::string s = DfaSample(**dfa, &rng);
    EXPECT_TRUE(DfaMatches(**dfa, s)) << s;
  }
}

TEST(ChoiceTest, ExactlyOneOfTheStrings) {
  ConstraintSpec spec;
  spec.kind = ConstraintSpec::Kind::kChoice;
  spec.choices = {"yes", "no", "maybe", "no way"};
  auto dfa = CompileConstraint(spec, {});
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  for (const auto& c : spec.choices) EXPECT_TRUE(DfaMatches(**dfa, c));
  EXPECT_FALSE(DfaMatches(**dfa, "ye"));
  EXPECT_FALSE(DfaMatches(**dfa, "no w"));
  spec.choices.clear();
  EXPECT_EQ(CompileConstraint(spec, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ConstraintCacheTest, CompilesOncePerText) {
  ConstraintCache cache({}, 2);
  ConstraintSpec a = ConstraintSpec::Regex("a+");
  ConstraintSpec b = ConstraintSpec::Regex("b+");
  ConstraintSpec c = ConstraintSpec::Regex("c+");
  auto a1 = cache.Get(a);
  auto a2 = cache.Get(a);
  ASSERT_TRUE(a1.ok() && a2.ok());
  EXPECT_EQ(a1->get(), a2->get());
  ASSERT_TRUE(cache.Get(b).ok());
  ASSERT_TRUE(cache.Get(c).ok());  // evicts a, the least recently used
  EXPECT_EQ(cache.size(), 2u);
  auto a3 = cache.Get(a);
  ASSERT_TRUE(a3.ok());
  EXPECT_NE(a1->get(), a3->get());
  // The same text under another kind is another constraint.
  ConstraintSpec choice = ConstraintSpec::Choice({"a+"});
  EXPECT_NE(choice.Key(), a.Key());
  EXPECT_FALSE(cache.Get(ConstraintSpec::Regex("(a")).ok());
}

}  // namespace
}  // namespace pdserve::structured
