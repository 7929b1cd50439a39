#include "structured/grammar.h"

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "structured/constraint.h"
#include "structured/regex_parser.h"
#include "structured/test_util.h"
#include "structured/token_guide.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::structured {
namespace {

absl::StatusOr<std::shared_ptr<const Dfa>> Grammar(
    const std::string& text, ConstraintConfig config = {}) {
  return CompileConstraint(ConstraintSpec::Grammar(text), config);
}

constexpr char kArithmetic[] = R"g(# integer arithmetic
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
)g";

// An independent recursive-descent recogniser of kArithmetic's language:
// returns the deepest parenthesis nesting, or -1 when `s` is not in it.
class ArithmeticRecogniser {
 public:
  explicit ArithmeticRecogniser(const std::string& s) : s_(s) {}
  int Depth() {
    const int d = Expr(0);
    return d >= 0 && pos_ == s_.size() ? d : -1;
  }

 private:
  int Expr(int level) {
    int d = Term(level);
    while (d >= 0 && pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) {
      ++pos_;
      const int e = Term(level);
      d = e < 0 ? -1 : std::max(d, e);
    }
    return d;
  }
  int Term(int level) {
    int d = Factor(level);
    while (d >= 0 && pos_ < s_.size() && (s_[pos_] == '*' || s_[pos_] == '/')) {
      ++pos_;
      const int e = Factor(level);
      d = e < 0 ? -1 : std::max(d, e);
    }
    return d;
  }
  int Factor(int level) {
    if (pos_ < s_.size() && s_[pos_] == '(') {
      ++pos_;
      const int d = Expr(level + 1);
      if (d < 0 || pos_ >= s_.size() || s_[pos_] != ')') return -1;
      ++pos_;
      return std::max(d, level + 1);
    }
    const size_t start = pos_;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    return pos_ > start ? level : -1;
  }
  const std::string& s_;
  size_t pos_ = 0;
};

int ArithmeticDepth(const std::string& s) {
  return ArithmeticRecogniser(s).Depth();
}

TEST(GrammarTest, ArithmeticMembership) {
  auto dfa = Grammar(kArithmetic);
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  for (const char* in : {"1", "12+3", "2*(3+4)", "((1))-2/3", "1*2*3+4-5"}) {
    EXPECT_TRUE(DfaMatches(**dfa, in)) << in;
  }
  for (const char* out : {"", "+", "1+", "(1", "1)", "()", "1 + 2", "a"}) {
    EXPECT_FALSE(DfaMatches(**dfa, out)) << out;
  }
}

TEST(GrammarTest, RecursionIsBoundedByMaxRecursion) {
  auto nested = [](int depth) {
    return std::string(depth, '(') + "1" + std::string(depth, ')');
  };
  for (int bound : {0, 2, 6}) {
    ConstraintConfig config;
    config.grammar.max_recursion = bound;
    auto dfa = Grammar(kArithmetic, config);
    ASSERT_TRUE(dfa.ok()) << dfa.status();
    EXPECT_TRUE(DfaMatches(**dfa, nested(bound))) << bound;
    EXPECT_FALSE(DfaMatches(**dfa, nested(bound + 1))) << bound;
    EXPECT_TRUE(DfaMatches(**dfa, nested(bound) + "+" + nested(bound)));
  }
}

TEST(GrammarTest, SampledStringsParseWithAnIndependentRecogniser) {
  auto dfa = Grammar(kArithmetic);
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  std::mt19937_64 rng(7);
  int deepest = 0;
  for (int i = 0; i < 500; ++i) {
    const std::string s = DfaSample(**dfa, &rng, 0.05);
    const int depth = ArithmeticDepth(s);
    ASSERT_GE(depth, 0) << s;
    EXPECT_LE(depth, 6) << s;
    deepest = std::max(deepest, depth);
  }
  EXPECT_GE(deepest, 2);  // the walks do nest
}

// A small JSON-like grammar: objects, arrays, strings, integers.
constexpr char kJsonish[] = R"g(
root   ::= value
value  ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ( pair ( "," pair )* )? "}"
pair   ::= string ":" value
array  ::= "[" ( value ( "," value )* )? "]"
string ::= "\"" [a-z]{0,8} "\""
number ::= "-"? ( "0" | [1-9] [0-9]{0,5} )
)g";

