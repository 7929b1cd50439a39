#include "structured/byte_regex.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace pdserve::structured {

void CodepointSet::Add(uint32_t lo, uint32_t hi) {
  if (lo > hi || lo > kMax) return;
  ranges_.emplace_back(lo, std::min(hi, kMax));
  Normalize();
}

void CodepointSet::Add(const CodepointSet& other) {
  ranges_.insert(ranges_.end(), other.ranges_.begin(), other.ranges_.end());
  Normalize();
}

bool CodepointSet::Contains(uint32_t cp) const {
  for (const auto& [lo, hi] : ranges_) {
    if (cp >= lo && cp <= hi) return true;
  }
  return false;
}

CodepointSet CodepointSet::Complement() const {
  CodepointSet out;
  uint32_t next = 0;
  for (const auto& [lo, hi] : ranges_) {
    if (lo > next) out.ranges_.emplace_back(next, lo - 1);
    next = hi + 1;
  }
  if (next <= kMax) out.ranges_.emplace_back(next, kMax);
  return out;
}

void CodepointSet::Remove(uint32_t lo, uint32_t hi) {
  std::vector<std::pair<uint32_t, uint32_t>> kept;
  for (const auto& [a, b] : ranges_) {
    if (b < lo || a > hi) {
      kept.emplace_back(a, b);
      continue;
    }
    if (a < lo) kept.emplace_back(a, lo - 1);
    if (b > hi) kept.emplace_back(hi + 1, b);
  }
  ranges_ = std::move(kept);
}

