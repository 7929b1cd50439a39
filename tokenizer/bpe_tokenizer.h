// Byte-pair-encoding tokenizers read from a Hugging Face tokenizer.json.
//
// Two kinds share one implementation:
//  - byte-level BPE (Llama-3, Qwen2/Qwen3, DeepSeek-V3): the text is split by
//    the pre-tokenizer's regexes (PCRE2, Unicode properties), and each piece is
//    merged starting from its bytes;
//  - SentencePiece-style BPE (Llama-2, Mistral): spaces become the metaspace
//    "▁", pieces are merged starting from their characters, and characters
//    outside the vocabulary become <0xNN> byte tokens (byte fallback).
// Added tokens are matched in the raw text before anything else, leftmost and
// longest first. BOS/EOS come from tokenizer_config.json (falling back to
// generation_config.json); whether Encode adds them follows the post-processor
// of tokenizer.json, or add_bos_token/add_eos_token for the Llama tokenizer
// classes, as in Hugging Face transformers.
//
// Immutable after Load; all methods are const and thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/json.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::engine {

class BpeTokenizer : public Tokenizer {
 public:
  // tokenizer.json, parsed. model.vocab and model.merges, nearly all of a
  // large file, are streamed into flat lists instead of the document (where
  // they stay as empty containers): a JSON document of 150k-entry containers
  // costs more to build and free than the rest of loading.
  struct ParsedJson {
    json::Value root;
    std::vector<std::pair<std::string, json::Value>> vocab;  // token, id
    std::vector<json::Value> merges;  // "left right" or [left, right]
  };
  // `where` names the file in errors.
  static absl::StatusOr<ParsedJson> ParseJson(std::string_view text,
                                              const std::string& where);

  // Reads tokenizer.json (required), tokenizer_config.json and
  // generation_config.json (optional) from `dir`.
  static absl::StatusOr<std::unique_ptr<BpeTokenizer>> Load(
      const std::string& dir);
  // As Load, with tokenizer.json (at `path`) already parsed.
  static absl::StatusOr<std::unique_ptr<BpeTokenizer>> Load(
      const std::string& dir, ParsedJson tokenizer, const std::string& path);
  // From a parsed tokenizer.json and the texts of the two config files (empty
  // when absent). `where` names tokenizer.json in errors. Errors:
  // INVALID_ARGUMENT for malformed files, UNIMPLEMENTED for components
  // pdserve does not support (named in the message).
  static absl::StatusOr<std::unique_ptr<BpeTokenizer>> FromJson(
      ParsedJson tokenizer, const std::string& tokenizer_config_json,
      const std::string& generation_config_json, const std::string& where);
  ~BpeTokenizer() override;

  using Tokenizer::Encode;
  std::vector<int32_t> Encode(const std::string& text,
                              bool add_special_tokens) const override;
  // Raw bytes of a token: byte-level tokens map back through the GPT-2 byte
  // alphabet; SentencePiece tokens have "▁" as a space and <0xNN> as the byte.
  // Special added tokens have no bytes; other added tokens are their content.
  std::string TokenBytes(int32_t id) const override;
  std::string Decode(const std::vector<int32_t>& ids,
                     bool skip_special_tokens) const override;
  int64_t vocab_size() const override {
    return static_cast<int64_t>(tokens_.size());
  }
  int32_t bos_id() const override { return bos_id_; }
  int32_t eos_id() const override { return eos_id_; }
  bool IsSpecial(int32_t id) const override;

  // The token as written in tokenizer.json ("Ġhello", "▁hi", "<|eot_id|>");
  // empty when `id` is out of range.
  const std::string& TokenText(int32_t id) const;
  // The id of a token as written in tokenizer.json, or -1.
  int32_t TokenId(std::string_view token) const;
  bool byte_level() const { return byte_level_; }

 private:
  struct Impl;
  struct Scratch;
  BpeTokenizer();

  // Appends the ids of one pre-tokenized piece (bytes for byte-level models,
  // metaspace text otherwise).
  void EncodePiece(std::string_view piece, Scratch* scratch,
                   std::vector<int32_t>* out) const;
  void EncodeSection(std::string_view section, bool first_section,
                     Scratch* scratch, std::vector<int32_t>* out) const;

  std::unique_ptr<Impl> impl_;
  bool byte_level_ = false;
  bool ignore_merges_ = false;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  int32_t unk_id_ = -1;
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  // Leading spaces that Decode removes (the SentencePiece "Strip" decoder or
  // Metaspace's prefix space); 0 for byte-level models.
  int strip_leading_spaces_ = 0;
  std::vector<int32_t> prefix_ids_;  // added by Encode before the text (BOS)
  std::vector<int32_t> suffix_ids_;  // ...and after it

  std::vector<std::string> tokens_;  // id -> token as in tokenizer.json
  std::vector<std::string>
      token_bytes_;            // id -> raw bytes ("" for special tokens)
  std::vector<bool> special_;  // id -> special added token
  absl::flat_hash_map<std::string, int32_t>
      token_ids_;  // tokenizer.json text -> id
  // Model-space text -> id: raw bytes for byte-level models, the token text
  // otherwise. Used for the initial symbols (not byte-level) and for
  // ignore_merges; empty for byte-level models without ignore_merges.
  absl::flat_hash_map<std::string, int32_t> piece_ids_;
  // (left id << 32 | right id) -> (rank << 32 | merged id).
  absl::flat_hash_map<uint64_t, uint64_t> merges_;
  int32_t byte_ids_[256];           // byte-level: the token of each single byte
  int32_t byte_fallback_ids_[256];  // <0xNN> tokens, -1 where absent
};

}  // namespace pdserve::engine
