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

void AppendJinjaJson(const json::OrderedValue& v, int indent, int level,
                     std::string* out) {
  const auto newline = [&](int lvl) {
    out->push_back('\n');
    out->append(static_cast<size_t>(indent * lvl), ' ');
  };
  if (v.is_string()) {
    out->push_back('"');
    for (unsigned char c : v.get_ref<const std::string&>()) {
      switch (c) {
        case '"':
          out->append("\\\"");
          break;
        case '\\':
          out->append("\\\\");
          break;
        case '\n':
          out->append("\\n");
          break;
        case '\r':
          out->append("\\r");
          break;
        case '\t':
          out->append("\\t");
          break;
        case '\b':
          out->append("\\b");
          break;
        case '\f':
          out->append("\\f");
          break;
        default:
          if (c < 0x20) {
            absl::StrAppend(out, "\\u00", c < 0x10 ? "0" : "", absl::Hex(c));
          } else {
            out->push_back(static_cast<char>(c));
          }
      }
    }
    out->push_back('"');
  } else if (v.is_array() || v.is_object()) {
    const bool object = v.is_object();
    if (v.empty()) {
      out->append(object ? "{}" : "[]");
      return;
    }
    out->push_back(object ? '{' : '[');
    bool first = true;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (!first) out->append(indent >= 0 ? "," : ", ");
      first = false;
      if (indent >= 0) newline(level + 1);
      if (object) {
        AppendJinjaJson(json::OrderedValue(it.key()), indent, level + 1, out);
        out->append(": ");
      }
      AppendJinjaJson(*it, indent, level + 1, out);
    }
    if (indent >= 0) newline(level);
    out->push_back(object ? '}' : ']');
  } else {
    out->append(v.dump());
  }
}

// A tool call's arguments as templates see them: the parsed JSON
// re-serialized by `tojson` (a text that does not parse stays a string).
std::string ArgumentsJson(const ChatToolCall& call) {
  json::OrderedValue args = json::OrderedValue::parse(
      call.arguments, nullptr, /*allow_exceptions=*/false);
  if (args.is_discarded()) args = call.arguments;
  return JinjaToJson(args);
}

absl::StatusOr<std::string> RenderLlama3(
    const ChatTemplate& t, const std::vector<ChatMessage>& messages,
    bool add_generation_prompt, const std::vector<json::OrderedValue>& tools) {
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
    const bool with_tools = t.tools && !tools.empty();
    absl::StrAppend(
        &out, t.bos_token,
        turn("system",
             absl::StrCat(with_tools ? "Environment: ipython\n" : "",
                          "Cutting Knowledge Date: December 2023\nToday Date: ",
                          t.today, "\n\n", system)));
    if (with_tools) {
      // 3.1 puts the function list into the first (user) turn.
      if (first == messages.size()) {
        return absl::InvalidArgumentError(
            "the llama3 chat template puts tools into the first user message, "
            "and there is none");
      }
      std::string list;
      for (const json::OrderedValue& tool : tools)
        absl::StrAppend(&list, JinjaToJson(tool, 4), "\n\n");
      out += turn("user",
                  absl::StrCat("Given the following functions, please respond "
                               "with a JSON for a function call with its "
                               "proper arguments that best answers the given "
                               "prompt.\n\nRespond in the format {\"name\": "
                               "function name, \"parameters\": dictionary of "
                               "argument name and its value}.Do not use "
                               "variables.\n\n",
                               list, Trim(messages[first].content)));
      ++first;
    }
  }
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (i == 0) out += t.bos_token;
    if (t.llama31_date_header && !m.tool_calls.empty()) {
      if (m.tool_calls.size() != 1) {
        return absl::InvalidArgumentError(
            "the llama3 chat template supports one tool call per assistant "
            "turn");
      }
      const ChatToolCall& call = m.tool_calls[0];
      absl::StrAppend(&out, "<|start_header_id|>assistant<|end_header_id|>\n\n",
                      "{\"name\": \"", call.name,
                      "\", \"parameters\": ", ArgumentsJson(call),
                      "}<|eot_id|>");
    } else if (t.llama31_date_header &&
               (m.role == "tool" || m.role == "ipython")) {
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
    bool add_generation_prompt, const std::vector<json::OrderedValue>& tools) {
  std::string out;
  if (t.tools && !tools.empty()) {
    // Qwen2.5 / Qwen3: the system prompt (or Qwen2.5's default), then the
    // tools' signatures and how to call them.
    const std::string& system =
        messages[0].role == "system" ? messages[0].content : t.default_system;
    out = "<|im_start|>system\n";
    if (!system.empty()) absl::StrAppend(&out, system, "\n\n");
    out +=
        "# Tools\n\nYou may call one or more functions to assist with the "
        "user query.\n\nYou are provided with function signatures within "
        "<tools></tools> XML tags:\n<tools>";
    for (const json::OrderedValue& tool : tools)
      absl::StrAppend(&out, "\n", JinjaToJson(tool));
    out +=
        "\n</tools>\n\nFor each function call, return a json object with "
        "function name and arguments within <tool_call></tool_call> XML "
        "tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call><|im_end|>\n";
  } else if (messages[0].role == "system") {
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
      // The content without the <think> block this turn may get: whether a
      // tool call starts on a line of its own depends on it.
      std::string bare_content = content;
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
        bare_content = content;
        if (i > last_query && (last || !reasoning.empty())) {
          content =
              absl::StrCat("<think>\n", RStrip(LStrip(reasoning, '\n'), '\n'),
                           "\n</think>\n\n", LStrip(content, '\n'));
        }
      }
      if (!t.reasoning && !t.default_system.empty() && !m.tool_calls.empty()) {
        // Qwen2.5: content (if any) and each call on lines of their own.
        out += "<|im_start|>assistant";
        if (!content.empty()) absl::StrAppend(&out, "\n", content);
        for (const ChatToolCall& call : m.tool_calls) {
          absl::StrAppend(&out, "\n<tool_call>\n{\"name\": \"", call.name,
                          "\", \"arguments\": ", ArgumentsJson(call),
                          "}\n</tool_call>");
        }
        out += "<|im_end|>\n";
        continue;
      }
      // Qwen3 (and ChatML without a tool format of its own).
      absl::StrAppend(&out, "<|im_start|>assistant\n", content);
      for (size_t k = 0; k < m.tool_calls.size(); ++k) {
        if (k > 0 || !bare_content.empty()) out += "\n";
        absl::StrAppend(&out, "<tool_call>\n{\"name\": \"",
                        m.tool_calls[k].name,
                        "\", \"arguments\": ", ArgumentsJson(m.tool_calls[k]),
                        "}\n</tool_call>");
      }
      out += "<|im_end|>\n";
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

// Mistral's tool-call ids are 9 alphanumeric characters; longer ids (such as
// OpenAI's "call_...") keep their last 9, as vLLM does.
absl::StatusOr<std::string> MistralCallId(const std::string& id) {
  std::string tail = id.size() > 9 ? id.substr(id.size() - 9) : id;
  bool alnum = tail.size() == 9;
  for (char c : tail) {
    alnum = alnum && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                      (c >= '0' && c <= '9'));
  }
  if (!alnum) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the mistral chat template needs tool call ids of at least 9 "
        "characters ending in 9 letters or digits, not \"",
        id, "\""));
  }
  return tail;
}

