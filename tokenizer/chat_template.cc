#include "tokenizer/chat_template.h"

#include <unicode/uchar.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/json.h"
#include "common/status_macros.h"

namespace pdserve::engine {
namespace {

using Family = ChatTemplate::Family;

// The code point at s[i] and its length in bytes (s is valid UTF-8).
char32_t CodePointAt(const std::string& s, size_t i, int* len) {
  const auto c = static_cast<unsigned char>(s[i]);
  const auto b = [&](size_t k) {
    return static_cast<char32_t>(static_cast<unsigned char>(s[i + k]) & 0x3F);
  };
  if (c < 0x80 || i + 1 >= s.size()) {
    *len = 1;
    return c;
  }
  if (c < 0xE0) {
    *len = 2;
    return (char32_t{c & 0x1Fu} << 6) | b(1);
  }
  if (c < 0xF0 && i + 2 < s.size()) {
    *len = 3;
    return (char32_t{c & 0x0Fu} << 12) | (b(1) << 6) | b(2);
  }
  if (i + 3 < s.size()) {
    *len = 4;
    return (char32_t{c & 0x07u} << 18) | (b(1) << 12) | (b(2) << 6) | b(3);
  }
  *len = 1;
  return c;
}

// Jinja's `trim` (Python's str.strip()): Unicode whitespace at both ends.
std::string Trim(const std::string& s) {
  size_t begin = 0, end = s.size();
  while (begin < end) {
    int len;
    if (!u_isUWhiteSpace(CodePointAt(s, begin, &len))) break;
    begin += len;
  }
  while (end > begin) {
    size_t start = end - 1;
    while (start > begin &&
           (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80)
      --start;
    int len;
    if (!u_isUWhiteSpace(CodePointAt(s, start, &len))) break;
    end = start;
  }
  return s.substr(begin, end - begin);
}

// Python's str.strip/lstrip/rstrip with an explicit character ('\n').
std::string LStrip(const std::string& s, char c) {
  size_t b = 0;
  while (b < s.size() && s[b] == c) ++b;
  return s.substr(b);
}
std::string RStrip(const std::string& s, char c) {
  size_t e = s.size();
  while (e > 0 && s[e - 1] == c) --e;
  return s.substr(0, e);
}

// A token as tokenizer_config.json writes it: a string, or an AddedToken
// object with "content"; "" otherwise.
std::string TokenName(const json::Value* v) {
  if (const std::string* s = json::StringOrNull(v)) return *s;
  if (v == nullptr) return "";
  const std::string* c = json::StringOrNull(json::Find(*v, "content"));
  return c != nullptr ? *c : "";
}

absl::Status BadRole(const ChatTemplate& t, const std::string& role) {
  return absl::InvalidArgumentError(
      absl::StrCat("the ", t.FamilyName(),
                   " chat template does not support role \"", role, "\""));
}

absl::StatusOr<std::string> RenderLlama3(
    const ChatTemplate& t, const std::vector<ChatMessage>& messages,
    bool add_generation_prompt) {
  auto turn = [](const std::string& role, const std::string& content) {
    return absl::StrCat("<|start_header_id|>", role, "<|end_header_id|>\n\n",
                        content, "<|eot_id|>");
  };
  std::string out;
  size_t first = 0;
  if (t.llama31_date_header) {
    std::string system;
    if (messages[0].role == "system") {
      system = Trim(messages[0].content);
      first = 1;
    }
    absl::StrAppend(
        &out, t.bos_token,
        turn("system",
             absl::StrCat("Cutting Knowledge Date: December 2023\nToday Date: ",
                          t.today, "\n\n", system)));
  }
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (i == 0) out += t.bos_token;
    if (t.llama31_date_header && (m.role == "tool" || m.role == "ipython")) {
      // 3.1 writes tool output as JSON (a string is "iterable" to its
      // template).
      out += turn("ipython", json::Quote(m.content));
    } else if (m.role == "system" || m.role == "user" ||
               m.role == "assistant") {
      out += turn(m.role, Trim(m.content));
    } else {
      return BadRole(t, m.role);
    }
  }
  if (add_generation_prompt)
    out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return out;
}

absl::StatusOr<std::string> RenderChatMl(
    const ChatTemplate& t, const std::vector<ChatMessage>& messages,
    bool add_generation_prompt) {
  std::string out;
  if (messages[0].role == "system") {
    absl::StrAppend(&out, "<|im_start|>system\n", messages[0].content,
                    "<|im_end|>\n");
  } else if (!t.default_system.empty()) {
    absl::StrAppend(&out, "<|im_start|>system\n", t.default_system,
                    "<|im_end|>\n");
  }
  // Qwen3 keeps reasoning only for assistant turns after the last real user
  // query (tool responses come back as user turns and do not count).
  size_t last_query = messages.size() - 1;
  for (size_t k = messages.size(); k-- > 0;) {
    const std::string& c = messages[k].content;
    if (messages[k].role == "user" &&
        !(absl::StartsWith(c, "<tool_response>") &&
          absl::EndsWith(c, "</tool_response>"))) {
      last_query = k;
      break;
    }
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    const bool last = i + 1 == messages.size();
    if (m.role == "user" || (m.role == "system" && i > 0)) {
      absl::StrAppend(&out, "<|im_start|>", m.role, "\n", m.content,
                      "<|im_end|>\n");
    } else if (m.role == "system") {
      continue;  // written above
    } else if (m.role == "assistant") {
      std::string content = m.content;
      if (t.reasoning) {
        std::string reasoning;
        const size_t close = content.find("</think>");
        if (close != std::string::npos) {
          const std::string before = RStrip(content.substr(0, close), '\n');
          const size_t open = before.rfind("<think>");
          reasoning = LStrip(
              open == std::string::npos ? before : before.substr(open + 7),
              '\n');
          content = LStrip(content.substr(content.rfind("</think>") + 8), '\n');
        }
        if (i > last_query && (last || !reasoning.empty())) {
          content =
              absl::StrCat("<think>\n", RStrip(LStrip(reasoning, '\n'), '\n'),
                           "\n</think>\n\n", LStrip(content, '\n'));
        }
      }
      absl::StrAppend(&out, "<|im_start|>assistant\n", content, "<|im_end|>\n");
    } else if (m.role == "tool") {
      if (i == 0 || messages[i - 1].role != "tool") out += "<|im_start|>user";
      absl::StrAppend(&out, "\n<tool_response>\n", m.content,
                      "\n</tool_response>");
      if (last || messages[i + 1].role != "tool") out += "<|im_end|>\n";
    } else {
      return BadRole(t, m.role);
    }
  }
  if (add_generation_prompt) {
    out += "<|im_start|>assistant\n";
    if (t.reasoning && !t.enable_thinking) out += "<think>\n\n</think>\n\n";
  }
  return out;
}

absl::StatusOr<std::string> RenderMistral(
    const ChatTemplate& t, const std::vector<ChatMessage>& messages) {
  size_t first = 0;
  const std::string* system = nullptr;
  if (messages[0].role == "system") {
    if (t.mistral_v1_spacing) {
      return absl::InvalidArgumentError(
          "this Mistral chat template does not support system messages");
    }
    system = &messages[0].content;
    first = 1;
  }
  std::string out = t.bos_token;
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if ((m.role == "user") != ((i - first) % 2 == 0) ||
        (m.role != "user" && m.role != "assistant")) {
      return absl::InvalidArgumentError(
          "the mistral chat template needs an optional system message, then "
          "alternating "
          "user/assistant messages starting with user");
    }
    const bool last = i + 1 == messages.size();
    if (m.role == "user") {
      if (t.mistral_v1_spacing) {
        absl::StrAppend(&out, "[INST] ", m.content, " [/INST]");
      } else if (last && system != nullptr) {
        absl::StrAppend(&out, "[INST] ", *system, "\n\n", m.content, "[/INST]");
      } else {
        absl::StrAppend(&out, "[INST] ", m.content, "[/INST]");
      }
    } else if (t.mistral_v1_spacing) {
      absl::StrAppend(&out, m.content, t.eos_token);
    } else {
      absl::StrAppend(&out, " ", Trim(m.content), t.eos_token);
    }
  }
  return out;
}

}  // namespace

