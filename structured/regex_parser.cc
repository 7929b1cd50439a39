#include "structured/regex_parser.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"

namespace pdserve::structured {
namespace {

constexpr int kMaxGroupDepth = 64;

class Parser {
 public:
  Parser(std::string_view text, RegexTarget target, ByteRegex* re)
      : text_(text), target_(target), re_(re) {}

  absl::StatusOr<int> Parse() {
    if (Peek() == '^') ++pos_;
    int node = ParseAlt(0);
    if (!re_->status().ok()) return re_->status();
    if (error_.ok() && pos_ < text_.size()) Error("unbalanced ')'");
    if (!error_.ok()) return error_;
    if (node < 0) return absl::InternalError("regex: no node");
    return node;
  }

 private:
  int Peek() const {
    return pos_ < text_.size() ? static_cast<unsigned char>(text_[pos_]) : -1;
  }

  int Error(const std::string& what) {
    if (error_.ok()) {
      error_ = absl::InvalidArgumentError(
          absl::StrFormat("regex: %s at offset %d", what, pos_));
    }
    return -1;
  }

  // Next code point of the UTF-8 text; invalid bytes are an error.
  bool NextCodepoint(uint32_t* cp) {
    const unsigned char c = static_cast<unsigned char>(text_[pos_]);
    int len = c < 0x80         ? 1
              : (c >> 5) == 6  ? 2
              : (c >> 4) == 14 ? 3
              : (c >> 3) == 30 ? 4
                               : 0;
    if (len == 0 || pos_ + len > text_.size()) {
      Error("invalid UTF-8");
      return false;
    }
    uint32_t v = len == 1 ? c : c & (0x7F >> len);
    for (int i = 1; i < len; ++i) {
      const unsigned char d = static_cast<unsigned char>(text_[pos_ + i]);
      if ((d & 0xC0) != 0x80) {
        Error("invalid UTF-8");
        return false;
      }
      v = (v << 6) | (d & 0x3F);
    }
    pos_ += len;
    *cp = v;
    return true;
  }

  int Leaf(const CodepointSet& set) {
    return target_ == RegexTarget::kJsonString ? re_->JsonStringChars(set)
                                               : re_->Codepoints(set);
  }

  int ParseAlt(int depth) {
    if (depth > kMaxGroupDepth) return Error("groups nested too deeply");
    std::vector<int> alts = {ParseConcat(depth)};
    while (error_.ok() && Peek() == '|') {
      ++pos_;
      alts.push_back(ParseConcat(depth));
    }
    if (!error_.ok()) return -1;
    return re_->Alt(std::move(alts));
  }

  int ParseConcat(int depth) {
    std::vector<int> parts;
    while (error_.ok() && pos_ < text_.size() && Peek() != '|' &&
           Peek() != ')') {
      if (Peek() == '$' && pos_ + 1 == text_.size()) {
        ++pos_;
        break;
      }
      int atom = ParseAtom(depth);
      if (atom < 0) return -1;
      atom = ParseQuantifiers(atom);
      if (atom < 0) return -1;
      parts.push_back(atom);
    }
    if (!error_.ok()) return -1;
    return re_->Concat(std::move(parts));
  }

  // Reads digits; false when there are none.
  bool Number(int* out) {
    size_t start = pos_;
    int64_t v = 0;
    while (Peek() >= '0' && Peek() <= '9') {
      v = v * 10 + (Peek() - '0');
      if (v > 1000000) v = 1000000;
      ++pos_;
    }
    *out = static_cast<int>(v);
    return pos_ > start;
  }

