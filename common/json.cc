#include "common/json.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <new>

#include "absl/strings/str_cat.h"

namespace pdserve::json {
namespace {

// Builds the document from nlohmann's SAX events (the interface of
// nlohmann::json_sax), enforcing kMaxDepth and handing the members of
// streamed containers to their sinks. Returning false stops the parser.
class DocumentBuilder {
 public:
  DocumentBuilder(absl::string_view what,
                  const std::vector<StreamedContainer>& streamed)
      : what_(what), streamed_(streamed) {}

  bool null() { return AddScalar(Value(nullptr)); }
  bool boolean(bool b) { return AddScalar(Value(b)); }
  bool number_integer(Value::number_integer_t i) { return AddScalar(Value(i)); }
  bool number_unsigned(Value::number_unsigned_t u) {
    return AddScalar(Value(u));
  }
  bool number_float(Value::number_float_t d, const std::string&) {
    return AddScalar(Value(d));
  }
  // The lexer reuses (and first clears) its buffer: moving from it is safe.
  bool string(std::string& s) { return AddScalar(Value(std::move(s))); }
  bool binary(Value::binary_t& b) {
    return AddScalar(Value::binary(std::move(b)));
  }
  bool key(std::string& k) {
    key_ = std::move(k);
    return true;
  }
  bool start_object(size_t) { return Open(Value::object()); }
  bool end_object() { return Close(); }
  bool start_array(size_t) { return Open(Value::array()); }
  bool end_array() { return Close(); }
  bool parse_error(size_t, const std::string&,
                   const nlohmann::detail::exception& e) {
    if (status_.ok()) {
      status_ = absl::InvalidArgumentError(
          absl::StrCat(what_, ": invalid JSON: ", e.what()));
    }
    return false;
  }

  absl::Status status() const { return status_; }
  Value& root() { return root_; }

 private:
  // One open array or object.
  struct Frame {
    // Where its members go; null for a streamed container, whose members
    // are built in `member_` and handed to `sink`.
    Value* container;
    const StreamedContainer* sink;
    bool is_object;
    // The frame is on an object-key path from the root (a streamed
    // container may sit at the end of it).
    bool on_key_path;
  };

  // Places a new value under the innermost open container and returns it.
  Value* Place(Value&& v) {
    if (frames_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Frame& top = frames_.back();
    if (top.container == nullptr) {
      member_ = std::move(v);
      if (top.is_object) member_key_ = std::move(key_);
      return &member_;
    }
    if (top.container->is_object()) {
      Value& slot = (*top.container)[key_];
      slot = std::move(v);
      return &slot;
    }
    top.container->push_back(std::move(v));
    return &top.container->back();
  }

  // A finished member of the streamed container on top goes to its sink.
  bool Deliver() {
    const StreamedContainer& s = *frames_.back().sink;
    status_ = s.sink(std::move(member_key_), std::move(member_));
    member_ = Value();
    member_key_.clear();
    return status_.ok();
  }

  bool AddScalar(Value&& v) {
    Place(std::move(v));
    if (!frames_.empty() && frames_.back().container == nullptr)
      return Deliver();
    return true;
  }

  // The streamed container a new container at this point is, if any.
  const StreamedContainer* StreamedHere() const {
    if (streamed_.empty() || frames_.empty()) return nullptr;
    const Frame& top = frames_.back();
    if (!top.on_key_path || top.container == nullptr || !top.is_object)
      return nullptr;
    for (const StreamedContainer& s : streamed_) {
      if (s.path.size() != path_.size() + 1 || s.path.back() != key_) continue;
      if (std::equal(path_.begin(), path_.end(), s.path.begin())) return &s;
    }
    return nullptr;
  }

  bool Open(Value&& empty) {
    if (static_cast<int>(frames_.size()) >= kMaxDepth) {
      status_ = absl::InvalidArgumentError(absl::StrCat(
          what_, ": invalid JSON: nested deeper than ", kMaxDepth, " levels"));
      return false;
    }
    const StreamedContainer* streamed = StreamedHere();
    const bool on_key_path =
        frames_.empty() ||
        (frames_.back().on_key_path && frames_.back().container != nullptr &&
         frames_.back().is_object);
    if (on_key_path && !frames_.empty()) path_.push_back(key_);
    const bool is_object = empty.is_object();
    Value* placed = Place(std::move(empty));
    frames_.push_back(
        {streamed ? nullptr : placed, streamed, is_object, on_key_path});
    return true;
  }

  bool Close() {
    const Frame closed = frames_.back();
    frames_.pop_back();
    if (closed.on_key_path && !frames_.empty()) path_.pop_back();
    // A container member of a streamed container is complete.
    if (closed.container != nullptr && !frames_.empty() &&
        frames_.back().container == nullptr) {
      return Deliver();
    }
    return true;
  }

  const absl::string_view what_;
  const std::vector<StreamedContainer>& streamed_;
  Value root_;
  std::vector<Frame> frames_;
  std::vector<std::string> path_;  // keys of the frames on a key path
  std::string key_;                // the key of the next object member
  Value member_;                   // a member of a streamed container
  std::string member_key_;
  absl::Status status_;
};

// nlohmann's own serialisation of a scalar; never throws (invalid UTF-8 is
// replaced).
template <typename Json>
void AppendScalar(const Json& v, std::string* out) {
  *out += v.dump(-1, ' ', false, Json::error_handler_t::replace);
}

template <typename Json>
void AppendOneLine(const Json& v, ArraySpacing arrays, std::string* out) {
  if (v.is_object()) {
    out->push_back('{');
    bool first = true;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (!first) *out += ", ";
      first = false;
      AppendScalar(Json(it.key()), out);
      *out += ": ";
      AppendOneLine(it.value(), arrays, out);
    }
    out->push_back('}');
  } else if (v.is_array()) {
    out->push_back('[');
    bool first = true;
    const char* separator = arrays == ArraySpacing::kSpaced ? ", " : ",";
    for (const Json& item : v) {
      if (!first) *out += separator;
      first = false;
      AppendOneLine(item, arrays, out);
    }
    out->push_back(']');
  } else {
    AppendScalar(v, out);
  }
}

template <typename Json>
void AppendLines(const Json& v, std::string* out) {
  if (!v.is_object() || v.empty()) {
    AppendOneLine(v, ArraySpacing::kSpaced, out);
    return;
  }
  *out += "{\n";
  bool first = true;
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (!first) *out += ",\n";
    first = false;
    *out += "  ";
    AppendScalar(Json(it.key()), out);
    *out += ": ";
    AppendOneLine(it.value(), ArraySpacing::kSpaced, out);
  }
  *out += "\n}";
}

absl::Status MissingField(absl::string_view what, absl::string_view key) {
  return absl::NotFoundError(
      absl::StrCat(what, ": missing field \"", key, "\""));
}

}  // namespace

