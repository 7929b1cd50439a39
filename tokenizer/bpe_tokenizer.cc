#include "tokenizer/bpe_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/casemap.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/uregex.h>
#include <unicode/utext.h>
#include <unicode/utf8.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/file_util.h"
#include "common/status_macros.h"

namespace pdserve::engine {
namespace {

using json::StringOrNull;
using json::Value;

constexpr std::string_view kMetaspace = "\xE2\x96\x81";  // U+2581 "▁"

absl::string_view AbslView(std::string_view s) {
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

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// GPT-2's byte alphabet: byte b is written as the character ByteChar(b), so
// that every byte has a printable, non-space character.
std::array<char32_t, 256> ByteAlphabet() {
  std::array<char32_t, 256> chars{};
  std::array<bool, 256> direct{};
  for (int b = 0; b < 256; ++b) {
    direct[b] = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) ||
                (b >= 0xAE && b <= 0xFF);
  }
  char32_t next = 256;
  for (int b = 0; b < 256; ++b)
    chars[b] = direct[b] ? static_cast<char32_t>(b) : next++;
  return chars;
}

bool IsValidUtf8(std::string_view s) {
  Utf8Stream probe;
  std::string out = probe.Push(std::string(s));
  out += probe.Finish();
  return out == s;
}

// True when `s` holds a code point that ICU's Unicode tables assign but
// PCRE2's do not: Debian 12's PCRE2 10.42 is at Unicode 14 and its ICU 72 at
// Unicode 15, whose new emoji, letters and digits PCRE2 would class as
// unassigned (\p{Cn}) and split differently from the reference tokenizers.
bool HasCodePointNewerThanPcre2(std::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const int32_t n = static_cast<int32_t>(s.size());
  for (int32_t i = 0; i < n;) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    UChar32 c;
    U8_NEXT(p, i, n, c);
    if (c < 0) continue;
    UVersionInfo age;
    u_charAge(c, age);
    if (age[0] >= 15) return true;
  }
  return false;
}

// A compiled PCRE2 pattern with Unicode properties (\p{L}, \s, ... as in the
// Oniguruma patterns of tokenizer.json). Text holding characters newer than
// PCRE2's Unicode version is matched with ICU's regex engine instead (same
// pattern, newer tables); that is rare, so the JIT-compiled PCRE2 stays the
// fast path. Immutable; matching takes a per-call MatchState.
class Regex {
 public:
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(
      const std::string& pattern, bool literal, const std::string& where) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    const uint32_t options =
        PCRE2_UTF | PCRE2_NO_UTF_CHECK | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    pcre2_code* code =
        pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()),
                      pattern.size(), options, &err, &offset, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": cannot compile regex \"", pattern, "\" at offset ", offset,
          ": ", reinterpret_cast<const char*>(msg)));
    }
    auto re = std::unique_ptr<Regex>(new Regex(code));
    re->jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
    if (!literal) {
      UErrorCode status = U_ZERO_ERROR;
      UParseError parse_error;
      // Kept alive with the Regex, in case ICU refers to the pattern text.
      re->icu_pattern_ = pattern;
      UText* text = utext_openUTF8(
          nullptr, re->icu_pattern_.data(),
          static_cast<int64_t>(re->icu_pattern_.size()), &status);
      re->icu_ = uregex_openUText(text, 0, &parse_error, &status);
      utext_close(text);
      if (U_FAILURE(status)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": cannot compile regex \"", pattern,
                         "\" with ICU at offset ", parse_error.offset, ": ",
                         u_errorName(status)));
      }
    }
    return re;
  }
  ~Regex() {
    pcre2_code_free(code_);
    if (icu_ != nullptr) uregex_close(icu_);
  }

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
absl::Status Bad(const std::string& where, absl::string_view msg) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", msg));
}

absl::Status Unsupported(const std::string& where, absl::string_view what,
                         absl::string_view type) {
  return absl::UnimplementedError(
      absl::StrCat(where, ": ", what, " \"", type, "\" is not supported"));
}

absl::StatusOr<std::string> PatternOf(const Value& v, bool* literal,
                                      const std::string& where) {
  const Value* p = json::Find(v, "pattern");
  if (p == nullptr) return Bad(where, "missing pattern");
  if (const std::string* re = StringOrNull(json::Find(*p, "Regex"))) {
    *literal = false;
    return *re;
  }
  if (const std::string* str = StringOrNull(json::Find(*p, "String"))) {
    *literal = true;
    return *str;
  }
  return Bad(where, "pattern needs \"Regex\" or \"String\"");
}

std::string TypeOf(const Value& v) {
  const std::string* t = StringOrNull(json::Find(v, "type"));
  return t != nullptr ? *t : "";
}

// The steps of a "Sequence" (under `list_key`) or the object itself. The
// recursion is bounded by json::kMaxDepth.
std::vector<const Value*> Flatten(const Value& v, const char* list_key) {
  std::vector<const Value*> out;
  if (TypeOf(v) == "Sequence") {
    if (const Value* list = json::Find(v, list_key); list && list->is_array()) {
      for (const Value& item : *list) {
        for (const Value* inner : Flatten(item, list_key)) out.push_back(inner);
      }
    }
    return out;
  }
  out.push_back(&v);
  return out;
}

// The text of a token entry in tokenizer_config.json: a string, or an
// AddedToken object with "content".
std::string TokenName(const Value* v) {
  if (const std::string* s = StringOrNull(v)) return *s;
  if (v == nullptr) return "";
  const std::string* c = StringOrNull(json::Find(*v, "content"));
  return c != nullptr ? *c : "";
}

// A token id in generation_config.json: a number or a list whose first entry
// is one; -1 when absent or not a valid id.
int64_t FirstId(const Value* v) {
  if (v == nullptr) return -1;
  if (v->is_array() && !v->empty()) v = &v->front();
  auto id = json::AsInt(*v, "", 0, (int64_t{1} << 31) - 1);
  return id.ok() ? *id : -1;
}

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

bool IsWhiteSpaceAt(std::string_view s, size_t i) {
  return u_isUWhiteSpace(DecodeUtf8(s, i));
}

std::string_view TrimEnd(std::string_view s) {
  while (!s.empty()) {
    size_t start = s.size() - 1;
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80)
      --start;
    if (!IsWhiteSpaceAt(s, start)) break;
    s = s.substr(0, start);
  }
  return s;
}

