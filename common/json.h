// JSON reading and writing for every pdserve component, on nlohmann::json
// (Debian's nlohmann-json3-dev).
//
// Reading: Parse never throws. Malformed input, nesting deeper than
// kMaxDepth, documents too large for memory and errors of a
// StreamedContainer's sink come back as a Status naming the source, so
// untrusted files (tokenizer.json, safetensors headers, traces) cannot crash
// the process. The typed getters below turn a missing or mistyped field into a
// Status as well. Code reading a Value directly checks its type first
// (is_array(), StringOrNull...) and never calls the accessors that throw or
// assert on a mismatch (at(), an unchecked get<T>(), operator[] with a key on
// a const value). Integers are exact over the whole int64/uint64 range.
//
// Writing: build a Value (or an OrderedValue, whose objects keep insertion
// order) and Dump it. Invalid UTF-8 in strings becomes U+FFFD instead of
// throwing.
//
// All functions are thread-compatible: no shared state.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pdserve::json {

// Objects are sorted maps: lookups are O(log n), which large objects (the
// 150k-entry vocabulary of a tokenizer.json) need.
using Value = nlohmann::json;
// Objects keep their keys in insertion order; for output meant to be read by
// people (CLI and bench reports), where fields follow a logical order.
using OrderedValue = nlohmann::ordered_json;

// Arrays and objects nested deeper than this are rejected by Parse (as
// protobuf's JSON parser did), which bounds the recursion of any code that
// walks a parsed document.
inline constexpr int kMaxDepth = 100;

// Parses a JSON document. `what` names the source (a file path) in errors.
absl::StatusOr<Value> Parse(absl::string_view text, absl::string_view what);

// A large array or object whose members Parse hands to `sink` one at a time
// instead of storing them in the document, which keeps an empty container of
// the same kind in its place. Building and freeing a DOM of a 150k-entry
// tokenizer vocabulary costs more than the rest of loading the tokenizer.
struct StreamedContainer {
  // Object keys from the root to the container, such as {"model", "vocab"}.
  std::vector<std::string> path;
  // Called with each member: its key (empty for array members) and value.
  // An error ends the parse with that error.
  std::function<absl::Status(std::string&& key, Value&& member)> sink;
};
absl::StatusOr<Value> Parse(absl::string_view text, absl::string_view what,
                            const std::vector<StreamedContainer>& streamed);

// Field accessors for an object. `Find` returns nullptr when `object` is not
// an object or the field is absent or null.
const Value* Find(const Value& object, absl::string_view key);
// The string `v` holds, or nullptr when `v` is null or not a string.
const std::string* StringOrNull(const Value* v);
// Integer field: must be a whole number in [min, max]. Missing -> `fallback`
// when given, else NOT_FOUND.
absl::StatusOr<int64_t> GetInt(const Value& object, absl::string_view key,
                               absl::string_view what,
                               std::optional<int64_t> fallback = std::nullopt,
                               int64_t min = INT64_MIN / 2,
                               int64_t max = INT64_MAX / 2);
absl::StatusOr<double> GetDouble(const Value& object, absl::string_view key,
                                 absl::string_view what,
                                 std::optional<double> fallback = std::nullopt);
absl::StatusOr<bool> GetBool(const Value& object, absl::string_view key,
                             absl::string_view what,
                             std::optional<bool> fallback = std::nullopt);
absl::StatusOr<std::string> GetString(
    const Value& object, absl::string_view key, absl::string_view what,
    std::optional<std::string> fallback = std::nullopt);
// Converts a JSON number to an integer, failing unless it is whole and in
// [min, max]. A float such as 3.0 counts when it is exactly an integer below
// 2^53 in magnitude.
absl::StatusOr<int64_t> AsInt(const Value& v, absl::string_view what,
                              int64_t min = INT64_MIN / 2,
                              int64_t max = INT64_MAX / 2);

// One-line text with ", " and ": " separators, as Python's json.dumps writes
// it (nlohmann's compact form has no spaces, which scripts and tests that
// match `"key": value` rely on). Floats are shortest round-trip; NaN and
// infinities become null.
// kCompact writes arrays as [1,2,3]: the token_ids of `pdserve generate
// --json`, which scripts match that way.
enum class ArraySpacing { kSpaced, kCompact };
std::string Dump(const Value& v, ArraySpacing arrays = ArraySpacing::kSpaced);
std::string Dump(const OrderedValue& v,
                 ArraySpacing arrays = ArraySpacing::kSpaced);
// An object with one top-level field per line, indented two spaces, each
// value as Dump writes it (config files: diffable and greppable, like
// Hugging Face's). Anything but a non-empty object is Dump(v).
std::string DumpLines(const Value& v);
std::string DumpLines(const OrderedValue& v);

// A string as a JSON string literal, quotes included (for messages that show
// a value unambiguously).
std::string Quote(absl::string_view s);

}  // namespace pdserve::json