absl::StatusOr<Value> Parse(absl::string_view text, absl::string_view what) {
  return Parse(text, what, {});
}

absl::StatusOr<Value> Parse(absl::string_view text, absl::string_view what,
                            const std::vector<StreamedContainer>& streamed) {
  DocumentBuilder builder(what, streamed);
  // Only bad_alloc (or a sink that throws) can escape the parser, which
  // reports malformed input through the builder: caught here, at the
  // boundary.
  try {
    if (Value::sax_parse(text.begin(), text.end(), &builder))
      return std::move(builder.root());
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": out of memory parsing ", text.size(), " bytes"));
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": invalid JSON: ", e.what()));
  }
  if (!builder.status().ok()) return builder.status();
  return absl::InvalidArgumentError(absl::StrCat(what, ": invalid JSON"));
}

const Value* Find(const Value& object, absl::string_view key) {
  if (!object.is_object()) return nullptr;
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

const std::string* StringOrNull(const Value* v) {
  return v != nullptr && v->is_string() ? &v->get_ref<const std::string&>()
                                        : nullptr;
}

absl::StatusOr<int64_t> AsInt(const Value& v, absl::string_view what,
                              int64_t min, int64_t max) {
  auto out_of_range = [&]() {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": expected a whole number in [", min, ", ", max,
                     "], got ", Dump(v)));
  };
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(max) || static_cast<int64_t>(u) < min)
      return out_of_range();
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i < min || i > max) return out_of_range();
    return i;
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d) || d != std::floor(d) ||
        std::fabs(d) > 9007199254740992.0 || d < static_cast<double>(min) ||
        d > static_cast<double>(max)) {
      return out_of_range();
    }
    return static_cast<int64_t>(d);
  }
  return absl::InvalidArgumentError(absl::StrCat(what, ": expected a number"));
}

absl::StatusOr<int64_t> GetInt(const Value& object, absl::string_view key,
                               absl::string_view what,
                               std::optional<int64_t> fallback, int64_t min,
                               int64_t max) {
  const Value* v = Find(object, key);
  if (v == nullptr) {
    if (fallback) return *fallback;
    return MissingField(what, key);
  }
  return AsInt(*v, absl::StrCat(what, ": field \"", key, "\""), min, max);
}

absl::StatusOr<double> GetDouble(const Value& object, absl::string_view key,
                                 absl::string_view what,
                                 std::optional<double> fallback) {
  const Value* v = Find(object, key);
  if (v == nullptr) {
    if (fallback) return *fallback;
    return MissingField(what, key);
  }
  if (!v->is_number()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": field \"", key, "\" must be a number"));
  }
  return v->get<double>();
}

absl::StatusOr<bool> GetBool(const Value& object, absl::string_view key,
                             absl::string_view what,
                             std::optional<bool> fallback) {
  const Value* v = Find(object, key);
  if (v == nullptr) {
    if (fallback) return *fallback;
    return MissingField(what, key);
  }
  if (!v->is_boolean()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": field \"", key, "\" must be true or false"));
  }
  return v->get<bool>();
}

absl::StatusOr<std::string> GetString(const Value& object,
                                      absl::string_view key,
                                      absl::string_view what,
                                      std::optional<std::string> fallback) {
  const Value* v = Find(object, key);
  if (v == nullptr) {
    if (fallback) return *fallback;
    return MissingField(what, key);
  }
  if (!v->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": field \"", key, "\" must be a string"));
  }
  return v->get_ref<const std::string&>();
}

std::string Dump(const Value& v, ArraySpacing arrays) {
  std::string out;
  AppendOneLine(v, arrays, &out);
  return out;
}

std::string Dump(const OrderedValue& v, ArraySpacing arrays) {
  std::string out;
  AppendOneLine(v, arrays, &out);
  return out;
}

std::string DumpLines(const Value& v) {
  std::string out;
  AppendLines(v, &out);
  return out;
}

std::string DumpLines(const OrderedValue& v) {
  std::string out;
  AppendLines(v, &out);
  return out;
}

std::string Quote(absl::string_view s) {
  std::string out;
  AppendScalar(Value(std::string(s)), &out);
  return out;
}

}  // namespace pdserve::json
