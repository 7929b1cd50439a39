// What the files of the BPE tokenizer share (bpe_tokenizer.cc: the
// tokenizer's surface, added-token sections, decoding; bpe_pretokenizer.cc:
// normalizers and pre-tokenizer splits, read from tokenizer.json and applied;
// bpe_merge.cc: the merge loop of one piece; bpe_json_loader.cc: reading
// tokenizer.json and its config files). Nothing else includes it.
#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/normalizer2.h>
#include <unicode/uregex.h>
#include <unicode/utext.h>

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/json.h"
#include "common/utf8.h"
#include "tokenizer/bpe_tokenizer.h"

namespace pdserve::engine::bpe_internal {

using json::StringOrNull;
using json::Value;

constexpr std::string_view kMetaspace = "\xE2\x96\x81";  // U+2581 "▁"

inline absl::string_view AbslView(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

// Length of the UTF-8 character starting with byte `c` (1 for stray bytes;
// the text is valid UTF-8 by the time this is used).
inline int Utf8Length(unsigned char c) {
  if (c < 0xC0) return 1;
  if (c < 0xE0) return 2;
  if (c < 0xF0) return 3;
  return 4;
}

inline char32_t DecodeUtf8(std::string_view s, size_t i) {
  const auto b = [&](size_t k) {
    return static_cast<unsigned char>(s[i + k]) & 0x3F;
  };
  const unsigned char c = static_cast<unsigned char>(s[i]);
  switch (Utf8Length(c)) {
    case 1:
      return c;
    case 2:
      return (char32_t{c & 0x1Fu} << 6) | b(1);
    case 3:
      return (char32_t{c & 0x0Fu} << 12) | (b(1) << 6) | b(2);
    default:
      return (char32_t{c & 0x07u} << 18) | (b(1) << 12) | (b(2) << 6) | b(3);
  }
}

using ::pdserve::AppendUtf8;

// GPT-2's byte alphabet: byte b is written as the character ByteChar(b), so
// that every byte has a printable, non-space character.
std::array<char32_t, 256> ByteAlphabet();

bool IsValidUtf8(std::string_view s);

// True when `s` holds a code point that ICU's Unicode tables assign but
// PCRE2's do not: Debian 12's PCRE2 10.42 is at Unicode 14 and its ICU 72 at
// Unicode 15, whose new emoji, letters and digits PCRE2 would class as
// unassigned (\p{Cn}) and split differently from the reference tokenizers.
bool HasCodePointNewerThanPcre2(std::string_view s);

// A compiled PCRE2 pattern with Unicode properties (\p{L}, \s, ... as in the
// Oniguruma patterns of tokenizer.json). Text holding characters newer than
// PCRE2's Unicode version is matched with ICU's regex engine instead (same
// pattern, newer tables); that is rare, so the JIT-compiled PCRE2 stays the
// fast path. Immutable; matching takes a per-call MatchState.
class Regex {
 public:
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(
      const std::string& pattern, bool literal, const std::string& where);
  ~Regex();

  struct MatchState {
    MatchState() {
      data = pcre2_match_data_create(1, nullptr);
      stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
      context = pcre2_match_context_create(nullptr);
      pcre2_jit_stack_assign(context, nullptr, stack);
    }
    ~MatchState() {
      pcre2_match_context_free(context);
      pcre2_jit_stack_free(stack);
      pcre2_match_data_free(data);
    }
    MatchState(const MatchState&) = delete;
    MatchState& operator=(const MatchState&) = delete;
    pcre2_match_data* data;
    pcre2_jit_stack* stack;
    pcre2_match_context* context;
  };

  // Calls fn(begin, end) for each non-empty match in `s`, left to right.
  template <typename Fn>
  void ForEachMatch(std::string_view s, MatchState* state, Fn fn) const {
    if (icu_ != nullptr && HasCodePointNewerThanPcre2(s)) {
      IcuForEachMatch(s, fn);
      return;
    }
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    size_t offset = 0;
    while (offset <= s.size()) {
      const int rc =
          jit_ ? pcre2_jit_match(code_, subject, s.size(), offset, 0,
                                 state->data, state->context)
               : pcre2_match(code_, subject, s.size(), offset,
                             PCRE2_NO_UTF_CHECK, state->data, state->context);
      if (rc < 0)
        return;  // no match (or a resource limit: the rest stays one piece)
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(state->data);
      const size_t begin = ov[0], end = ov[1];
      if (end > begin) {
        fn(begin, end);
        offset = end;
      } else {
        if (begin >= s.size()) return;
        offset = begin + Utf8Length(static_cast<unsigned char>(s[begin]));
      }
    }
  }

  // Replaces every match of the pattern in `s` with `content`.
  std::string ReplaceAll(std::string_view s, std::string_view content,
                         MatchState* state) const {
    std::string out;
    size_t prev = 0;
    ForEachMatch(s, state, [&](size_t b, size_t e) {
      out.append(s.substr(prev, b - prev));
      out.append(content);
      prev = e;
    });
    out.append(s.substr(prev));
    return out;
  }

 private:
  explicit Regex(pcre2_code* code) : code_(code) {}

  template <typename Fn>
  void IcuForEachMatch(std::string_view s, Fn fn) const {
    // A URegularExpression holds match state: clone the compiled pattern
    // for this call (cheap next to the rare texts that come here).
    UErrorCode status = U_ZERO_ERROR;
    URegularExpression* re = uregex_clone(icu_, &status);
    UText* text = utext_openUTF8(nullptr, s.data(),
                                 static_cast<int64_t>(s.size()), &status);
    uregex_setUText(re, text, &status);
    // On a UTF-8 UText, native indices are byte offsets into `s`.
    while (U_SUCCESS(status) && uregex_findNext(re, &status)) {
      const int64_t begin = uregex_start64(re, 0, &status);
      const int64_t end = uregex_end64(re, 0, &status);
      if (U_SUCCESS(status) && end > begin)
        fn(static_cast<size_t>(begin), static_cast<size_t>(end));
    }
    uregex_close(re);
    utext_close(text);
  }

  pcre2_code* code_;
  bool jit_ = false;
  std::string icu_pattern_;
  URegularExpression* icu_ = nullptr;  // null for literal patterns
};

// What a Split pre-tokenizer does with the pattern's matches.
enum class SplitBehavior {
  kIsolated,
  kRemoved,
  kMergedWithPrevious,
  kMergedWithNext,
  kContiguous
};

struct SplitStep {
  std::unique_ptr<Regex> regex;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
};

struct NormalizerStep {
  enum Kind { kUnicode, kPrepend, kReplace, kLowercase } kind;
  const icu::Normalizer2* unicode = nullptr;  // kUnicode
  std::string text;                // kPrepend: prefix; kReplace: content
  std::unique_ptr<Regex> pattern;  // kReplace
};

// tokenizer.json field readers with the file named in errors.
absl::Status Bad(const std::string& where, absl::string_view msg);
absl::Status Unsupported(const std::string& where, absl::string_view what,
                         absl::string_view type);
// The "pattern" of a Split or Replace step: a regex, or a literal string
// (*literal).
absl::StatusOr<std::string> PatternOf(const Value& v, bool* literal,
                                      const std::string& where);
// The "type" of a step, "" when absent.
std::string TypeOf(const Value& v);
// The steps of a "Sequence" (under `list_key`) or the object itself. The
// recursion is bounded by json::kMaxDepth.
std::vector<const Value*> Flatten(const Value& v, const char* list_key);

// Leftmost-longest matching of the added tokens' contents (a byte trie).
class AddedTokenMatcher {
 public:
  void Add(const std::string& content, int32_t index) {
    if (content.empty()) return;
    int32_t node = 0;
    for (unsigned char c : content) {
      auto it = nodes_[node].next.find(c);
      if (it == nodes_[node].next.end()) {
        nodes_.push_back({});
        it = nodes_[node]
                 .next.emplace(c, static_cast<int32_t>(nodes_.size() - 1))
                 .first;
      }
      node = it->second;
    }
    nodes_[node].token = index;
    first_byte_[static_cast<unsigned char>(content[0])] = true;
  }

  // The longest token starting at s[i]: sets *len and returns its index, or -1.
  int32_t Match(std::string_view s, size_t i, size_t* len) const {
    if (!first_byte_[static_cast<unsigned char>(s[i])]) return -1;
    int32_t node = 0, best = -1;
    for (size_t j = i; j < s.size(); ++j) {
      auto it = nodes_[node].next.find(static_cast<unsigned char>(s[j]));
      if (it == nodes_[node].next.end()) break;
      node = it->second;
      if (nodes_[node].token >= 0) {
        best = nodes_[node].token;
        *len = j + 1 - i;
      }
    }
    return best;
  }

 private:
  struct Node {
    absl::flat_hash_map<unsigned char, int32_t> next;
    int32_t token = -1;
  };
  std::vector<Node> nodes_ = {Node{}};
  bool first_byte_[256] = {};
};

struct AddedToken {
  std::string content;
  int32_t id;
  bool special, lstrip, rstrip;
};

// pre_tokenizer: one optional transform of each section (spaces to the
// metaspace, a prefix), then splits applied in order to every piece.
enum class PrefixScheme { kNever, kFirst, kAlways };

struct PreTokenizer {
  bool byte_level = false;  // a ByteLevel step: pieces merge from their bytes
  // Where a section gets `prefix_text` ("first": only the text's first).
  PrefixScheme prefix = PrefixScheme::kNever;
  std::string prefix_text;      // " " (ByteLevel add_prefix_space) or "▁"
  bool replace_spaces = false;  // Metaspace: ' ' -> "▁"
  std::vector<SplitStep> splits;
};

// pre_tokenizer and normalizer of tokenizer.json (null when absent).
absl::StatusOr<PreTokenizer> ParsePreTokenizer(const Value* pre_json,
                                               const std::string& where);
absl::StatusOr<std::vector<NormalizerStep>> ParseNormalizer(
    const Value* norm, const std::string& where);

}  // namespace pdserve::engine::bpe_internal

namespace pdserve::engine {

struct BpeTokenizer::Impl {
  std::vector<bpe_internal::AddedToken> added;
  bpe_internal::AddedTokenMatcher added_matcher;
  std::vector<bpe_internal::NormalizerStep> normalizers;
  bpe_internal::PreTokenizer pre_tokenizer;
};

struct BpeTokenizer::Scratch {
  struct Symbol {
    int32_t id;     // -1: a character outside the vocabulary
    int32_t prev;   // index, -1 at the start
    int32_t next;   // index, -1 at the end
    int32_t begin;  // byte range in the piece
    int32_t len;    // 0 once merged into its left neighbour
  };
  struct Candidate {
    int32_t rank;
    int32_t pos;  // left symbol
    int32_t merged;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::vector<Symbol> symbols;
  std::vector<Candidate> heap;
  std::vector<std::string_view> pieces, next_pieces;
  bpe_internal::Regex::MatchState match;
};

}  // namespace pdserve::engine
