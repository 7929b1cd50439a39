// What a request asks its output to match, and its compilation into a DFA,
// cached by the constraint's text.
//
// A ConstraintSpec is plain data that travels with a request (router to
// workers, in router.proto and internal.proto); CompileConstraint turns it
// into a Dfa (structured/dfa.h) within DfaLimits, and ConstraintCache keeps
// the compiled automata so a schema that many requests share is compiled
// once. Errors: INVALID_ARGUMENT naming the problem (bad regex, unsupported
// schema keyword, a grammar syntax error or undefined rule, an empty
// language, a constraint over the state or time caps). ConstraintCache is
// thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "structured/dfa.h"
#include "structured/grammar.h"
#include "structured/json_schema.h"
#include "structured/lru_map.h"

namespace pdserve::structured {

struct ConstraintSpec {
  enum class Kind {
    kNone,        // unconstrained
    kRegex,       // `text` is a regular expression the whole output matches
    kChoice,      // the output is exactly one of `choices`
    kJsonSchema,  // `text` is a JSON schema the output validates against
    kJsonObject,  // the output is any JSON object
    kGrammar,     // `text` is a GBNF grammar (structured/grammar.h)
  };
  Kind kind = Kind::kNone;
  std::string text;
  std::vector<std::string> choices;

  static ConstraintSpec Regex(std::string regex);
  static ConstraintSpec Choice(std::vector<std::string> choices);
  static ConstraintSpec JsonSchema(std::string schema);
  static ConstraintSpec JsonObject();
  static ConstraintSpec Grammar(std::string grammar);

  bool active() const { return kind != Kind::kNone; }
  // A byte string that identifies the constraint (the cache key).
  std::string Key() const;
  // "regex", "choice", "json_schema", "json_object", "grammar" or "none".
  const char* KindName() const;
};

struct ConstraintConfig {
  DfaLimits limits;
  JsonSchemaOptions json;
  GrammarOptions grammar;
  // Longest constraint text accepted (bytes).
  size_t max_text_bytes = 256 * 1024;
  size_t max_choices = 4096;
  absl::Status Validate() const;
};

// Compiles `spec` (which must be active) into an automaton.
absl::StatusOr<std::shared_ptr<const Dfa>> CompileConstraint(
    const ConstraintSpec& spec, const ConstraintConfig& config);

// Compiled automata by Key, least recently used evicted past `capacity`.
// Failed compilations are not cached.
class ConstraintCache {
 public:
  ConstraintCache(ConstraintConfig config, size_t capacity);
  absl::StatusOr<std::shared_ptr<const Dfa>> Get(const ConstraintSpec& spec);
  const ConstraintConfig& config() const { return config_; }
  size_t size() const { return dfas_.size(); }

 private:
  const ConstraintConfig config_;
  LruMap<const Dfa> dfas_;
};

}  // namespace pdserve::structured
