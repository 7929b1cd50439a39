// Fuzzes the constraint compiler (structured/constraint.h): regexes, JSON
// schemas, choice lists, json_object mode and GBNF grammars, under small
// caps. Input: a kind byte (0 regex, 1 JSON schema, 2 choice list as a JSON
// array of strings, 3 json_object, 4 grammar text, 5 bytes that drive a
// generator of random well-formed grammars: rules referring to each other,
// recursion, groups, classes, quantifiers), then the constraint's text. Bad
// input must be a Status, never a crash, a hang or a compile far past its
// time cap; a constraint that compiles must give token masks over a byte
// vocabulary that allow exactly the bytes that keep the automaton alive, and
// EOS exactly where it can end.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "structured/constraint.h"
#include "structured/token_guide.h"
#include "tokenizer/tokenizer.h"

namespace {

using pdserve::structured::ConstraintSpec;
using pdserve::structured::Dfa;

// A random grammar whose shape the bytes choose: up to 6 rules, each a few
// alternatives of a few elements (literals, classes, '.', references to any
// rule, so recursion of every kind, groups, and quantifiers).
class GrammarGen {
 public:
  GrammarGen(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  std::string Generate() {
    rules_ = 1 + Next() % 6;
    std::string out;
    for (int r = 0; r < rules_; ++r) {
      out += Name(r) + " ::= " + Alt(0) + "\n";
    }
    return out;
  }

 private:
  uint8_t Next() { return pos_ < size_ ? data_[pos_++] : 0; }
  static std::string Name(int r) {
    return r == 0 ? "root" : "r" + std::to_string(r);
  }
  std::string Alt(int depth) {
    std::string out = Seq(depth);
    for (int n = Next() % 3; n > 0; --n) out += " | " + Seq(depth);
    return out;
  }
  std::string Seq(int depth) {
    std::string out;
    for (int n = 1 + Next() % 4; n > 0; --n) {
      out += " " + Element(depth) + Quantifier();
    }
    return out;
  }
  std::string Element(int depth) {
    static constexpr char kChars[] = "ab(),[]{}\"\\-z";
    switch (Next() % 6) {
      case 0:
      case 1: {
        std::string lit = "\"";
        for (int n = Next() % 3; n > 0; --n) {
          const char c = kChars[Next() % (sizeof(kChars) - 1)];
          if (c == '"' || c == '\\') lit += '\\';
          lit += c;
        }
        return lit + "\"";
      }
      case 2:
        return Next() % 2 ? "[a-c]" : "[^ab\\]]";
      case 3:
        return depth < 3 ? "(" + Alt(depth + 1) + ")" : ".";
      default:
        return Name(Next() % rules_);
    }
  }
  std::string Quantifier() {
    switch (Next() % 8) {
      case 0:
        return "*";
      case 1:
        return "+";
      case 2:
        return "?";
      case 3:
        return "{" + std::to_string(Next() % 4) + "," +
               std::to_string(4 + Next() % 4) + "}";
      default:
        return "";
    }
  }
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  int rules_ = 1;
};

ConstraintSpec SpecOf(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 6) {
    case 0:
      return ConstraintSpec::Regex(text);
    case 1:
      return ConstraintSpec::JsonSchema(text);
    case 2: {
      std::vector<std::string> choices;
      auto list = nlohmann::json::parse(text, nullptr, false);
      if (list.is_array()) {
        for (const auto& c : list) {
          if (c.is_string()) choices.push_back(c.get<std::string>());
        }
      }
      return ConstraintSpec::Choice(std::move(choices));
    }
    case 3:
      return ConstraintSpec::JsonObject();
    case 4:
      return ConstraintSpec::Grammar(text);
    default:
      return ConstraintSpec::Grammar(GrammarGen(data + 1, size - 1).Generate());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 || size > 1 << 16) return 0;
  pdserve::structured::ConstraintConfig config;
  config.limits.max_nfa_states = 20000;
  config.limits.max_dfa_states = 2000;
  config.limits.max_build_time = absl::Milliseconds(500);
  config.grammar.max_expansions = 512;
  const ConstraintSpec spec = SpecOf(data, size);
  const absl::Time start = absl::Now();
  auto dfa = pdserve::structured::CompileConstraint(spec, config);
  // The time cap holds (with slack for a loaded machine and the sanitizers).
  if (absl::Now() - start > absl::Seconds(5)) std::abort();
  if (!dfa.ok()) {
    if (dfa.status().message().empty()) std::abort();
    return 0;
  }
  static const auto* trie =
      new std::shared_ptr<const pdserve::structured::TokenTrie>(
          pdserve::structured::TokenTrie::Build(
              pdserve::engine::ByteTokenizer()));
  auto guide =
      std::make_shared<const pdserve::structured::Guide>(*dfa, *trie, 64);
  std::mt19937_64 rng(size);
  for (int walk = 0; walk < 4; ++walk) {
    pdserve::structured::TokenMatcher m(guide);
    for (int step = 0; step < 64; ++step) {
      const auto& mask = *guide->Mask(m.state());
      // Byte tokens: token b allowed iff byte b keeps the DFA alive.
      for (int b = 0; b < 256; ++b) {
        const bool live =
            m.state() >= 0 &&
            (*dfa)->Next(m.state(), static_cast<uint8_t>(b)) != Dfa::kDead;
        if (mask.allowed(b) != live) std::abort();
      }
      if (mask.allowed(pdserve::engine::ByteTokenizer::kEos) != m.CanEnd())
        std::abort();
      if (mask.count == 0) std::abort();  // trimmed: never a dead end
      std::vector<int32_t> allowed;
      for (int32_t t = 0; t < pdserve::engine::ByteTokenizer::kVocab; ++t) {
        if (mask.allowed(t)) allowed.push_back(t);
      }
      const int32_t t = allowed[rng() % allowed.size()];
      if (!m.Accept(t).ok()) std::abort();
      if (t == pdserve::engine::ByteTokenizer::kEos) break;
    }
  }
  return 0;
}
