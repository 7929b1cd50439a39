#include "structured/token_guide.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "structured/constraint.h"
#include "structured/test_util.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::structured {
namespace {

// A vocabulary of given byte strings (BPE-like: multi-byte tokens, tokens
// spanning JSON punctuation and text, half UTF-8 characters), then a special
// BOS and EOS.
class ListTokenizer : public engine::Tokenizer {
 public:
  explicit ListTokenizer(std::vector<std::string> tokens)
      : tokens_(std::move(tokens)) {}
  using Tokenizer::Encode;
  std::vector<int32_t> Encode(const std::string&, bool) const override {
    return {};
  }
  std::string TokenBytes(int32_t id) const override {
    return id >= 0 && id < static_cast<int32_t>(tokens_.size()) ? tokens_[id]
                                                                : "";
  }
  int64_t vocab_size() const override { return tokens_.size() + 2; }
  int32_t bos_id() const override { return tokens_.size(); }
  int32_t eos_id() const override { return tokens_.size() + 1; }

 private:
  std::vector<std::string> tokens_;
};

std::vector<std::string> TestVocab() {
  std::vector<std::string> v;
  for (int b = 0; b < 256; ++b)
    v.push_back(std::string(1, static_cast<char>(b)));
  for (const char* t :
       {"{\"",  "\":", "\": \"", "\",",  "\"}",      "name", "na",
        "me\"", "12",  "123",    "true", "false",    "null", ", \"",
        "}",    "]}",  "\xC3",   "\xA9", "\xC3\xA9", "é\"",  "ab",
        "abc",  "yes", "no",     " no",  "maybe"}) {
    v.push_back(t);
  }
  v.push_back("abc");  // a duplicate (two ids, same bytes)
  return v;
}

std::shared_ptr<const Guide> MakeGuide(const ConstraintSpec& spec,
                                       std::shared_ptr<const TokenTrie> trie) {
  auto dfa = CompileConstraint(spec, {});
  EXPECT_TRUE(dfa.ok()) << dfa.status();
  return std::make_shared<const Guide>(*dfa, trie, 1024);
}

// A token is allowed exactly when its bytes keep the DFA alive (or it is EOS
// in an accepting state): the trie walk must equal this brute force.
void ExpectMaskIsExact(const Guide& guide, const ListTokenizer& tok,
                       int state) {
  const TokenMask& mask = *guide.Mask(state);
  int64_t count = 0;
  for (int32_t id = 0; id < tok.vocab_size(); ++id) {
    bool allowed;
    if (id == tok.eos_id()) {
      allowed = guide.CanEnd(state);
    } else if (id == tok.bos_id()) {
      allowed = false;
    } else {
      int s = state;
      for (char c : tok.TokenBytes(id)) {
        s = s < 0 ? s : guide.dfa().Next(s, static_cast<uint8_t>(c));
      }
      allowed = s >= 0;
    }
    EXPECT_EQ(mask.allowed(id), allowed)
        << "state " << state << " token " << id;
    count += allowed;
  }
  EXPECT_EQ(mask.count, count);
}

TEST(TokenGuideTest, MasksEqualBruteForceOnEveryReachedState) {
  ListTokenizer tok(TestVocab());
  auto trie = TokenTrie::Build(tok);
  const ConstraintSpec specs[] = {
      ConstraintSpec::JsonSchema(
          R"({"type":"object","properties":{"name":{"type":"string","maxLength":4},
           "n":{"type":"integer"}},"required":["name","n"],"additionalProperties":false})"),
      ConstraintSpec::Regex("(ab|é)+c?[0-9]{1,3}"),
      ConstraintSpec::Choice({"yes", "no", "maybe", "no way"}),
  };
  std::mt19937_64 rng(5);
  for (const auto& spec : specs) {
    auto guide = MakeGuide(spec, trie);
    for (int walk = 0; walk < 20; ++walk) {
      TokenMatcher m(guide);
      for (int step = 0; step < 40; ++step) {
        ExpectMaskIsExact(*guide, tok, m.state());
        const TokenMask& mask = *guide->Mask(m.state());
        ASSERT_GT(mask.count, 0);
        std::vector<int32_t> allowed;
        for (int32_t id = 0; id < tok.vocab_size(); ++id) {
          if (mask.allowed(id)) allowed.push_back(id);
        }
        const int32_t t = allowed[std::uniform_int_distribution<size_t>(
            0, allowed.size() - 1)(rng)];
        ASSERT_TRUE(m.Accept(t).ok());
        if (t == tok.eos_id()) break;
      }
    }
  }
}

TEST(TokenGuideTest, EosOnlyWhenTheConstraintCanEnd) {
  ListTokenizer tok(TestVocab());
  auto guide = MakeGuide(ConstraintSpec::Choice({"no", "no way"}),
                         TokenTrie::Build(tok));
  TokenMatcher m(guide);
  EXPECT_FALSE(guide->Mask(m.state())->allowed(tok.eos_id()));
  EXPECT_FALSE(m.Accept(tok.eos_id()).ok());
  ASSERT_TRUE(m.Accept('n').ok());  // byte tokens have the byte's id
  ASSERT_TRUE(m.Accept('o').ok());
  EXPECT_TRUE(m.CanEnd());
  EXPECT_FALSE(m.Complete());  // " way" may follow
  EXPECT_TRUE(guide->Mask(m.state())->allowed(tok.eos_id()));
  EXPECT_FALSE(guide->Mask(m.state())->allowed(tok.bos_id()));
  ASSERT_TRUE(m.AcceptAll({' ', 'w', 'a', 'y'}).ok());
  EXPECT_TRUE(m.Complete());
  EXPECT_EQ(guide->Mask(m.state())->count, 1);  // EOS only
  ASSERT_TRUE(m.Accept(tok.eos_id()).ok());
  EXPECT_EQ(m.state(), Guide::kEnded);
  EXPECT_FALSE(m.Accept('a').ok());
}

