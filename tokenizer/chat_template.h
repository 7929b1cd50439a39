// Chat prompts for the common model families, written in C++ instead of
// evaluating the Jinja template of tokenizer_config.json:
//  - Llama-3 (and the 3.1 form with its "Cutting Knowledge Date" system
//  header),
//  - ChatML as used by Qwen2 / Qwen2.5 (default system prompt) and Qwen3
//    (<think> reasoning kept only after the last user turn),
//  - Mistral's [INST] ... [/INST] (v0.3 spacing, or v0.1 when its template says
//  so).
// The family is recognised from the template text, falling back on the
// architecture in config.json; anything else is an error that says so.
// Tools, assistant tool calls and tool results are rendered in each family's
// own format (Qwen2.5/Qwen3 "# Tools" + <tool_call>/<tool_response>,
// Llama-3.1's JSON functions and ipython turns, Mistral v0.3's
// [AVAILABLE_TOOLS]/[TOOL_CALLS]/[TOOL_RESULTS]); Qwen3's is checked byte for
// byte against its Jinja template in tests/tokenizer.
//
// The rendered prompt already contains BOS where the family wants it, so it is
// tokenized with add_special_tokens = false. Plain values; thread-safe.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/json.h"

namespace pdserve::engine {

// A function call an assistant turn made (OpenAI's message.tool_calls).
struct ChatToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // a JSON text
};

struct ChatMessage {
  ChatMessage() = default;
  ChatMessage(std::string role, std::string content)
      : role(std::move(role)), content(std::move(content)) {}

  std::string role;  // system, user, assistant or tool
  std::string content;
  std::vector<ChatToolCall> tool_calls;  // assistant turns
  std::string tool_call_id;              // tool results: the call answered
  std::string name;                      // tool results: the function
};

struct ChatTemplate {
  enum class Family { kLlama3, kChatMl, kMistral };
  Family family = Family::kChatMl;
  std::string bos_token;  // text written at the start (Llama-3, Mistral)
  std::string eos_token;  // text after each assistant turn (Mistral)
  // Llama-3.1: a system header with the knowledge cut-off and this date.
  bool llama31_date_header = false;
  std::string today = "26 Jul 2024";
  // ChatML: the system prompt used when the conversation has none (Qwen2 /
  // Qwen2.5); empty for none (Qwen3).
  std::string default_system;
  // ChatML (Qwen3): assistant turns carry <think> reasoning.
  bool reasoning = false;
  bool enable_thinking =
      true;  // false: the generation prompt closes an empty <think>
  // Mistral v0.1: "[INST] text [/INST]answer"; v0.3: "[INST] text[/INST]
  // answer".
  bool mistral_v1_spacing = false;

  // The template shows tools to the model (Qwen2.5/Qwen3's "# Tools" system
  // block, Llama-3.1's JSON function list, Mistral v0.3's
  // [AVAILABLE_TOOLS]); when false, tools are not rendered (tool calls and
  // results still are).
  bool tools = false;

  // "llama3", "chatml" or "mistral", for messages.
  std::string FamilyName() const;
};

// Recognises the family from a Jinja chat template's text (as found in
// tokenizer_config.json); NOT_FOUND when it is none of the known ones.
absl::StatusOr<ChatTemplate> ChatTemplateFromJinja(const std::string& jinja);

// The chat template of a model or tokenizer directory: tokenizer_config.json's
// "chat_template" when present, else the family of config.json's
// architecture (Qwen2/Qwen3/Mistral). BOS/EOS text from tokenizer_config.json.
absl::StatusOr<ChatTemplate> ChatTemplateForModel(const std::string& dir);

// Renders `messages`; with add_generation_prompt, ends with the header of an
// assistant turn for the model to complete. `tools` are OpenAI tool objects
// ({"type": "function", "function": {...}}, key order kept), shown the way
// the family's own Jinja template shows them; an assistant turn's tool-call
// arguments are rendered as the parsed JSON re-serialized (as vLLM hands
// templates a dict, not the string).
absl::StatusOr<std::string> ApplyChatTemplate(
    const ChatTemplate& chat_template, const std::vector<ChatMessage>& messages,
    bool add_generation_prompt,
    const std::vector<json::OrderedValue>& tools = {});

// JSON text the way Jinja's `tojson` writes it in Hugging Face chat templates
// (Python's json.dumps with ensure_ascii=False: ", " and ": " separators, or
// one item per line with `indent` spaces per level when indent >= 0).
std::string JinjaToJson(const json::OrderedValue& value, int indent = -1);

// Parses a JSON list of {"role": ..., "content": ...} objects.
absl::StatusOr<std::vector<ChatMessage>> ParseChatMessages(
    const std::string& json_text);

}  // namespace pdserve::engine
