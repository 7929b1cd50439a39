// Tokenizers and UTF-8-safe streaming detokenization.
//
// `Tokenizer` is an interface because real alternatives exist: pdserve's byte
// tokenizer for random-weight models, and Hugging Face BPE for real
// checkpoints (tokenizer/bpe_tokenizer.h). Implementations are immutable after
// construction and thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve::engine {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Token ids of `text`, with the model's BOS first when it has one.
  std::vector<int32_t> Encode(const std::string& text) const {
    return Encode(text, true);
  }
  // With add_special_tokens false, only the text's own tokens (no BOS/EOS);
  // for prompts that already spell them out, such as a chat template's.
  virtual std::vector<int32_t> Encode(const std::string& text,
                                      bool add_special_tokens) const = 0;
  // Raw bytes of one token (empty for special tokens such as BOS/EOS). The
  // bytes of consecutive tokens concatenate to the text, which may split a
  // UTF-8 character across tokens.
  virtual std::string TokenBytes(int32_t id) const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int32_t bos_id() const = 0;  // -1: none
  virtual int32_t eos_id() const = 0;  // -1: none
  // Special tokens (BOS, EOS, chat markers) have no text of their own.
  virtual bool IsSpecial(int32_t id) const {
    return id == bos_id() || id == eos_id();
  }
  // The text of `ids` as valid UTF-8 (ill-formed bytes become U+FFFD). Special
  // tokens are dropped, or written as their content when !skip_special_tokens.
  virtual std::string Decode(const std::vector<int32_t>& ids,
                             bool skip_special_tokens) const;

  // Loads the tokenizer of a model directory: tokenizer.json of pdserve's
  // byte model or a Hugging Face BPE model, with tokenizer_config.json and
  // generation_config.json when present.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(
      const std::string& model_dir);

 protected:
  // What Decode writes for a special token when !skip_special_tokens.
  virtual std::string SpecialTokenText(int32_t) const { return ""; }
};

// 256 byte tokens (id = byte value), then BOS (256) and EOS (257).
class ByteTokenizer : public Tokenizer {
 public:
  static constexpr int32_t kBos = 256;
  static constexpr int32_t kEos = 257;
  static constexpr int64_t kVocab = 258;

  using Tokenizer::Encode;
  std::vector<int32_t> Encode(const std::string& text,
                              bool add_special_tokens) const override;
  std::string TokenBytes(int32_t id) const override;
  int64_t vocab_size() const override { return kVocab; }
  int32_t bos_id() const override { return kBos; }
  int32_t eos_id() const override { return kEos; }

  // tokenizer.json / tokenizer_config.json contents for `model init`.
  static std::string TokenizerJson();
  static std::string TokenizerConfigJson();

 protected:
  std::string SpecialTokenText(int32_t id) const override;
};

// Turns a byte stream into valid UTF-8 text incrementally. A character split
// across pushes waits for its remaining bytes; ill-formed bytes become U+FFFD
// (one per maximal ill-formed subpart, as the Unicode standard recommends).
// The output is the same however the bytes are split across calls.
class Utf8Stream {
 public:
  std::string Push(const std::string& bytes);
  // Ends the stream: an incomplete trailing character becomes U+FFFD.
  std::string Finish();

 private:
  std::string pending_;
};

// Detokenizes generated tokens and applies stop strings. Text that could be
// the start of a stop string is held back until it is clear; when a stop
// string appears, text ends right before it. One instance per request;
// thread-compatible.
class TextStream {
 public:
  TextStream(const Tokenizer* tokenizer, std::vector<std::string> stop);

  struct Delta {
    std::string text;      // new text safe to show
    bool stopped = false;  // a stop string matched; the request should end
  };
  Delta Push(const std::vector<int32_t>& token_ids);
  // Final flush when the request ends for another reason.
  Delta Finish();

 private:
  Delta Emit(bool final);

  const Tokenizer* tokenizer_;
  std::vector<std::string> stop_;
  Utf8Stream utf8_;
  std::string text_;    // decoded text so far
  size_t emitted_ = 0;  // bytes of text_ already returned
  bool stopped_ = false;
};

}  // namespace pdserve::engine