  int ParseQuantifiers(int atom) {
    while (error_.ok()) {
      int min, max;
      const int c = Peek();
      if (c == '*') {
        min = 0, max = -1, ++pos_;
      } else if (c == '+') {
        min = 1, max = -1, ++pos_;
      } else if (c == '?') {
        min = 0, max = 1, ++pos_;
      } else if (c == '{') {
        const size_t save = pos_;
        ++pos_;
        if (!Number(&min)) {
          pos_ = save;  // a literal '{'
          return atom;
        }
        max = min;
        if (Peek() == ',') {
          ++pos_;
          if (!Number(&max)) max = -1;
        }
        if (Peek() != '}') {
          pos_ = save;
          return atom;
        }
        ++pos_;
      } else {
        return atom;
      }
      if (Peek() == '?') ++pos_;  // lazy: the same language
      if (Peek() == '+')
        return Error("possessive quantifiers are not supported");
      if (max >= 0 && max < min) return Error("repetition {n,m} with m < n");
      atom = re_->Repeat(atom, min, max);
      if (atom < 0) return re_->status().ok() ? Error("bad repetition") : -1;
    }
    return -1;
  }

  int ParseAtom(int depth) {
    const int c = Peek();
    if (c == '(') {
      ++pos_;
      if (Peek() == '?') {
        if (pos_ + 1 < text_.size() && text_[pos_ + 1] == ':') {
          pos_ += 2;
        } else if (pos_ + 1 < text_.size() && text_[pos_ + 1] == 'P' &&
                   pos_ + 2 < text_.size() && text_[pos_ + 2] == '<') {
          // (?P<name>...): a named group, matched like any group.
          const size_t close = text_.find('>', pos_);
          if (close == std::string_view::npos) return Error("bad group name");
          pos_ = close + 1;
        } else if (pos_ + 1 < text_.size() && text_[pos_ + 1] == '<' &&
                   pos_ + 2 < text_.size() && text_[pos_ + 2] != '=' &&
                   text_[pos_ + 2] != '!') {
          const size_t close = text_.find('>', pos_);
          if (close == std::string_view::npos) return Error("bad group name");
          pos_ = close + 1;
        } else {
          return Error("lookaround and inline flags are not supported");
        }
      }
      int inner = ParseAlt(depth + 1);
      if (inner < 0) return -1;
      if (Peek() != ')') return Error("missing ')'");
      ++pos_;
      return inner;
    }
    if (c == '[') return ParseClass();
    if (c == '.') {
      ++pos_;
      CodepointSet any;
      any.Add(0, CodepointSet::kMax);
      any.Remove('\n', '\n');
      return Leaf(any);
    }
    if (c == '*' || c == '+' || c == '?') return Error("nothing to repeat");
    if (c == '^') return Error("'^' is only supported at the start");
    if (c == '$') return Error("'$' is only supported at the end");
    CodepointSet set;
    if (c == '\\') {
      if (!ParseEscape(&set, /*in_class=*/false)) return -1;
      return Leaf(set);
    }
    uint32_t cp;
    if (!NextCodepoint(&cp)) return -1;
    set.Add(cp, cp);
    return Leaf(set);
  }