std::string_view TrimStart(std::string_view s) {
  while (!s.empty() && IsWhiteSpaceAt(s, 0)) {
    s = s.substr(Utf8Length(static_cast<unsigned char>(s[0])));
  }
  return s;
}

// ---------------------------------------------------------------------------
// The steps of BpeTokenizer::FromJson. Each reads one part of tokenizer.json
// (null when the file has none) into what the tokenizer keeps of it, and
// names `where` (the file) in its errors: INVALID_ARGUMENT for malformed
// input, UNIMPLEMENTED for components pdserve does not support.

// model.*: options of the BPE algorithm itself.
struct ModelOptions {
  bool ignore_merges = false;  // a piece that is a whole token is not merged
  bool byte_fallback = false;  // unknown characters become <0xNN> tokens
  bool fuse_unk = false;       // a run of unknown characters is one unk
};

absl::StatusOr<ModelOptions> ParseModelOptions(const Value& model,
                                               const std::string& where) {
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    ASSIGN_OR_RETURN(std::string affix, json::GetString(model, key, where, ""));
    if (!affix.empty())
      return Unsupported(where, absl::StrCat("model.", key), affix);
  }
  ModelOptions options;
  ASSIGN_OR_RETURN(options.ignore_merges,
                   json::GetBool(model, "ignore_merges", where, false));
  ASSIGN_OR_RETURN(options.byte_fallback,
                   json::GetBool(model, "byte_fallback", where, false));
  ASSIGN_OR_RETURN(options.fuse_unk,
                   json::GetBool(model, "fuse_unk", where, false));
  return options;
}

constexpr int64_t kMaxTokenId = (int64_t{1} << 31) - 1;

// added_tokens: in file order (the order the matcher indexes them by).
absl::StatusOr<std::vector<AddedToken>> ParseAddedTokens(
    const Value* added, const std::string& where) {
  std::vector<AddedToken> out;
  if (added == nullptr) return out;
  if (!added->is_array()) return Bad(where, "added_tokens must be a list");
  out.reserve(added->size());
  for (const Value& a : *added) {
    AddedToken tok;
    ASSIGN_OR_RETURN(
        int64_t id, json::GetInt(a, "id", where, std::nullopt, 0, kMaxTokenId));
    tok.id = static_cast<int32_t>(id);
    ASSIGN_OR_RETURN(tok.content, json::GetString(a, "content", where));
    ASSIGN_OR_RETURN(tok.special, json::GetBool(a, "special", where, false));
    ASSIGN_OR_RETURN(tok.lstrip, json::GetBool(a, "lstrip", where, false));
    ASSIGN_OR_RETURN(tok.rstrip, json::GetBool(a, "rstrip", where, false));
    out.push_back(std::move(tok));
  }
  return out;
}

// model.vocab: id -> text and text -> id. The table spans the added tokens'
// ids too (they may reuse vocabulary ids or extend them), but holds only
// the vocabulary's texts: merges and the model's pieces see those alone.
struct Vocabulary {
  std::vector<std::string> tokens;                // id -> text, "" if unused
  absl::flat_hash_map<std::string, int32_t> ids;  // text -> id
};

// Takes the token texts out of `vocab`.
absl::StatusOr<Vocabulary> ParseVocabulary(
    std::vector<std::pair<std::string, Value>>& vocab,
    const std::vector<AddedToken>& added, const std::string& where) {
  std::vector<int32_t> entry_ids;
  entry_ids.reserve(vocab.size());
  int64_t max_id = -1;
  for (const auto& [token, id_value] : vocab) {
    auto id = json::AsInt(id_value, where, 0, kMaxTokenId);
    if (!id.ok()) {  // again, naming the token (not built for every entry)
      return json::AsInt(id_value,
                         absl::StrCat(where, ": vocab id of \"", token, "\""),
                         0, kMaxTokenId)
          .status();
    }
    max_id = std::max(max_id, *id);
    entry_ids.push_back(static_cast<int32_t>(*id));
  }
  for (const AddedToken& a : added) max_id = std::max<int64_t>(max_id, a.id);
  if (max_id < 0) return Bad(where, "empty vocabulary");
  const size_t count = vocab.size() + added.size();
  if (static_cast<size_t>(max_id) > 2 * count + 1024) {
    return Bad(where, absl::StrCat("token id ", max_id, " is far beyond the ",
                                   count, " tokens: ids must be dense"));
  }
  Vocabulary out;
  out.tokens.resize(max_id + 1);
  out.ids.reserve(count);
  for (size_t i = 0; i < vocab.size(); ++i) {
    std::string& token = vocab[i].first;
    const int32_t id = entry_ids[i];
    out.ids[token] = id;
    out.tokens[id] = std::move(token);
  }
  return out;
}

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

std::optional<SplitBehavior> SplitBehaviorNamed(const std::string& name) {
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  return std::nullopt;
}

absl::StatusOr<SplitStep> ParseSplit(const Value& step,
                                     const std::string& where) {
  SplitStep s;
  bool literal = false;
  ASSIGN_OR_RETURN(std::string pattern, PatternOf(step, &literal, where));
  ASSIGN_OR_RETURN(s.regex, Regex::Compile(pattern, literal, where));
  ASSIGN_OR_RETURN(std::string behavior,
                   json::GetString(step, "behavior", where, "Isolated"));
  ASSIGN_OR_RETURN(s.invert, json::GetBool(step, "invert", where, false));
  const std::optional<SplitBehavior> b = SplitBehaviorNamed(behavior);
  if (!b) return Unsupported(where, "Split behavior", behavior);
  s.behavior = *b;
  return s;
}

// A ByteLevel pre-tokenizer step; `first`: it is the first step.
absl::Status ApplyByteLevel(const Value& step, bool first,
                            const std::string& where, PreTokenizer* pre) {
  pre->byte_level = true;
  ASSIGN_OR_RETURN(bool prefix,
                   json::GetBool(step, "add_prefix_space", where, true));
  ASSIGN_OR_RETURN(bool use_regex,
                   json::GetBool(step, "use_regex", where, true));
  if (prefix) {
    if (!first) {
      return Bad(where,
                 "ByteLevel add_prefix_space is supported only as the first "
                 "pre-tokenizer");
    }
    pre->prefix = PrefixScheme::kAlways;
    pre->prefix_text = " ";
  }
  if (use_regex) {
    // GPT-2's split, which ByteLevel applies when use_regex is set.
    SplitStep s;
    ASSIGN_OR_RETURN(
        s.regex, Regex::Compile("'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| "
                                "?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+",
                                false, where));
    pre->splits.push_back(std::move(s));
  }
  return absl::OkStatus();
}

