// Fuzzes the constraint compiler (structured/constraint.h): regexes, JSON
// schemas, choice lists and json_object mode, under small caps. Input: a kind
// byte (0 regex, 1 JSON schema, 2 choice list as a JSON array of strings, 3
// json_object), then the constraint's text. Bad input must be a Status, never
// a crash or a hang; a constraint that compiles must accept the strings its
// DFA generates, and its token masks over a byte vocabulary must allow
// exactly the bytes that keep the automaton alive.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "structured/constraint.h"
#include "structured/token_guide.h"
#include "tokenizer/tokenizer.h"

namespace {

using pdserve::structured::ConstraintSpec;
using pdserve::structured::Dfa;

ConstraintSpec SpecOf(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
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
    default:
      return ConstraintSpec::JsonObject();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 || size > 1 << 16) return 0;
  pdserve::structured::ConstraintConfig config;
  config.limits.max_nfa_states = 20000;
  config.limits.max_dfa_states = 2000;
  config.limits.max_build_time = absl::Milliseconds(500);
  auto dfa = pdserve::structured::CompileConstraint(SpecOf(data, size), config);
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
