#include "router/openai/tool_calls.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "common/json.h"

namespace pdserve::router::openai {
namespace {

using Family = engine::ChatTemplate::Family;
using json::OrderedValue;

bool IsSpace(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

bool AllSpace(absl::string_view s) {
  return std::all_of(s.begin(), s.end(), IsSpace);
}

size_t SkipSpace(absl::string_view s, size_t pos) {
  while (pos < s.size() && IsSpace(s[pos])) ++pos;
  return pos;
}

// The end (one past) of the JSON value starting at `pos` (no leading
// space), or npos when the text ends inside it. Only containers and strings
// are delimited (the native formats' calls are objects and arrays).
size_t ContainerEnd(absl::string_view s, size_t pos) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = pos; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if (c == '}' || c == ']') {
      if (--depth == 0) return i + 1;
    }
  }
  return absl::string_view::npos;
}

OrderedValue ParseOrdered(absl::string_view s) {
  return OrderedValue::parse(s.begin(), s.end(), nullptr,
                             /*allow_exceptions=*/false);
}

// The longest suffix of `s` (from `from` on) that is a proper prefix of
// `marker`.
size_t PartialMarker(absl::string_view s, size_t from,
                     absl::string_view marker) {
  for (size_t k = std::min(marker.size() - 1, s.size() - from); k > 0; --k) {
    if (s.substr(s.size() - k) == marker.substr(0, k)) return k;
  }
  return 0;
}

ToolCallDelta Content(std::string text) {
  ToolCallDelta d;
  d.content = std::move(text);
  return d;
}

ToolCallDelta Arguments(int index, std::string arguments) {
  ToolCallDelta d;
  d.index = index;
  d.arguments = std::move(arguments);
  return d;
}

constexpr absl::string_view kHermesOpen = "<tool_call>";
constexpr absl::string_view kHermesClose = "</tool_call>";
constexpr absl::string_view kLlamaPythonTag = "<|python_tag|>";
constexpr absl::string_view kMistralCalls = "[TOOL_CALLS]";

}  // namespace

ToolCallStream::ToolCallStream(const CompletionRequest& r, Family family,
                               uint64_t id_seed)
    : family_(family), id_state_(id_seed) {
  for (const FunctionTool& t : r.tools) tool_names_.push_back(t.name);
  switch (tool_names_.empty() ? ToolChoice::kNone : r.tool_choice) {
    case ToolChoice::kNone:
      mode_ = Mode::kContent;
      break;
    case ToolChoice::kAuto:
      mode_ = Mode::kAuto;
      break;
    case ToolChoice::kRequired:
      mode_ = Mode::kRequired;
      break;
    case ToolChoice::kNamed:
      mode_ = Mode::kNamed;
      named_ = r.tool_choice_name;
      break;
  }
}

std::string ToolCallStream::NewId() {
  static constexpr char kAlphabet[] =
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) {
    // splitmix64: ids need to be unlikely to repeat, not secret.
    uint64_t z = (id_state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    id.push_back(kAlphabet[z % (sizeof(kAlphabet) - 1)]);
  }
  return id;
}

std::vector<ToolCallDelta> ToolCallStream::Push(const std::string& text) {
  std::vector<ToolCallDelta> out;
  if (text.empty()) return out;
  text_ += text;
  switch (mode_) {
    case Mode::kContent:
      out.push_back(Content(text));
      break;
    case Mode::kNamed:
      if (calls_started_ == 0) {
        ToolCallDelta start;
        start.index = calls_started_++;
        start.id = NewId();
        start.name = named_;
        out.push_back(std::move(start));
      }
      out.push_back(Arguments(0, text));
      break;
    case Mode::kRequired:
      ScanRequired(&out);
      break;
    case Mode::kAuto:
      PushAuto(&out);
      break;
  }
  return out;
}