// A Metaspace pre-tokenizer step (supported only as the first).
absl::Status ApplyMetaspace(const Value& step, bool first,
                            const std::string& where, PreTokenizer* pre) {
  if (!first)
    return Bad(where, "Metaspace is supported only as the first pre-tokenizer");
  ASSIGN_OR_RETURN(
      std::string replacement,
      json::GetString(step, "replacement", where, std::string(kMetaspace)));
  if (replacement != kMetaspace)
    return Unsupported(where, "Metaspace replacement", replacement);
  pre->replace_spaces = true;
  pre->prefix_text = std::string(kMetaspace);
  ASSIGN_OR_RETURN(bool add_prefix,
                   json::GetBool(step, "add_prefix_space", where, true));
  ASSIGN_OR_RETURN(std::string scheme,
                   json::GetString(step, "prepend_scheme", where,
                                   add_prefix ? "always" : "never"));
  if (scheme == "always") {
    pre->prefix = PrefixScheme::kAlways;
  } else if (scheme == "first") {
    pre->prefix = PrefixScheme::kFirst;
  } else if (scheme == "never") {
    pre->prefix = PrefixScheme::kNever;
  } else {
    return Unsupported(where, "Metaspace prepend_scheme", scheme);
  }
  ASSIGN_OR_RETURN(bool split, json::GetBool(step, "split", where, true));
  if (split) {
    SplitStep s;
    ASSIGN_OR_RETURN(s.regex,
                     Regex::Compile(std::string(kMetaspace), true, where));
    s.behavior = SplitBehavior::kMergedWithNext;
    pre->splits.push_back(std::move(s));
  }
  return absl::OkStatus();
}

absl::StatusOr<PreTokenizer> ParsePreTokenizer(const Value* pre_json,
                                               const std::string& where) {
  PreTokenizer pre;
  if (pre_json == nullptr) return pre;
  const std::vector<const Value*> steps = Flatten(*pre_json, "pretokenizers");
  for (size_t i = 0; i < steps.size(); ++i) {
    const Value& step = *steps[i];
    const std::string type = TypeOf(step);
    if (type == "ByteLevel") {
      RETURN_IF_ERROR(ApplyByteLevel(step, i == 0, where, &pre));
    } else if (type == "Split") {
      ASSIGN_OR_RETURN(SplitStep s, ParseSplit(step, where));
      pre.splits.push_back(std::move(s));
    } else if (type == "Digits") {
      SplitStep s;
      ASSIGN_OR_RETURN(bool individual,
                       json::GetBool(step, "individual_digits", where, false));
      ASSIGN_OR_RETURN(
          s.regex,
          Regex::Compile(individual ? "\\p{Nd}" : "\\p{Nd}+", false, where));
      pre.splits.push_back(std::move(s));
    } else if (type == "Metaspace") {
      RETURN_IF_ERROR(ApplyMetaspace(step, i == 0, where, &pre));
    } else {
      return Unsupported(where, "pre-tokenizer", type);
    }
  }
  return pre;
}

// normalizer: steps applied in order to each section before pre-tokenizing.
absl::StatusOr<NormalizerStep> ParseNormalizerStep(const Value& step,
                                                   const std::string& where) {
  const std::string type = TypeOf(step);
  NormalizerStep n;
  if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    UErrorCode status = U_ZERO_ERROR;
    n.kind = NormalizerStep::kUnicode;
    n.unicode = type == "NFC"    ? icu::Normalizer2::getNFCInstance(status)
                : type == "NFD"  ? icu::Normalizer2::getNFDInstance(status)
                : type == "NFKC" ? icu::Normalizer2::getNFKCInstance(status)
                                 : icu::Normalizer2::getNFKDInstance(status);
    if (U_FAILURE(status))
      return Bad(where, absl::StrCat("ICU ", type, ": ", u_errorName(status)));
  } else if (type == "Prepend") {
    n.kind = NormalizerStep::kPrepend;
    ASSIGN_OR_RETURN(n.text, json::GetString(step, "prepend", where));
  } else if (type == "Replace") {
    n.kind = NormalizerStep::kReplace;
    bool literal = false;
    ASSIGN_OR_RETURN(std::string pattern, PatternOf(step, &literal, where));
    ASSIGN_OR_RETURN(n.pattern, Regex::Compile(pattern, literal, where));
    ASSIGN_OR_RETURN(n.text, json::GetString(step, "content", where));
  } else if (type == "Lowercase") {
    n.kind = NormalizerStep::kLowercase;
  } else {
    return Unsupported(where, "normalizer", type);
  }
  return n;
}

absl::StatusOr<std::vector<NormalizerStep>> ParseNormalizer(
    const Value* norm, const std::string& where) {
  std::vector<NormalizerStep> out;
  if (norm == nullptr) return out;
  for (const Value* step : Flatten(*norm, "normalizers")) {
    ASSIGN_OR_RETURN(NormalizerStep n, ParseNormalizerStep(*step, where));
    out.push_back(std::move(n));
  }
  return out;
}

// decoder: only what TokenBytes and Decode need to know.
struct DecoderOptions {
  bool byte_fallback = false;    // <0xNN> tokens decode to their byte
  int strip_leading_spaces = 0;  // removed from the start of Decode's text
};