TEST(GrammarTest, JsonishGrammarCompilesAtDefaultDepth) {
  auto dfa = Grammar(kJsonish);
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  for (const char* in : {R"({"a":[1,2,{"b":null}],"c":"x"})", "[]", "{}", "-12",
                         R"([[[[[["deep"]]]]]])"}) {
    EXPECT_TRUE(DfaMatches(**dfa, in)) << in;
  }
  for (const char* out : {R"({"a"})", "[1,]", "01", R"({"A":1})",
                          R"([[[[[[["too deep"]]]]]]])"}) {
    EXPECT_FALSE(DfaMatches(**dfa, out)) << out;
  }
}

TEST(GrammarTest, LeftRecursionWithABaseIsExpandedToTheBound) {
  ConstraintConfig config;
  config.grammar.max_recursion = 3;
  auto dfa = Grammar(
      "root ::= list\nlist ::= list \",\" item | item\n"
      "item ::= [a-c]",
      config);
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  EXPECT_TRUE(DfaMatches(**dfa, "a"));
  EXPECT_TRUE(DfaMatches(**dfa, "a,b,c,a"));
  EXPECT_FALSE(DfaMatches(**dfa, "a,b,c,a,b"));
  EXPECT_FALSE(DfaMatches(**dfa, "a,"));
}

TEST(GrammarTest, SyntaxEscapesClassesAndQuantifiers) {
  auto dfa = Grammar(
      "root ::= \"\\x41\\u00e9\\t\" [^a-y\\]] . [α-ω]{2,3} \"z\"? "
      "(\"-\" | \"\\\\\"){1,} \"q\"{2}  # comment \"not code\"\n");
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  EXPECT_TRUE(DfaMatches(**dfa, "Aé\tz😀αβ-qq"));
  EXPECT_TRUE(DfaMatches(**dfa, "Aé\t{xαβγz\\-\\qq"));
  EXPECT_FALSE(DfaMatches(**dfa, "Aé\tb😀αβ-qq"));   // b is excluded
  EXPECT_FALSE(DfaMatches(**dfa, "Aé\t]😀αβ-qq"));   // so is ]
  EXPECT_FALSE(DfaMatches(**dfa, "Aé\tz😀α-qq"));    // one Greek letter
  EXPECT_FALSE(DfaMatches(**dfa, "Aé\tz😀αβqq"));    // no - or backslash
  EXPECT_FALSE(DfaMatches(**dfa, "Aé\tz😀αβ-qqq"));  // three q
}

TEST(GrammarTest, RulesMaySpanLinesAndGroupsNest) {
  auto dfa = Grammar(R"g(root ::= (
    "a" |
    "b" ( "c"
        | "d" )
  ) tail
tail ::= "!"
)g");
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  EXPECT_TRUE(DfaMatches(**dfa, "a!"));
  EXPECT_TRUE(DfaMatches(**dfa, "bd!"));
  EXPECT_FALSE(DfaMatches(**dfa, "b!"));
}

TEST(GrammarTest, EmptyAlternativesCrlfAndNames) {
  auto dfa = Grammar("root ::= \"a\" opt_tail\r\nopt_tail ::= \"b\" | \r\n");
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  EXPECT_TRUE(DfaMatches(**dfa, "a"));
  EXPECT_TRUE(DfaMatches(**dfa, "ab"));
  EXPECT_FALSE(DfaMatches(**dfa, "abb"));
  auto empty = Grammar("root ::= ( ) \"x\" ( \"\" )*");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(DfaMatches(**empty, "x"));
  // Only the empty string: a valid (if useless) language.
  auto nothing_but_end = Grammar("root ::= \"\"");
  ASSERT_TRUE(nothing_but_end.ok()) << nothing_but_end.status();
  EXPECT_TRUE(DfaMatches(**nothing_but_end, ""));
}

