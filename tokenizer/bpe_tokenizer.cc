#include "tokenizer/bpe_tokenizer.h"

// The tokenizer's surface: token tables, Encode's split of the text around
// added tokens (each plain section then goes through EncodeSection in
// bpe_pretokenizer.cc), Decode, and the UTF-8 helpers of the other files.
#include <unicode/uchar.h>

#include <algorithm>
#include <array>

#include "tokenizer/bpe_internal.h"

namespace pdserve::engine {
namespace bpe_internal {

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

}  // namespace bpe_internal

namespace {

using bpe_internal::AbslView;
using bpe_internal::AddedToken;
using bpe_internal::DecodeUtf8;
using bpe_internal::IsValidUtf8;
using bpe_internal::Utf8Length;

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

}  // namespace

BpeTokenizer::BpeTokenizer() : impl_(std::make_unique<Impl>()) {
  std::fill(std::begin(byte_ids_), std::end(byte_ids_), -1);
  std::fill(std::begin(byte_fallback_ids_), std::end(byte_fallback_ids_), -1);
}

BpeTokenizer::~BpeTokenizer() = default;

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

}  // namespace pdserve::engine
