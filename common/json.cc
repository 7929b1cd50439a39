#include "common/json.h"

#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"

namespace pdserve::json {

absl::StatusOr<Value> Parse(absl::string_view text, absl::string_view what) {
  Value value;
  google::protobuf::util::JsonParseOptions options;
  auto status = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(text.data(), text.size()), &value, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": invalid JSON: ", status.message().as_string()));
  }
  return value;
}

const Value* Find(const Value& object, absl::string_view key) {
  if (object.kind_case() != Value::kStructValue) return nullptr;
  const auto& fields = object.struct_value().fields();
  auto it = fields.find(std::string(key));
  if (it == fields.end() || it->second.kind_case() == Value::kNullValue) {
    return nullptr;
  }
  return &it->second;
}

absl::StatusOr<int64_t> AsInt(const Value& v, absl::string_view what,
                              int64_t min, int64_t max) {
  if (v.kind_case() != Value::kNumberValue) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": expected a number"));
  }
  const double d = v.number_value();
  if (!std::isfinite(d) || d != std::floor(d) || d < static_cast<double>(min) ||
      d > static_cast<double>(max) || std::fabs(d) > 9007199254740992.0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": expected a whole number in [", min, ", ", max,
                     "], got ", Number(d)));
  }
  return static_cast<int64_t>(d);
}

absl::StatusOr<int64_t> GetInt(const Value& object, absl::string_view key,
                               absl::string_view what,
                               std::optional<int64_t> fallback, int64_t min,
                               int64_t max) {
  const Value* v = Find(object, key);
  if (v == nullptr) {
    if (fallback) return *fallback;
    return absl::NotFoundError(
        absl::StrCat(what, ": missing field \"", key, "\""));
  }
  return AsInt(*v, absl::StrCat(what, ": field \"", key, "\""), min, max);
}

absl::StatusOr<double> GetDouble(const Value& object, absl::string_view key,
                                 absl::string_view what,
                                 std::optional<double> fallback) {
  const Value* v = Find(object, key);
  if (v == nullptr) {
    if (fallback) return *fallback;
    return absl::NotFoundError(
        absl::StrCat(what, ": missing field \"", key, "\""));
  }
  if (v->kind_case() != Value::kNumberValue) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": field \"", key, "\" must be a number"));
  }
  return v->number_value();
}

absl::StatusOr<bool> GetBool(const Value& object, absl::string_view key,
                             absl::string_view what,
                             std::optional<bool> fallback) {
  const Value* v = Find(object, key);
  if (v == nullptr) {
    if (fallback) return *fallback;
    return absl::NotFoundError(
        absl::StrCat(what, ": missing field \"", key, "\""));
  }
  if (v->kind_case() != Value::kBoolValue) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": field \"", key, "\" must be true or false"));
  }
  return v->bool_value();
}

absl::StatusOr<std::string> GetString(const Value& object,
                                      absl::string_view key,
                                      absl::string_view what,
                                      std::optional<std::string> fallback) {
  const Value* v = Find(object, key);
  if (v == nullptr) {
    if (fallback) return *fallback;
    return absl::NotFoundError(
        absl::StrCat(what, ": missing field \"", key, "\""));
  }
  if (v->kind_case() != Value::kStringValue) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": field \"", key, "\" must be a string"));
  }
  return v->string_value();
}

std::string Quote(absl::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  out.push_back('"');
  return out;
}

std::string Number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

std::string FloatArray(const float* data, size_t n) {
  std::string out = "[";
  for (size_t i = 0; i < n; ++i) {
    if (i) out.push_back(',');
    out += Number(data[i]);
  }
  out.push_back(']');
  return out;
}

}  // namespace pdserve::json
