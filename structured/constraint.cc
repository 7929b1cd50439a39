#include "structured/constraint.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "structured/regex_parser.h"

namespace pdserve::structured {

ConstraintSpec ConstraintSpec::Regex(std::string regex) {
  ConstraintSpec spec;
  spec.kind = Kind::kRegex;
  spec.text = std::move(regex);
  return spec;
}

ConstraintSpec ConstraintSpec::Choice(std::vector<std::string> choices) {
  ConstraintSpec spec;
  spec.kind = Kind::kChoice;
  spec.choices = std::move(choices);
  return spec;
}

ConstraintSpec ConstraintSpec::JsonSchema(std::string schema) {
  ConstraintSpec spec;
  spec.kind = Kind::kJsonSchema;
  spec.text = std::move(schema);
  return spec;
}

ConstraintSpec ConstraintSpec::JsonObject() {
  ConstraintSpec spec;
  spec.kind = Kind::kJsonObject;
  return spec;
}

ConstraintSpec ConstraintSpec::Grammar(std::string grammar) {
  ConstraintSpec spec;
  spec.kind = Kind::kGrammar;
  spec.text = std::move(grammar);
  return spec;
}

std::string ConstraintSpec::Key() const {
  std::string key = absl::StrCat(static_cast<int>(kind), ":");
  if (kind == Kind::kChoice) {
    // Length-prefixed, so no two choice lists share a key.
    for (const std::string& c : choices)
      absl::StrAppend(&key, c.size(), ":", c);
  } else {
    key += text;
  }
  return key;
}

const char* ConstraintSpec::KindName() const {
  switch (kind) {
    case Kind::kNone:
      return "none";
    case Kind::kRegex:
      return "regex";
    case Kind::kChoice:
      return "choice";
    case Kind::kJsonSchema:
      return "json_schema";
    case Kind::kJsonObject:
      return "json_object";
    case Kind::kGrammar:
      return "grammar";
  }
  return "none";
}

absl::Status ConstraintConfig::Validate() const {
  if (json.any_value_depth < 0 || json.any_value_depth > 8) {
    return absl::InvalidArgumentError(
        "ConstraintConfig: json.any_value_depth must be in [0, 8]");
  }
  if (json.max_recursion < 0 || json.max_recursion > 8) {
    return absl::InvalidArgumentError(
        "ConstraintConfig: json.max_recursion must be in [0, 8]");
  }
  if (auto s = grammar.Validate(); !s.ok()) return s;
  return limits.Validate();
}

absl::StatusOr<std::shared_ptr<const Dfa>> CompileConstraint(
    const ConstraintSpec& spec, const ConstraintConfig& config) {
  if (spec.text.size() > config.max_text_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s constraint is %d bytes, above the limit of %d", spec.KindName(),
        spec.text.size(), config.max_text_bytes));
  }
  const absl::Time deadline = absl::Now() + config.limits.max_build_time;
  ByteRegex re(config.limits.max_nfa_states);
  absl::StatusOr<int> root;
  switch (spec.kind) {
    case ConstraintSpec::Kind::kNone:
      return absl::InvalidArgumentError("no constraint to compile");
    case ConstraintSpec::Kind::kRegex:
      root = ParseRegex(spec.text, RegexTarget::kRaw, &re);
      break;
    case ConstraintSpec::Kind::kChoice: {
      if (spec.choices.empty()) {
        return absl::InvalidArgumentError("choice constraint has no choices");
      }
      if (spec.choices.size() > config.max_choices) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "choice constraint has %d choices, above the limit of %d",
            spec.choices.size(), config.max_choices));
      }
      size_t bytes = 0;
      std::vector<int> alts;
      for (const std::string& c : spec.choices) {
        bytes += c.size();
        if (bytes > config.max_text_bytes) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "choice constraint is above the limit of %d bytes",
              config.max_text_bytes));
        }
        alts.push_back(re.Literal(c));
      }
      root = re.Alt(std::move(alts));
      if (!re.status().ok()) root = re.status();
      break;
    }
    case ConstraintSpec::Kind::kJsonSchema:
      root = CompileJsonSchema(spec.text, config.json, &re, &config.limits,
                               deadline);
      break;
    case ConstraintSpec::Kind::kJsonObject:
      root = CompileJsonObject(config.json, &re, &config.limits, deadline);
      break;
    case ConstraintSpec::Kind::kGrammar:
      root = CompileGrammar(spec.text, config.grammar, config.limits, deadline,
                            &re);
      break;
  }
  // A constraint over a cap is the client's error, like any other bad
  // constraint: INVALID_ARGUMENT (HTTP 400), not RESOURCE_EXHAUSTED (which
  // the fronts report as a retryable 429).
  if (!root.ok()) return absl::InvalidArgumentError(root.status().message());
  // A grammar whose root is one embedded automaton (a recursive rule, built
  // and minimized already) needs no second build.
  if (spec.kind == ConstraintSpec::Kind::kGrammar &&
      re.node(*root).kind == ByteRegex::Kind::kAutomaton) {
    return re.shared_automaton(re.node(*root).automaton);
  }
  // The whole compile shares one time limit.
  DfaLimits limits = config.limits;
  limits.max_build_time =
      std::max(deadline - absl::Now(), absl::Nanoseconds(1));
  auto dfa = Dfa::Build(re, *root, limits);
  // A grammar's automaton is minimized: its nesting levels repeat states
  // that only the minimization merges, and fewer states mean fewer first
  // visits (trie walks) when masking.
  if (dfa.ok() && spec.kind == ConstraintSpec::Kind::kGrammar) {
    dfa = dfa->Minimized(deadline);
  }
  if (!dfa.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(spec.KindName(), " constraint: ", dfa.status().message()));
  }
  return std::make_shared<const Dfa>(*std::move(dfa));
}

ConstraintCache::ConstraintCache(ConstraintConfig config, size_t capacity)
    : config_(std::move(config)), dfas_(capacity) {}

absl::StatusOr<std::shared_ptr<const Dfa>> ConstraintCache::Get(
    const ConstraintSpec& spec) {
  const std::string key = spec.Key();
  if (auto hit = dfas_.Find(key)) return hit;
  // Compiled outside any lock: two requests racing on one new constraint may
  // both compile it, which costs time but not correctness.
  auto dfa = CompileConstraint(spec, config_);
  if (!dfa.ok()) return dfa.status();
  return dfas_.Insert(key, *std::move(dfa));
}

}  // namespace pdserve::structured