// [AVAILABLE_TOOLS] [...][/AVAILABLE_TOOLS]: each function's fields in
// order, string values written as they are (the template does not escape
// them), the rest as JSON; "return" is left out.
std::string MistralTools(const std::vector<json::OrderedValue>& tools) {
  std::string out = "[AVAILABLE_TOOLS] [";
  for (size_t k = 0; k < tools.size(); ++k) {
    out += "{\"type\": \"function\", \"function\": {";
    bool first = true;
    if (auto fn = tools[k].find("function");
        fn != tools[k].end() && fn->is_object()) {
      for (auto it = fn->begin(); it != fn->end(); ++it) {
        if (it.key() == "return") continue;
        if (!first) out += ", ";
        first = false;
        if (it->is_string()) {
          absl::StrAppend(&out, "\"", it.key(), "\": \"",
                          it->get_ref<const std::string&>(), "\"");
        } else {
          absl::StrAppend(&out, "\"", it.key(), "\": ", JinjaToJson(*it));
        }
      }
    }
    out += "}}";
    out += k + 1 < tools.size() ? ", " : "]";
  }
  return out + "[/AVAILABLE_TOOLS]";
}

absl::StatusOr<std::string> RenderMistral(
    const ChatTemplate& t, const std::vector<ChatMessage>& messages,
    const std::vector<json::OrderedValue>& tools) {
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
  // User and assistant turns alternate; tool calls and their results sit
  // between them and do not count.
  size_t turn = 0, last_user = messages.size();
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "user") last_user = i;
    if (m.role == "tool" || !m.tool_calls.empty()) continue;
    if ((m.role == "user") != (turn++ % 2 == 0) ||
        (m.role != "user" && m.role != "assistant")) {
      return absl::InvalidArgumentError(
          "the mistral chat template needs an optional system message, then "
          "alternating "
          "user/assistant messages starting with user");
    }
  }
  const bool with_tools = t.tools && !tools.empty();
  std::string out = t.bos_token;
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    const bool last = i + 1 == messages.size();
    if (m.role == "user") {
      if (with_tools && i == last_user) out += MistralTools(tools);
      if (t.mistral_v1_spacing) {
        absl::StrAppend(&out, "[INST] ", m.content, " [/INST]");
      } else if (last && system != nullptr) {
        absl::StrAppend(&out, "[INST] ", *system, "\n\n", m.content, "[/INST]");
      } else {
        absl::StrAppend(&out, "[INST] ", m.content, "[/INST]");
      }
    } else if (!m.tool_calls.empty()) {
      out += "[TOOL_CALLS] [";
      for (size_t k = 0; k < m.tool_calls.size(); ++k) {
        const ChatToolCall& call = m.tool_calls[k];
        ASSIGN_OR_RETURN(const std::string id, MistralCallId(call.id));
        absl::StrAppend(&out, "{\"name\": \"", call.name,
                        "\", \"arguments\": ", ArgumentsJson(call),
                        ", \"id\": \"", id, "\"}");
        out += k + 1 < m.tool_calls.size() ? ", " : "]" + t.eos_token;
      }
    } else if (m.role == "tool") {
      ASSIGN_OR_RETURN(const std::string id, MistralCallId(m.tool_call_id));
      absl::StrAppend(&out, "[TOOL_RESULTS] {\"content\": ", m.content,
                      ", \"call_id\": \"", id, "\"}[/TOOL_RESULTS]");
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
    t.tools = absl::StrContains(jinja, "Environment: ipython");
  } else if (absl::StrContains(jinja, "<|im_start|>")) {
    t.family = Family::kChatMl;
    t.reasoning = absl::StrContains(jinja, "</think>");
    t.tools = absl::StrContains(jinja, "<tools>");
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
    t.tools = absl::StrContains(jinja, "[AVAILABLE_TOOLS]");
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
      t.tools = true;
    } else if (arch == "Qwen2ForCausalLM") {
      t.family = Family::kChatMl;
      t.tools = true;
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

std::string JinjaToJson(const json::OrderedValue& value, int indent) {
  std::string out;
  AppendJinjaJson(value, indent, 0, &out);
  return out;
}

absl::StatusOr<std::string> ApplyChatTemplate(
    const ChatTemplate& chat_template, const std::vector<ChatMessage>& messages,
    bool add_generation_prompt, const std::vector<json::OrderedValue>& tools) {
  if (messages.empty())
    return absl::InvalidArgumentError("a chat needs at least one message");
  switch (chat_template.family) {
    case Family::kLlama3:
      return RenderLlama3(chat_template, messages, add_generation_prompt,
                          tools);
    case Family::kChatMl:
      return RenderChatMl(chat_template, messages, add_generation_prompt,
                          tools);
    case Family::kMistral:
      return RenderMistral(chat_template, messages, tools);
  }
  return absl::InternalError("unknown chat template family");
}

absl::StatusOr<std::vector<ChatMessage>> ParseChatMessages(
    const std::string& json_text) {
  // Checked (depth, syntax) by the common parser, then read again keeping
  // key order: tool-call arguments are rendered in the order they were given.
  RETURN_IF_ERROR(json::Parse(json_text, "messages").status());
  const json::OrderedValue root =
      json::OrderedValue::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (!root.is_array()) {
    return absl::InvalidArgumentError(
        "messages: expected a JSON list of {\"role\", \"content\"} objects");
  }
  const auto string_field = [](const json::OrderedValue& m, const char* key,
                               std::string* out) {
    auto it = m.find(key);
    if (it == m.end() || it->is_null()) return true;
    if (!it->is_string()) return false;
    *out = it->get<std::string>();
    return true;
  };
  std::vector<ChatMessage> out;
  for (const json::OrderedValue& m : root) {
    ChatMessage msg;
    if (!m.is_object() || !m.contains("role") ||
        !string_field(m, "role", &msg.role) ||
        !string_field(m, "content", &msg.content) ||
        !string_field(m, "tool_call_id", &msg.tool_call_id) ||
        !string_field(m, "name", &msg.name)) {
      return absl::InvalidArgumentError(
          "messages: every message needs a string \"role\"; \"content\", "
          "\"tool_call_id\" and \"name\" are strings");
    }
    if (auto calls = m.find("tool_calls");
        calls != m.end() && calls->is_array()) {
      for (const json::OrderedValue& call : *calls) {
        ChatToolCall c;
        auto fn = call.find("function");
        if (!call.is_object() || fn == call.end() || !fn->is_object() ||
            !string_field(call, "id", &c.id) ||
            !string_field(*fn, "name", &c.name)) {
          return absl::InvalidArgumentError(
              "messages: a tool call is {\"id\", \"function\": {\"name\", "
              "\"arguments\"}}");
        }
        // Arguments as OpenAI sends them (a JSON text) or as an object.
        if (auto args = fn->find("arguments"); args != fn->end()) {
          c.arguments =
              args->is_string() ? args->get<std::string>() : args->dump();
        }
        msg.tool_calls.push_back(std::move(c));
      }
    }
    out.push_back(std::move(msg));
  }
  return out;
}

}  // namespace pdserve::engine