absl::StatusOr<DecoderOptions> ParseDecoder(const Value* dec, bool byte_level,
                                            const std::string& where) {
  DecoderOptions out;
  if (dec == nullptr) return out;
  for (const Value* step : Flatten(*dec, "decoders")) {
    const std::string type = TypeOf(*step);
    if (type == "ByteLevel") {
      if (!byte_level)
        return Bad(where,
                   "a ByteLevel decoder needs a ByteLevel pre-tokenizer");
    } else if (type == "ByteFallback") {
      out.byte_fallback = true;
    } else if (type == "Strip") {
      ASSIGN_OR_RETURN(std::string content,
                       json::GetString(*step, "content", where, " "));
      ASSIGN_OR_RETURN(int64_t start,
                       json::GetInt(*step, "start", where, 0, 0, 16));
      if (content == " ") out.strip_leading_spaces = static_cast<int>(start);
    } else if (type == "Metaspace") {
      ASSIGN_OR_RETURN(bool add_prefix,
                       json::GetBool(*step, "add_prefix_space", where, true));
      ASSIGN_OR_RETURN(std::string scheme,
                       json::GetString(*step, "prepend_scheme", where,
                                       add_prefix ? "always" : "never"));
      if (scheme != "never") out.strip_leading_spaces = 1;
    } else if (type != "Replace" && type != "Fuse") {
      return Unsupported(where, "decoder", type);
    }
  }
  return out;
}

// How the model sees each vocabulary token: its raw bytes, and the text BPE
// starts from and ignore_merges looks up (the bytes for byte-level models,
// the token text otherwise).
struct ModelSpace {
  std::vector<std::string> token_bytes;  // id -> raw bytes
  absl::flat_hash_map<std::string, int32_t> piece_ids;
  std::array<int32_t, 256> byte_ids;           // byte-level: each byte's token
  std::array<int32_t, 256> byte_fallback_ids;  // <0xNN> tokens, -1 if absent
};

// `byte_fallback`: <0xNN> tokens stand for their byte (model or decoder).
// `piece_ids`: build ModelSpace::piece_ids, which byte-level models look up
// only for ignore_merges (their initial symbols are bytes).
absl::StatusOr<ModelSpace> BuildModelSpace(const Vocabulary& vocab,
                                           bool byte_level, bool byte_fallback,
                                           bool piece_ids,
                                           const std::string& where) {
  ModelSpace out;
  out.token_bytes.resize(vocab.tokens.size());
  out.byte_ids.fill(-1);
  out.byte_fallback_ids.fill(-1);
  const std::array<char32_t, 256> alphabet = ByteAlphabet();
  // Character -> byte; the alphabet's characters are all below U+0200.
  std::array<int16_t, 0x200> alphabet_byte;
  alphabet_byte.fill(-1);
  for (int b = 0; b < 256; ++b)
    alphabet_byte[alphabet[b]] = static_cast<int16_t>(b);
  if (piece_ids) out.piece_ids.reserve(vocab.ids.size());
  for (const auto& [token, id] : vocab.ids) {
    std::string bytes;
    if (byte_level) {
      bool in_alphabet = true;
      for (size_t i = 0; i < token.size();
           i += Utf8Length(static_cast<unsigned char>(token[i]))) {
        const char32_t c = DecodeUtf8(token, i);
        if (c >= alphabet_byte.size() || alphabet_byte[c] < 0) {
          in_alphabet = false;
          break;
        }
        bytes.push_back(static_cast<char>(alphabet_byte[c]));
      }
      if (!in_alphabet) bytes = token;
    } else if (byte_fallback && token.size() == 6 &&
               token.compare(0, 3, "<0x") == 0 && token[5] == '>' &&
               isxdigit(static_cast<unsigned char>(token[3])) &&
               isxdigit(static_cast<unsigned char>(token[4]))) {
      const int b = std::stoi(token.substr(3, 2), nullptr, 16);
      bytes.push_back(static_cast<char>(b));
      out.byte_fallback_ids[b] = id;
    } else {
      bytes = absl::StrReplaceAll(token, {{AbslView(kMetaspace), " "}});
    }
    if (piece_ids) out.piece_ids[byte_level ? bytes : token] = id;
    out.token_bytes[id] = std::move(bytes);
  }
  if (byte_level) {
    for (int b = 0; b < 256; ++b) {
      std::string ch;
      AppendUtf8(alphabet[b], &ch);
      auto it = vocab.ids.find(ch);
      if (it == vocab.ids.end()) {
        return Bad(
            where,
            absl::StrCat("byte-level vocabulary lacks the token for byte ", b));
      }
      out.byte_ids[b] = it->second;
    }
  }
  return out;
}

// (left id << 32 | right id) -> (rank << 32 | merged id).
using MergeTable = absl::flat_hash_map<uint64_t, uint64_t>;

// Resolves merges[begin, end) of model.merges to MergeTable entries, in
// order; ranks are positions in the whole list.
absl::Status ResolveMerges(const std::vector<Value>& merges, size_t begin,
                           size_t end,
                           const absl::flat_hash_map<std::string, int32_t>& ids,
                           const std::string& where,
                           std::vector<std::pair<uint64_t, uint64_t>>* out) {
  out->reserve(end - begin);
  std::string joined;
  for (size_t rank = begin; rank < end; ++rank) {
    const Value& m = merges[rank];
    absl::string_view left, right;
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos)
        return Bad(where, absl::StrCat("merge \"", s, "\" has no space"));
      left = absl::string_view(s).substr(0, sp);
      right = absl::string_view(s).substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() &&
               m[1].is_string()) {
      left = m[0].get_ref<const std::string&>();
      right = m[1].get_ref<const std::string&>();
    } else {
      return Bad(where, "merges must be strings or pairs of strings");
    }
    joined.assign(left.data(), left.size());
    joined.append(right.data(), right.size());
    auto l = ids.find(left), r = ids.find(right), merged = ids.find(joined);
    if (l == ids.end() || r == ids.end() || merged == ids.end()) {
      return Bad(where, absl::StrCat("merge \"", left, " ", right,
                                     "\" uses tokens outside the vocabulary"));
    }
    out->emplace_back((static_cast<uint64_t>(l->second) << 32) |
                          static_cast<uint32_t>(r->second),
                      (static_cast<uint64_t>(rank) << 32) |
                          static_cast<uint32_t>(merged->second));
  }
  return absl::OkStatus();
}

