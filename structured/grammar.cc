#include "structured/grammar.h"

#include <algorithm>
#include <cctype>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace pdserve::structured {

absl::Status GrammarOptions::Validate() const {
  if (max_recursion < 0 || max_recursion > 32) {
    return absl::InvalidArgumentError(
        "GrammarOptions: max_recursion must be in [0, 32]");
  }
  if (max_rules < 1 || max_expansions < 1) {
    return absl::InvalidArgumentError(
        "GrammarOptions: max_rules and max_expansions must be positive");
  }
  return absl::OkStatus();
}

namespace {

// Deepest ( group ) nesting the parser accepts, and deepest chain of rule
// expansions the compiler follows: both bound the compiler's stack.
constexpr int kMaxGroupDepth = 128;
constexpr int kMaxExpansionDepth = 1000;

struct Expr {
  enum class Kind { kLiteral, kClass, kRef, kSeq, kAlt, kRepeat };
  Kind kind = Kind::kSeq;
  std::string bytes;      // kLiteral (UTF-8)
  CodepointSet set;       // kClass
  std::string name;       // kRef
  int rule = -1;          // kRef, once resolved
  size_t offset = 0;      // where it starts in the text
  std::vector<int> kids;  // kSeq, kAlt; kRepeat: one
  int min = 0, max = 0;   // kRepeat (max -1: unbounded)
};

struct Rule {
  std::string name;
  int body = -1;
  size_t offset = 0;
};

struct Grammar {
  std::vector<Expr> exprs;
  std::vector<Rule> rules;
  int root = -1;
};

bool IsNameChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_';
}

std::string Printable(char c) {
  const auto u = static_cast<unsigned char>(c);
  if (u >= 0x21 && u < 0x7F) return std::string(1, c);
  return absl::StrFormat("\\x%02X", u);
}

class Parser {
 public:
  Parser(std::string_view text, const GrammarOptions& options)
      : text_(text), options_(options) {}

  absl::StatusOr<Grammar> Parse() {
    absl::flat_hash_map<std::string, int> by_name;
    while (status_.ok()) {
      SkipSpace();
      if (AtEnd()) break;
      const size_t offset = pos_;
      std::string name = ReadName();
      if (name.empty()) {
        Error(absl::StrCat("expected a rule name, found '", Printable(Peek()),
                           "'"));
        break;
      }
      SkipSpace();
      if (text_.substr(pos_, 3) != "::=") {
        Error(absl::StrCat("expected '::=' after the rule name '", name, "'"));
        break;
      }
      pos_ += 3;
      const int body = ParseAlt(0);
      if (!status_.ok()) break;
      SkipSpace();
      if (!AtEnd() && Peek() == ')') {
        Error("unmatched ')'");
        break;
      }
      if (auto it = by_name.find(name); it != by_name.end()) {
        return Fail(offset,
                    absl::StrFormat("rule '%s' is defined twice (first at "
                                    "offset %d)",
                                    name, g_.rules[it->second].offset));
      }
      if (static_cast<int>(g_.rules.size()) >= options_.max_rules) {
        return Fail(offset,
                    absl::StrFormat("more than %d rules", options_.max_rules));
      }
      by_name.emplace(name, static_cast<int>(g_.rules.size()));
      g_.rules.push_back({std::move(name), body, offset});
    }
    if (!status_.ok()) return status_;
    for (Expr& e : g_.exprs) {
      if (e.kind != Expr::Kind::kRef) continue;
      auto it = by_name.find(e.name);
      if (it == by_name.end()) {
        return Fail(e.offset, absl::StrCat("undefined rule '", e.name, "'"));
      }
      e.rule = it->second;
    }
    auto root = by_name.find("root");
    if (root == by_name.end()) {
      return absl::InvalidArgumentError(
          "grammar: no 'root' rule (the rule the output starts at)");
    }
    g_.root = root->second;
    return std::move(g_);
  }

 private:
  bool AtEnd() const { return pos_ >= text_.size(); }
  char Peek() const { return AtEnd() ? '\0' : text_[pos_]; }

