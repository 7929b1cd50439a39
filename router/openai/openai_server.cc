#include "router/openai/openai_server.h"

#include <httplib.h>
#include <signal.h>

#include <array>
#include <atomic>
#include <random>
#include <thread>
#include <variant>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/json.h"
#include "common/logging.h"
#include "common/metric_handles.h"
#include "common/status_macros.h"
#include "pdserve/v1/router.grpc.pb.h"
#include "router/openai/errors.h"
#include "router/openai/headers.h"
#include "router/openai/http_connections.h"
#include "router/openai/request.h"
#include "router/openai/tool_calls.h"
#include "router/openai/unknown_field_log.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "wire/structured_convert.h"

namespace pdserve::router::openai {
namespace {

using json::OrderedValue;

// Label values of pdserve_http_requests_total, resolved at start-up.
constexpr std::array<const char*, 5> kEndpoints = {
    "/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
    "other"};
constexpr std::array<int, 12> kStatuses = {200, 400, 401, 403, 404, 405,
                                           413, 429, 499, 500, 503, 504};

struct HttpMetrics {
  explicit HttpMetrics(metrics::Registry& r) {
    metrics::CounterFamily* family = metrics::Must(r.AddCounter(
        "pdserve_http_requests_total",
        "OpenAI-compatible HTTP requests by endpoint and response status "
        "(status \"other\" for any code not listed)",
        {"endpoint", "status"}));
    for (size_t e = 0; e < kEndpoints.size(); ++e) {
      for (size_t s = 0; s <= kStatuses.size(); ++s) {
        const std::string status =
            s < kStatuses.size() ? std::to_string(kStatuses[s]) : "other";
        requests[e][s] =
            metrics::Must(family->WithLabels({kEndpoints[e], status}));
      }
    }
  }
  void Count(const std::string& path, int status) {
    size_t e = kEndpoints.size() - 1;
    for (size_t i = 0; i + 1 < kEndpoints.size(); ++i) {
      if (path == kEndpoints[i]) e = i;
    }
    size_t s = kStatuses.size();
    for (size_t i = 0; i < kStatuses.size(); ++i) {
      if (status == kStatuses[i]) s = i;
    }
    requests[e][s]->Increment();
  }
  std::array<std::array<metrics::Counter*, kStatuses.size() + 1>,
             kEndpoints.size()>
      requests{};
};

void Reply(httplib::Response& res, const HttpError& error) {
  res.status = error.status;
  if (error.retry_after_s > 0)
    res.set_header("Retry-After", std::to_string(error.retry_after_s));
  res.set_content(ErrorJson(error), "application/json");
}

int64_t RetryAfterMs(const grpc::ClientContext& ctx) {
  const auto& md = ctx.GetServerTrailingMetadata();
  auto it = md.find("retry-after-ms");
  if (it == md.end()) return 0;
  int64_t ms = 0;
  for (char c : std::string(it->second.data(), it->second.size())) {
    if (c < '0' || c > '9' || ms > (int64_t{1} << 40)) return 0;
    ms = ms * 10 + (c - '0');
  }
  return ms;
}

// OpenAI spells the end of a completion "stop" (a stop string or EOS) or
// "length"; the router's "cancelled" never reaches a live client.
std::string FinishReason(const std::string& router_reason) {
  if (router_reason == "eos" || router_reason == "stop") return "stop";
  return router_reason;
}

OrderedValue Usage(const v1::Usage& u) {
  return OrderedValue{
      {"prompt_tokens", u.prompt_tokens()},
      {"completion_tokens", u.completion_tokens()},
      {"total_tokens", u.prompt_tokens() + u.completion_tokens()},
      {"prompt_tokens_details", {{"cached_tokens", u.cached_prompt_tokens()}}}};
}

// One Generate call on the in-process channel. Whoever ends it first
// (stream end, client disconnect, server stop) calls Finish once.
struct GenerateCall {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader;
  absl::Mutex mu;
  bool finished ABSL_GUARDED_BY(mu) = false;
  grpc::Status status ABSL_GUARDED_BY(mu);