TEST(TokenGuideTest, PartialUtf8TokensCombine) {
  ListTokenizer tok(TestVocab());
  auto guide = MakeGuide(ConstraintSpec::Regex("é{2}"), TokenTrie::Build(tok));
  TokenMatcher m(guide);
  const int32_t lead = 256 + 16, cont = 256 + 17;  // "\xC3", "\xA9"
  EXPECT_TRUE(guide->Mask(m.state())->allowed(lead));
  EXPECT_FALSE(guide->Mask(m.state())->allowed(cont));
  ASSERT_TRUE(m.Accept(lead).ok());
  EXPECT_TRUE(guide->Mask(m.state())->allowed(cont));
  EXPECT_FALSE(guide->Mask(m.state())->allowed(lead));
  ASSERT_TRUE(m.Accept(cont).ok());
  ASSERT_TRUE(m.Accept(256 + 18).ok());  // "é" whole
  EXPECT_TRUE(m.Complete());
}

TEST(TokenGuideTest, ApplyMaskKeepsAllowedLogitsUntouched) {
  ListTokenizer tok(TestVocab());
  auto trie = TokenTrie::Build(tok);
  for (const char* regex : {"[0-9]", "[^\"]*"}) {  // a sparse and a dense mask
    auto guide = MakeGuide(ConstraintSpec::Regex(regex), trie);
    const TokenMask& mask = *guide->Mask(guide->start());
    // Logits wider than the tokenizer (a padded model vocabulary).
    std::vector<float> logits(tok.vocab_size() + 70);
    for (size_t i = 0; i < logits.size(); ++i) logits[i] = 0.25f * i;
    ApplyTokenMask(mask, logits.data(), logits.size());
    for (size_t i = 0; i < logits.size(); ++i) {
      if (mask.allowed(static_cast<int32_t>(i))) {
        EXPECT_EQ(logits[i], 0.25f * i);
      } else {
        EXPECT_TRUE(std::isinf(logits[i]) && logits[i] < 0) << i;
      }
    }
  }
}

// Dense masks: the run-time-picked kernel and the portable one both leave
// allowed logits bit-for-bit untouched and set the rest to -inf, for rows
// that end inside a word, past the mask, and words all on, all off or mixed.
TEST(TokenGuideTest, DenseMaskKernelsAgreeWithTheBitTest) {
  std::mt19937_64 rng(3);
  for (int64_t vocab : {64, 100, 1000, 4096, 128256}) {
    TokenMask mask;
    mask.bits.resize(static_cast<size_t>((vocab + 63) / 64));
    for (size_t w = 0; w < mask.bits.size(); ++w) {
      const int kind = static_cast<int>(w % 4);
      mask.bits[w] = kind == 0 ? 0 : kind == 1 ? ~uint64_t{0} : rng();
    }
    for (uint64_t b : mask.bits) mask.count += __builtin_popcountll(b);
    for (int64_t n : {vocab, vocab - 1, vocab + 70}) {
      if (n <= 0) continue;
      std::vector<float> row(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) row[i] = 0.5f * static_cast<float>(i) - 7;
      std::vector<float> fast = row, portable = row;
      ApplyTokenMask(mask, fast.data(), n);
      ApplyTokenMaskPortableForTest(mask, portable.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const bool on = mask.allowed(static_cast<int32_t>(i));
        if (on) {
          ASSERT_EQ(fast[i], row[i]) << vocab << " " << n << " " << i;
        } else {
          ASSERT_TRUE(std::isinf(fast[i]) && fast[i] < 0) << n << " " << i;
        }
        // The portable kernel covers the whole words below n.
        if (i < n / 64 * 64 &&
            i < static_cast<int64_t>(mask.bits.size()) * 64) {
          ASSERT_EQ(portable[i], fast[i]) << vocab << " " << n << " " << i;
        }
      }
    }
  }
}

TEST(TokenGuideTest, CacheSharesGuidesAndMasks) {
  ListTokenizer tok(TestVocab());
  GuideCache cache({}, TokenTrie::Build(tok));
  ConstraintSpec spec = ConstraintSpec::Regex("[a-c]+");
  auto g1 = cache.Get(spec);
  auto g2 = cache.Get(spec);
  ASSERT_TRUE(g1.ok() && g2.ok());
  EXPECT_EQ(g1->get(), g2->get());
  EXPECT_EQ((*g1)->Mask(0).get(), (*g2)->Mask(0).get());
  EXPECT_EQ((*g1)->cached_masks(), 1u);
  auto bad = cache.Get(ConstraintSpec::Regex("a{"));
  EXPECT_TRUE(bad.ok());  // '{' without a count is a literal
  EXPECT_EQ(cache.Get(ConstraintSpec::Regex("(?<=a)")).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve::structured