  absl::Status Fail(size_t offset, const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrFormat("grammar: %s at offset %d", what, offset));
  }
  void Error(const std::string& what) {
    if (status_.ok()) status_ = Fail(pos_, what);
  }

  void SkipSpace() {
    while (!AtEnd()) {
      const char c = text_[pos_];
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        ++pos_;
      } else if (c == '#') {
        while (!AtEnd() && text_[pos_] != '\n') ++pos_;
      } else {
        break;
      }
    }
  }

  std::string ReadName() {
    const size_t start = pos_;
    while (!AtEnd() && IsNameChar(text_[pos_])) ++pos_;
    return std::string(text_.substr(start, pos_ - start));
  }

  // Whether `name ::=` starts here (the next rule's head ends this rule).
  bool AtRuleHead() {
    const size_t save = pos_;
    const bool named = !ReadName().empty();
    SkipSpace();
    const bool head = named && text_.substr(pos_, 3) == "::=";
    pos_ = save;
    return head;
  }

  int Add(Expr e) {
    g_.exprs.push_back(std::move(e));
    return static_cast<int>(g_.exprs.size()) - 1;
  }

  int ParseAlt(int depth) {
    if (depth > kMaxGroupDepth) {
      Error(absl::StrFormat("groups nested more than %d deep", kMaxGroupDepth));
      return -1;
    }
    Expr alt;
    alt.kind = Expr::Kind::kAlt;
    alt.offset = pos_;
    alt.kids.push_back(ParseSeq(depth));
    while (status_.ok() && Peek() == '|') {
      ++pos_;
      alt.kids.push_back(ParseSeq(depth));
    }
    if (!status_.ok()) return -1;
    if (alt.kids.size() == 1) return alt.kids[0];
    return Add(std::move(alt));
  }

  int ParseSeq(int depth) {
    Expr seq;
    seq.kind = Expr::Kind::kSeq;
    seq.offset = pos_;
    while (status_.ok()) {
      SkipSpace();
      if (AtEnd() || Peek() == '|' || Peek() == ')') break;
      if (IsNameChar(Peek()) && AtRuleHead()) break;
      int item = ParsePrimary(depth);
      if (item < 0) return -1;
      item = ParseQuantifiers(item);
      if (item < 0) return -1;
      seq.kids.push_back(item);
    }
    if (!status_.ok()) return -1;
    if (seq.kids.size() == 1) return seq.kids[0];
    return Add(std::move(seq));
  }

  int ParsePrimary(int depth) {
    const size_t offset = pos_;
    const char c = Peek();
    if (c == '"') return ParseLiteral();
    if (c == '[') return ParseClass();
    if (c == '(') {
      ++pos_;
      const int inner = ParseAlt(depth + 1);
      if (inner < 0) return -1;
      SkipSpace();
      if (Peek() != ')') {
        Error(absl::StrFormat(
            "expected ')' to close the group opened at offset %d", offset));
        return -1;
      }
      ++pos_;
      return inner;
    }
    if (c == '.') {
      ++pos_;
      Expr any;
      any.kind = Expr::Kind::kClass;
      any.offset = offset;
      any.set.Add(0, CodepointSet::kMax);
      return Add(std::move(any));
    }
    if (IsNameChar(c)) {
      Expr ref;
      ref.kind = Expr::Kind::kRef;
      ref.offset = offset;
      ref.name = ReadName();
      return Add(std::move(ref));
    }
    Error(absl::StrCat("unexpected '", Printable(c), "'"));
    return -1;
  }

  int ParseQuantifiers(int item) {
    while (status_.ok()) {
      SkipSpace();
      int min = 0, max = 0;
      const char c = Peek();
      if (c == '*') {
        min = 0, max = -1;
        ++pos_;
      } else if (c == '+') {
        min = 1, max = -1;
        ++pos_;
      } else if (c == '?') {
        min = 0, max = 1;
        ++pos_;
      } else if (c == '{') {
        if (!ParseBraces(&min, &max)) return -1;
      } else {
        break;
      }
      Expr rep;
      rep.kind = Expr::Kind::kRepeat;
      rep.offset = g_.exprs[item].offset;
      rep.kids = {item};
      rep.min = min;
      rep.max = max;
      item = Add(std::move(rep));
    }
    return status_.ok() ? item : -1;
  }

  // Reads a count of at most ByteRegex::kMaxRepeat; -1 when none is here.
  int ReadCount() {
    if (!std::isdigit(static_cast<unsigned char>(Peek()))) return -1;
    int64_t n = 0;
    while (std::isdigit(static_cast<unsigned char>(Peek()))) {
      n = n * 10 + (Peek() - '0');
      ++pos_;
      if (n > ByteRegex::kMaxRepeat) {
        Error(absl::StrFormat("repetition count above %d",
                              ByteRegex::kMaxRepeat));
        return -1;
      }
    }
    return static_cast<int>(n);
  }

  bool ParseBraces(int* min, int* max) {
    const size_t offset = pos_;
    ++pos_;  // '{'
    SkipSpace();
    *min = ReadCount();
    if (!status_.ok()) return false;
    if (*min < 0) {
      Error("expected a count after '{'");
      return false;
    }
    SkipSpace();
    *max = *min;
    if (Peek() == ',') {
      ++pos_;
      SkipSpace();
      *max = ReadCount();
      if (!status_.ok()) return false;
      SkipSpace();
    }
    if (Peek() != '}') {
      Error(absl::StrFormat("expected '}' to close the repetition at offset %d",
                            offset));
      return false;
    }
    ++pos_;
    if (*max >= 0 && *max < *min) {
      status_ =
          Fail(offset, absl::StrFormat("bad repetition {%d,%d}", *min, *max));
      return false;
    }
    return true;
  }

  // One code point of UTF-8 text.
  bool ReadChar(uint32_t* cp) {
    const auto b0 = static_cast<unsigned char>(text_[pos_]);
    int len = b0 < 0x80         ? 1
              : (b0 >> 5) == 6  ? 2
              : (b0 >> 4) == 14 ? 3
              : (b0 >> 3) == 30 ? 4
                                : 0;
    if (len == 0 || pos_ + len > text_.size()) {
      Error("invalid UTF-8");
      return false;
    }
    uint32_t v = len == 1 ? b0 : b0 & (0x7F >> len);
    for (int i = 1; i < len; ++i) {
      const auto b = static_cast<unsigned char>(text_[pos_ + i]);
      if ((b >> 6) != 2) {
        Error("invalid UTF-8");
        return false;
      }
      v = (v << 6) | (b & 0x3F);
    }
    static constexpr uint32_t kMinOfLen[] = {0, 0, 0x80, 0x800, 0x10000};
    if (v < kMinOfLen[len] || v > CodepointSet::kMax ||
        (v >= 0xD800 && v <= 0xDFFF)) {
      Error("invalid UTF-8");
      return false;
    }
    pos_ += len;
    *cp = v;
    return true;
  }

  // An escape at '\\' inside a literal or a class.
  bool ParseEscape(uint32_t* cp) {
    const size_t offset = pos_;
    ++pos_;
    if (AtEnd()) {
      Error("unfinished escape");
      return false;
    }
    const char c = text_[pos_++];
    int digits = 0;
    switch (c) {
      case 'n':
        *cp = '\n';
        return true;
      case 'r':
        *cp = '\r';
        return true;
      case 't':
        *cp = '\t';
        return true;
      case '\\':
      case '"':
      case '[':
      case ']':
      case '-':
      case '/':
        *cp = static_cast<unsigned char>(c);
        return true;
      case 'x':
        digits = 2;
        break;
      case 'u':
        digits = 4;
        break;
      case 'U':
        digits = 8;
        break;
      default:
        status_ =
            Fail(offset, absl::StrCat("unknown escape '\\", Printable(c), "'"));
        return false;
    }
    uint64_t v = 0;
    for (int i = 0; i < digits; ++i) {
      const char h = Peek();
      if (!std::isxdigit(static_cast<unsigned char>(h))) {
        status_ = Fail(offset, absl::StrFormat("escape '\\%c' needs %d hex "
                                               "digits",
                                               c, digits));
        return false;
      }
      v = v * 16 +
          (std::isdigit(static_cast<unsigned char>(h))
               ? h - '0'
               : std::tolower(static_cast<unsigned char>(h)) - 'a' + 10);
      ++pos_;
    }
    if (v > CodepointSet::kMax || (v >= 0xD800 && v <= 0xDFFF)) {
      status_ = Fail(offset, "escape is not a Unicode scalar value");
      return false;
    }
    *cp = static_cast<uint32_t>(v);
    return true;
  }

  int ParseLiteral() {
    Expr lit;
    lit.kind = Expr::Kind::kLiteral;
    lit.offset = pos_;
    ++pos_;  // '"'
    while (true) {
      if (AtEnd()) {
        Error(absl::StrFormat("unterminated string opened at offset %d",
                              lit.offset));
        return -1;
      }
      const char c = text_[pos_];
      uint32_t cp = 0;
      if (c == '"') {
        ++pos_;
        break;
      }
      if (c == '\\' ? !ParseEscape(&cp) : !ReadChar(&cp)) return -1;
      AppendUtf8(cp, &lit.bytes);
    }
    return Add(std::move(lit));
  }

  bool ClassChar(uint32_t* cp) {
    return Peek() == '\\' ? ParseEscape(cp) : ReadChar(cp);
  }

  int ParseClass() {
    Expr cls;
    cls.kind = Expr::Kind::kClass;
    cls.offset = pos_;
    ++pos_;  // '['
    const bool negate = Peek() == '^';
    if (negate) ++pos_;
    while (true) {
      if (AtEnd()) {
        Error(absl::StrFormat(
            "unterminated character class opened at offset %d", cls.offset));
        return -1;
      }
      if (Peek() == ']') {
        ++pos_;
        break;
      }
      const size_t at = pos_;
      uint32_t lo = 0, hi = 0;
      if (!ClassChar(&lo)) return -1;
      hi = lo;
      if (Peek() == '-' && pos_ + 1 < text_.size() && text_[pos_ + 1] != ']') {
        ++pos_;
        if (!ClassChar(&hi)) return -1;
        if (hi < lo) {
          status_ = Fail(at, "character range out of order");
          return -1;
        }
      }
      cls.set.Add(lo, hi);
    }
    if (negate) cls.set = cls.set.Complement();
    return Add(std::move(cls));
  }

  std::string_view text_;
  const GrammarOptions& options_;
  size_t pos_ = 0;
  absl::Status status_;
  Grammar g_;
};