TEST(GrammarTest, DeepNestingIsRefusedNotACrash) {
  auto groups = Grammar("root ::= " + std::string(500, '(') + "\"a\"" +
                        std::string(500, ')'));
  ASSERT_FALSE(groups.ok());
  EXPECT_NE(groups.status().message().find("nested more than"),
            std::string::npos)
      << groups.status();
  // A chain of 2000 rules, each referring to the next.
  std::string chain = "root ::= r0\n";
  for (int i = 0; i < 1999; ++i) {
    chain +=
        "r" + std::to_string(i) + " ::= \"a\" r" + std::to_string(i + 1) + "\n";
  }
  chain += "r1999 ::= \"z\"\n";
  ConstraintConfig config;
  config.grammar.max_rules = 4096;
  config.grammar.max_expansions = 100000;
  auto deep = Grammar(chain, config);
  ASSERT_FALSE(deep.ok());
  EXPECT_NE(deep.status().message().find("nest more than"), std::string::npos)
      << deep.status();
}

TEST(GrammarTest, ErrorsNameTheProblem) {
  struct Case {
    const char* grammar;
    const char* message;
  } cases[] = {
      {"", "no 'root' rule"},
      {"start ::= \"a\"", "no 'root' rule"},
      {"root ::= item", "undefined rule 'item' at offset 9"},
      {"root ::= \"a\"\nroot ::= \"b\"", "defined twice"},
      {"root ::= \"a", "unterminated string opened at offset 9"},
      {"root ::= [a-", "unterminated character class"},
      {"root ::= [z-a]", "range out of order at offset 10"},
      {"root ::= (\"a\"", "expected ')'"},
      {"root ::= \"a\")", "unmatched ')' at offset 12"},
      {"root ::= \"a\" ; \"b\"", "unexpected ';' at offset 13"},
      {"root = \"a\"", "expected '::=' after the rule name 'root'"},
      {"root ::= \"\\q\"", "unknown escape '\\q' at offset 10"},
      {"root ::= \"\\u12\"", "needs 4 hex digits"},
      {"root ::= \"\\uD800\"", "not a Unicode scalar value"},
      {"root ::= \"a\"{3,2}", "bad repetition {3,2}"},
      {"root ::= \"a\"{20000}", "repetition count above 10000"},
      {"root ::= \"a\"{x}", "expected a count after '{'"},
      {"root ::= root \"a\"", "rule 'root' (offset 0) derives no finite"},
      {"root ::= a\na ::= \"(\" b\nb ::= a \")\"",
       "rule 'root' (offset 0) derives no finite"},
      {"root ::= [^\\x00-\\U0010FFFF]", "derives no finite string"},
  };
  for (const Case& c : cases) {
    auto dfa = Grammar(c.grammar);
    ASSERT_FALSE(dfa.ok()) << c.grammar;
    EXPECT_EQ(dfa.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(dfa.status().message().find(c.message), std::string::npos)
        << c.grammar << " -> " << dfa.status().message();
    EXPECT_EQ(dfa.status().message().rfind("grammar", 0), 0u)
        << dfa.status().message();
  }
}

TEST(GrammarTest, CapsAreInvalidArgumentNamingTheCap) {
  {
    ConstraintConfig config;
    config.grammar.max_rules = 2;
    auto dfa = Grammar("root ::= a\na ::= b\nb ::= \"x\"", config);
    ASSERT_FALSE(dfa.ok());
    EXPECT_NE(dfa.status().message().find("more than 2 rules"),
              std::string::npos)
        << dfa.status();
  }
  {
    ConstraintConfig config;
    config.limits.max_dfa_states = 20;
    auto dfa = Grammar(kJsonish, config);
    ASSERT_FALSE(dfa.ok());
    EXPECT_EQ(dfa.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(dfa.status().message().find("DFA states"), std::string::npos)
        << dfa.status();
  }
  {
    // Doubling rules: each level's string is twice the last, so the
    // automaton grows exponentially and meets the NFA cap.
    std::string g = "root ::= r0\n";
    for (int i = 0; i < 30; ++i) {
      g += "r" + std::to_string(i) + " ::= r" + std::to_string(i + 1) + " r" +
           std::to_string(i + 1) + "\n";
    }
    g += "r30 ::= [ab]\n";
    auto dfa = Grammar(g);
    ASSERT_FALSE(dfa.ok());
    EXPECT_EQ(dfa.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(dfa.status().message().find("too large"), std::string::npos)
        << dfa.status();
  }
  {
    ConstraintConfig config;
    config.grammar.max_expansions = 5;
    auto dfa = Grammar(kArithmetic, config);
    ASSERT_FALSE(dfa.ok());
    EXPECT_NE(dfa.status().message().find("more than 5 rule expansions"),
              std::string::npos)
        << dfa.status();
  }
  {
    ConstraintConfig config;
    config.max_text_bytes = 16;
    auto dfa = Grammar(kArithmetic, config);
    ASSERT_FALSE(dfa.ok());
    EXPECT_NE(dfa.status().message().find("above the limit"), std::string::npos)
        << dfa.status();
  }
  {
    ConstraintConfig config;
    config.limits.max_build_time = absl::Microseconds(1);
    auto dfa = Grammar(kJsonish, config);
    ASSERT_FALSE(dfa.ok());
    EXPECT_EQ(dfa.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(dfa.status().message().find("time limit"), std::string::npos)
        << dfa.status();
  }
  ConstraintConfig bad;
  bad.grammar.max_recursion = 100;
  EXPECT_FALSE(bad.Validate().ok());
}

TEST(GrammarTest, MasksAllowEosExactlyInAcceptingStates) {
  auto dfa = Grammar(kArithmetic);
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  const engine::ByteTokenizer tokenizer;
  auto guide =
      std::make_shared<const Guide>(*dfa, TokenTrie::Build(tokenizer), 1024);
  std::mt19937_64 rng(3);
  for (int walk = 0; walk < 50; ++walk) {
    TokenMatcher m(guide);
    std::string text;
    for (int step = 0; step < 200; ++step) {
      const TokenMask& mask = *guide->Mask(m.state());
      EXPECT_EQ(mask.allowed(engine::ByteTokenizer::kEos),
                (*dfa)->accepting(m.state()))
          << text;
      std::vector<int32_t> allowed;
      for (int32_t t = 0; t < engine::ByteTokenizer::kVocab; ++t) {
        if (mask.allowed(t)) allowed.push_back(t);
        if (t < 256) {
          EXPECT_EQ(
              mask.allowed(t),
              (*dfa)->Next(m.state(), static_cast<uint8_t>(t)) != Dfa::kDead);
        }
      }
      ASSERT_FALSE(allowed.empty());
      const int32_t t = allowed[rng() % allowed.size()];
      ASSERT_TRUE(m.Accept(t).ok());
      if (t == engine::ByteTokenizer::kEos) break;
      text += static_cast<char>(t);
    }
    if (m.state() == Guide::kEnded) {
      EXPECT_GE(ArithmeticDepth(text), 0) << text;
    }
  }
}

TEST(DfaMinimizeTest, SameLanguageFewerStates) {
  ByteRegex re;
  // (a|b)*abb written redundantly, and a choice with shared suffixes.
  auto root =
      ParseRegex("(a|b)*abb|(xa|ya)(c|c)d|(xa|ya)cd", RegexTarget::kRaw, &re);
  ASSERT_TRUE(root.ok());
  auto dfa = Dfa::Build(re, *root, {});
  ASSERT_TRUE(dfa.ok());
  auto min = dfa->Minimized(absl::InfiniteFuture());
  ASSERT_TRUE(min.ok());
  EXPECT_LT(min->num_states(), dfa->num_states());
  std::mt19937_64 rng(1);
  for (int i = 0; i < 300; ++i) {
    std::string s;
    const int len = rng() % 7;
    for (int k = 0; k < len; ++k) s += "abcdxy"[rng() % 6];
    EXPECT_EQ(DfaMatches(*dfa, s), DfaMatches(*min, s)) << s;
    const std::string t = DfaSample(*dfa, &rng);
    EXPECT_TRUE(DfaMatches(*min, t)) << t;
  }
}

}  // namespace
}  // namespace pdserve::structured
