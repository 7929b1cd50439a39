// Pre-tokenization: the normalizers (NFC/NFKC via ICU, prepend, replace,
// lowercase) and pre-tokenizer steps (ByteLevel, Metaspace, Split, Digits)
// read from tokenizer.json, the PCRE2/ICU regexes they use, and
// EncodeSection, which applies them to one section of text and hands each
// piece to the merge loop (bpe_merge.cc).
#include <unicode/bytestream.h>
#include <unicode/casemap.h>
#include <unicode/uchar.h>
#include <unicode/utf8.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status_macros.h"
#include "tokenizer/bpe_internal.h"

namespace pdserve::engine {
namespace bpe_internal {

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

absl::StatusOr<std::unique_ptr<Regex>> Regex::Compile(
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
    UText* text =
        utext_openUTF8(nullptr, re->icu_pattern_.data(),
                       static_cast<int64_t>(re->icu_pattern_.size()), &status);
    re->icu_ = uregex_openUText(text, 0, &parse_error, &status);
    utext_close(text);
    if (U_FAILURE(status)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": cannot compile regex \"", pattern, "\" with ICU at offset ",
          parse_error.offset, ": ", u_errorName(status)));
    }
  }
  return re;
}

Regex::~Regex() {
  pcre2_code_free(code_);
  if (icu_ != nullptr) uregex_close(icu_);
}

namespace {

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
    pre->prefix_text.assign(1, ' ');  // not = " ": a false GCC 12 -Wrestrict
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

}  // namespace

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

}  // namespace bpe_internal

using bpe_internal::AbslView;
using bpe_internal::kMetaspace;
using bpe_internal::NormalizerStep;
using bpe_internal::PrefixScheme;
using bpe_internal::PreTokenizer;
using bpe_internal::SplitBehavior;
using bpe_internal::SplitStep;

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

}  // namespace pdserve::engine