std::string ChatTemplate::FamilyName() const {
  switch (family) {
    case Family::kLlama3:
      return "llama3";
    case Family::kChatMl:
      return "chatml";
    case Family::kMistral:
      return "mistral";
  }
  return "unknown";
}

absl::StatusOr<ChatTemplate> ChatTemplateFromJinja(const std::string& jinja) {
  ChatTemplate t;
  if (absl::StrContains(jinja, "<|start_header_id|>")) {
    t.family = Family::kLlama3;
    t.bos_token = "<|begin_of_text|>";
    t.llama31_date_header = absl::StrContains(jinja, "Cutting Knowledge Date");
  } else if (absl::StrContains(jinja, "<|im_start|>")) {
    t.family = Family::kChatMl;
    t.reasoning = absl::StrContains(jinja, "</think>");
    for (const char* system : {"You are Qwen, created by Alibaba Cloud. You "
                               "are a helpful assistant.",
                               "You are a helpful assistant."}) {
      if (!t.reasoning && absl::StrContains(jinja, system)) {
        t.default_system = system;
        break;
      }
    }
  } else if (absl::StrContains(jinja, "[INST]") &&
             !absl::StrContains(jinja, "<<SYS>>")) {
    t.family = Family::kMistral;
    t.bos_token = "<s>";
    t.eos_token = "</s>";
    t.mistral_v1_spacing = absl::StrContains(jinja, "' [/INST]'");
  } else {
    return absl::NotFoundError(
        "the chat template is not one pdserve implements (Llama-3, ChatML as "
        "in Qwen2/Qwen3, Mistral)");
  }
  return t;
}