  // The call's final status (after the stream ended).
  grpc::Status Finish() {
    absl::MutexLock l(&mu);
    if (!finished) {
      status = reader->Finish();
      finished = true;
    }
    return status;
  }
  // Cancels a call still running (the client went away); the router then
  // cancels its worker calls, which free the request's KV blocks.
  void Cancel() {
    ctx.TryCancel();
    Finish();
  }
};

}  // namespace

struct OpenAiServer::Impl {
  OpenAiServerConfig config;
  RouterHooks hooks;
  std::unique_ptr<v1::Router::Stub> stub;
  std::unique_ptr<engine::Tokenizer> tokenizer;
  absl::StatusOr<engine::ChatTemplate> chat_template =
      absl::UnknownError("not loaded");
  std::unique_ptr<HttpMetrics> m;
  HangupWatcher hangups;
  std::unique_ptr<UnknownFieldLog> unknown_fields;
  std::unique_ptr<FrontHttpServer> http;
  std::thread listener;
  int port = 0;
  absl::Mutex rng_mu;
  std::mt19937_64 rng ABSL_GUARDED_BY(rng_mu){std::random_device{}()};

  uint64_t RandomSeed() {
    absl::MutexLock l(&rng_mu);
    return rng();
  }

  // OpenAI's logprobs object for `lps`: completions' parallel lists
  // (tokens, token_logprobs, top_logprobs, text_offset from *text_offset on,
  // in bytes) or chat's {"content": [{token, logprob, bytes, top_logprobs}]}.
  // A token's text is its raw bytes (invalid UTF-8 shown as U+FFFD; chat
  // also gives the exact bytes).
  OrderedValue LogprobsJson(const CompletionRequest& r,
                            const std::vector<v1::TokenLogprobs>& lps,
                            size_t* text_offset) const {
    // The token's bytes as valid UTF-8 (ill-formed bytes -> U+FFFD).
    auto text_of = [&](uint32_t id) {
      engine::Utf8Stream utf8;
      std::string text =
          utf8.Push(tokenizer->TokenBytes(static_cast<int32_t>(id)));
      return text + utf8.Finish();
    };
    auto bytes_of = [&](uint32_t id) {
      OrderedValue b = OrderedValue::array();
      for (unsigned char c : tokenizer->TokenBytes(static_cast<int32_t>(id)))
        b.push_back(static_cast<int>(c));
      return b;
    };
    if (r.endpoint == Endpoint::kChatCompletions) {
      OrderedValue content = OrderedValue::array();
      for (const v1::TokenLogprobs& lp : lps) {
        OrderedValue top = OrderedValue::array();
        for (const v1::TopLogprob& t : lp.top()) {
          top.push_back({{"token", text_of(t.token_id())},
                         {"logprob", t.logprob()},
                         {"bytes", bytes_of(t.token_id())}});
        }
        content.push_back({{"token", text_of(lp.token_id())},
                           {"logprob", lp.logprob()},
                           {"bytes", bytes_of(lp.token_id())},
                           {"top_logprobs", std::move(top)}});
      }
      return OrderedValue{{"content", std::move(content)}};
    }
    OrderedValue tokens = OrderedValue::array(),
                 token_logprobs = OrderedValue::array(),
                 top_logprobs = OrderedValue::array(),
                 offsets = OrderedValue::array();
    for (const v1::TokenLogprobs& lp : lps) {
      tokens.push_back(text_of(lp.token_id()));
      token_logprobs.push_back(lp.logprob());
      OrderedValue top = OrderedValue::object();
      // Highest first: a later token with the same text keeps the first.
      for (const v1::TopLogprob& t : lp.top())
        top.emplace(text_of(t.token_id()), t.logprob());
      top_logprobs.push_back(std::move(top));
      offsets.push_back(*text_offset);
      *text_offset +=
          tokenizer->TokenBytes(static_cast<int32_t>(lp.token_id())).size();
    }
    return OrderedValue{{"tokens", std::move(tokens)},
                        {"token_logprobs", std::move(token_logprobs)},
                        {"top_logprobs", std::move(top_logprobs)},
                        {"text_offset", std::move(offsets)}};
  }

  // The chunk/response envelope both endpoints share.
  OrderedValue Envelope(const CompletionRequest& r, const std::string& id,
                        int64_t created, bool chunk) const {
    const bool chat = r.endpoint == Endpoint::kChatCompletions;
    return OrderedValue{
        {"id", absl::StrCat(chat ? "chatcmpl-" : "cmpl-", id)},
        {"object", chat ? (chunk ? "chat.completion.chunk" : "chat.completion")
                        : "text_completion"},
        {"created", created},
        {"model", config.served_model_name}};
  }