class Compiler {
 public:
  Compiler(const Grammar& g, const GrammarOptions& options,
           const DfaLimits& limits, absl::Time deadline, ByteRegex* re)
      : g_(g),
        options_(options),
        limits_(limits),
        deadline_(deadline),
        re_(re) {}

  absl::StatusOr<int> Compile() {
    if (auto s = CheckProductive(); !s.ok()) return s;
    FindCycles();
    const int node = Enter(g_.root, options_.max_recursion);
    if (!status_.ok()) return status_;
    if (!re_->status().ok()) return re_->status();
    return node;
  }

 private:
  // Refuses a reachable rule that derives no finite string: the standard
  // productive-nonterminal fixpoint.
  absl::Status CheckProductive() {
    const int n = static_cast<int>(g_.rules.size());
    productive_.assign(n, false);
    for (bool changed = true; changed;) {
      changed = false;
      for (int r = 0; r < n; ++r) {
        if (!productive_[r] && Productive(g_.rules[r].body)) {
          productive_[r] = true;
          changed = true;
        }
      }
    }
    std::vector<bool> seen(n, false);
    std::vector<int> stack = {g_.root};
    seen[g_.root] = true;
    refs_.assign(n, {});
    for (int r = 0; r < n; ++r) CollectRefs(g_.rules[r].body, &refs_[r]);
    while (!stack.empty()) {
      const int r = stack.back();
      stack.pop_back();
      for (int s : refs_[r]) {
        if (!seen[s]) {
          seen[s] = true;
          stack.push_back(s);
        }
      }
    }
    for (int r = 0; r < n; ++r) {
      if (seen[r] && !productive_[r]) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "grammar: rule '%s' (offset %d) derives no finite string: every "
            "alternative recurses without reaching a base case, or uses an "
            "empty character class",
            g_.rules[r].name, g_.rules[r].offset));
      }
    }
    return absl::OkStatus();
  }

  bool Productive(int id) const {
    const Expr& e = g_.exprs[id];
    switch (e.kind) {
      case Expr::Kind::kLiteral:
        return true;
      case Expr::Kind::kClass:
        return !e.set.empty();
      case Expr::Kind::kRef:
        return productive_[e.rule];
      case Expr::Kind::kSeq:
        return std::all_of(e.kids.begin(), e.kids.end(),
                           [&](int k) { return Productive(k); });
      case Expr::Kind::kAlt:
        return std::any_of(e.kids.begin(), e.kids.end(),
                           [&](int k) { return Productive(k); });
      case Expr::Kind::kRepeat:
        return e.min == 0 || Productive(e.kids[0]);
    }
    return false;
  }

  void CollectRefs(int id, std::vector<int>* out) const {
    const Expr& e = g_.exprs[id];
    if (e.kind == Expr::Kind::kRef) {
      if (std::find(out->begin(), out->end(), e.rule) == out->end())
        out->push_back(e.rule);
      return;
    }
    for (int k : e.kids) CollectRefs(k, out);
  }

  // Strongly connected components of the reference graph (Tarjan), and
  // whether each is a cycle (more than one rule, or a rule referring to
  // itself).
  void FindCycles() {
    const int n = static_cast<int>(g_.rules.size());
    scc_.assign(n, -1);
    index_.assign(n, -1);
    low_.assign(n, 0);
    on_stack_.assign(n, false);
    for (int r = 0; r < n; ++r) {
      if (index_[r] < 0) Tarjan(r);
    }
    cyclic_.assign(num_sccs_, false);
    std::vector<int> size(num_sccs_, 0);
    for (int r = 0; r < n; ++r) ++size[scc_[r]];
    for (int r = 0; r < n; ++r) {
      if (size[scc_[r]] > 1 ||
          std::find(refs_[r].begin(), refs_[r].end(), r) != refs_[r].end()) {
        cyclic_[scc_[r]] = true;
      }
    }
  }

  void Tarjan(int r) {
    index_[r] = low_[r] = next_index_++;
    stack_.push_back(r);
    on_stack_[r] = true;
    for (int s : refs_[r]) {
      if (index_[s] < 0) {
        Tarjan(s);
        low_[r] = std::min(low_[r], low_[s]);
      } else if (on_stack_[s]) {
        low_[r] = std::min(low_[r], index_[s]);
      }
    }
    if (low_[r] == index_[r]) {
      while (true) {
        const int s = stack_.back();
        stack_.pop_back();
        on_stack_[s] = false;
        scc_[s] = num_sccs_;
        if (s == r) break;
      }
      ++num_sccs_;
    }
  }

  void Fail(absl::Status status) {
    if (status_.ok()) status_ = std::move(status);
  }

  // `rule` entered afresh with `budget` levels left: a rule on a cycle is
  // compiled once per level to a minimized DFA and embedded; any other rule
  // is expanded in place.
  int Enter(int rule, int budget) {
    if (!cyclic_[scc_[rule]]) return Expand(rule, budget, {rule});
    const std::pair<int, int> key(rule, budget);
    if (auto it = entered_.find(key); it != entered_.end()) return it->second;
    const int node = Expand(rule, budget, {rule});
    if (node < 0) return -1;
    int embedded = node;
    if (re_->node(node).kind != ByteRegex::Kind::kNothing) {
      DfaLimits limits = limits_;
      limits.max_build_time = deadline_ - absl::Now();
      if (limits.max_build_time <= absl::ZeroDuration()) return TimeUp();
      auto dfa = Dfa::Build(*re_, node, limits);
      if (dfa.ok()) dfa = dfa->Minimized(deadline_);
      if (!dfa.ok()) {
        Fail(absl::InvalidArgumentError(absl::StrFormat(
            "grammar: rule '%s' at nesting level %d: %s", g_.rules[rule].name,
            options_.max_recursion - budget, dfa.status().message())));
        return -1;
      }
      embedded = re_->Automaton(std::make_shared<const Dfa>(*std::move(dfa)));
    }
    entered_.emplace(key, embedded);
    return embedded;
  }

  int TimeUp() {
    Fail(absl::InvalidArgumentError(
        absl::StrFormat("grammar: compile exceeded its time limit of %s",
                        absl::FormatDuration(limits_.max_build_time))));
    return -1;
  }

  // `rule`'s body with `budget` levels left, inside the rules `active` of
  // its own cycle (sorted).
  int Expand(int rule, int budget, std::vector<int> active) {
    if (!status_.ok()) return -1;
    const std::string key =
        absl::StrCat(rule, ":", budget, ":", absl::StrJoin(active, ","));
    if (auto it = expanded_.find(key); it != expanded_.end()) return it->second;
    if (static_cast<int>(expanded_.size()) >= options_.max_expansions) {
      Fail(absl::InvalidArgumentError(absl::StrFormat(
          "grammar: too large: more than %d rule expansions (rules x nesting "
          "levels)",
          options_.max_expansions)));
      return -1;
    }
    if (depth_ >= kMaxExpansionDepth) {
      Fail(absl::InvalidArgumentError(
          absl::StrFormat("grammar: rule references nest more than %d deep",
                          kMaxExpansionDepth)));
      return -1;
    }
    if (absl::Now() > deadline_) return TimeUp();
    ++depth_;
    const int node = Emit(g_.rules[rule].body, rule, budget, active);
    --depth_;
    if (node < 0) {
      Fail(re_->status().ok() ? absl::InternalError("grammar: no node")
                              : re_->status());
      return -1;
    }
    expanded_.emplace(key, node);
    return node;
  }

  int Emit(int id, int rule, int budget, const std::vector<int>& active) {
    if (!status_.ok()) return -1;
    const Expr& e = g_.exprs[id];
    switch (e.kind) {
      case Expr::Kind::kLiteral:
        return re_->Literal(e.bytes);
      case Expr::Kind::kClass:
        return re_->Codepoints(e.set);
      case Expr::Kind::kSeq:
      case Expr::Kind::kAlt: {
        std::vector<int> parts;
        for (int k : e.kids) {
          parts.push_back(Emit(k, rule, budget, active));
          if (parts.back() < 0) return -1;
        }
        return e.kind == Expr::Kind::kSeq ? re_->Concat(std::move(parts))
                                          : re_->Alt(std::move(parts));
      }
      case Expr::Kind::kRepeat: {
        const int kid = Emit(e.kids[0], rule, budget, active);
        if (kid < 0) return -1;
        return re_->Repeat(kid, e.min, e.max);
      }
      case Expr::Kind::kRef: {
        const int s = e.rule;
        // A rule of another component is entered afresh: nothing in it can
        // lead back here.
        if (scc_[s] != scc_[rule]) return Enter(s, budget);
        // Re-entering a rule this expansion is inside costs a level; past
        // the last one the alternative is left out.
        if (std::binary_search(active.begin(), active.end(), s)) {
          return budget == 0 ? re_->Nothing() : Enter(s, budget - 1);
        }
        std::vector<int> inner = active;
        inner.insert(std::upper_bound(inner.begin(), inner.end(), s), s);
        return Expand(s, budget, std::move(inner));
      }
    }
    return -1;
  }

  const Grammar& g_;
  const GrammarOptions& options_;
  const DfaLimits& limits_;
  const absl::Time deadline_;
  ByteRegex* re_;
  absl::Status status_;

  std::vector<bool> productive_;
  std::vector<std::vector<int>> refs_;  // rules each rule refers to
  std::vector<int> scc_, index_, low_, stack_;
  std::vector<bool> on_stack_, cyclic_;
  int next_index_ = 0, num_sccs_ = 0;

  int depth_ = 0;
  absl::flat_hash_map<std::string, int> expanded_;
  absl::flat_hash_map<std::pair<int, int>, int> entered_;
};

}  // namespace

absl::StatusOr<int> CompileGrammar(std::string_view text,
                                   const GrammarOptions& options,
                                   const DfaLimits& limits, absl::Time deadline,
                                   ByteRegex* re) {
  auto grammar = Parser(text, options).Parse();
  if (!grammar.ok()) return grammar.status();
  return Compiler(*grammar, options, limits, deadline, re).Compile();
}

}  // namespace pdserve::structured