  // After '\\': adds what the escape matches to `set`.
  bool ParseEscape(CodepointSet* set, bool in_class) {
    ++pos_;
    if (pos_ >= text_.size()) {
      Error("trailing backslash");
      return false;
    }
    const char c = text_[pos_];
    auto hex = [&](int digits, uint32_t* out) {
      uint32_t v = 0;
      for (int i = 0; i < digits; ++i) {
        if (pos_ >= text_.size() || !isxdigit(text_[pos_])) return false;
        const char h = text_[pos_++];
        v = v * 16 + (isdigit(h) ? h - '0' : (tolower(h) - 'a' + 10));
      }
      *out = v;
      return true;
    };
    CodepointSet s;
    switch (c) {
      case 'd':
      case 'D':
        s.Add('0', '9');
        break;
      case 'w':
      case 'W':
        s.Add('0', '9'), s.Add('A', 'Z'), s.Add('a', 'z'), s.Add('_', '_');
        break;
      case 's':
      case 'S':
        s.Add(' ', ' '), s.Add('\t', '\r');
        break;
      case 'n':
        s.Add('\n', '\n');
        break;
      case 't':
        s.Add('\t', '\t');
        break;
      case 'r':
        s.Add('\r', '\r');
        break;
      case 'f':
        s.Add('\f', '\f');
        break;
      case 'v':
        s.Add('\v', '\v');
        break;
      case '0':
        s.Add(0, 0);
        break;
      case 'x':
      case 'u': {
        ++pos_;
        uint32_t v;
        if (c == 'u' && Peek() == '{') {
          ++pos_;
          v = 0;
          int n = 0;
          while (pos_ < text_.size() && isxdigit(text_[pos_]) && n < 6) {
            const char h = text_[pos_++];
            v = v * 16 + (isdigit(h) ? h - '0' : (tolower(h) - 'a' + 10));
            ++n;
          }
          if (n == 0 || Peek() != '}' || v > CodepointSet::kMax) {
            Error("bad \\u{...} escape");
            return false;
          }
          ++pos_;
        } else if (!hex(c == 'x' ? 2 : 4, &v)) {
          Error(absl::StrFormat("bad \\%c escape", c));
          return false;
        }
        set->Add(v, v);
        return true;
      }
      case 'b':
        if (in_class) {
          s.Add('\b', '\b');
          break;
        }
        [[fallthrough]];
      case 'B':
        Error("word boundaries are not supported");
        return false;
      default:
        if (c >= '1' && c <= '9') {
          Error("backreferences are not supported");
          return false;
        }
        if (isalnum(static_cast<unsigned char>(c))) {
          Error(absl::StrFormat("unknown escape \\%c", c));
          return false;
        }
        {
          uint32_t cp;
          if (!NextCodepoint(&cp)) return false;
          set->Add(cp, cp);
          return true;
        }
    }
    ++pos_;
    set->Add(c == 'D' || c == 'W' || c == 'S' ? s.Complement() : s);
    return true;
  }

  int ParseClass() {
    ++pos_;  // '['
    bool negate = false;
    if (Peek() == '^') {
      negate = true;
      ++pos_;
    }
    CodepointSet set;
    bool first = true;
    while (true) {
      if (pos_ >= text_.size()) return Error("missing ']'");
      if (Peek() == ']' && !first) break;
      first = false;
      uint32_t lo;
      if (Peek() == '\\') {
        CodepointSet esc;
        if (!ParseEscape(&esc, /*in_class=*/true)) return -1;
        if (esc.ranges().size() != 1 ||
            esc.ranges()[0].first != esc.ranges()[0].second) {
          set.Add(esc);
          continue;
        }
        lo = esc.ranges()[0].first;
      } else if (Peek() == '[' && pos_ + 1 < text_.size() &&
                 text_[pos_ + 1] == ':') {
        return Error("POSIX classes are not supported");
      } else if (!NextCodepoint(&lo)) {
        return -1;
      }
      uint32_t hi = lo;
      if (Peek() == '-' && pos_ + 1 < text_.size() && text_[pos_ + 1] != ']') {
        ++pos_;
        if (Peek() == '\\') {
          CodepointSet esc;
          if (!ParseEscape(&esc, /*in_class=*/true)) return -1;
          if (esc.ranges().size() != 1 ||
              esc.ranges()[0].first != esc.ranges()[0].second) {
            return Error("bad class range");
          }
          hi = esc.ranges()[0].first;
        } else if (!NextCodepoint(&hi)) {
          return -1;
        }
        if (hi < lo) return Error("class range out of order");
      }
      set.Add(lo, hi);
    }
    ++pos_;  // ']'
    if (negate) set = set.Complement();
    if (set.empty()) return re_->Nothing();
    return Leaf(set);
  }

  std::string_view text_;
  RegexTarget target_;
  ByteRegex* re_;
  size_t pos_ = 0;
  absl::Status error_;
};

}  // namespace

absl::StatusOr<int> ParseRegex(std::string_view pattern, RegexTarget target,
                               ByteRegex* re) {
  Parser parser(pattern, target, re);
  return parser.Parse();
}

}  // namespace pdserve::structured