absl::StatusOr<ChatTemplate> ChatTemplateForModel(const std::string& dir) {
  const std::string config_path = dir + "/tokenizer_config.json";
  ASSIGN_OR_RETURN(std::string config_text, ReadFileIfExists(config_path));
  json::Value config;
  if (!config_text.empty()) {
    ASSIGN_OR_RETURN(config, json::Parse(config_text, config_path));
  }
  std::string jinja;
  if (const json::Value* ct = json::Find(config, "chat_template")) {
    if (const std::string* text = json::StringOrNull(ct)) {
      jinja = *text;
    } else if (ct->is_array()) {
      // [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
      for (const json::Value& named : *ct) {
        if (TokenName(json::Find(named, "name")) == "default") {
          const std::string* tmpl =
              json::StringOrNull(json::Find(named, "template"));
          if (tmpl != nullptr) jinja = *tmpl;
        }
      }
    }
  }
  ChatTemplate t;
  if (!jinja.empty()) {
    auto from_jinja = ChatTemplateFromJinja(jinja);
    if (!from_jinja.ok()) {
      return absl::UnimplementedError(
          absl::StrCat(config_path, ": ", from_jinja.status().message()));
    }
    t = *from_jinja;
  } else {
    // No template text: the architecture's family, when it has only one.
    const std::string model_config_path = dir + "/config.json";
    ASSIGN_OR_RETURN(std::string model_text,
                     ReadFileIfExists(model_config_path));
    std::string arch;
    if (!model_text.empty()) {
      ASSIGN_OR_RETURN(json::Value model,
                       json::Parse(model_text, model_config_path));
      const json::Value* archs = json::Find(model, "architectures");
      if (archs != nullptr && archs->is_array() && !archs->empty()) {
        arch = TokenName(&archs->front());
      }
    }
    if (arch == "Qwen3ForCausalLM") {
      t.family = Family::kChatMl;
      t.reasoning = true;
    } else if (arch == "Qwen2ForCausalLM") {
      t.family = Family::kChatMl;
      t.default_system =
          "You are Qwen, created by Alibaba Cloud. You are a helpful "
          "assistant.";
    } else if (arch == "MistralForCausalLM") {
      t.family = Family::kMistral;
      t.bos_token = "<s>";
      t.eos_token = "</s>";
    } else if (arch == "LlamaForCausalLM" &&
               absl::StrContains(config_text, "<|start_header_id|>")) {
      t.family = Family::kLlama3;
      t.bos_token = "<|begin_of_text|>";
    } else {
      return absl::NotFoundError(absl::StrCat(
          dir,
          ": no chat template: tokenizer_config.json has no \"chat_template\" "
          "and architecture \"",
          arch.empty() ? "(none)" : arch, "\" has no default one"));
    }
  }
  if (const std::string bos = TokenName(json::Find(config, "bos_token"));
      !bos.empty())
    t.bos_token = bos;
  if (const std::string eos = TokenName(json::Find(config, "eos_token"));
      !eos.empty())
    t.eos_token = eos;
  if (t.family == Family::kChatMl) t.bos_token.clear();
  return t;
}

absl::StatusOr<std::string> ApplyChatTemplate(
    const ChatTemplate& chat_template, const std::vector<ChatMessage>& messages,
    bool add_generation_prompt) {
  if (messages.empty())
    return absl::InvalidArgumentError("a chat needs at least one message");
  switch (chat_template.family) {
    case Family::kLlama3:
      return RenderLlama3(chat_template, messages, add_generation_prompt);
    case Family::kChatMl:
      return RenderChatMl(chat_template, messages, add_generation_prompt);
    case Family::kMistral:
      return RenderMistral(chat_template, messages);
  }
  return absl::InternalError("unknown chat template family");
}

absl::StatusOr<std::vector<ChatMessage>> ParseChatMessages(
    const std::string& json_text) {
  ASSIGN_OR_RETURN(json::Value root, json::Parse(json_text, "messages"));
  if (!root.is_array()) {
    return absl::InvalidArgumentError(
        "messages: expected a JSON list of {\"role\", \"content\"} objects");
  }
  std::vector<ChatMessage> out;
  for (const json::Value& m : root) {
    ChatMessage msg;
    ASSIGN_OR_RETURN(msg.role, json::GetString(m, "role", "messages"));
    ASSIGN_OR_RETURN(msg.content,
                     json::GetString(m, "content", "messages", ""));
    out.push_back(std::move(msg));
  }
  return out;
}

}  // namespace pdserve::engine