// model.merges, ranked by position: "left right" strings, or [left, right]
// pairs (tokenizers >= 0.20). Of a repeated pair the first (best) rank wins.
// The string lookups are most of the time it takes to load a large file
// (Llama-3 has 280k merges), so the two halves of the list are resolved on
// two threads.
absl::StatusOr<MergeTable> ParseMerges(
    const std::vector<Value>& merges,
    const absl::flat_hash_map<std::string, int32_t>& ids,
    const std::string& where) {
  if (merges.size() > static_cast<size_t>(kMaxTokenId))
    return Bad(where, "too many merges");
  const size_t half = merges.size() / 2;
  std::vector<std::pair<uint64_t, uint64_t>> first, second;
  absl::Status first_status;
  absl::Status second_status;
  {
    std::jthread helper([&] {
      first_status = ResolveMerges(merges, 0, half, ids, where, &first);
    });
    second_status =
        ResolveMerges(merges, half, merges.size(), ids, where, &second);
  }                               // joins
  RETURN_IF_ERROR(first_status);  // the earliest bad merge is reported
  RETURN_IF_ERROR(second_status);
  MergeTable out;
  out.reserve(merges.size());
  for (const auto& [key, value] : first) out.emplace(key, value);
  for (const auto& [key, value] : second) out.emplace(key, value);
  return out;
}

// BOS/EOS: tokenizer_config.json names them; generation_config.json has
// ids. -1 where neither gives a token of `t`.
std::pair<int32_t, int32_t> FindBosEos(const Value& config,
                                       const Value& generation,
                                       const BpeTokenizer& t) {
  auto find = [&](const char* name_key, const char* id_key) {
    const std::string name = TokenName(json::Find(config, name_key));
    int64_t id = name.empty() ? -1 : t.TokenId(name);
    if (id < 0) id = FirstId(json::Find(generation, id_key));
    return id < t.vocab_size() ? static_cast<int32_t>(id) : -1;
  };
  return {find("bos_token", "bos_token_id"), find("eos_token", "eos_token_id")};
}

// What Encode puts around the text's ids when it adds special tokens.
struct SpecialAffixes {
  std::vector<int32_t> prefix;
  std::vector<int32_t> suffix;
};

absl::Status AddTemplateProcessing(const Value& step, const BpeTokenizer& t,
                                   const std::string& where,
                                   SpecialAffixes* out) {
  const Value* single = json::Find(step, "single");
  const Value* specials = json::Find(step, "special_tokens");
  if (single == nullptr || !single->is_array())
    return Bad(where, "TemplateProcessing needs a \"single\" list");
  bool after = false;
  for (const Value& piece : *single) {
    if (json::Find(piece, "Sequence") != nullptr) {
      after = true;
      continue;
    }
    const Value* sp = json::Find(piece, "SpecialToken");
    const std::string name = sp ? TokenName(json::Find(*sp, "id")) : "";
    if (name.empty())
      return Bad(where,
                 "TemplateProcessing entries need Sequence or SpecialToken");
    std::vector<int32_t> ids;
    const Value* entry = specials ? json::Find(*specials, name) : nullptr;
    if (const Value* list = entry ? json::Find(*entry, "ids") : nullptr;
        list && list->is_array()) {
      for (const Value& id : *list) {
        ASSIGN_OR_RETURN(int64_t i,
                         json::AsInt(id, where, 0, t.vocab_size() - 1));
        ids.push_back(static_cast<int32_t>(i));
      }
    } else if (int32_t id = t.TokenId(name); id >= 0) {
      ids.push_back(id);
    } else {
      return Bad(where, absl::StrCat("TemplateProcessing token \"", name,
                                     "\" is not in the vocabulary"));
    }
    auto& target = after ? out->suffix : out->prefix;
    target.insert(target.end(), ids.begin(), ids.end());
  }
  return absl::OkStatus();
}

// post_processor: the special tokens it puts around a single sequence.
absl::StatusOr<SpecialAffixes> ParsePostProcessor(const Value* post,
                                                  const BpeTokenizer& t,
                                                  const std::string& where) {
  SpecialAffixes out;
  if (post == nullptr) return out;
  for (const Value* step : Flatten(*post, "processors")) {
    const std::string type = TypeOf(*step);
    if (type == "ByteLevel") continue;
    if (type == "TemplateProcessing") {
      RETURN_IF_ERROR(AddTemplateProcessing(*step, t, where, &out));
    } else if (type == "BertProcessing" || type == "RobertaProcessing") {
      for (const char* key : {"cls", "sep"}) {
        const Value* pair = json::Find(*step, key);
        if (pair == nullptr || !pair->is_array() || pair->size() != 2)
          return Bad(where,
                     absl::StrCat(type, " needs \"", key, "\": [token, id]"));
        ASSIGN_OR_RETURN(int64_t id,
                         json::AsInt((*pair)[1], where, 0, t.vocab_size() - 1));
        (std::string(key) == "cls" ? out.prefix : out.suffix)
            .push_back(static_cast<int32_t>(id));
      }
    } else {
      return Unsupported(where, "post-processor", type);
    }
  }
  return out;
}

// What Encode adds. transformers rebuilds the post-processor of the Llama
// tokenizer classes from add_bos_token (default true) / add_eos_token;
// every other class uses tokenizer.json's post-processor as written.
absl::StatusOr<SpecialAffixes> ParseSpecialAffixes(const Value* post,
                                                   const Value& config,
                                                   const BpeTokenizer& t,
                                                   const std::string& where) {
  constexpr absl::string_view kConfig = "tokenizer_config.json";
  ASSIGN_OR_RETURN(std::string tokenizer_class,
                   json::GetString(config, "tokenizer_class", kConfig, ""));
  if (tokenizer_class != "LlamaTokenizer" &&
      tokenizer_class != "LlamaTokenizerFast" &&
      tokenizer_class != "CodeLlamaTokenizer" &&
      tokenizer_class != "CodeLlamaTokenizerFast") {
    return ParsePostProcessor(post, t, where);
  }
  ASSIGN_OR_RETURN(bool add_bos,
                   json::GetBool(config, "add_bos_token", kConfig, true));
  ASSIGN_OR_RETURN(bool add_eos,
                   json::GetBool(config, "add_eos_token", kConfig, false));
  SpecialAffixes out;
  if (add_bos && t.bos_id() >= 0) out.prefix.push_back(t.bos_id());
  if (add_eos && t.eos_id() >= 0) out.suffix.push_back(t.eos_id());
  return out;
}

}  // namespace

