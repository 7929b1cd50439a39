// Turns a chat completion's generated text into OpenAI tool calls, piece by
// piece as the text streams in, so a streamed answer and a whole one are the
// same calls.
//
//  - named function: the whole output is the call's arguments (the output is
//    constrained to its parameters' schema); each piece is an arguments
//    fragment at once.
//  - required: the output is the JSON array of RequiredToolCallsSchema
//    (router/openai/tool_request.h). A call's name goes out as soon as its
//    string closes, its arguments byte by byte as they come; only bytes that
//    cannot be attributed yet (structure between calls) are held back.
//  - auto: unconstrained output in the model family's native format:
//    ChatML/Qwen/Hermes `<tool_call>{"name", "arguments"}</tool_call>`,
//    Llama-3.1 `{"name", "parameters"}` (several separated by ';', an
//    optional <|python_tag|> before), Mistral `[TOOL_CALLS][{"name",
//    "arguments"}, ...]`. Plain text streams as content; from the point
//    where a call may begin the text is held until the end, then answered as
//    tool calls when every call parses, names a declared tool and has JSON
//    object arguments, else as content.
//  - none (or no tools): content only.
//
// Output that ends before its calls are complete (max_tokens, a stop string)
// is no tool call: Finish says so, and a whole answer is plain content
// (a stream has already sent the fragments it had).
//
// Thread-compatible: one per response.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "router/openai/request.h"
#include "tokenizer/chat_template.h"

namespace pdserve::router::openai {

// One piece of a chat answer: content text, or part of tool call `index`
// (the first part of a call carries its id and name, later ones only
// arguments).
struct ToolCallDelta {
  std::string content;
  int index = -1;  // >= 0: a tool-call part
  std::string id;  // set on a call's first part
  std::string name;
  std::string arguments;
};

// A whole call.
struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // JSON text
};

// The deltas of a whole answer put together: the content, and each call
// with its arguments concatenated.
struct ToolCallAnswer {
  std::string content;
  std::vector<ToolCall> calls;
};
ToolCallAnswer AssembleToolCalls(const std::vector<ToolCallDelta>& deltas);

class ToolCallStream {
 public:
  // `id_seed` seeds the ids ("call_" + 24 letters and digits) so a test can
  // fix them; the server passes a random value.
  ToolCallStream(const CompletionRequest& r,
                 engine::ChatTemplate::Family family, uint64_t id_seed);

  // Feeds the next generated text; returns what can be sent now.
  std::vector<ToolCallDelta> Push(const std::string& text);
  // The end of the output: `complete` when it ended by itself (EOS or the
  // constraint's end), not by max_tokens or a stop string. Returns the rest
  // to send; *tool_calls says whether the answer is tool calls.
  std::vector<ToolCallDelta> Finish(bool complete, bool* tool_calls);

  // True when this request answers with tool calls at all (tools given and
  // tool_choice not none).
  bool active() const { return mode_ != Mode::kContent; }

 private:
  enum class Mode { kContent, kNamed, kRequired, kAuto };
  std::string NewId();
  void ScanRequired(std::vector<ToolCallDelta>* out);
  void PushAuto(std::vector<ToolCallDelta>* out);
  bool ParseAuto(std::vector<ToolCall>* calls) const;

  Mode mode_;
  engine::ChatTemplate::Family family_;
  std::vector<std::string> tool_names_;
  std::string named_;
  uint64_t id_state_;
  std::string text_;  // everything generated so far
  int calls_started_ = 0;

  // kRequired: a scanner over text_ from scan_.
  struct Scan {
    enum class State {
      kBeforeArray,
      kBeforeCall,   // after '[' or between calls
      kBeforeKey,    // inside a call object
      kKey,          // inside a key string
      kAfterKey,     // before ':'
      kBeforeValue,  // after ':'
      kName,         // inside the name string
      kArguments,    // inside the arguments value
      kOtherValue,   // a value of another key (not generated; skipped)
      kDone,
      kBroken,
    };
    State state = State::kBeforeArray;
    size_t pos = 0;
    std::string key;
    std::string name;
    bool name_sent = false;
    std::string pending_arguments;  // arguments seen before the name
    int depth = 0;
    bool in_string = false;
    bool escaped = false;
    bool scalar = false;  // the value being scanned is not a container
  } scan_;

  // kAuto: bytes of text_ sent as content so far; once a call may have
  // begun, everything after `held_from_` waits for Finish.
  size_t sent_ = 0;
  std::optional<size_t> held_from_;
};

}  // namespace pdserve::router::openai
