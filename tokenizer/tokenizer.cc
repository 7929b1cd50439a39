#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/json.h"
#include "common/status_macros.h"
#include "tokenizer/bpe_tokenizer.h"

namespace pdserve::engine {

std::vector<int32_t> ByteTokenizer::Encode(const std::string& text,
                                           bool add_special_tokens) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() + 1);
  if (add_special_tokens) ids.push_back(kBos);
  for (unsigned char c : text) ids.push_back(c);
  return ids;
}

std::string ByteTokenizer::TokenBytes(int32_t id) const {
  if (id >= 0 && id < 256) return std::string(1, static_cast<char>(id));
  return "";
}

std::string ByteTokenizer::SpecialTokenText(int32_t id) const {
  if (id == kBos) return "<s>";
  if (id == kEos) return "</s>";
  return "";
}

std::string Tokenizer::Decode(const std::vector<int32_t>& ids,
                              bool skip_special_tokens) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (IsSpecial(id)) {
      if (!skip_special_tokens) bytes += SpecialTokenText(id);
    } else {
      bytes += TokenBytes(id);
    }
  }
  Utf8Stream utf8;
  return utf8.Push(bytes) + utf8.Finish();
}

std::string ByteTokenizer::TokenizerJson() {
  return R"({
  "version": "1.0",
  "model": {"type": "pdserve-bytes", "byte_tokens": 256},
  "added_tokens": [
    {"id": 256, "content": "<s>", "special": true},
    {"id": 257, "content": "</s>", "special": true}
  ]
}
)";
}

std::string ByteTokenizer::TokenizerConfigJson() {
  return R"({"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PdserveByteTokenizer"}
)";
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(
    const std::string& model_dir) {
  const std::string path = model_dir + "/tokenizer.json";
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  // One read into a buffer of the file's size (tokenizer.json can be 10 MB).
  std::string text(static_cast<size_t>(std::max<std::streamoff>(in.tellg(), 0)),
                   '\0');
  in.seekg(0);
  if (!in.read(text.data(), static_cast<std::streamsize>(text.size())))
    return absl::DataLossError(absl::StrCat(path, ": read failed"));
  ASSIGN_OR_RETURN(BpeTokenizer::ParsedJson parsed,
                   BpeTokenizer::ParseJson(text, path));
  const json::Value* model = json::Find(parsed.root, "model");
  std::string type;
  if (model != nullptr) {
    ASSIGN_OR_RETURN(type, json::GetString(*model, "type", path, ""));
  }
  if (type == "pdserve-bytes") return std::make_unique<ByteTokenizer>();
  if (type == "BPE") {
    ASSIGN_OR_RETURN(std::unique_ptr<BpeTokenizer> bpe,
                     BpeTokenizer::Load(model_dir, std::move(parsed), path));
    return std::unique_ptr<Tokenizer>(std::move(bpe));
  }
  return absl::UnimplementedError(
      absl::StrCat(path, ": tokenizer model type \"", type,
                   "\" is not supported (supported: BPE, pdserve-bytes)"));
}

namespace {

constexpr char kReplacement[] = "\xEF\xBF\xBD";

// Length of the valid UTF-8 sequence starting at s[i], 0 if ill-formed, or -1
// if it is a valid but incomplete prefix at the end of s. On 0, *bad is the
// length of the maximal ill-formed subpart to replace with one U+FFFD.
int SequenceLength(const std::string& s, size_t i, int* bad) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  *bad = 1;
  if (c < 0x80) return 1;
  int need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (int k = 1; k <= need; ++k) {
    if (i + k >= s.size()) return -1;
    const unsigned char t = b(i + k);
    const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (t < l || t > h) {
      *bad = k;
      return 0;
    }
  }
  return need + 1;
}

}  // namespace

std::string Utf8Stream::Push(const std::string& bytes) {
  pending_ += bytes;
  std::string out;
  size_t i = 0;
  while (i < pending_.size()) {
    int bad;
    const int len = SequenceLength(pending_, i, &bad);
    if (len < 0) break;  // wait for the rest of this character
    if (len == 0) {
      out += kReplacement;
      i += bad;
    } else {
      out.append(pending_, i, len);
      i += len;
    }
  }
  pending_.erase(0, i);
  return out;
}

std::string Utf8Stream::Finish() {
  std::string out;
  // Whatever is left is an incomplete prefix: one replacement character for it.
  if (!pending_.empty()) out = kReplacement;
  pending_.clear();
  return out;
}

TextStream::TextStream(const Tokenizer* tokenizer,
                       std::vector<std::string> stop)
    : tokenizer_(tokenizer), stop_(std::move(stop)) {}

TextStream::Delta TextStream::Push(const std::vector<int32_t>& token_ids) {
  if (stopped_) return {};
  std::string bytes;
  for (int32_t id : token_ids) bytes += tokenizer_->TokenBytes(id);
  text_ += utf8_.Push(bytes);
  return Emit(false);
}

TextStream::Delta TextStream::Finish() {
  if (stopped_) return {};
  text_ += utf8_.Finish();
  return Emit(true);
}

TextStream::Delta TextStream::Emit(bool final) {
  Delta d;
  size_t stop_at = std::string::npos;
  for (const auto& s : stop_) {
    const size_t p = text_.find(s, emitted_);
    if (p != std::string::npos && p < stop_at) stop_at = p;
  }
  if (stop_at != std::string::npos) {
    d.text = text_.substr(emitted_, stop_at - emitted_);
    d.stopped = true;
    stopped_ = true;
    emitted_ = stop_at;
    return d;
  }
  size_t hold = 0;
  if (!final) {
    // Longest suffix of the unemitted text that is a proper prefix of a stop
    // string.
    const size_t avail = text_.size() - emitted_;
    for (const auto& s : stop_) {
      for (size_t n = std::min(avail, s.size() - 1); n > hold; --n) {
        if (text_.compare(text_.size() - n, n, s, 0, n) == 0) {
          hold = n;
          break;
        }
      }
    }
  }
  const size_t end = text_.size() - hold;
  d.text = text_.substr(emitted_, end - emitted_);
  emitted_ = end;
  return d;
}

}  // namespace pdserve::engine