void ToolCallStream::ScanRequired(std::vector<ToolCallDelta>* out) {
  using State = Scan::State;
  Scan& s = scan_;
  std::string fragment;  // arguments bytes of this push, for the current call
  auto flush = [&] {
    if (fragment.empty()) return;
    if (s.name_sent) {
      out->push_back(Arguments(calls_started_ - 1, fragment));
    } else {
      s.pending_arguments += fragment;  // not attributable yet
    }
    fragment.clear();
  };
  while (s.pos < text_.size() && s.state != State::kDone &&
         s.state != State::kBroken) {
    const char c = text_[s.pos];
    switch (s.state) {
      case State::kBeforeArray:
        if (c == '[') {
          s.state = State::kBeforeCall;
        } else if (!IsSpace(c)) {
          s.state = State::kBroken;
        }
        ++s.pos;
        break;
      case State::kBeforeCall:
        if (c == '{') {
          s.state = State::kBeforeKey;
          s.name.clear();
          s.name_sent = false;
          s.pending_arguments.clear();
        } else if (c == ']') {
          s.state = State::kDone;
        } else if (!IsSpace(c) && c != ',') {
          s.state = State::kBroken;
        }
        ++s.pos;
        break;
      case State::kBeforeKey:
        if (c == '"') {
          s.state = State::kKey;
          s.key.clear();
        } else if (c == '}') {
          flush();
          s.state = s.name_sent ? State::kBeforeCall : State::kBroken;
        } else if (!IsSpace(c) && c != ',') {
          s.state = State::kBroken;
        }
        ++s.pos;
        break;
      case State::kKey:
        if (c == '"') {
          s.state = State::kAfterKey;
        } else if (c == '\\') {
          s.state = State::kBroken;  // the schema's keys need no escapes
        } else {
          s.key.push_back(c);
        }
        ++s.pos;
        break;
      case State::kAfterKey:
        if (c == ':') {
          s.state = State::kBeforeValue;
        } else if (!IsSpace(c)) {
          s.state = State::kBroken;
        }
        ++s.pos;
        break;
      case State::kBeforeValue:
        if (IsSpace(c)) {
          ++s.pos;
        } else if (s.key == "name") {
          s.state = c == '"' && s.name.empty() ? State::kName : State::kBroken;
          ++s.pos;
        } else {
          // Scanned from this byte on (not consumed here).
          s.state =
              s.key == "arguments" ? State::kArguments : State::kOtherValue;
          s.depth = 0;
          s.in_string = false;
          s.escaped = false;
          s.scalar = c != '{' && c != '[';
        }
        break;
      case State::kName:
        if (c == '"') {
          if (std::find(tool_names_.begin(), tool_names_.end(), s.name) ==
              tool_names_.end()) {
            s.state = State::kBroken;
            break;
          }
          ToolCallDelta start;
          start.index = calls_started_++;
          start.id = NewId();
          start.name = s.name;
          out->push_back(std::move(start));
          s.name_sent = true;
          if (!s.pending_arguments.empty()) {
            out->push_back(
                Arguments(calls_started_ - 1, std::move(s.pending_arguments)));
            s.pending_arguments.clear();
          }
          s.state = State::kBeforeKey;
        } else if (c == '\\') {
          s.state = State::kBroken;  // tool names have nothing to escape
        } else {
          s.name.push_back(c);
        }
        ++s.pos;
        break;
      case State::kArguments:
      case State::kOtherValue: {
        // Whether `c` belongs to the value, and whether the value ends.
        bool take = true, ends = false;
        if (s.in_string) {
          if (s.escaped) {
            s.escaped = false;
          } else if (c == '\\') {
            s.escaped = true;
          } else if (c == '"') {
            s.in_string = false;
            ends = s.scalar && s.depth == 0;
          }
        } else if (c == '"') {
          s.in_string = true;
        } else if (c == '{' || c == '[') {
          ++s.depth;
        } else if (c == '}' || c == ']') {
          if (s.depth == 0) {
            take = false;  // a scalar ended by its object's close
            ends = true;
          } else {
            ends = --s.depth == 0;
          }
        } else if (s.scalar && s.depth == 0 && (c == ',' || IsSpace(c))) {
          take = false;
          ends = true;
        }
        if (take) {
          if (s.state == State::kArguments) fragment.push_back(c);
          ++s.pos;
        }
        if (ends) {
          flush();
          s.state = State::kBeforeKey;
        }
        break;
      }
      case State::kDone:
      case State::kBroken:
        break;
    }
  }
  flush();
}

void ToolCallStream::PushAuto(std::vector<ToolCallDelta>* out) {
  if (held_from_.has_value()) return;  // held until Finish
  size_t send_to = text_.size();
  if (family_ == Family::kChatMl) {
    // A call may start anywhere: content streams up to "<tool_call>", and a
    // tail that may be its beginning waits for the next piece.
    const size_t at = absl::string_view(text_).find(kHermesOpen, sent_);
    if (at != std::string::npos) {
      held_from_ = at;
      send_to = at;
    } else {
      send_to -= PartialMarker(text_, sent_, kHermesOpen);
    }
  } else if (sent_ == 0) {
    // Llama-3.1 and Mistral answer a call with nothing before it: decide on
    // the first non-space text.
    const size_t first = SkipSpace(text_, 0);
    if (first == text_.size()) return;  // only spaces so far: wait
    const absl::string_view rest = absl::string_view(text_).substr(first);
    const std::vector<absl::string_view> markers =
        family_ == Family::kLlama3
            ? std::vector<absl::string_view>{"{", kLlamaPythonTag}
            : std::vector<absl::string_view>{"[", kMistralCalls};
    bool maybe = false;
    for (absl::string_view m : markers) {
      if (absl::StartsWith(rest, m)) {
        held_from_ = 0;
        return;
      }
      maybe = maybe || absl::StartsWith(m, rest);
    }
    if (maybe) return;  // a marker's beginning: wait for more
  }
  if (send_to > sent_) {
    out->push_back(Content(text_.substr(sent_, send_to - sent_)));
    sent_ = send_to;
  }
}

