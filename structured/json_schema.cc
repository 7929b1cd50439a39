#include "structured/json_schema.h"

#include <cmath>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "structured/regex_parser.h"

namespace pdserve::structured {
namespace {

using OJson = nlohmann::ordered_json;

constexpr int kMaxSchemaDepth = 64;
constexpr int kMaxDocumentDepth = 100;
constexpr int64_t kMaxInt = 999999999999999999;  // 18 digits

// Keywords the compiler implements.
const absl::flat_hash_set<std::string>& Implemented() {
  static const auto* k =
      new absl::flat_hash_set<std::string>{"type",
                                           "properties",
                                           "required",
                                           "additionalProperties",
                                           "items",
                                           "anyOf",
                                           "$ref",
                                           "$defs",
                                           "definitions",
                                           "enum",
                                           "const",
                                           "pattern",
                                           "format",
                                           "minLength",
                                           "maxLength",
                                           "minItems",
                                           "maxItems",
                                           "minimum",
                                           "maximum",
                                           "exclusiveMinimum",
                                           "exclusiveMaximum"};
  return *k;
}
// Keywords that say nothing about which values validate.
const absl::flat_hash_set<std::string>& Annotations() {
  static const auto* k = new absl::flat_hash_set<std::string>{
      "title",    "description", "default",  "examples",  "$schema", "$id",
      "$comment", "deprecated",  "readOnly", "writeOnly", "strict",  "name"};
  return *k;
}

// Deepest nesting of arrays and objects in `text` (strings skipped), so a
// hostile document is refused before the recursive parser sees it.
int NestingDepth(std::string_view text) {
  int depth = 0, max_depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      max_depth = std::max(max_depth, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return max_depth;
}

class SchemaCompiler {
 public:
  SchemaCompiler(const OJson* root, const JsonSchemaOptions& options,
                 ByteRegex* re, const DfaLimits* limits, absl::Time deadline)
      : root_(root),
        options_(options),
        re_(re),
        limits_(limits),
        deadline_(deadline) {}

  absl::StatusOr<int> Run(const OJson& schema) {
    int node = Compile(schema, "#", 0);
    if (!re_->status().ok()) return re_->status();
    if (!status_.ok()) return status_;
    if (node < 0) return absl::InternalError("json schema: no node");
    return node;
  }

  int AnyObject(int depth) { return Object(AnyValue(depth - 1), StringAny()); }

 private:
  int Fail(const std::string& where, const std::string& what) {
    if (status_.ok()) {
      status_ = absl::InvalidArgumentError(
          absl::StrCat("json schema: ", what, " at ", where));
    }
    return -1;
  }
  bool failed() const { return !status_.ok() || !re_->status().ok(); }

  int Comma() {
    return re_->Concat({re_->Byte(','), re_->Optional(re_->Byte(' '))});
  }
  int Colon() {
    return re_->Concat({re_->Byte(':'), re_->Optional(re_->Byte(' '))});
  }

  int StringChar() {
    if (string_char_ < 0) {
      CodepointSet all;
      all.Add(0, CodepointSet::kMax);
      string_char_ = re_->JsonStringChars(all);
    }
    return string_char_;
  }
  int StringAny() {
    return re_->Concat(
        {re_->Byte('"'), re_->Repeat(StringChar(), 0, -1), re_->Byte('"')});
  }
  int Number(bool allow_negative) {
    std::vector<int> parts;
    if (allow_negative) parts.push_back(re_->Optional(re_->Byte('-')));
    ByteSet digit, nonzero;
    for (char c = '0'; c <= '9'; ++c) digit.set(c);
    nonzero = digit;
    nonzero.reset('0');
    parts.push_back(
        re_->Alt({re_->Byte('0'),
                  re_->Concat({re_->Bytes(nonzero),
                               re_->Repeat(re_->Bytes(digit), 0, 14)})}));
    parts.push_back(re_->Optional(
        re_->Concat({re_->Byte('.'), re_->Repeat(re_->Bytes(digit), 1, 15)})));
    ByteSet e, sign;
    e.set('e'), e.set('E'), sign.set('+'), sign.set('-');
    parts.push_back(re_->Optional(
        re_->Concat({re_->Bytes(e), re_->Optional(re_->Bytes(sign)),
                     re_->Repeat(re_->Bytes(digit), 1, 3)})));
    return re_->Concat(std::move(parts));
  }

  // Digit strings of one length from x to y (x <= y, same length).
  int SameLength(const std::string& x, const std::string& y) {
    if (x.empty()) return re_->Empty();
    auto digits = [&](char lo, char hi) {
      ByteSet s;
      for (char c = lo; c <= hi; ++c) s.set(c);
      return re_->Bytes(s);
    };
    const std::string xr = x.substr(1), yr = y.substr(1);
    if (x[0] == y[0]) return re_->Concat({re_->Byte(x[0]), SameLength(xr, yr)});
    const bool x_min = xr.find_first_not_of('0') == std::string::npos;
    const bool y_max = yr.find_first_not_of('9') == std::string::npos;
    const int rest = static_cast<int>(xr.size());
    std::vector<int> alts;
    char lo = x[0], hi = y[0];
    if (!x_min) {
      alts.push_back(re_->Concat(
          {re_->Byte(x[0]), SameLength(xr, std::string(rest, '9'))}));
      ++lo;
    }
    if (!y_max) {
      alts.push_back(re_->Concat(
          {re_->Byte(y[0]), SameLength(std::string(rest, '0'), yr)}));
      --hi;
    }
    if (lo <= hi) {
      alts.push_back(re_->Concat(
          {digits(lo, hi), re_->Repeat(digits('0', '9'), rest, rest)}));
    }
    return re_->Alt(std::move(alts));
  }
  // Non-negative integers from a to b written without leading zeros.
  int NonNegative(int64_t a, int64_t b) {
    std::vector<int> alts;
    const std::string sa = std::to_string(a), sb = std::to_string(b);
    int64_t pow = 1;
    for (size_t len = 1; len <= sb.size(); ++len, pow *= 10) {
      if (len < sa.size()) continue;
      const int64_t lo = std::max(a, len == 1 ? int64_t{0} : pow);
      const int64_t hi = std::min(b, pow * 10 - 1);
      if (lo > hi) continue;
      alts.push_back(SameLength(std::to_string(lo), std::to_string(hi)));
    }
    return re_->Alt(std::move(alts));
  }
  int Integer(const OJson& s, const std::string& where) {
    int64_t lo = -kMaxInt, hi = kMaxInt;
    auto bound = [&](const char* key, bool is_min, bool exclusive) {
      auto it = s.find(key);
      if (it == s.end()) return;
      if (!it->is_number()) {
        Fail(where, absl::StrCat(key, " must be a number"));
        return;
      }
      const double v = it->get<double>();
      double r = is_min ? std::ceil(v) : std::floor(v);
      if (exclusive && r == v) r += is_min ? 1 : -1;
      if (r > static_cast<double>(kMaxInt)) r = static_cast<double>(kMaxInt);
      if (r < -static_cast<double>(kMaxInt)) r = -static_cast<double>(kMaxInt);
      const int64_t iv = static_cast<int64_t>(r);
      if (is_min)
        lo = std::max(lo, iv);
      else
        hi = std::min(hi, iv);
    };
    bound("minimum", true, false);
    bound("exclusiveMinimum", true, true);
    bound("maximum", false, false);
    bound("exclusiveMaximum", false, true);
    if (failed()) return -1;
    if (lo > hi) return Fail(where, "integer range is empty");
    std::vector<int> alts;
    if (hi >= 0) alts.push_back(NonNegative(std::max<int64_t>(lo, 0), hi));
    if (lo < 0) {
      alts.push_back(
          re_->Concat({re_->Byte('-'), NonNegative(hi < 0 ? -hi : 1, -lo)}));
    }
    return re_->Alt(std::move(alts));
  }

  int NumberType(const OJson& s, const std::string& where) {
    for (const char* key :
         {"maximum", "exclusiveMaximum", "exclusiveMinimum"}) {
      if (s.contains(key)) {
        return Fail(where, absl::StrCat(key,
                                        " on type number is not supported "
                                        "(use type integer for ranges)"));
      }
    }
    auto it = s.find("minimum");
    if (it != s.end()) {
      if (!it->is_number() || it->get<double>() != 0) {
        return Fail(where, "minimum on type number is supported only as 0");
      }
      return Number(false);
    }
    return Number(true);
  }

  int String(const OJson& s, const std::string& where) {
    const auto pattern = s.find("pattern");
    const auto format = s.find("format");
    const bool lengths = s.contains("minLength") || s.contains("maxLength");
    int inner;
    if (pattern != s.end() || format != s.end()) {
      if (lengths) {
        return Fail(where,
                    "minLength/maxLength together with pattern or "
                    "format are not supported");
      }
      if (pattern != s.end() && format != s.end()) {
        return Fail(where, "pattern together with format is not supported");
      }
      std::string regex;
      if (pattern != s.end()) {
        if (!pattern->is_string())
          return Fail(where, "pattern must be a string");
        regex = pattern->get<std::string>();
      } else {
        if (!format->is_string()) return Fail(where, "format must be a string");
        const std::string f = format->get<std::string>();
        const std::string date =
            "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])";
        const std::string time =
            "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?"
            "(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])";
        if (f == "date") {
          regex = date;
        } else if (f == "time") {
          regex = time;
        } else if (f == "date-time") {
          regex = date + "T" + time;
        } else if (f == "uuid") {
          regex =
              "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}";
        } else if (f == "ipv4") {
          regex =
              "((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\\.){3}"
              "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])";
        } else if (f == "email") {
          regex = "[a-z0-9._+-]{1,32}@[a-z0-9-]{1,32}\\.[a-z]{2,8}";
        } else {
          return Fail(where, absl::StrCat("unsupported format '", f, "'"));
        }
      }
      auto node = ParseRegex(regex, RegexTarget::kJsonString, re_);
      if (!node.ok()) {
        return Fail(where, std::string(node.status().message()));
      }
      inner = *node;
    } else {
      int min = 0, max = -1;
      if (!Count(s, "minLength", where, &min) ||
          !Count(s, "maxLength", where, &max)) {
        return -1;
      }
      if (max >= 0 && max < min) return Fail(where, "maxLength < minLength");
      inner = re_->Repeat(StringChar(), min, max);
    }
    return re_->Concat({re_->Byte('"'), inner, re_->Byte('"')});
  }

  // Reads a non-negative count keyword into *out (left alone when absent).
  bool Count(const OJson& s, const char* key, const std::string& where,
             int* out) {
    auto it = s.find(key);
    if (it == s.end()) return true;
    if (!it->is_number_integer() || it->get<int64_t>() < 0) {
      Fail(where, absl::StrCat(key, " must be a non-negative integer"));
      return false;
    }
    if (it->get<int64_t>() > ByteRegex::kMaxRepeat) {
      Fail(where, absl::StrCat(key, " above ", ByteRegex::kMaxRepeat,
                               " is not supported"));
      return false;
    }
    *out = static_cast<int>(it->get<int64_t>());
    return true;
  }

  // `[` item (sep item){min-1,max-1} `]`
  int Array(const OJson& s, const std::string& where, int depth) {
    int item;
    auto items = s.find("items");
    if (items == s.end()) {
      item = AnyValue(options_.any_value_depth - 1);
    } else {
      item = Compile(*items, where + "/items", depth + 1);
    }
    int min = 0, max = -1;
    if (!Count(s, "minItems", where, &min) ||
        !Count(s, "maxItems", where, &max)) {
      return -1;
    }
    if (max >= 0 && max < min) return Fail(where, "maxItems < minItems");
    if (item < 0) return -1;
    if (re_->node(item).kind == ByteRegex::Kind::kNothing) max = 0;
    if (max >= 0 && max < min)
      return Fail(where, "items can never be generated");
    if (max == 0) return re_->Literal("[]");
    int rest = re_->Repeat(re_->Concat({Comma(), item}), std::max(min - 1, 0),
                           max < 0 ? -1 : max - 1);
    int body = re_->Concat({item, rest});
    if (min == 0) body = re_->Optional(body);
    return re_->Concat({re_->Byte('['), body, re_->Byte(']')});
  }

  // `{` (key : value (, key : value)*)? `}` for any keys.
  int Object(int value, int key) {
    int member = re_->Concat({key, Colon(), value});
    int body = re_->Optional(re_->Concat(
        {member, re_->Repeat(re_->Concat({Comma(), member}), 0, -1)}));
    return re_->Concat({re_->Byte('{'), body, re_->Byte('}')});
  }

  int ObjectType(const OJson& s, const std::string& where, int depth) {
    auto props = s.find("properties");
    auto additional = s.find("additionalProperties");
    absl::flat_hash_set<std::string> required;
    if (auto r = s.find("required"); r != s.end()) {
      if (!r->is_array()) return Fail(where, "required must be an array");
      for (const auto& name : *r) {
        if (!name.is_string())
          return Fail(where, "required names must be strings");
        required.insert(name.get<std::string>());
      }
    }
    if (props != s.end() && !props->is_object()) {
      return Fail(where, "properties must be an object");
    }
    if (props == s.end() || props->empty()) {
      if (!required.empty()) {
        return Fail(where,
                    absl::StrCat("required property '", *required.begin(),
                                 "' is not in properties"));
      }
      if (additional != s.end() && additional->is_object()) {
        int value =
            Compile(*additional, where + "/additionalProperties", depth + 1);
        if (value < 0) return -1;
        return Object(value, StringAny());
      }
      if (additional != s.end() && additional->is_boolean() &&
          !additional->get<bool>()) {
        return re_->Literal("{}");
      }
      return AnyObject(options_.any_value_depth);
    }
    if (additional != s.end() && !additional->is_boolean() &&
        !additional->is_object()) {
      return Fail(where, "additionalProperties must be a boolean or a schema");
    }
    struct Member {
      int node;
      bool required;
    };
    std::vector<Member> members;
    for (const auto& [name, sub] : props->items()) {
      int value =
          Compile(sub, absl::StrCat(where, "/properties/", name), depth + 1);
      if (value < 0) return -1;
      const bool req = required.contains(name);
      required.erase(name);
      if (re_->node(value).kind == ByteRegex::Kind::kNothing) {
        if (req) {
          return Fail(where, absl::StrCat("required property '", name,
                                          "' can never be generated"));
        }
        continue;
      }
      members.push_back(
          {re_->Concat({re_->Literal(OJson(name).dump()), Colon(), value}),
           req});
    }
    if (!required.empty()) {
      return Fail(where, absl::StrCat("required property '", *required.begin(),
                                      "' is not in properties"));
    }
    int first_required = -1;
    for (size_t i = 0; i < members.size(); ++i) {
      if (members[i].required) {
        first_required = static_cast<int>(i);
        break;
      }
    }
    // Members after index k: required ones always, optional ones maybe, each
    // after a comma.
    auto tail = [&](size_t k) {
      std::vector<int> parts;
      for (size_t j = k + 1; j < members.size(); ++j) {
        int part = re_->Concat({Comma(), members[j].node});
        parts.push_back(members[j].required ? part : re_->Optional(part));
      }
      return re_->Concat(std::move(parts));
    };
    int body;
    if (first_required >= 0) {
      // Optional members before the first required one are each followed by
      // a comma.
      std::vector<int> parts;
      for (int i = 0; i < first_required; ++i) {
        parts.push_back(re_->Optional(re_->Concat({members[i].node, Comma()})));
      }
      parts.push_back(members[first_required].node);
      parts.push_back(tail(first_required));
      body = re_->Concat(std::move(parts));
    } else {
      std::vector<int> alts = {re_->Empty()};
      for (size_t k = 0; k < members.size(); ++k) {
        alts.push_back(re_->Concat({members[k].node, tail(k)}));
      }
      body = re_->Alt(std::move(alts));
    }
    return re_->Concat({re_->Byte('{'), body, re_->Byte('}')});
  }

  int AnyValue(int depth) {
    if (depth < 0) depth = 0;
    if (static_cast<int>(any_.size()) <= depth) any_.resize(depth + 1, -1);
    if (any_[depth] >= 0) return any_[depth];
    std::vector<int> alts = {re_->Literal("null"), re_->Literal("true"),
                             re_->Literal("false"), Number(true), StringAny()};
    if (depth > 0) {
      int inner = Embed(AnyValue(depth - 1));
      alts.push_back(re_->Concat(
          {re_->Byte('['),
           re_->Optional(re_->Concat(
               {inner, re_->Repeat(re_->Concat({Comma(), inner}), 0, -1)})),
           re_->Byte(']')}));
      alts.push_back(Object(inner, StringAny()));
    }
    const int node = re_->Alt(std::move(alts));
    any_[depth] = node;
    return node;
  }

  // `node` as an embedded minimized automaton (see CompileJsonSchema), or
  // `node` itself when there are no limits or it cannot be built within
  // them (then the final build reports the cap it meets).
  int Embed(int node) {
    if (limits_ == nullptr || node < 0 || failed()) return node;
    DfaLimits limits = *limits_;
    limits.max_build_time = deadline_ - absl::Now();
    if (limits.max_build_time <= absl::ZeroDuration()) return node;
    auto dfa = Dfa::Build(*re_, node, limits);
    if (dfa.ok()) dfa = dfa->Minimized(deadline_);
    if (!dfa.ok()) return node;
    return re_->Automaton(std::make_shared<const Dfa>(*std::move(dfa)));
  }

  const OJson* Resolve(const std::string& ref) {
    if (ref == "#") return root_;
    if (ref.rfind("#/", 0) != 0) return nullptr;
    const OJson* cur = root_;
    size_t pos = 2;
    while (pos <= ref.size()) {
      size_t end = ref.find('/', pos);
      if (end == std::string::npos) end = ref.size();
      std::string token = ref.substr(pos, end - pos);
      std::string decoded;
      for (size_t i = 0; i < token.size(); ++i) {
        if (token[i] == '~' && i + 1 < token.size() &&
            (token[i + 1] == '0' || token[i + 1] == '1')) {
          decoded.push_back(token[i + 1] == '0' ? '~' : '/');
          ++i;
        } else {
          decoded.push_back(token[i]);
        }
      }
      if (!cur->is_object()) return nullptr;
      auto it = cur->find(decoded);
      if (it == cur->end()) return nullptr;
      cur = &*it;
      pos = end + 1;
    }
    return cur;
  }

  int Typed(const std::string& type, const OJson& s, const std::string& where,
            int depth) {
    if (type == "null") return re_->Literal("null");
    if (type == "boolean") {
      return re_->Alt({re_->Literal("true"), re_->Literal("false")});
    }
    if (type == "integer") return Integer(s, where);
    if (type == "number") return NumberType(s, where);
    if (type == "string") return String(s, where);
    if (type == "array") return Array(s, where, depth);
    if (type == "object") return ObjectType(s, where, depth);
    return Fail(where, absl::StrCat("unknown type '", type, "'"));
  }

  int Compile(const OJson& s, const std::string& where, int depth) {
    if (failed()) return -1;
    if (depth > kMaxSchemaDepth) return Fail(where, "schema nested too deeply");
    if (s.is_boolean()) {
      return s.get<bool>() ? AnyValue(options_.any_value_depth)
                           : re_->Nothing();
    }
    if (!s.is_object())
      return Fail(where, "a schema must be an object or a boolean");
    bool has_constraint = false;
    for (const auto& [key, value] : s.items()) {
      if (Annotations().contains(key)) continue;
      if (!Implemented().contains(key)) {
        return Fail(where, absl::StrCat("unsupported keyword '", key, "'"));
      }
      if (key != "$defs" && key != "definitions") has_constraint = true;
    }
    if (auto ref = s.find("$ref"); ref != s.end()) {
      if (!ref->is_string()) return Fail(where, "$ref must be a string");
      for (const auto& [key, value] : s.items()) {
        if (key != "$ref" && key != "$defs" && key != "definitions" &&
            !Annotations().contains(key)) {
          return Fail(where, absl::StrCat("keyword '", key,
                                          "' beside $ref is not supported"));
        }
      }
      const std::string target = ref->get<std::string>();
      const OJson* resolved = Resolve(target);
      if (resolved == nullptr) {
        return Fail(where, absl::StrCat("$ref '", target,
                                        "' does not resolve (only local "
                                        "references such as '#/$defs/x')"));
      }
      int& active = active_refs_[target];
      if (active >= options_.max_recursion) return re_->Nothing();
      ++active;
      int node = Compile(*resolved, target, depth + 1);
      --active_refs_[target];
      return node;
    }
    if (auto e = s.find("enum"); e != s.end()) {
      if (!e->is_array() || e->empty()) {
        return Fail(where, "enum must be a non-empty array");
      }
      std::vector<int> alts;
      for (const auto& v : *e) alts.push_back(re_->Literal(v.dump()));
      return re_->Alt(std::move(alts));
    }
    if (auto c = s.find("const"); c != s.end()) return re_->Literal(c->dump());
    if (auto any_of = s.find("anyOf"); any_of != s.end()) {
      if (!any_of->is_array() || any_of->empty()) {
        return Fail(where, "anyOf must be a non-empty array");
      }
      for (const auto& [key, value] : s.items()) {
        if (key != "anyOf" && key != "$defs" && key != "definitions" &&
            !Annotations().contains(key)) {
          return Fail(where, absl::StrCat("keyword '", key,
                                          "' beside anyOf is not supported"));
        }
      }
      std::vector<int> alts;
      for (size_t i = 0; i < any_of->size(); ++i) {
        alts.push_back(Compile((*any_of)[i], absl::StrCat(where, "/anyOf/", i),
                               depth + 1));
        if (alts.back() < 0) return -1;
      }
      return re_->Alt(std::move(alts));
    }
    auto type = s.find("type");
    if (type == s.end()) {
      if (!has_constraint) return AnyValue(options_.any_value_depth);
      for (const char* k : {"properties", "required", "additionalProperties"}) {
        if (s.contains(k)) return ObjectType(s, where, depth);
      }
      for (const char* k : {"items", "minItems", "maxItems"}) {
        if (s.contains(k)) return Array(s, where, depth);
      }
      for (const char* k : {"pattern", "format", "minLength", "maxLength"}) {
        if (s.contains(k)) return String(s, where);
      }
      return NumberType(s, where);
    }
    if (type->is_string())
      return Typed(type->get<std::string>(), s, where, depth);
    if (type->is_array() && !type->empty()) {
      std::vector<int> alts;
      for (const auto& t : *type) {
        if (!t.is_string()) return Fail(where, "type names must be strings");
        alts.push_back(Typed(t.get<std::string>(), s, where, depth));
        if (alts.back() < 0) return -1;
      }
      return re_->Alt(std::move(alts));
    }
    return Fail(where, "type must be a string or a non-empty array of strings");
  }

  const OJson* root_;
  const JsonSchemaOptions& options_;
  ByteRegex* re_;
  absl::Status status_;
  const DfaLimits* limits_;
  absl::Time deadline_;
  int string_char_ = -1;
  std::vector<int> any_;  // AnyValue node per depth
  absl::flat_hash_map<std::string, int> active_refs_;
};

}  // namespace

absl::StatusOr<int> CompileJsonSchema(std::string_view schema_text,
                                      const JsonSchemaOptions& options,
                                      ByteRegex* re, const DfaLimits* limits,
                                      absl::Time deadline) {
  if (NestingDepth(schema_text) > kMaxDocumentDepth) {
    return absl::InvalidArgumentError("json schema: nested too deeply");
  }
  OJson schema = OJson::parse(schema_text, nullptr, /*allow_exceptions=*/false);
  if (schema.is_discarded()) {
    return absl::InvalidArgumentError("json schema: not valid JSON");
  }
  SchemaCompiler compiler(&schema, options, re, limits, deadline);
  return compiler.Run(schema);
}

absl::StatusOr<int> CompileJsonObject(const JsonSchemaOptions& options,
                                      ByteRegex* re, const DfaLimits* limits,
                                      absl::Time deadline) {
  SchemaCompiler compiler(nullptr, options, re, limits, deadline);
  int node = compiler.AnyObject(options.any_value_depth);
  if (!re->status().ok()) return re->status();
  return node;
}

}  // namespace pdserve::structured