struct BpeTokenizer::Impl {
  std::vector<AddedToken> added;
  AddedTokenMatcher added_matcher;
  std::vector<NormalizerStep> normalizers;
  PreTokenizer pre_tokenizer;
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
  Regex::MatchState match;
};

BpeTokenizer::BpeTokenizer() : impl_(std::make_unique<Impl>()) {
  std::fill(std::begin(byte_ids_), std::end(byte_ids_), -1);
  std::fill(std::begin(byte_fallback_ids_), std::end(byte_fallback_ids_), -1);
}

BpeTokenizer::~BpeTokenizer() = default;

absl::StatusOr<BpeTokenizer::ParsedJson> BpeTokenizer::ParseJson(
    std::string_view text, const std::string& where) {
  ParsedJson parsed;
  const std::vector<json::StreamedContainer> streamed = {
      {{"model", "vocab"},
       [&](std::string&& token, Value&& id) {
         parsed.vocab.emplace_back(std::move(token), std::move(id));
         return absl::OkStatus();
       }},
      {{"model", "merges"}, [&](std::string&&, Value&& merge) {
         parsed.merges.push_back(std::move(merge));
         return absl::OkStatus();
       }}};
  ASSIGN_OR_RETURN(parsed.root, json::Parse(AbslView(text), where, streamed));
  return parsed;
}

absl::StatusOr<std::unique_ptr<BpeTokenizer>> BpeTokenizer::Load(
    const std::string& dir) {
  const std::string path = dir + "/tokenizer.json";
  ASSIGN_OR_RETURN(std::string text, ReadFileIfExists(path));
  if (text.empty())
    return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  ASSIGN_OR_RETURN(ParsedJson parsed, ParseJson(text, path));
  return Load(dir, std::move(parsed), path);
}

absl::StatusOr<std::unique_ptr<BpeTokenizer>> BpeTokenizer::Load(
    const std::string& dir, ParsedJson tokenizer, const std::string& path) {
  ASSIGN_OR_RETURN(std::string config,
                   ReadFileIfExists(dir + "/tokenizer_config.json"));
  ASSIGN_OR_RETURN(std::string generation,
                   ReadFileIfExists(dir + "/generation_config.json"));
  return FromJson(std::move(tokenizer), config, generation, path);
}

absl::StatusOr<std::unique_ptr<BpeTokenizer>> BpeTokenizer::FromJson(
    ParsedJson tokenizer, const std::string& tokenizer_config_json,
    const std::string& generation_config_json, const std::string& where) {
  const Value& root = tokenizer.root;
  const Value* model = json::Find(root, "model");
  if (model == nullptr || TypeOf(*model) != "BPE")
    return Bad(where, "model.type must be \"BPE\"");
  // ParseJson left model.vocab and model.merges as empty containers.
  if (const Value* v = json::Find(*model, "vocab");
      v == nullptr || !v->is_object())
    return Bad(where, "model.vocab must be an object");
  if (const Value* m = json::Find(*model, "merges");
      m == nullptr || !m->is_array())
    return Bad(where, "model.merges must be a list");
  Value config, generation;  // null when the file is absent
  if (!tokenizer_config_json.empty()) {
    ASSIGN_OR_RETURN(
        config, json::Parse(tokenizer_config_json, "tokenizer_config.json"));
  }
  if (!generation_config_json.empty()) {
    ASSIGN_OR_RETURN(generation, json::Parse(generation_config_json,
                                             "generation_config.json"));
  }

  std::unique_ptr<BpeTokenizer> t(new BpeTokenizer());
  Impl& impl = *t->impl_;
  ASSIGN_OR_RETURN(const ModelOptions options,
                   ParseModelOptions(*model, where));
  t->ignore_merges_ = options.ignore_merges;
  t->byte_fallback_ = options.byte_fallback;
  t->fuse_unk_ = options.fuse_unk;
  ASSIGN_OR_RETURN(impl.added,
                   ParseAddedTokens(json::Find(root, "added_tokens"), where));
  ASSIGN_OR_RETURN(Vocabulary vocab,
                   ParseVocabulary(tokenizer.vocab, impl.added, where));
  ASSIGN_OR_RETURN(impl.pre_tokenizer,
                   ParsePreTokenizer(json::Find(root, "pre_tokenizer"), where));
  t->byte_level_ = impl.pre_tokenizer.byte_level;
  ASSIGN_OR_RETURN(impl.normalizers,
                   ParseNormalizer(json::Find(root, "normalizer"), where));
  ASSIGN_OR_RETURN(
      const DecoderOptions decoder,
      ParseDecoder(json::Find(root, "decoder"), t->byte_level_, where));
  t->strip_leading_spaces_ = decoder.strip_leading_spaces;

  ASSIGN_OR_RETURN(
      ModelSpace space,
      BuildModelSpace(vocab, t->byte_level_,
                      options.byte_fallback || decoder.byte_fallback,
                      !t->byte_level_ || t->ignore_merges_, where));
  ASSIGN_OR_RETURN(MergeTable merges,
                   ParseMerges(tokenizer.merges, vocab.ids, where));
  std::copy(space.byte_ids.begin(), space.byte_ids.end(), t->byte_ids_);
  std::copy(space.byte_fallback_ids.begin(), space.byte_fallback_ids.end(),
            t->byte_fallback_ids_);
  t->piece_ids_ = std::move(space.piece_ids);
  t->token_bytes_ = std::move(space.token_bytes);
  t->merges_ = std::move(merges);
  t->tokens_ = std::move(vocab.tokens);
  t->token_ids_ = std::move(vocab.ids);

  // Added tokens override vocabulary entries with the same id.
  t->special_.assign(t->tokens_.size(), false);
  for (size_t i = 0; i < impl.added.size(); ++i) {
    const AddedToken& a = impl.added[i];
    t->tokens_[a.id] = a.content;
    t->token_ids_[a.content] = a.id;
    t->special_[a.id] = a.special;
    t->token_bytes_[a.id] = a.special ? "" : a.content;
    impl.added_matcher.Add(a.content, static_cast<int32_t>(i));
  }
  if (const std::string* unk = StringOrNull(json::Find(*model, "unk_token")))
    t->unk_id_ = t->TokenId(*unk);

  std::tie(t->bos_id_, t->eos_id_) = FindBosEos(config, generation, *t);
  ASSIGN_OR_RETURN(SpecialAffixes affixes,
                   ParseSpecialAffixes(json::Find(root, "post_processor"),
                                       config, *t, where));
  t->prefix_ids_ = std::move(affixes.prefix);
  t->suffix_ids_ = std::move(affixes.suffix);
  return t;
}

