#include "router/openai/request.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/json.h"
#include "router/openai/structured_request.h"
#include "router/openai/tool_request.h"

namespace pdserve::router::openai {
namespace {

using json::Value;

// The parse state: the first error wins.
class Fields {
 public:
  explicit Fields(const Value& root) : root_(root) {}

  bool failed() const { return error_.has_value(); }
  ApiError error() const { return *error_; }

  void Fail(std::string param, std::string message) {
    if (!error_) error_ = ApiError{std::move(message), std::move(param)};
  }

  // nullptr when absent or JSON null (OpenAI treats null as "not given").
  const Value* Get(const char* key) const { return json::Find(root_, key); }

  std::optional<std::string> String(const char* key) {
    const Value* v = Get(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) {
      Fail(key, absl::StrCat("'", key, "' must be a string"));
      return std::nullopt;
    }
    return v->get_ref<const std::string&>();
  }

  std::optional<bool> Bool(const char* key) {
    const Value* v = Get(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_boolean()) {
      Fail(key, absl::StrCat("'", key, "' must be a boolean"));
      return std::nullopt;
    }
    return v->get<bool>();
  }

  std::optional<double> Number(const char* key, double min, double max) {
    const Value* v = Get(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number()) {
      Fail(key, absl::StrCat("'", key, "' must be a number"));
      return std::nullopt;
    }
    const double d = v->get<double>();
    if (!std::isfinite(d) || d < min || d > max) {
      Fail(key, absl::StrCat("'", key, "' must be in [", min, ", ", max, "]"));
      return std::nullopt;
    }
    return d;
  }

  std::optional<int64_t> Int(const char* key, int64_t min, int64_t max) {
    const Value* v = Get(key);
    if (v == nullptr) return std::nullopt;
    auto i = json::AsInt(*v, key, min, max);
    if (!i.ok()) {
      Fail(key, absl::StrCat("'", key, "' must be an integer in [", min, ", ",
                             max, "]"));
      return std::nullopt;
    }
    return *i;
  }

