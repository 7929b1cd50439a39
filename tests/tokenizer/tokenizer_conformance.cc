// Checks pdserve's BPE tokenizer against ids from the JavaScript reference
// implementation (js_encode.js), string by string, plus the round trip and
// streaming detokenization; or times it on a benchmark corpus.
//
//   tokenizer_conformance check DIR CORPUS.json EXPECTED.json
//   [--js-ignores-add-bos] tokenizer_conformance bench DIR CORPUS.json
//
// --js-ignores-add-bos: the reference does not apply tokenizer_config.json's
// add_bos_token for the Llama tokenizer classes (transformers does, and so does
// pdserve), so the expected ids with special tokens are BOS + the plain ids.
#include <unicode/normalizer2.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/json.h"
#include "tokenizer/bpe_tokenizer.h"
#include "tokenizer/chat_template.h"

namespace pdserve::engine {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The strings of a JSON list; entries that are not strings become "" (and
// then fail the comparison they are used in).
std::vector<std::string> Strings(const json::Value& list) {
  std::vector<std::string> out;
  if (!list.is_array()) return out;
  for (const json::Value& v : list) {
    const std::string* s = json::StringOrNull(&v);
    out.push_back(s != nullptr ? *s : "");
  }
  return out;
}

// A list of id lists; ids that are not int32 become -1.
std::vector<std::vector<int32_t>> IdLists(const json::Value* list) {
  std::vector<std::vector<int32_t>> out;
  if (list == nullptr || !list->is_array()) return out;
  for (const json::Value& row : *list) {
    std::vector<int32_t> ids;
    if (row.is_array()) {
      for (const json::Value& id : row) {
        auto i = json::AsInt(id, "id", INT32_MIN, INT32_MAX);
        ids.push_back(i.ok() ? static_cast<int32_t>(*i) : -1);
      }
    }
    out.push_back(std::move(ids));
  }
  return out;
}

std::string Nfc(const std::string& s) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(status);
  std::string out;
  icu::StringByteSink<std::string> sink(&out);
  nfc->normalizeUTF8(0,
                     icu::StringPiece(s.data(), static_cast<int32_t>(s.size())),
                     sink, nullptr, status);
  return U_SUCCESS(status) ? out : s;
}

// A short printable form of a string for failure messages.
std::string Show(const std::string& s) {
  std::string q = json::Quote(s.size() > 160 ? s.substr(0, 160) + "..." : s);
  return q;
}

std::string ShowIds(const std::vector<int32_t>& ids) {
  if (ids.size() > 40) {
    return absl::StrCat("[", absl::StrJoin(ids.begin(), ids.begin() + 40, ","),
                        ",...] (", ids.size(), " ids)");
  }
  return absl::StrCat("[", absl::StrJoin(ids, ","), "]");
}

struct Counter {
  const char* what;
  int pass = 0, fail = 0, shown = 0;
  void Check(bool ok, const std::function<std::string()>& detail) {
    if (ok) {
      ++pass;
      return;
    }
    ++fail;
    if (shown++ < 5)
      std::fprintf(stderr, "  MISMATCH (%s): %s\n", what, detail().c_str());
  }
};

int Check(const std::string& dir, const std::string& corpus_path,
          const std::string& expected_path, bool js_ignores_add_bos) {
  const auto t0 = std::chrono::steady_clock::now();
  auto tok = BpeTokenizer::Load(dir);
  if (!tok.ok()) {
    std::fprintf(stderr, "cannot load %s: %s\n", dir.c_str(),
                 std::string(tok.status().message()).c_str());
    return 1;
  }
  const double load_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  auto corpus_json = json::Parse(ReadFile(corpus_path), corpus_path);
  auto expected_json = json::Parse(ReadFile(expected_path), expected_path);
  if (!corpus_json.ok() || !expected_json.ok()) {
    std::fprintf(stderr, "cannot parse the corpus or the expected ids\n");
    return 1;
  }
  const std::vector<std::string> corpus = Strings(*corpus_json);
  const auto plain = IdLists(json::Find(*expected_json, "plain"));
  const auto with_special = IdLists(json::Find(*expected_json, "with_special"));
  if (plain.size() != corpus.size() || with_special.size() != corpus.size()) {
    std::fprintf(stderr, "expected ids do not cover the corpus\n");
    return 1;
  }
  const BpeTokenizer& t = **tok;
  Counter ids_plain{"ids without special tokens"},
      ids_special{"ids with special tokens"},
      round_trip{"decode(encode(text))"}, streaming{"streamed text"};
  int round_trip_na = 0, normalized = 0;
  for (size_t i = 0; i < corpus.size(); ++i) {
    const std::string& text = corpus[i];
    const std::vector<int32_t> got = t.Encode(text, false);
    ids_plain.Check(got == plain[i], [&] {
      return absl::StrCat(Show(text), "\n    js      ", ShowIds(plain[i]),
                          "\n    pdserve ", ShowIds(got));
    });
    std::vector<int32_t> want = with_special[i];
    if (js_ignores_add_bos && t.bos_id() >= 0) {
      want = plain[i];
      want.insert(want.begin(), t.bos_id());
    }
    const std::vector<int32_t> got_special = t.Encode(text);
    ids_special.Check(got_special == want, [&] {
      return absl::StrCat(Show(text), "\n    js      ", ShowIds(want),
                          "\n    pdserve ", ShowIds(got_special));
    });

    // Round trip. SentencePiece-style models put a "▁" before every text run,
    // including runs after an added token, and write spaces as "▁", so text
    // with added tokens or a literal "▁" does not come back verbatim there
    // (nor in Hugging Face); NFC models return NFC.
    bool sentencepiece_lossy = text.find("\xE2\x96\x81") != std::string::npos;
    for (int32_t id : got) sentencepiece_lossy |= t.IsSpecial(id);
    const std::string back = t.Decode(got, false);
    if (!t.byte_level() && sentencepiece_lossy) {
      ++round_trip_na;
    } else {
      const bool nfc_only = back != text && back == Nfc(text);
      normalized += nfc_only;
      round_trip.Check(back == text || nfc_only, [&] {
        return absl::StrCat(Show(text), " came back as ", Show(back));
      });
    }

    // Streaming, one token at a time, equals decoding all at once
    // (SentencePiece keeps the leading space that whole-text decoding strips).
    TextStream stream(&t, {});
    std::string streamed;
    for (int32_t id : got) streamed += stream.Push({id}).text;
    streamed += stream.Finish().text;
    const std::string whole = t.Decode(got, true);
    streaming.Check(
        streamed == whole || (!t.byte_level() && streamed == " " + whole), [&] {
          return absl::StrCat(Show(text), ": streamed ", Show(streamed),
                              " vs decoded ", Show(whole));
        });
  }
  const bool ok =
      ids_plain.fail + ids_special.fail + round_trip.fail + streaming.fail == 0;
  std::printf(
      "%s: %zu strings; ids without special tokens %d/%zu equal, with special "
      "tokens %d/%zu equal; "
      "round trip %d/%d (%d equal after NFC, %d not applicable); streaming "
      "%d/%zu; "
      "load %.2f s\n",
      dir.c_str(), corpus.size(), ids_plain.pass, corpus.size(),
      ids_special.pass, corpus.size(), round_trip.pass,
      round_trip.pass + round_trip.fail, normalized, round_trip_na,
      streaming.pass, corpus.size(), load_s);
  return ok ? 0 : 1;
}

int Chat(const std::string& dir, const std::string& conversations_path,
         const std::string& expected_path) {
  auto chat = ChatTemplateForModel(dir);
  auto conversations =
      json::Parse(ReadFile(conversations_path), conversations_path);
  auto expected = json::Parse(ReadFile(expected_path), expected_path);
  if (!chat.ok() || !conversations.ok() || !expected.ok()) {
    std::fprintf(stderr,
                 "cannot load the chat template, conversations or prompts\n");
    return 1;
  }
  const std::vector<std::string> want = Strings(*expected);
  Counter prompts{"chat prompt"};
  int i = 0;
  if (!conversations->is_array()) {
    std::fprintf(stderr, "%s: expected a list of conversations\n",
                 conversations_path.c_str());
    return 1;
  }
  // Re-read keeping key order: tools are rendered as given.
  const json::OrderedValue ordered = json::OrderedValue::parse(
      ReadFile(conversations_path), nullptr, /*allow_exceptions=*/false);
  for (const json::OrderedValue& conversation : ordered) {
    // A list of messages, or {"messages": [...], "tools": [...]}.
    const bool with_tools =
        conversation.is_object() && conversation.contains("messages");
    std::vector<json::OrderedValue> tools;
    if (with_tools && conversation.contains("tools")) {
      for (const json::OrderedValue& t : conversation["tools"])
        tools.push_back(t);
    }
    auto messages = ParseChatMessages(
        (with_tools ? conversation["messages"] : conversation).dump());
    auto got = messages.ok() ? ApplyChatTemplate(*chat, *messages, true, tools)
                             : absl::StatusOr<std::string>(messages.status());
    const std::string w = i < static_cast<int>(want.size()) ? want[i] : "";
    ++i;
    prompts.Check(got.ok() && *got == w, [&] {
      return absl::StrCat(
          "conversation ", i - 1, "\n    js      ", Show(w), "\n    pdserve ",
          got.ok() ? Show(*got) : std::string(got.status().message()));
    });
  }
  std::printf("%s: %s chat template, %d/%d prompts equal\n", dir.c_str(),
              chat->FamilyName().c_str(), prompts.pass,
              prompts.pass + prompts.fail);
  return prompts.fail == 0 ? 0 : 1;
}

int Bench(const std::string& dir, const std::string& corpus_path) {
  auto tok = BpeTokenizer::Load(dir);
  auto corpus_json = json::Parse(ReadFile(corpus_path), corpus_path);
  if (!tok.ok() || !corpus_json.ok()) {
    std::fprintf(stderr, "cannot load the tokenizer or the corpus\n");
    return 1;
  }
  const std::vector<std::string> corpus = Strings(*corpus_json);
  size_t bytes = 0, tokens = 0;
  for (const auto& s : corpus) bytes += s.size();
  (*tok)->Encode(corpus[0], false);  // warm up
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& s : corpus) tokens += (*tok)->Encode(s, false).size();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  std::printf("%s\n", json::Dump(json::OrderedValue{{"bytes", bytes},
                                                    {"seconds", seconds},
                                                    {"tokens", tokens}})
                          .c_str());
  return 0;
}

}  // namespace
}  // namespace pdserve::engine

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() >= 4 && args[0] == "check") {
    const bool ignores_bos =
        args.size() > 4 && args[4] == "--js-ignores-add-bos";
    return pdserve::engine::Check(args[1], args[2], args[3], ignores_bos);
  }
  if (args.size() == 4 && args[0] == "chat") {
    return pdserve::engine::Chat(args[1], args[2], args[3]);
  }
  if (args.size() == 3 && args[0] == "bench")
    return pdserve::engine::Bench(args[1], args[2]);
  std::fprintf(
      stderr,
      "usage: tokenizer_conformance check DIR CORPUS.json "
      "EXPECTED.json [--js-ignores-add-bos]\n"
      "       tokenizer_conformance chat DIR CONVERSATIONS.json EXPECTED.json\n"
      "       tokenizer_conformance bench DIR CORPUS.json\n");
  return 2;
}
