// JSON reading and writing without a third-party JSON library.
//
// Parsing goes through protobuf's JSON parser into google.protobuf.Value, which
// Debian's libprotobuf already provides and which rejects malformed input with
// a Status instead of crashing. Numbers are doubles, so integers are exact up
// to 2^53 (ample for configs and safetensors offsets, which are checked).
// All functions are thread-compatible: no shared state.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/struct.pb.h"

namespace pdserve::json {

using Value = google::protobuf::Value;
using Object = google::protobuf::Struct;

// Parses a JSON document. `what` names the source (a file path) in errors.
absl::StatusOr<Value> Parse(absl::string_view text, absl::string_view what);

// Field accessors for an object. `Find` returns nullptr when absent or null.
const Value* Find(const Value& object, absl::string_view key);
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
// range.
absl::StatusOr<int64_t> AsInt(const Value& v, absl::string_view what,
                              int64_t min = INT64_MIN / 2,
                              int64_t max = INT64_MAX / 2);

// Escapes a string as a JSON string literal, quotes included.
std::string Quote(absl::string_view s);
// Shortest round-trip text for a float ("NaN"/"Infinity" are not JSON: they
// become null).
std::string Number(double v);
std::string FloatArray(const float* data, size_t n);

}  // namespace pdserve::json
