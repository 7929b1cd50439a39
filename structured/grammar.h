// Compiles a context-free grammar in llama.cpp's GBNF syntax into a
// ByteRegex, expanding recursion to a bounded nesting depth.
//
// Syntax: rules `name ::= alternatives`, names of letters, digits, '-' and
// '_'; a rule is the text up to the next `name ::=` (so a rule may span
// lines; a GBNF grammar that llama.cpp accepts means the same here).
// Elements: "literals" and [character classes] (negation [^...], ranges a-z)
// with the escapes \n \r \t \\ \" \[ \] \- \/ \xHH \uHHHH \UHHHHHHHH; '.'
// (any character); rule references; ( groups ); alternation |; and the
// quantifiers * + ? {m} {m,} {m,n}. '#' starts a comment to the end of the
// line. The grammar's language starts at the rule `root`. Characters are
// Unicode code points, matched as their UTF-8 bytes.
//
// Bounded recursion: a DFA cannot count, so recursion is expanded to
// `max_recursion` levels. A rule reference that re-enters a rule the current
// expansion is already inside (through any cycle of references) costs one
// level; past the last level that alternative is left out. The language is
// therefore the grammar's strings whose derivations nest at most that deep
// (for an arithmetic grammar, at most max_recursion nested parentheses).
// Each rule at each level is compiled to a minimized DFA once and embedded
// where it is used (ByteRegex::Automaton), so the size grows with the depth
// linearly, not exponentially.
//
// Errors (INVALID_ARGUMENT, prefixed "grammar: "): a syntax error with its
// byte offset, a rule defined twice, an undefined rule, no `root`, a rule
// that derives no finite string (recursion that never reaches a base case,
// such as `root ::= root "a"`), and a grammar over a cap (rules, expansions,
// nesting, NFA/DFA states, time). Thread-compatible.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "structured/byte_regex.h"
#include "structured/dfa.h"

namespace pdserve::structured {

struct GrammarOptions {
  // Nesting levels of recursion that are generated (see above).
  int max_recursion = 6;
  // Most rules a grammar may define.
  int max_rules = 1024;
  // Most distinct (rule, level, context) expansions one compile may make.
  int max_expansions = 8192;
  absl::Status Validate() const;
};

// The node in `re` matching the grammar's language. Sub-automata are built
// within `limits`, all before `deadline`.
absl::StatusOr<int> CompileGrammar(std::string_view text,
                                   const GrammarOptions& options,
                                   const DfaLimits& limits, absl::Time deadline,
                                   ByteRegex* re);

}  // namespace pdserve::structured