  // The GenerateRequest for `r`, or the 400 to answer.
  std::variant<v1::GenerateRequest, HttpError> ToGenerate(
      const CompletionRequest& r) const {
    v1::GenerateRequest g;
    if (r.endpoint == Endpoint::kChatCompletions) {
      if (!chat_template.ok())
        return BadRequest(
            absl::StrCat("model ", config.served_model_name,
                         " has no chat template, so /v1/chat/completions is "
                         "not available (use /v1/completions): ",
                         chat_template.status().message()),
            "messages");
      std::vector<json::OrderedValue> tools;
      for (const FunctionTool& tool : r.tools) tools.push_back(tool.definition);
      auto text =
          engine::ApplyChatTemplate(*chat_template, r.messages, true, tools);
      if (!text.ok())
        return BadRequest(std::string(text.status().message()), "messages");
      // The rendered prompt spells out its own special tokens.
      for (int32_t t : tokenizer->Encode(*text, false))
        g.mutable_token_ids()->add_ids(static_cast<uint32_t>(t));
    } else if (const auto* text = std::get_if<std::string>(&r.prompt)) {
      g.set_prompt(*text);
    } else {
      for (uint32_t t : std::get<std::vector<uint32_t>>(r.prompt))
        g.mutable_token_ids()->add_ids(t);
    }
    v1::SamplingParams* s = g.mutable_sampling();
    s->set_max_tokens(r.max_tokens);
    s->set_temperature(r.temperature);
    s->set_top_p(r.top_p);
    s->set_top_k(r.top_k);
    s->set_seed(r.seed.has_value() ? *r.seed : 0);
    for (const std::string& stop : r.stop) s->add_stop(stop);
    s->set_ignore_eos(r.ignore_eos);
    if (r.logprobs.has_value()) {
      s->set_logprobs(true);
      s->set_top_logprobs(static_cast<uint32_t>(*r.logprobs));
    }
    ConstraintToProto(r.constraint, s);
    g.set_cache_salt(r.cache_salt);
    return g;
  }

