// `pdserve tokenize` and `pdserve detokenize`: a model's tokenizer from the
// command line, with JSON output.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/command.h"
#include "common/json.h"
#include "tokenizer/bpe_tokenizer.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

ABSL_FLAG(
    std::string, tokenizer, "",
    "tokenize/detokenize: model or tokenizer directory, or its tokenizer.json");
ABSL_FLAG(std::string, text, "", "tokenize: the text to tokenize");
ABSL_FLAG(std::string, file, "",
          "tokenize: read the text to tokenize from this file");
ABSL_FLAG(std::string, messages, "",
          "tokenize: a JSON list of {\"role\", \"content\"} rendered with the "
          "model's chat template");
ABSL_FLAG(bool, add_generation_prompt, true,
          "tokenize --messages: end with the assistant header for the model to "
          "complete");
ABSL_FLAG(bool, add_special_tokens, true,
          "tokenize: add BOS/EOS as the tokenizer config says");
ABSL_FLAG(std::string, ids, "", "detokenize: comma-separated token ids");
ABSL_FLAG(bool, skip_special_tokens, true,
          "detokenize: leave out special tokens such as BOS/EOS");

namespace pdserve::cli {
namespace {

// --tokenizer names a directory, or a tokenizer.json inside one.
absl::StatusOr<std::string> TokenizerDir() {
  std::string path = absl::GetFlag(FLAGS_tokenizer);
  if (path.empty())
    return absl::InvalidArgumentError("--tokenizer PATH is required");
  if (std::filesystem::is_regular_file(path)) {
    path = std::filesystem::path(path).parent_path().string();
    if (path.empty()) path = ".";
  }
  if (!std::filesystem::is_directory(path)) {
    return absl::NotFoundError(
        absl::StrCat(path, ": no such tokenizer directory"));
  }
  return path;
}

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The tokens as written in tokenizer.json, when the tokenizer has such names:
// adds "tokens" to `out`.
void AddTokenTexts(const engine::Tokenizer& tokenizer,
                   const std::vector<int32_t>& ids, json::OrderedValue* out) {
  const auto* bpe = dynamic_cast<const engine::BpeTokenizer*>(&tokenizer);
  if (bpe == nullptr) return;
  json::OrderedValue tokens = json::OrderedValue::array();
  for (int32_t id : ids) tokens.push_back(bpe->TokenText(id));
  (*out)["tokens"] = std::move(tokens);
}

}  // namespace

int RunTokenize(const std::vector<std::string>&) {
  auto dir = TokenizerDir();
  if (!dir.ok()) return ReportError(dir.status());
  const bool has_text = !absl::GetFlag(FLAGS_text).empty();
  const bool has_file = !absl::GetFlag(FLAGS_file).empty();
  const bool has_messages = !absl::GetFlag(FLAGS_messages).empty();
  if (has_text + has_file + has_messages != 1) {
    return ReportError(absl::InvalidArgumentError(
        "give exactly one of --text, --file or --messages"));
  }
  std::string text = absl::GetFlag(FLAGS_text);
  bool add_special = absl::GetFlag(FLAGS_add_special_tokens);
  json::OrderedValue chat_json;  // "chat_template" and "prompt" with --messages
  if (has_file) {
    auto read = ReadText(absl::GetFlag(FLAGS_file));
    if (!read.ok()) return ReportError(read.status());
    text = std::move(*read);
  } else if (has_messages) {
    auto messages = engine::ParseChatMessages(absl::GetFlag(FLAGS_messages));
    if (!messages.ok()) return ReportError(messages.status());
    auto chat = engine::ChatTemplateForModel(*dir);
    if (!chat.ok()) return ReportError(chat.status());
    auto prompt = engine::ApplyChatTemplate(
        *chat, *messages, absl::GetFlag(FLAGS_add_generation_prompt));
    if (!prompt.ok()) return ReportError(prompt.status());
    text = std::move(*prompt);
    add_special = false;  // the template writes BOS itself
    chat_json = {{"chat_template", chat->FamilyName()}, {"prompt", text}};
  }
  auto tokenizer = engine::Tokenizer::Load(*dir);
  if (!tokenizer.ok()) return ReportError(tokenizer.status());
  const std::vector<int32_t> ids = (*tokenizer)->Encode(text, add_special);
  json::OrderedValue out = {{"ids", ids}, {"count", ids.size()}};
  AddTokenTexts(**tokenizer, ids, &out);
  if (!chat_json.is_null()) out.update(chat_json);
  std::printf("%s\n", json::Dump(out).c_str());
  return 0;
}

int RunDetokenize(const std::vector<std::string>&) {
  auto dir = TokenizerDir();
  if (!dir.ok()) return ReportError(dir.status());
  std::vector<int32_t> ids;
  for (absl::string_view part :
       absl::StrSplit(absl::GetFlag(FLAGS_ids), ',', absl::SkipWhitespace())) {
    int32_t id;
    if (!absl::SimpleAtoi(part, &id) || id < 0) {
      return ReportError(absl::InvalidArgumentError(
          absl::StrCat("--ids must be comma-separated token ids, got \"",
                       std::string(part), "\"")));
    }
    ids.push_back(id);
  }
  auto tokenizer = engine::Tokenizer::Load(*dir);
  if (!tokenizer.ok()) return ReportError(tokenizer.status());
  for (int32_t id : ids) {
    if (id >= (*tokenizer)->vocab_size()) {
      return ReportError(absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " is outside the vocabulary [0, ",
                       (*tokenizer)->vocab_size(), ")")));
    }
  }
  const std::string text =
      (*tokenizer)->Decode(ids, absl::GetFlag(FLAGS_skip_special_tokens));
  json::OrderedValue out = {{"text", text}};
  AddTokenTexts(**tokenizer, ids, &out);
  std::printf("%s\n", json::Dump(out).c_str());
  return 0;
}

}  // namespace pdserve::cli