bool BpeTokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && id < vocab_size() && special_[id];
}

const std::string& BpeTokenizer::TokenText(int32_t id) const {
  static const std::string kEmpty;
  return id >= 0 && id < vocab_size() ? tokens_[id] : kEmpty;
}

int32_t BpeTokenizer::TokenId(std::string_view token) const {
  auto it = token_ids_.find(AbslView(token));
  return it == token_ids_.end() ? -1 : it->second;
}

std::string BpeTokenizer::TokenBytes(int32_t id) const {
  return id >= 0 && id < vocab_size() ? token_bytes_[id] : std::string();
}

std::string BpeTokenizer::Decode(const std::vector<int32_t>& ids,
                                 bool skip_special_tokens) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size()) continue;
    if (special_[id]) {
      if (!skip_special_tokens) bytes += tokens_[id];
    } else {
      bytes += token_bytes_[id];
    }
  }
  size_t strip = 0;
  while (strip < bytes.size() &&
         static_cast<int>(strip) < strip_leading_spaces_ &&
         bytes[strip] == ' ') {
    ++strip;
  }
  Utf8Stream utf8;
  return utf8.Push(bytes.substr(strip)) + utf8.Finish();
}

std::vector<int32_t> BpeTokenizer::Encode(const std::string& input,
                                          bool add_special_tokens) const {
  // The pipeline works on valid UTF-8; ill-formed input bytes become U+FFFD.
  std::string repaired;
  std::string_view text = input;
  if (!IsValidUtf8(input)) {
    Utf8Stream utf8;
    repaired = utf8.Push(input) + utf8.Finish();
    text = repaired;
  }
  Scratch scratch;
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + prefix_ids_.size() + suffix_ids_.size() + 4);
  if (add_special_tokens)
    out.insert(out.end(), prefix_ids_.begin(), prefix_ids_.end());

  // Sections: runs of plain text between added tokens.
  struct Section {
    std::string_view text;
    int32_t added;  // index into impl_->added, or -1
  };
  std::vector<Section> sections;
  size_t start = 0;
  for (size_t i = 0; i < text.size();) {
    size_t len = 0;
    const int32_t a = impl_->added_matcher.Match(text, i, &len);
    if (a < 0) {
      ++i;
      continue;
    }
    if (i > start) sections.push_back({text.substr(start, i - start), -1});
    sections.push_back({text.substr(i, len), a});
    i += len;
    start = i;
  }
  if (start < text.size()) sections.push_back({text.substr(start), -1});
  for (size_t i = 0; i < sections.size(); ++i) {
    if (sections[i].added < 0) continue;
    const AddedToken& a = impl_->added[sections[i].added];
    if (a.lstrip && i > 0 && sections[i - 1].added < 0)
      sections[i - 1].text = TrimEnd(sections[i - 1].text);
    if (a.rstrip && i + 1 < sections.size() && sections[i + 1].added < 0) {
      sections[i + 1].text = TrimStart(sections[i + 1].text);
    }
  }
  for (size_t i = 0; i < sections.size(); ++i) {
    if (sections[i].added >= 0) {
      out.push_back(impl_->added[sections[i].added].id);
    } else if (!sections[i].text.empty()) {
      EncodeSection(sections[i].text, i == 0, &scratch, &out);
    }
  }
  if (add_special_tokens)
    out.insert(out.end(), suffix_ids_.begin(), suffix_ids_.end());
  return out;
}

void BpeTokenizer::EncodeSection(std::string_view section, bool first_section,
                                 Scratch* scratch,
                                 std::vector<int32_t>* out) const {
  const Impl& impl = *impl_;
  const PreTokenizer& pre = impl.pre_tokenizer;
  std::string normalized;
  if (!impl.normalizers.empty()) {
    normalized.assign(section);
    for (const NormalizerStep& n : impl.normalizers) {
      switch (n.kind) {
        case NormalizerStep::kUnicode: {
          UErrorCode status = U_ZERO_ERROR;
          const icu::StringPiece in(normalized.data(),
                                    static_cast<int32_t>(normalized.size()));
          if (n.unicode->isNormalizedUTF8(in, status) || U_FAILURE(status))
            break;
          std::string result;
          icu::StringByteSink<std::string> sink(&result);
          status = U_ZERO_ERROR;
          n.unicode->normalizeUTF8(0, in, sink, nullptr, status);
          if (U_SUCCESS(status)) normalized = std::move(result);
          break;
        }
        case NormalizerStep::kPrepend:
          if (!normalized.empty()) normalized.insert(0, n.text);
          break;
        case NormalizerStep::kReplace:
          normalized =
              n.pattern->ReplaceAll(normalized, n.text, &scratch->match);
          break;
        case NormalizerStep::kLowercase: {
          UErrorCode status = U_ZERO_ERROR;
          std::string result;
          icu::StringByteSink<std::string> sink(&result);
          icu::CaseMap::utf8ToLower(
              "", 0,
              icu::StringPiece(normalized.data(),
                               static_cast<int32_t>(normalized.size())),
              sink, nullptr, status);
          if (U_SUCCESS(status)) normalized = std::move(result);
          break;
        }
      }
    }
    section = normalized;
    if (section.empty()) return;
  }

  std::string transformed;
  if (pre.replace_spaces || pre.prefix != PrefixScheme::kNever) {
    const bool prepend = pre.prefix == PrefixScheme::kAlways ||
                         (pre.prefix == PrefixScheme::kFirst && first_section);
    const std::string_view space_char =
        pre.replace_spaces ? kMetaspace : std::string_view(" ");
    if (prepend && section.substr(0, space_char.size()) != space_char &&
        !(pre.replace_spaces && !section.empty() && section[0] == ' ')) {
      transformed = pre.prefix_text;
    }
    if (pre.replace_spaces) {
      transformed +=
          absl::StrReplaceAll(AbslView(section), {{" ", AbslView(kMetaspace)}});
    } else {
      transformed.append(section);
    }
    section = transformed;
  }

  auto& pieces = scratch->pieces;
  auto& next = scratch->next_pieces;
  pieces.assign(1, section);
  for (const SplitStep& step : pre.splits) {
    next.clear();
    for (std::string_view piece : pieces) {
      // The piece alternates between text and matches; `delimiter` marks the
      // segments the behaviour acts on (the matches, or the text when
      // inverted). Same folding as Hugging Face tokenizers' split().
      const size_t first = next.size();
      bool prev_delimiter = false;
      auto extend_last = [&](size_t e) {
        next.back() = std::string_view(next.back().data(),
                                       piece.data() + e - next.back().data());
      };
      auto emit = [&](size_t b, size_t e, bool delimiter) {
        if (e <= b) return;
        const bool have_last = next.size() > first;
        switch (step.behavior) {
          case SplitBehavior::kIsolated:
            next.push_back(piece.substr(b, e - b));
            break;
          case SplitBehavior::kRemoved:
            if (!delimiter) next.push_back(piece.substr(b, e - b));
            break;
          case SplitBehavior::kMergedWithPrevious:
            if (delimiter && !prev_delimiter && have_last) {
              extend_last(e);
            } else {
              next.push_back(piece.substr(b, e - b));
            }
            break;
          case SplitBehavior::kMergedWithNext:
            if ((delimiter && !prev_delimiter) || !have_last) {
              next.push_back(piece.substr(b, e - b));
            } else {
              extend_last(e);
            }
            break;
          case SplitBehavior::kContiguous:
            if (delimiter && prev_delimiter && have_last) {
              extend_last(e);
            } else {
              next.push_back(piece.substr(b, e - b));
            }
            break;
        }
        prev_delimiter = delimiter;
      };
      size_t prev = 0;
      step.regex->ForEachMatch(piece, &scratch->match, [&](size_t b, size_t e) {
        emit(prev, b, step.invert);
        emit(b, e, !step.invert);
        prev = e;
      });
      emit(prev, piece.size(), step.invert);
    }
    pieces.swap(next);
  }
  for (std::string_view piece : pieces) EncodePiece(piece, scratch, out);
}