  void HandleGenerate(Endpoint endpoint, const httplib::Request& req,
                      httplib::Response& res) {
    auto parsed = ParseCompletionRequest(endpoint, req.body);
    if (const auto* err = std::get_if<ApiError>(&parsed))
      return Reply(res, BadRequest(err->message, err->param));
    CompletionRequest r = std::get<CompletionRequest>(std::move(parsed));
    unknown_fields->Record(endpoint, r.unknown_fields);
    if (r.model != config.served_model_name)
      return Reply(res, NotFound(absl::StrCat("The model `", r.model,
                                              "` does not exist; this server "
                                              "serves `",
                                              config.served_model_name, "`"),
                                 "model_not_found"));
    // Unseeded sampling is random, as OpenAI's is; greedy ignores the seed.
    if (!r.seed.has_value() && r.temperature > 0) r.seed = RandomSeed();
    auto g = ToGenerate(r);
    if (const auto* err = std::get_if<HttpError>(&g)) return Reply(res, *err);

    auto call = std::make_shared<GenerateCall>();
    if (req.has_header("Authorization")) {
      // Checked before it becomes metadata: gRPC aborts on a bad value.
      const std::string authorization = req.get_header_value("Authorization");
      if (absl::Status s = CheckForwardedHeader("Authorization", authorization);
          !s.ok())
        return Reply(res, Unauthorized(std::string(s.message())));
      call->ctx.AddMetadata("authorization", authorization);
    }
    call->reader = stub->Generate(&call->ctx, std::get<v1::GenerateRequest>(g));
    // Until the response goes out, a client that hangs up cancels the call:
    // nobody would read what it computes. (A streamed response notices a
    // hangup itself, on its next write.)
    const int fd = CurrentConnectionFd();
    const uint64_t watch =
        fd < 0 ? 0 : hangups.Watch(fd, [call] { call->ctx.TryCancel(); });
    absl::Cleanup unwatch = [&] {
      if (watch != 0) hangups.Unwatch(watch);
    };
    // The first message decides the HTTP status: errors before it
    // (validation, auth, limits, no workers) are a proper error response.
    auto first = std::make_shared<v1::GenerateResponse>();
    if (!call->reader->Read(first.get())) {
      const grpc::Status st = call->Finish();
      if (st.ok())
        return Reply(res, FromGrpc(grpc::Status(grpc::StatusCode::INTERNAL,
                                                "router sent no response"),
                                   0));
      return Reply(res, FromGrpc(st, RetryAfterMs(call->ctx)));
    }
    const int64_t created = absl::ToUnixSeconds(absl::Now());
    if (!r.stream) return Complete(r, *call, *first, created, res);

    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, call, first, r = std::move(r), created](
            size_t, httplib::DataSink& sink) {
          // false (the client went away) ends the response at once.
          return Stream(r, *call, *first, created, sink);
        },
        // Runs however the response ends, including a client that went away.
        [call](bool) { call->Cancel(); });
  }

  // The tool-call reader of a chat answer (inactive without tools).
  ToolCallStream NewToolCallStream(const CompletionRequest& r) {
    return ToolCallStream(r,
                          chat_template.ok()
                              ? chat_template->family
                              : engine::ChatTemplate::Family::kChatMl,
                          RandomSeed());
  }
  // Whether the output ended by itself, so a tool call in it is whole.
  static bool EndedByItself(const std::string& router_reason) {
    return router_reason == "eos" || router_reason == "stop";
  }

  // A non-streamed response: the whole stream, then one JSON body.
  void Complete(const CompletionRequest& r, GenerateCall& call,
                v1::GenerateResponse msg, int64_t created,
                httplib::Response& res) {
    const std::string id = msg.request_id();
    std::string text, finish;
    v1::Usage usage;
    std::vector<v1::TokenLogprobs> lps;
    do {
      text += msg.text();
      lps.insert(lps.end(), msg.logprobs().begin(), msg.logprobs().end());
      if (!msg.finish_reason().empty()) {
        finish = msg.finish_reason();
        usage = msg.usage();
      }
    } while (finish.empty() && call.reader->Read(&msg));
    const grpc::Status st = call.Finish();
    if (finish.empty()) {
      return Reply(res,
                   FromGrpc(st.ok() ? grpc::Status(grpc::StatusCode::INTERNAL,
                                                   "stream ended without a "
                                                   "finish reason")
                                    : st,
                            RetryAfterMs(call.ctx)));
    }
    OrderedValue body = Envelope(r, id, created, false);
    OrderedValue choice = {{"index", 0}};
    std::string finish_reason = FinishReason(finish);
    if (r.endpoint == Endpoint::kChatCompletions) {
      choice["message"] = {{"role", "assistant"}, {"content", text}};
      // The same pieces a stream would send, put together.
      ToolCallStream calls = NewToolCallStream(r);
      if (calls.active()) {
        std::vector<ToolCallDelta> deltas = calls.Push(text);
        bool tool_calls = false;
        for (ToolCallDelta& d :
             calls.Finish(EndedByItself(finish), &tool_calls))
          deltas.push_back(std::move(d));
        if (tool_calls) {
          ToolCallAnswer answer = AssembleToolCalls(deltas);
          OrderedValue list = OrderedValue::array();
          for (const ToolCall& call : answer.calls) {
            list.push_back(
                {{"id", call.id},
                 {"type", "function"},
                 {"function",
                  {{"name", call.name}, {"arguments", call.arguments}}}});
          }
          choice["message"] = {
              {"role", "assistant"},
              {"content", answer.content.empty() ||
                                  answer.content.find_first_not_of(" \n\r\t") ==
                                      std::string::npos
                              ? OrderedValue()
                              : OrderedValue(answer.content)},
              {"tool_calls", std::move(list)}};
          finish_reason = "tool_calls";
        }
      }
    } else {
      choice["text"] = text;
    }
    size_t offset = 0;
    choice["logprobs"] =
        r.logprobs.has_value() ? LogprobsJson(r, lps, &offset) : OrderedValue();
    choice["finish_reason"] = finish_reason;
    body["choices"] = OrderedValue::array({std::move(choice)});
    body["usage"] = Usage(usage);
    res.status = 200;
    res.set_content(json::Dump(body), "application/json");
  }

  // Server-Sent Events: a chunk per piece of text as it arrives, a final
  // chunk with the finish reason, the usage chunk when asked, [DONE]. A
  // failed write means the client went away: the call is cancelled by the
  // resource releaser as soon as this returns.
  bool Stream(const CompletionRequest& r, GenerateCall& call,
              v1::GenerateResponse msg, int64_t created,
              httplib::DataSink& sink) {
    const bool chat = r.endpoint == Endpoint::kChatCompletions;
    const std::string id = msg.request_id();
    auto send = [&](const std::string& data) {
      const std::string event = absl::StrCat("data: ", data, "\n\n");
      return sink.write(event.data(), event.size());
    };
    auto chunk = [&](OrderedValue choice) {
      OrderedValue c = Envelope(r, id, created, true);
      c["choices"] = OrderedValue::array({std::move(choice)});
      if (r.include_usage) c["usage"] = nullptr;
      return send(json::Dump(c));
    };
    size_t offset = 0;
    std::vector<v1::TokenLogprobs> lps;  // of the piece being sent
    auto piece = [&](const std::string& text, const OrderedValue& finish) {
      OrderedValue choice = {{"index", 0}};
      if (chat) {
        choice["delta"] = text.empty() && !finish.is_null()
                              ? OrderedValue::object()
                              : OrderedValue{{"content", text}};
      } else {
        choice["text"] = text;
      }
      choice["logprobs"] = r.logprobs.has_value() && !lps.empty()
                               ? LogprobsJson(r, lps, &offset)
                               : OrderedValue();
      choice["finish_reason"] = finish;
      return chunk(std::move(choice));
    };
    // Tool calls: each delta the reader gives (content or a call part), the
    // message's logprobs on its first one.
    ToolCallStream calls = NewToolCallStream(r);
    auto tool_piece = [&](const ToolCallDelta& d, bool with_logprobs) {
      OrderedValue delta;
      if (d.index < 0) {
        delta = {{"content", d.content}};
      } else {
        OrderedValue part = {{"index", d.index}};
        if (!d.id.empty()) {
          part["id"] = d.id;
          part["type"] = "function";
          part["function"] = {{"name", d.name}, {"arguments", ""}};
        } else {
          part["function"] = {{"arguments", d.arguments}};
        }
        delta = {{"tool_calls", OrderedValue::array({std::move(part)})}};
      }
      OrderedValue choice = {{"index", 0}, {"delta", std::move(delta)}};
      choice["logprobs"] =
          with_logprobs && r.logprobs.has_value() && !lps.empty()
              ? LogprobsJson(r, lps, &offset)
              : OrderedValue();
      choice["finish_reason"] = nullptr;
      return chunk(std::move(choice));
    };
    // Chat: the role comes first, in a delta of its own.
    if (chat &&
        !chunk(OrderedValue{{"index", 0},
                            {"delta", {{"role", "assistant"}, {"content", ""}}},
                            {"logprobs", nullptr},
                            {"finish_reason", nullptr}}))
      return false;
    std::string finish;
    v1::Usage usage;
    do {
      lps.assign(msg.logprobs().begin(), msg.logprobs().end());
      // With logprobs, tokens without text of their own (EOS, a split UTF-8
      // character) still get a chunk for their logprobs.
      if (calls.active()) {
        const std::vector<ToolCallDelta> deltas = calls.Push(msg.text());
        for (size_t k = 0; k < deltas.size(); ++k) {
          if (!tool_piece(deltas[k], k == 0)) return false;
        }
        if (deltas.empty() && !lps.empty() && !piece("", nullptr)) return false;
      } else if ((!msg.text().empty() || !lps.empty()) &&
                 !piece(msg.text(), nullptr)) {
        return false;
      }
      if (!msg.finish_reason().empty()) {
        finish = msg.finish_reason();
        usage = msg.usage();
      }
    } while (finish.empty() && call.reader->Read(&msg));
    if (finish.empty()) {
      // The stream failed after the status line went out: say so in-band.
      const grpc::Status st = call.Finish();
      send(ErrorJson(FromGrpc(
          st.ok() ? grpc::Status(grpc::StatusCode::INTERNAL,
                                 "stream ended without a finish reason")
                  : st,
          RetryAfterMs(call.ctx))));
    } else {
      lps.clear();
      std::string finish_reason = FinishReason(finish);
      if (calls.active()) {
        bool tool_calls = false;
        for (const ToolCallDelta& d :
             calls.Finish(EndedByItself(finish), &tool_calls))
          if (!tool_piece(d, false)) return false;
        if (tool_calls) finish_reason = "tool_calls";
      }
      if (!piece("", finish_reason)) return false;
      if (r.include_usage) {
        OrderedValue c = Envelope(r, id, created, true);
        c["choices"] = OrderedValue::array();
        c["usage"] = Usage(usage);
        if (!send(json::Dump(c))) return false;
      }
    }
    if (!send("[DONE]")) return false;
    sink.done();
    return true;
  }

  void HandleModels(const httplib::Request& req, httplib::Response& res) {
    if (req.has_header("Authorization")) {
      if (absl::Status s = CheckForwardedHeader(
              "Authorization", req.get_header_value("Authorization"));
          !s.ok())
        return Reply(res, Unauthorized(std::string(s.message())));
    }
    if (hooks.authenticate) {
      absl::Status s =
          hooks.authenticate(req.get_header_value("Authorization"));
      if (!s.ok())
        return Reply(
            res, FromGrpc(grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                                       std::string(s.message())),
                          0));
    }
    const OrderedValue body = {
        {"object", "list"},
        {"data",
         OrderedValue::array({OrderedValue{{"id", config.served_model_name},
                                           {"object", "model"},
                                           {"created", 0},
                                           {"owned_by", "pdserve"}}})}};
    res.set_content(json::Dump(body), "application/json");
  }
};