void CodepointSet::Normalize() {
  std::sort(ranges_.begin(), ranges_.end());
  std::vector<std::pair<uint32_t, uint32_t>> merged;
  for (const auto& r : ranges_) {
    if (!merged.empty() && r.first <= merged.back().second + 1) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  ranges_ = std::move(merged);
}

namespace {

// Splits [lo, hi] (no surrogates, same encoded length after the first
// splits) into ranges whose UTF-8 encodings are byte-range sequences, the
// way RE2 and Rust's regex-syntax do.
void Utf8Sequences(uint32_t lo, uint32_t hi,
                   std::vector<std::vector<std::pair<uint8_t, uint8_t>>>* out) {
  for (uint32_t max : {0x7Fu, 0x7FFu, 0xFFFFu}) {
    if (lo <= max && hi > max) {
      Utf8Sequences(lo, max, out);
      Utf8Sequences(max + 1, hi, out);
      return;
    }
  }
  if (hi <= 0x7F) {
    out->push_back({{static_cast<uint8_t>(lo), static_cast<uint8_t>(hi)}});
    return;
  }
  for (int i = 1; i < 4; ++i) {
    const uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        Utf8Sequences(lo, lo | m, out);
        Utf8Sequences((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        Utf8Sequences(lo, (hi & ~m) - 1, out);
        Utf8Sequences(hi & ~m, hi, out);
        return;
      }
    }
  }
  std::string a, b;
  AppendUtf8(lo, &a);
  AppendUtf8(hi, &b);
  std::vector<std::pair<uint8_t, uint8_t>> seq;
  for (size_t k = 0; k < a.size(); ++k) {
    seq.emplace_back(static_cast<uint8_t>(a[k]), static_cast<uint8_t>(b[k]));
  }
  out->push_back(std::move(seq));
}

}  // namespace

int ByteRegex::Add(Node node) {
  if (!status_.ok()) return -1;
  if (size() >= max_nodes_) {
    Fail(absl::ResourceExhaustedError(absl::StrFormat(
        "constraint too large: more than %d regex nodes", max_nodes_)));
    return -1;
  }
  nodes_.push_back(std::move(node));
  return size() - 1;
}

ByteRegex::Node ByteRegex::MakeNode(Kind kind) {
  Node n;
  n.kind = kind;
  return n;
}

int ByteRegex::Nothing() { return Add(MakeNode(Kind::kNothing)); }
int ByteRegex::Empty() { return Add(MakeNode(Kind::kEmpty)); }

int ByteRegex::Bytes(const ByteSet& set) {
  if (set.none()) return Nothing();
  Node n = MakeNode(Kind::kBytes);
  n.bytes = set;
  return Add(std::move(n));
}

int ByteRegex::Byte(uint8_t b) {
  ByteSet s;
  s.set(b);
  return Bytes(s);
}

int ByteRegex::Literal(std::string_view bytes) {
  if (bytes.empty()) return Empty();
  std::vector<int> parts;
  for (char c : bytes) parts.push_back(Byte(static_cast<uint8_t>(c)));
  return Concat(std::move(parts));
}

int ByteRegex::Concat(std::vector<int> parts) {
  if (!status_.ok()) return -1;
  std::vector<int> kept;
  for (int p : parts) {
    if (p < 0) return -1;
    if (nodes_[p].kind == Kind::kNothing) return Nothing();
    if (nodes_[p].kind != Kind::kEmpty) kept.push_back(p);
  }
  if (kept.empty()) return Empty();
  if (kept.size() == 1) return kept[0];
  Node n = MakeNode(Kind::kConcat);
  n.kids = std::move(kept);
  return Add(std::move(n));
}

int ByteRegex::Alt(std::vector<int> parts) {
  if (!status_.ok()) return -1;
  std::vector<int> kept;
  for (int p : parts) {
    if (p < 0) return -1;
    if (nodes_[p].kind != Kind::kNothing) kept.push_back(p);
  }
  if (kept.empty()) return Nothing();
  if (kept.size() == 1) return kept[0];
  Node n = MakeNode(Kind::kAlt);
  n.kids = std::move(kept);
  return Add(std::move(n));
}

int ByteRegex::Repeat(int kid, int min, int max) {
  if (!status_.ok() || kid < 0) return -1;
  if (min < 0 || (max >= 0 && max < min)) {
    Fail(absl::InvalidArgumentError(
        absl::StrFormat("bad repetition {%d,%d}", min, max)));
    return -1;
  }
  if (min > kMaxRepeat || max > kMaxRepeat) {
    Fail(absl::InvalidArgumentError(absl::StrFormat(
        "repetition count above %d is not supported", kMaxRepeat)));
    return -1;
  }
  if (max == 0) return Empty();
  if (nodes_[kid].kind == Kind::kNothing) return min == 0 ? Empty() : kid;
  if (nodes_[kid].kind == Kind::kEmpty) return kid;
  if (min == 1 && max == 1) return kid;
  Node n = MakeNode(Kind::kRepeat);
  n.kids = {kid};
  n.min = min;
  n.max = max;
  return Add(std::move(n));
}

int ByteRegex::Automaton(std::shared_ptr<const Dfa> dfa) {
  if (!status_.ok() || dfa == nullptr) return -1;
  Node n = MakeNode(Kind::kAutomaton);
  n.automaton = static_cast<int>(automata_.size());
  const int id = Add(std::move(n));
  if (id >= 0) automata_.push_back(std::move(dfa));
  return id;
}

int ByteRegex::Codepoints(const CodepointSet& set) {
  std::vector<std::vector<std::pair<uint8_t, uint8_t>>> seqs;
  for (auto [lo, hi] : set.ranges()) {
    // Surrogates have no UTF-8 encoding.
    if (lo <= 0xDFFF && hi >= 0xD800) {
      if (lo < 0xD800) Utf8Sequences(lo, 0xD7FF, &seqs);
      if (hi > 0xDFFF) Utf8Sequences(0xE000, hi, &seqs);
      continue;
    }
    Utf8Sequences(lo, hi, &seqs);
  }
  std::vector<int> alts;
  for (const auto& seq : seqs) {
    std::vector<int> parts;
    for (auto [a, b] : seq) {
      ByteSet s;
      for (int x = a; x <= b; ++x) s.set(x);
      parts.push_back(Bytes(s));
    }
    alts.push_back(Concat(std::move(parts)));
  }
  return Alt(std::move(alts));
}

int ByteRegex::JsonStringChars(const CodepointSet& set) {
  CodepointSet plain = set;
  plain.Remove(0, 0x1F);
  plain.Remove('"', '"');
  plain.Remove('\\', '\\');
  std::vector<int> alts = {Codepoints(plain)};
  if (set.Contains('"')) alts.push_back(Literal("\\\""));
  if (set.Contains('\\')) alts.push_back(Literal("\\\\"));
  for (uint32_t c = 0; c < 0x20; ++c) {
    if (!set.Contains(c)) continue;
    switch (c) {
      case '\b':
        alts.push_back(Literal("\\b"));
        break;
      case '\f':
        alts.push_back(Literal("\\f"));
        break;
      case '\n':
        alts.push_back(Literal("\\n"));
        break;
      case '\r':
        alts.push_back(Literal("\\r"));
        break;
      case '\t':
        alts.push_back(Literal("\\t"));
        break;
      default:
        alts.push_back(Literal(absl::StrFormat("\\u%04x", c)));
    }
  }
  return Alt(std::move(alts));
}

}  // namespace pdserve::structured