 private:
  const Value& root_;
  std::optional<ApiError> error_;
};

// "prompt": "text" | [ids] | ["text"] | [[ids]] (one prompt only: n = 1).
void ParsePrompt(Fields& f, const Value* v, CompletionRequest& r) {
  if (v == nullptr) return f.Fail("prompt", "'prompt' is required");
  if (v->is_string()) {
    r.prompt = v->get_ref<const std::string&>();
    return;
  }
  if (!v->is_array() || v->empty())
    return f.Fail("prompt",
                  "'prompt' must be a string or a non-empty array of token "
                  "ids");
  const Value* one = v;
  if ((*v)[0].is_string() || (*v)[0].is_array()) {
    if (v->size() != 1)
      return f.Fail("prompt",
                    "batched prompts are not supported: send one prompt per "
                    "request");
    if ((*v)[0].is_string()) {
      r.prompt = (*v)[0].get_ref<const std::string&>();
      return;
    }
    one = &(*v)[0];
    if (one->empty())
      return f.Fail("prompt", "'prompt' token id array is empty");
  }
  std::vector<uint32_t> ids;
  ids.reserve(one->size());
  for (const Value& t : *one) {
    auto id = json::AsInt(t, "prompt", 0, std::numeric_limits<uint32_t>::max());
    if (!id.ok())
      return f.Fail("prompt",
                    "'prompt' must be a string or an array of non-negative "
                    "integer token ids");
    ids.push_back(static_cast<uint32_t>(*id));
  }
  r.prompt = std::move(ids);
}

// The tool-calling parts of a message: an assistant's "tool_calls"
// ([{"id", "type": "function", "function": {"name", "arguments"}}], the
// arguments a JSON text) and a tool result's "tool_call_id" and "name".
// False (with the error recorded) when malformed.
bool ParseToolMessageFields(Fields& f, const Value& m,
                            engine::ChatMessage& out) {
  if (const Value* calls = json::Find(m, "tool_calls")) {
    if (out.role != "assistant" || !calls->is_array()) {
      f.Fail("messages",
             "'tool_calls' must be an array, on assistant messages only");
      return false;
    }
    for (const Value& call : *calls) {
      const Value* fn = json::Find(call, "function");
      const std::string* name =
          fn == nullptr ? nullptr : json::StringOrNull(json::Find(*fn, "name"));
      const std::string* args =
          fn == nullptr ? nullptr
                        : json::StringOrNull(json::Find(*fn, "arguments"));
      const std::string* type = json::StringOrNull(json::Find(call, "type"));
      if (name == nullptr || args == nullptr ||
          (type != nullptr && *type != "function")) {
        f.Fail("messages",
               "every tool call needs {\"type\": \"function\", "
               "\"function\": {\"name\": ..., \"arguments\": ...}}");
        return false;
      }
      if (!json::Parse(*args, "arguments").ok()) {
        f.Fail("messages",
               absl::StrCat("the arguments of tool call ", json::Quote(*name),
                            " are not a JSON text"));
        return false;
      }
      engine::ChatToolCall c;
      c.name = *name;
      c.arguments = *args;
      if (const std::string* id = json::StringOrNull(json::Find(call, "id")))
        c.id = *id;
      out.tool_calls.push_back(std::move(c));
    }
  }
  for (const char* key : {"tool_call_id", "name"}) {
    const Value* v = json::Find(m, key);
    if (v == nullptr) continue;
    if (!v->is_string()) {
      f.Fail("messages", absl::StrCat("message '", key, "' must be a string"));
      return false;
    }
    (std::string(key) == "name" ? out.name : out.tool_call_id) =
        v->get<std::string>();
  }
  return true;
}

// "messages": [{"role": ..., "content": "text" | [{"type":"text","text":..}]}]
void ParseMessages(Fields& f, const Value* v, CompletionRequest& r) {
  if (v == nullptr) return f.Fail("messages", "'messages' is required");
  if (!v->is_array() || v->empty())
    return f.Fail("messages", "'messages' must be a non-empty array");
  for (const Value& m : *v) {
    const std::string* role = json::StringOrNull(json::Find(m, "role"));
    if (role == nullptr)
      return f.Fail("messages", "every message needs a string 'role'");
    if (*role != "system" && *role != "user" && *role != "assistant" &&
        *role != "tool" && *role != "developer")
      return f.Fail("messages",
                    absl::StrCat("unknown message role ", json::Quote(*role)));
    engine::ChatMessage out;
    // OpenAI's newer "developer" role is the system prompt.
    out.role = *role == "developer" ? "system" : *role;
    if (!ParseToolMessageFields(f, m, out)) return;
    const Value* content = json::Find(m, "content");
    if (content == nullptr) {
      // An assistant turn may carry only tool calls.
    } else if (content->is_string()) {
      out.content = content->get_ref<const std::string&>();
    } else if (content->is_array()) {
      for (const Value& part : *content) {
        const std::string* type = json::StringOrNull(json::Find(part, "type"));
        const std::string* text = json::StringOrNull(json::Find(part, "text"));
        if (type == nullptr || *type != "text" || text == nullptr)
          return f.Fail("messages",
                        "only text content parts ({\"type\": \"text\", "
                        "\"text\": ...}) are supported");
        out.content += *text;
      }
    } else {
      return f.Fail("messages",
                    "message 'content' must be a string or an array of text "
                    "parts");
    }
    r.messages.push_back(std::move(out));
  }
}

void ParseStop(Fields& f, const Value* v, CompletionRequest& r) {
  if (v == nullptr) return;
  if (v->is_string()) {
    // OpenAI accepts "" as "no stop string"; the engine rejects empty ones.
    if (!v->get_ref<const std::string&>().empty())
      r.stop.push_back(v->get<std::string>());
    return;
  }
  if (!v->is_array())
    return f.Fail("stop", "'stop' must be a string or an array of strings");
  for (const Value& s : *v) {
    if (!s.is_string())
      return f.Fail("stop", "'stop' must be a string or an array of strings");
    if (s.get_ref<const std::string&>().empty())
      return f.Fail("stop", "'stop' strings must not be empty");
    r.stop.push_back(s.get<std::string>());
  }
}

// Fields with values pdserve cannot honour: an error, never silently ignored.
void RejectUnsupported(Fields& f, Endpoint endpoint) {
  if (auto n = f.Int("n", 1, 1 << 20); n && *n != 1)
    f.Fail("n", "only n = 1 is supported: send one request per completion");
  if (auto best_of = f.Int("best_of", 1, 1 << 20); best_of && *best_of != 1)
    f.Fail("best_of", "only best_of = 1 is supported");
  for (const char* penalty : {"presence_penalty", "frequency_penalty"}) {
    if (auto p = f.Number(penalty, -2, 2); p && *p != 0)
      f.Fail(penalty, absl::StrCat("'", penalty, "' is not supported"));
  }
  if (auto p = f.Number("repetition_penalty", 0, 1e9); p && *p != 1)
    f.Fail("repetition_penalty", "'repetition_penalty' is not supported");
  if (const Value* bias = f.Get("logit_bias");
      bias != nullptr && !(bias->is_object() && bias->empty()))
    f.Fail("logit_bias", "'logit_bias' is not supported");
  if (endpoint == Endpoint::kCompletions) {
    if (auto echo = f.Bool("echo"); echo && *echo)
      f.Fail("echo", "'echo' is not supported");
    if (auto suffix = f.String("suffix"); suffix && !suffix->empty())
      f.Fail("suffix", "'suffix' is not supported");
  }
}

}  // namespace

std::variant<CompletionRequest, ApiError> ParseCompletionRequest(
    Endpoint endpoint, absl::string_view body) {
  auto parsed = json::Parse(body, "request body");
  if (!parsed.ok())
    return ApiError{absl::StrCat("request body is not valid JSON: ",
                                 parsed.status().message()),
                    ""};
  const Value& root = *parsed;
  if (!root.is_object())
    return ApiError{"request body must be a JSON object", ""};
  Fields f(root);
  CompletionRequest r;
  r.endpoint = endpoint;
  if (auto model = f.String("model")) r.model = *model;
  if (f.failed()) return f.error();
  if (r.model.empty()) return ApiError{"'model' is required", "model"};

  if (endpoint == Endpoint::kCompletions) {
    ParsePrompt(f, f.Get("prompt"), r);
  } else {
    ParseMessages(f, f.Get("messages"), r);
    r.max_tokens = kDefaultChatMaxTokens;
  }
  // Chat prefers max_completion_tokens; max_tokens is its deprecated alias.
  constexpr int64_t kMaxTokens = std::numeric_limits<int32_t>::max();
  if (auto mt = f.Int("max_tokens", 1, kMaxTokens))
    r.max_tokens = static_cast<uint32_t>(*mt);
  if (endpoint == Endpoint::kChatCompletions) {
    if (auto mt = f.Int("max_completion_tokens", 1, kMaxTokens))
      r.max_tokens = static_cast<uint32_t>(*mt);
  }
  if (auto t = f.Number("temperature", 0, 2)) r.temperature = *t;
  if (auto p = f.Number("top_p", 0, 1)) {
    if (*p == 0) {
      f.Fail("top_p", "'top_p' must be in (0, 1]");
    } else {
      r.top_p = *p;
    }
  }
  // vLLM: top_k -1 means off.
  if (auto k = f.Int("top_k", -1, std::numeric_limits<int32_t>::max()))
    r.top_k = *k < 0 ? 0 : static_cast<uint32_t>(*k);
  if (const Value* seed = f.Get("seed")) {
    // OpenAI documents a 64-bit integer; negative seeds keep their bits.
    auto s = json::AsInt(*seed, "seed", std::numeric_limits<int64_t>::min(),
                         std::numeric_limits<int64_t>::max());
    if (seed->is_number_unsigned()) {
      r.seed = seed->get<uint64_t>();
    } else if (s.ok()) {
      r.seed = static_cast<uint64_t>(*s);
    } else {
      f.Fail("seed", "'seed' must be an integer");
    }
  }
  ParseStop(f, f.Get("stop"), r);
  if (auto b = f.Bool("ignore_eos")) r.ignore_eos = *b;
  if (auto salt = f.String("cache_salt")) r.cache_salt = *salt;
  if (auto s = f.Bool("stream")) r.stream = *s;
  if (const Value* opts = f.Get("stream_options")) {
    if (!opts->is_object()) {
      f.Fail("stream_options", "'stream_options' must be an object");
    } else if (const Value* iu = json::Find(*opts, "include_usage")) {
      if (!iu->is_boolean()) {
        f.Fail("stream_options", "'include_usage' must be a boolean");
      } else {
        r.include_usage = iu->get<bool>();
      }
    }
    if (!f.failed() && !r.stream)
      f.Fail("stream_options", "'stream_options' needs 'stream': true");
  }
  if (endpoint == Endpoint::kCompletions) {
    if (auto lp = f.Int("logprobs", 0, kMaxTopLogprobs))
      r.logprobs = static_cast<int32_t>(*lp);
  } else {
    const std::optional<bool> lp = f.Bool("logprobs");
    const std::optional<int64_t> top =
        f.Int("top_logprobs", 0, kMaxTopLogprobs);
    if (lp && *lp) r.logprobs = static_cast<int32_t>(top.value_or(0));
    if (!f.failed() && top && !(lp && *lp))
      f.Fail("top_logprobs", "'top_logprobs' needs 'logprobs': true");
  }
  RejectUnsupported(f, endpoint);
  if (f.failed()) return f.error();
  if (auto e = ParseStructuredOutput(endpoint, body, root, &r)) return *e;
  if (endpoint == Endpoint::kChatCompletions) {
    if (auto e = ParseToolFields(body, root, &r)) return *e;
  }
  return r;
}

}  // namespace pdserve::router::openai