bool ToolCallStream::ParseAuto(std::vector<ToolCall>* calls) const {
  const absl::string_view held = absl::string_view(text_).substr(*held_from_);
  // One call object: {"name": a declared tool, <args_key>: an object}.
  auto add = [&](const OrderedValue& call,
                 std::initializer_list<const char*> args_keys) {
    if (!call.is_object()) return false;
    auto name = call.find("name");
    if (name == call.end() || !name->is_string() ||
        std::find(tool_names_.begin(), tool_names_.end(),
                  name->get<std::string>()) == tool_names_.end()) {
      return false;
    }
    for (const char* key : args_keys) {
      auto args = call.find(key);
      if (args == call.end()) continue;
      if (!args->is_object()) return false;
      calls->push_back(ToolCall{
          "", name->get<std::string>(),
          args->dump(-1, ' ', false, OrderedValue::error_handler_t::replace)});
      return true;
    }
    return false;
  };
  size_t pos = 0;
  switch (family_) {
    case Family::kChatMl:
      while ((pos = SkipSpace(held, pos)) < held.size()) {
        if (!absl::StartsWith(held.substr(pos), kHermesOpen)) return false;
        pos += kHermesOpen.size();
        size_t close = held.find(kHermesClose, pos);
        const size_t end =
            close == absl::string_view::npos ? held.size() : close;
        if (!add(ParseOrdered(held.substr(pos, end - pos)), {"arguments"}))
          return false;
        pos = close == absl::string_view::npos ? held.size()
                                               : close + kHermesClose.size();
      }
      return !calls->empty();
    case Family::kLlama3: {
      pos = SkipSpace(held, 0);
      if (absl::StartsWith(held.substr(pos), kLlamaPythonTag))
        pos += kLlamaPythonTag.size();
      while ((pos = SkipSpace(held, pos)) < held.size()) {
        if (!calls->empty()) {
          if (held[pos] != ';') return false;
          pos = SkipSpace(held, pos + 1);
        }
        const size_t end = ContainerEnd(held, pos);
        if (end == absl::string_view::npos ||
            !add(ParseOrdered(held.substr(pos, end - pos)),
                 {"parameters", "arguments"}))
          return false;
        pos = end;
      }
      return !calls->empty();
    }
    case Family::kMistral: {
      pos = SkipSpace(held, 0);
      if (absl::StartsWith(held.substr(pos), kMistralCalls))
        pos = SkipSpace(held, pos + kMistralCalls.size());
      const size_t end = ContainerEnd(held, pos);
      if (end == absl::string_view::npos || !AllSpace(held.substr(end)))
        return false;
      const OrderedValue list = ParseOrdered(held.substr(pos, end - pos));
      if (!list.is_array() || list.empty()) return false;
      for (const OrderedValue& call : list) {
        if (!add(call, {"arguments"})) return false;
      }
      return true;
    }
  }
  return false;
}

std::vector<ToolCallDelta> ToolCallStream::Finish(bool complete,
                                                  bool* tool_calls) {
  std::vector<ToolCallDelta> out;
  *tool_calls = false;
  switch (mode_) {
    case Mode::kContent:
      break;
    case Mode::kNamed:
      *tool_calls =
          complete && !text_.empty() && !ParseOrdered(text_).is_discarded();
      break;
    case Mode::kRequired:
      *tool_calls = complete && scan_.state == Scan::State::kDone &&
                    AllSpace(absl::string_view(text_).substr(scan_.pos)) &&
                    !ParseOrdered(text_).is_discarded();
      break;
    case Mode::kAuto: {
      std::vector<ToolCall> calls;
      if (held_from_.has_value() && complete && ParseAuto(&calls)) {
        *tool_calls = true;
        for (ToolCall& call : calls) {
          ToolCallDelta start;
          start.index = calls_started_++;
          start.id = NewId();
          start.name = call.name;
          out.push_back(std::move(start));
          out.push_back(
              Arguments(calls_started_ - 1, std::move(call.arguments)));
        }
      } else if (sent_ < text_.size()) {
        // Not a call after all (or cut short): the held text is content.
        out.push_back(Content(text_.substr(sent_)));
        sent_ = text_.size();
      }
      break;
    }
  }
  return out;
}

ToolCallAnswer AssembleToolCalls(const std::vector<ToolCallDelta>& deltas) {
  ToolCallAnswer answer;
  for (const ToolCallDelta& d : deltas) {
    if (d.index < 0) {
      answer.content += d.content;
      continue;
    }
    if (static_cast<size_t>(d.index) >= answer.calls.size())
      answer.calls.resize(d.index + 1);
    ToolCall& call = answer.calls[d.index];
    if (!d.id.empty()) {
      call.id = d.id;
      call.name = d.name;
    }
    call.arguments += d.arguments;
  }
  return answer;
}

}  // namespace pdserve::router::openai
