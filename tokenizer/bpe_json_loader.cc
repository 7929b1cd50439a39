// Reading a Hugging Face tokenizer.json (with tokenizer_config.json and
// generation_config.json) into a BpeTokenizer: the streamed JSON parse of the
// vocabulary and merges, the field readers, and one step per part of the
// file (model options, added tokens, vocabulary, decoder, the model's byte
// and piece tables, merges, BOS/EOS and the post-processor). The
// pre-tokenizer and normalizer are read in bpe_pretokenizer.cc.
#include <algorithm>
#include <cctype>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "tokenizer/bpe_internal.h"

namespace pdserve::engine {
namespace bpe_internal {

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

}  // namespace bpe_internal

namespace {

using bpe_internal::AbslView;
using bpe_internal::AddedToken;
using bpe_internal::AppendUtf8;
using bpe_internal::Bad;
using bpe_internal::ByteAlphabet;
using bpe_internal::DecodeUtf8;
using bpe_internal::Flatten;
using bpe_internal::kMetaspace;
using bpe_internal::ParseNormalizer;
using bpe_internal::ParsePreTokenizer;
using bpe_internal::StringOrNull;
using bpe_internal::TypeOf;
using bpe_internal::Unsupported;
using bpe_internal::Utf8Length;
using bpe_internal::Value;

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

}  // namespace pdserve::engine