void BpeTokenizer::EncodePiece(std::string_view piece, Scratch* scratch,
                               std::vector<int32_t>* out) const {
  if (piece.empty()) return;
  if (ignore_merges_) {
    auto it = piece_ids_.find(AbslView(piece));
    if (it != piece_ids_.end()) {
      out->push_back(it->second);
      return;
    }
  }
  using Symbol = Scratch::Symbol;
  using Candidate = Scratch::Candidate;
  auto& symbols = scratch->symbols;
  symbols.clear();
  if (byte_level_) {
    for (size_t i = 0; i < piece.size(); ++i) {
      const int32_t n = static_cast<int32_t>(symbols.size());
      symbols.push_back({byte_ids_[static_cast<unsigned char>(piece[i])], n - 1,
                         n + 1, static_cast<int32_t>(i), 1});
    }
  } else {
    for (size_t i = 0; i < piece.size();) {
      const int len =
          std::min<int>(Utf8Length(static_cast<unsigned char>(piece[i])),
                        static_cast<int>(piece.size() - i));
      auto it = piece_ids_.find(AbslView(piece.substr(i, len)));
      const int32_t n = static_cast<int32_t>(symbols.size());
      symbols.push_back({it == piece_ids_.end() ? -1 : it->second, n - 1, n + 1,
                         static_cast<int32_t>(i), len});
      i += len;
    }
  }
  symbols.back().next = -1;

  // Merge the best-ranked adjacent pair first (leftmost on ties) until none
  // applies, as Hugging Face tokenizers does.
  auto& heap = scratch->heap;
  heap.clear();
  auto lookup = [&](int32_t left, int32_t right, Candidate* c) {
    if (left < 0 || right < 0) return false;
    auto it = merges_.find((static_cast<uint64_t>(left) << 32) |
                           static_cast<uint32_t>(right));
    if (it == merges_.end()) return false;
    c->rank = static_cast<int32_t>(it->second >> 32);
    c->merged = static_cast<int32_t>(it->second & 0xFFFFFFFFu);
    return true;
  };
  const auto cmp = std::greater<Candidate>();
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    Candidate c;
    if (lookup(symbols[i].id, symbols[i + 1].id, &c)) {
      c.pos = static_cast<int32_t>(i);
      heap.push_back(c);
    }
  }
  std::make_heap(heap.begin(), heap.end(), cmp);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), cmp);
    const Candidate top = heap.back();
    heap.pop_back();
    Symbol& left = symbols[top.pos];
    if (left.len == 0 || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    Candidate check;
    if (!lookup(left.id, right.id, &check) || check.merged != top.merged)
      continue;
    left.id = top.merged;
    left.len += right.len;
    left.next = right.next;
    right.len = 0;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    Candidate c;
    if (left.prev >= 0 && lookup(symbols[left.prev].id, left.id, &c)) {
      c.pos = left.prev;
      heap.push_back(c);
      std::push_heap(heap.begin(), heap.end(), cmp);
    }
    if (left.next >= 0 && lookup(left.id, symbols[left.next].id, &c)) {
      c.pos = top.pos;
      heap.push_back(c);
      std::push_heap(heap.begin(), heap.end(), cmp);
    }
  }

  bool last_unk = false;
  for (int32_t i = 0; i >= 0; i = symbols[i].next) {
    const Symbol& s = symbols[i];
    if (s.id >= 0) {
      out->push_back(s.id);
      last_unk = false;
      continue;
    }
    bool bytes_ok = byte_fallback_;
    for (int32_t k = 0; bytes_ok && k < s.len; ++k) {
      bytes_ok =
          byte_fallback_ids_[static_cast<unsigned char>(piece[s.begin + k])] >=
          0;
    }
    if (bytes_ok) {
      for (int32_t k = 0; k < s.len; ++k) {
        out->push_back(
            byte_fallback_ids_[static_cast<unsigned char>(piece[s.begin + k])]);
      }
      last_unk = false;
    } else if (unk_id_ >= 0 && !(fuse_unk_ && last_unk)) {
      out->push_back(unk_id_);
      last_unk = true;
    }
  }
}

}  // namespace pdserve::engine