absl::Status OpenAiServerConfig::Validate() const {
  if (port < 0 || port > 65535)
    return absl::InvalidArgumentError("--http-port must be in [0, 65535]");
  if (served_model_name.empty())
    return absl::InvalidArgumentError("--served-model-name must not be empty");
  if (model_dir.empty())
    return absl::InvalidArgumentError("the HTTP front needs --model");
  if (tls_cert_file.empty() != tls_key_file.empty())
    return absl::InvalidArgumentError(
        "HTTPS needs both a certificate and a key");
  if (max_connections < 1)
    return absl::InvalidArgumentError(
        "--http-max-connections must be at least 1");
  if (max_queued_connections < 0)
    return absl::InvalidArgumentError(
        "--http-max-queued-connections must not be negative");
  if (keep_alive_idle_timeout <= absl::ZeroDuration())
    return absl::InvalidArgumentError(
        "--http-keep-alive-timeout-ms must be positive");
  if (keep_alive_max_requests < 1)
    return absl::InvalidArgumentError(
        "keep_alive_max_requests must be at least 1");
  if (max_body_bytes < 1024)
    return absl::InvalidArgumentError(
        "--http-max-body-bytes must be at least 1 KiB");
  return absl::OkStatus();
}

OpenAiServer::OpenAiServer(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}
OpenAiServer::~OpenAiServer() { Stop(); }
int OpenAiServer::port() const { return impl_->port; }
bool OpenAiServer::tls() const { return !impl_->config.tls_cert_file.empty(); }
OpenAiServer::ConnectionStats OpenAiServer::connection_stats() const {
  const ConnectionPool::Stats s = impl_->http->pool().stats();
  return ConnectionStats{s.active, s.queued, s.shed};
}

