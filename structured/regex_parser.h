// Parses a regular expression (the common subset of ECMAScript, Python and
// RE2 syntax: literals, '.', classes with ranges and \d \w \s, groups,
// non-capturing groups, '|', and the quantifiers * + ? {n} {n,} {n,m}) into
// a ByteRegex. The whole text must match (a leading '^' and a trailing '$'
// are accepted and change nothing). Constructs that a DFA cannot express or
// that pdserve does not implement (backreferences, lookaround, word
// boundaries, inline flags) are INVALID_ARGUMENT naming the construct and
// its offset. Thread-compatible.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "structured/byte_regex.h"

namespace pdserve::structured {

enum class RegexTarget {
  kRaw,         // the pattern's characters as UTF-8 bytes
  kJsonString,  // the characters as written inside a JSON string literal
};

// Returns the node of `pattern` in `re`.
absl::StatusOr<int> ParseRegex(std::string_view pattern, RegexTarget target,
                               ByteRegex* re);

}  // namespace pdserve::structured
