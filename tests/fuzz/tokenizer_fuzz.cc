// Fuzzes the tokenizer.json loader (tokenizer/bpe_tokenizer.h, the same
// BpeTokenizer::ParseJson and FromJson that Tokenizer::Load calls after
// reading the files)
// and then the loaded tokenizer itself. Input: tokenizer.json, then
// kPartSeparator-separated tokenizer_config.json, generation_config.json and
// a text to encode. A tokenizer that loads must encode to in-vocabulary ids,
// and decoding any ids (valid or not) must give valid UTF-8.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_util.h"
#include "tokenizer/bpe_tokenizer.h"
#include "tokenizer/tokenizer.h"

namespace {

bool ValidUtf8(const std::string& s) {
  pdserve::engine::Utf8Stream utf8;
  return utf8.Push(s) + utf8.Finish() == s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 1 << 20) return 0;
  const auto parts = pdserve::fuzz::SplitParts(data, size, 4);
  auto parsed =
      pdserve::engine::BpeTokenizer::ParseJson(parts[0], "tokenizer.json");
  if (!parsed.ok()) return 0;
  auto tokenizer = pdserve::engine::BpeTokenizer::FromJson(
      *parsed, parts[1], parts[2], "tokenizer.json");
  if (!tokenizer.ok()) return 0;
  const pdserve::engine::BpeTokenizer& t = **tokenizer;
  const std::string text = parts[3].empty() ? "Hello wörld 123 ▁a\n" : parts[3];
  for (bool special : {true, false}) {
    std::vector<int32_t> ids = t.Encode(text, special);
    for (int32_t id : ids) {
      if (id < 0 || id >= t.vocab_size()) std::abort();
      t.TokenBytes(id);
      t.TokenText(id);
    }
    ids.push_back(-1);
    ids.push_back(static_cast<int32_t>(t.vocab_size()));
    for (bool skip : {true, false}) {
      if (!ValidUtf8(t.Decode(ids, skip))) std::abort();
    }
  }
  return 0;
}
