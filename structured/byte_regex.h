// A regular expression over bytes, as a tree in an arena: the common form that
// every constraint (regex text, a choice among strings, a JSON schema)
// compiles to before it becomes a DFA (structured/dfa.h).
//
// Leaves are byte sets; Unicode text is turned into UTF-8 byte sequences
// here (AddCodepoints), so a character that a BPE token splits is matched
// byte by byte like any other. The builder counts the nodes it makes and
// fails with RESOURCE_EXHAUSTED past a cap, which bounds what a hostile
// constraint can make the compiler do. Thread-compatible.
#pragma once

#include <bitset>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/utf8.h"

namespace pdserve::structured {

class Dfa;  // structured/dfa.h

using ByteSet = std::bitset<256>;

// A set of Unicode code points as sorted, disjoint, inclusive ranges.
class CodepointSet {
 public:
  static constexpr uint32_t kMax = 0x10FFFF;
  void Add(uint32_t lo, uint32_t hi);
  void Add(const CodepointSet& other);
  bool Contains(uint32_t cp) const;
  // Every code point (surrogates excluded when converted) not in this set.
  CodepointSet Complement() const;
  // Removes [lo, hi].
  void Remove(uint32_t lo, uint32_t hi);
  bool empty() const { return ranges_.empty(); }
  const std::vector<std::pair<uint32_t, uint32_t>>& ranges() const {
    return ranges_;
  }

 private:
  void Normalize();
  std::vector<std::pair<uint32_t, uint32_t>> ranges_;
};

class ByteRegex {
 public:
  // kAutomaton: the language of an already built DFA, so a part that many
  // places share (a grammar rule at one nesting depth) is compiled and
  // minimized once and embedded at each place as its few states, instead of
  // as copies of its whole regex.
  enum class Kind {
    kNothing,
    kEmpty,
    kBytes,
    kConcat,
    kAlt,
    kRepeat,
    kAutomaton
  };
  struct Node {
    Kind kind = Kind::kEmpty;
    ByteSet bytes;          // kBytes
    std::vector<int> kids;  // kConcat, kAlt: the parts; kRepeat: one
    int min = 0;            // kRepeat: at least min copies
    int max = 0;            // kRepeat: at most max copies; -1 unbounded
    int automaton = -1;     // kAutomaton: index into automata
  };

  explicit ByteRegex(int max_nodes = 200000) : max_nodes_(max_nodes) {}

  // Each returns a node id, or -1 once the node cap is reached (then
  // status() is RESOURCE_EXHAUSTED and every later call returns -1 too).
  int Nothing();  // matches no string
  int Empty();    // matches only the empty string
  int Bytes(const ByteSet& set);
  int Byte(uint8_t b);
  int Literal(std::string_view bytes);
  int Concat(std::vector<int> parts);
  int Alt(std::vector<int> parts);
  // min..max copies of `kid` (max -1: unbounded). Fails (status) when
  // max < min or a bound exceeds kMaxRepeat.
  int Repeat(int kid, int min, int max);
  int Optional(int kid) { return Repeat(kid, 0, 1); }
  // The strings `dfa` accepts (a trimmed DFA, as Dfa::Build makes).
  int Automaton(std::shared_ptr<const Dfa> dfa);
  // The UTF-8 encodings of `set`'s code points (surrogates excluded).
  int Codepoints(const CodepointSet& set);
  // The same characters as they appear inside a JSON string literal: plain
  // characters as themselves, and '"', '\\' and control characters (which
  // JSON requires escaped) as their escape sequences, so a pattern's
  // characters map to the escaped text a JSON parser decodes back to them.
  int JsonStringChars(const CodepointSet& set);

  static constexpr int kMaxRepeat = 10000;

  const Node& node(int id) const { return nodes_[id]; }
  const Dfa& automaton(int index) const { return *automata_[index]; }
  const std::shared_ptr<const Dfa>& shared_automaton(int index) const {
    return automata_[index];
  }
  int size() const { return static_cast<int>(nodes_.size()); }
  const absl::Status& status() const { return status_; }
  void Fail(absl::Status status) {
    if (status_.ok()) status_ = std::move(status);
  }

 private:
  static Node MakeNode(Kind kind);
  int Add(Node node);

  int max_nodes_;
  std::vector<Node> nodes_;
  std::vector<std::shared_ptr<const Dfa>> automata_;
  absl::Status status_;
};

using ::pdserve::AppendUtf8;  // common/utf8.h

}  // namespace pdserve::structured