void OpenAiServer::Stop() {
  if (impl_->http) impl_->http->stop();
  if (impl_->listener.joinable()) impl_->listener.join();
}

absl::StatusOr<std::unique_ptr<OpenAiServer>> OpenAiServer::Start(
    const OpenAiServerConfig& config, RouterHooks hooks,
    metrics::Registry* registry) {
  RETURN_IF_ERROR(config.Validate());
  if (hooks.channel == nullptr)
    return absl::InvalidArgumentError("the HTTP front needs a router channel");
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->hooks = std::move(hooks);
  impl->stub = v1::Router::NewStub(impl->hooks.channel);
  ASSIGN_OR_RETURN(impl->tokenizer, engine::Tokenizer::Load(config.model_dir));
  // A model without a template still serves completions; chat answers 400.
  impl->chat_template = engine::ChatTemplateForModel(config.model_dir);
  impl->m = std::make_unique<HttpMetrics>(*registry);
  impl->unknown_fields = std::make_unique<UnknownFieldLog>(*registry);
  // A client that goes away mid-write must not kill the router (TLS writes
  // do not pass MSG_NOSIGNAL).
  signal(SIGPIPE, SIG_IGN);

  SSL_CTX* ssl_ctx = nullptr;
  if (!config.tls_cert_file.empty()) {
    ssl_ctx = SSL_CTX_new(TLS_server_method());
    if (ssl_ctx == nullptr ||
        SSL_CTX_set_min_proto_version(ssl_ctx, TLS1_2_VERSION) != 1 ||
        SSL_CTX_use_certificate_chain_file(ssl_ctx,
                                           config.tls_cert_file.c_str()) != 1 ||
        SSL_CTX_use_PrivateKey_file(ssl_ctx, config.tls_key_file.c_str(),
                                    SSL_FILETYPE_PEM) != 1 ||
        SSL_CTX_check_private_key(ssl_ctx) != 1) {
      if (ssl_ctx != nullptr) SSL_CTX_free(ssl_ctx);
      return absl::InvalidArgumentError(
          absl::StrCat("cannot load the HTTPS certificate ",
                       config.tls_cert_file, " or key ", config.tls_key_file));
    }
    SSL_CTX_set_options(ssl_ctx, SSL_OP_NO_COMPRESSION);
  }
  ConnectionLimits limits;
  limits.threads = config.max_connections;
  limits.max_queued = config.max_queued_connections;
  limits.keep_alive_idle = config.keep_alive_idle_timeout;
  limits.keep_alive_max_requests = config.keep_alive_max_requests;
  impl->http = std::make_unique<FrontHttpServer>(limits, ssl_ctx);
  FrontHttpServer& http = *impl->http;
  // Tokens go out as they come: no Nagle delay on small SSE writes.
  http.set_tcp_nodelay(true);
  http.set_payload_max_length(static_cast<size_t>(config.max_body_bytes));
  Impl* self = impl.get();
  http.Post("/v1/completions",
            [self](const httplib::Request& req, httplib::Response& res) {
              self->HandleGenerate(Endpoint::kCompletions, req, res);
            });
  http.Post("/v1/chat/completions",
            [self](const httplib::Request& req, httplib::Response& res) {
              self->HandleGenerate(Endpoint::kChatCompletions, req, res);
            });
  http.Get("/v1/models",
           [self](const httplib::Request& req, httplib::Response& res) {
             self->HandleModels(req, res);
           });
  http.Get("/health", [self](const httplib::Request&, httplib::Response& res) {
    const bool ok = !self->hooks.healthy || self->hooks.healthy();
    res.status = ok ? 200 : 503;
    if (!ok)
      Reply(res, FromGrpc(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                       "no worker can serve requests"),
                          0));
  });
  auto unknown = [](const httplib::Request& req, httplib::Response& res) {
    Reply(res, NotFound(absl::StrCat("Unknown request URL: ", req.method, " ",
                                     req.path),
                        "unknown_url"));
  };
  // Patterns are tried in registration order: these catch everything else.
  http.Get(".*", unknown);
  http.Post(".*", unknown);
  http.Put(".*", unknown);
  http.Delete(".*", unknown);
  http.Patch(".*", unknown);
  // httplib's own refusals (bad request line, 413, ...) in OpenAI's shape.
  http.set_error_handler(httplib::Server::HandlerWithResponse(
      [](const httplib::Request&, httplib::Response& res) {
        if (!res.body.empty())
          return httplib::Server::HandlerResponse::Unhandled;
        HttpError e = res.status == 404 ? NotFound("not found", "unknown_url")
                                        : BadRequest("malformed HTTP request");
        e.status = res.status;
        if (res.status == 413) e.message = "request body too large";
        res.set_content(ErrorJson(e), "application/json");
        return httplib::Server::HandlerResponse::Handled;
      }));
  http.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
        Reply(res, HttpError{500, "server_error", "", "internal error", "", 0});
      });
  http.set_logger(
      [self](const httplib::Request& req, const httplib::Response& res) {
        self->m->Count(req.path, res.status);
      });
  if (config.port == 0) {
    impl->port = http.bind_to_any_port(config.host);
  } else if (http.bind_to_port(config.host, config.port)) {
    impl->port = config.port;
  }
  if (impl->port <= 0)
    return absl::UnavailableError(absl::StrCat("cannot listen on ", config.host,
                                               ":", config.port, " (HTTP)"));
  impl->listener = std::thread([self] { self->http->listen_after_bind(); });
  return std::unique_ptr<OpenAiServer>(new OpenAiServer(std::move(impl)));
}

}  // namespace pdserve::router::openai
