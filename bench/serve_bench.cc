#include "bench/serve_bench.h"

#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/json.h"
#include "common/status_macros.h"
#include "pdserve/v1/router.grpc.pb.h"

namespace pdserve::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

RequestResult RunOne(v1::Router::Stub* stub, const RequestSpec& spec) {
  RequestResult r;
  v1::GenerateRequest req;
  req.set_prompt(spec.prompt);
  req.mutable_sampling()->set_max_tokens(spec.max_tokens);
  req.mutable_sampling()->set_ignore_eos(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
  const auto start = Clock::now();
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse resp;
  Clock::time_point last = start;
  bool first = true;
  while (reader->Read(&resp)) {
    const auto now = Clock::now();
    if (resp.token_ids_size() > 0) {
      if (first) {
        r.ttft_s = std::chrono::duration<double>(now - start).count();
        first = false;
      } else {
        // Tokens that arrive together share the gap.
        const double gap = std::chrono::duration<double>(now - last).count() /
                           resp.token_ids_size();
        for (int i = 0; i < resp.token_ids_size(); ++i) r.itl_s.push_back(gap);
      }
      last = now;
    }
    if (!resp.finish_reason().empty()) {
      r.prompt_tokens = resp.usage().prompt_tokens();
      r.completion_tokens = resp.usage().completion_tokens();
      r.cached_prompt_tokens = resp.usage().cached_prompt_tokens();
    }
  }
  const grpc::Status st = reader->Finish();
  r.e2e_s = Since(start);
  r.ok = st.ok();
  if (!st.ok()) r.error = st.error_message();
  return r;
}

// An OpenAI-compatible server: "http://host:port" and the API's base path.
struct OpenAiTarget {
  std::string origin;     // scheme://host:port
  std::string base_path;  // "/v1"
  std::string model;
  std::string api_key;  // $OPENAI_API_KEY

  static absl::StatusOr<OpenAiTarget> Parse(const std::string& url) {
    const size_t scheme = url.find("://");
    if (scheme == std::string::npos || !(absl::StartsWith(url, "http://") ||
                                         absl::StartsWith(url, "https://")))
      return absl::InvalidArgumentError(absl::StrCat(
          "--openai-url must look like http://HOST:PORT/v1, got ", url));
    OpenAiTarget t;
    const size_t path = url.find('/', scheme + 3);
    t.origin = url.substr(0, path);
    t.base_path = path == std::string::npos ? "" : url.substr(path);
    while (!t.base_path.empty() && t.base_path.back() == '/')
      t.base_path.pop_back();
    if (const char* key = std::getenv("OPENAI_API_KEY")) t.api_key = key;
    return t;
  }

  std::unique_ptr<httplib::Client> Connect() const {
    auto c = std::make_unique<httplib::Client>(origin);
    c->set_tcp_nodelay(true);
    c->set_keep_alive(true);
    c->set_read_timeout(600, 0);
    c->set_connection_timeout(10, 0);
    if (!api_key.empty()) c->set_bearer_token_auth(api_key);
    return c;
  }

  // The first model of GET /models.
  absl::Status ResolveModel() {
    auto c = Connect();
    auto res = c->Get(base_path + "/models");
    if (!res || res->status != 200)
      return absl::UnavailableError(absl::StrCat(
          "GET ", origin, base_path, "/models failed (",
          res ? std::to_string(res->status) : httplib::to_string(res.error()),
          "); pass --model"));
    ASSIGN_OR_RETURN(json::Value body, json::Parse(res->body, "/models"));
    const json::Value* data = json::Find(body, "data");
    if (data == nullptr || !data->is_array() || data->empty())
      return absl::NotFoundError("/models lists no model; pass --model");
    ASSIGN_OR_RETURN(model, json::GetString((*data)[0], "id", "/models"));
    return absl::OkStatus();
  }
};

// One streamed completion. TTFT: the first SSE chunk carrying text; ITL: the
// gaps between later text chunks, each spread evenly over the tokens the
// chunks carried on average (usage's completion_tokens / text chunks), so
// a server that batches tokens per chunk is not flattered.
RequestResult RunOneOpenAi(httplib::Client& client, const OpenAiTarget& t,
                           const RequestSpec& spec) {
  RequestResult r;
  const std::string body = json::Dump(
      json::OrderedValue{{"model", t.model},
                         {"prompt", spec.prompt},
                         {"max_tokens", spec.max_tokens},
                         {"temperature", 0},
                         {"ignore_eos", true},
                         {"stream", true},
                         {"stream_options", {{"include_usage", true}}}});
  const auto start = Clock::now();
  Clock::time_point last = start;
  std::vector<double> gaps;
  bool first = true, done = false;
  std::string buffer, raw;
  auto on_event = [&](absl::string_view data) {
    if (data == "[DONE]") {
      done = true;
      return;
    }
    auto event = json::Parse(data, "SSE event");
    if (!event.ok()) return;
    if (const json::Value* err = json::Find(*event, "error")) {
      r.error = err->dump();
      return;
    }
    const json::Value* choices = json::Find(*event, "choices");
    if (choices != nullptr && choices->is_array() && !choices->empty()) {
      const json::Value& c = (*choices)[0];
      const std::string* text = json::StringOrNull(json::Find(c, "text"));
      if (const json::Value* delta = json::Find(c, "delta");
          text == nullptr && delta != nullptr)
        text = json::StringOrNull(json::Find(*delta, "content"));  // chat
      if (text != nullptr && !text->empty()) {
        const auto now = Clock::now();
        if (first) {
          r.ttft_s = std::chrono::duration<double>(now - start).count();
          first = false;
        } else {
          gaps.push_back(std::chrono::duration<double>(now - last).count());
        }
        last = now;
      }
    }
    if (const json::Value* usage = json::Find(*event, "usage")) {
      r.prompt_tokens = static_cast<uint32_t>(
          json::GetInt(*usage, "prompt_tokens", "usage", 0).value_or(0));
      r.completion_tokens = static_cast<uint32_t>(
          json::GetInt(*usage, "completion_tokens", "usage", 0).value_or(0));
      if (const json::Value* details =
              json::Find(*usage, "prompt_tokens_details")) {
        r.cached_prompt_tokens = static_cast<uint32_t>(
            json::GetInt(*details, "cached_tokens", "usage", 0).value_or(0));
      }
    }
  };
  httplib::Request req;
  req.method = "POST";
  req.path = t.base_path + "/completions";
  req.body = body;
  req.set_header("Content-Type", "application/json");
  req.set_header("Accept", "text/event-stream");
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (raw.size() < 4096) raw.append(data, std::min(n, 4096 - raw.size()));
    buffer.append(data, n);
    size_t end;
    while ((end = buffer.find("\n\n")) != std::string::npos) {
      absl::string_view event(buffer.data(), end);
      for (absl::string_view line : absl::StrSplit(event, '\n')) {
        if (!absl::ConsumePrefix(&line, "data:")) continue;
        absl::ConsumePrefix(&line, " ");
        on_event(line);
      }
      buffer.erase(0, end + 2);
    }
    return true;
  };
  httplib::Response res;
  httplib::Error error = httplib::Error::Success;
  const bool sent = client.send(req, res, error);
  r.e2e_s = Since(start);
  if (!sent) {
    r.error = absl::StrCat("HTTP request failed: ", httplib::to_string(error));
  } else if (res.status != 200) {
    r.error = absl::StrCat("HTTP ", res.status, ": ", raw);
  } else if (!done && r.error.empty()) {
    r.error = "stream ended without data: [DONE]";
  }
  r.ok = r.error.empty() && sent && res.status == 200;
  if (!gaps.empty()) {
    const double per_chunk =
        r.completion_tokens > 1 ? static_cast<double>(r.completion_tokens - 1) /
                                      static_cast<double>(gaps.size())
                                : 1.0;
    const int copies = std::max(1, static_cast<int>(std::lround(per_chunk)));
    for (double g : gaps) {
      for (int i = 0; i < copies; ++i) r.itl_s.push_back(g / per_chunk);
    }
  }
  return r;
}

// Runs `specs` open loop (arrival times) or closed loop (concurrency).
std::vector<RequestResult> Execute(const ServeBenchConfig& config,
                                   const std::vector<RequestSpec>& specs,
                                   double* duration_s,
                                   const OpenAiTarget* openai) {
  std::unique_ptr<v1::Router::Stub> stub;
  if (openai == nullptr) {
    stub = v1::Router::NewStub(
        grpc::CreateChannel(config.router, grpc::InsecureChannelCredentials()));
  }
  // One keep-alive HTTP connection per client thread (closed loop) or per
  // request (open loop), as an OpenAI SDK client would hold.
  auto run = [&](std::unique_ptr<httplib::Client>& http,
                 const RequestSpec& spec) {
    if (openai == nullptr) return RunOne(stub.get(), spec);
    if (http == nullptr) http = openai->Connect();
    return RunOneOpenAi(*http, *openai, spec);
  };
  std::vector<RequestResult> results(specs.size());
  std::atomic<int> done{0};
  std::atomic<size_t> next{0};
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  if (config.concurrency > 0) {
    for (int c = 0; c < config.concurrency; ++c) {
      threads.emplace_back([&] {
        std::unique_ptr<httplib::Client> http;
        for (size_t i = next++; i < specs.size(); i = next++) {
          results[i] = run(http, specs[i]);
          ++done;
        }
      });
    }
  } else {
    for (size_t i = 0; i < specs.size(); ++i) {
      const auto at =
          start + std::chrono::duration_cast<Clock::duration>(
                      std::chrono::duration<double>(specs[i].arrival_s));
      std::this_thread::sleep_until(at);
      threads.emplace_back([&, i] {
        std::unique_ptr<httplib::Client> http;
        results[i] = run(http, specs[i]);
        ++done;
      });
    }
  }
  if (config.progress) {
    while (done < static_cast<int>(specs.size())) {
      const int d = done;
      const int width = 40, filled = static_cast<int>(width * d / specs.size());
      std::fprintf(stderr, "\r[%s%s] %d/%zu requests, %.1fs",
                   std::string(filled, '#').c_str(),
                   std::string(width - filled, '.').c_str(), d, specs.size(),
                   Since(start));
      std::fflush(stderr);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  for (auto& t : threads) t.join();
  if (config.progress) std::fprintf(stderr, "\r%80s\r", "");
  *duration_s = Since(start);
  return results;
}

}  // namespace

absl::Status ServeBenchConfig::Validate() const {
  if (router.empty() == openai_url.empty())
    return absl::InvalidArgumentError(
        "give one of --router (pdserve gRPC) or --openai-url (any "
        "OpenAI-compatible server)");
  if (concurrency < 0)
    return absl::InvalidArgumentError("--concurrency must not be negative");
  if (slo_ttft_s <= 0 || slo_itl_s <= 0)
    return absl::InvalidArgumentError("SLOs must be positive");
  if (search_goodput && max_rate <= 0)
    return absl::InvalidArgumentError("--max-rate must be positive");
  if (trace_file.empty()) return workload.Validate();
  return absl::OkStatus();
}

Percentiles ComputePercentiles(std::vector<double> v) {
  Percentiles p;
  if (v.empty()) return p;
  std::sort(v.begin(), v.end());
  auto rank = [&](double q) {
    const size_t k =
        static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
    return v[std::clamp<size_t>(k, 1, v.size()) - 1];
  };
  p.p50 = rank(0.5);
  p.p90 = rank(0.9);
  p.p99 = rank(0.99);
  double sum = 0;
  for (double x : v) sum += x;
  p.mean = sum / static_cast<double>(v.size());
  return p;
}

ServeReport Summarise(const std::vector<RequestResult>& results,
                      double duration_s, double slo_ttft_s, double slo_itl_s) {
  ServeReport r;
  r.requests = static_cast<int32_t>(results.size());
  r.duration_s = duration_s;
  std::vector<double> ttft, itl, e2e;
  int met = 0;
  for (const auto& x : results) {
    if (!x.ok) {
      ++r.failed;
      continue;
    }
    ++r.succeeded;
    ttft.push_back(x.ttft_s);
    e2e.push_back(x.e2e_s);
    itl.insert(itl.end(), x.itl_s.begin(), x.itl_s.end());
    r.prompt_tokens += x.prompt_tokens;
    r.completion_tokens += x.completion_tokens;
    r.cached_prompt_tokens += x.cached_prompt_tokens;
    const double mean_itl =
        x.itl_s.empty()
            ? 0
            : (x.e2e_s - x.ttft_s) / static_cast<double>(x.itl_s.size());
    // SLO on TTFT and on the request's mean inter-token latency.
    met += x.ttft_s <= slo_ttft_s && mean_itl <= slo_itl_s;
  }
  r.ttft = ComputePercentiles(ttft);
  r.itl = ComputePercentiles(itl);
  r.e2e = ComputePercentiles(e2e);
  r.ttft_samples = ttft;
  if (duration_s > 0) {
    r.requests_per_s = r.succeeded / duration_s;
    r.output_tokens_per_s =
        static_cast<double>(r.completion_tokens) / duration_s;
    r.input_tokens_per_s = static_cast<double>(r.prompt_tokens) / duration_s;
  }
  r.prefix_hit_rate =
      r.prompt_tokens > 0
          ? static_cast<double>(r.cached_prompt_tokens) / r.prompt_tokens
          : 0;
  r.slo_attainment = r.requests > 0 ? static_cast<double>(met) / r.requests : 0;
  return r;
}

absl::StatusOr<ServeReport> RunServeBench(const ServeBenchConfig& config) {
  RETURN_IF_ERROR(config.Validate());
  std::vector<RequestSpec> specs;
  if (!config.trace_file.empty()) {
    std::ifstream in(config.trace_file);
    if (!in)
      return absl::NotFoundError(
          absl::StrCat(config.trace_file, ": cannot open"));
    std::stringstream ss;
    ss << in.rdbuf();
    ASSIGN_OR_RETURN(specs, ParseTrace(ss.str(), config.trace_file));
  } else {
    ASSIGN_OR_RETURN(specs, MakeWorkload(config.workload));
  }
  std::optional<OpenAiTarget> openai;
  if (!config.openai_url.empty()) {
    ASSIGN_OR_RETURN(openai, OpenAiTarget::Parse(config.openai_url));
    openai->model = config.openai_model;
    if (openai->model.empty()) RETURN_IF_ERROR(openai->ResolveModel());
  }
  const OpenAiTarget* target = openai ? &*openai : nullptr;
  double duration = 0;
  auto results = Execute(config, specs, &duration, target);
  ServeReport report =
      Summarise(results, duration, config.slo_ttft_s, config.slo_itl_s);
  report.request_rate = config.concurrency > 0 ? 0 : config.workload.rate;
  if (report.failed > 0) {
    for (const auto& r : results) {
      if (!r.ok) {
        std::fprintf(stderr, "[bench] first failure: %s\n", r.error.c_str());
        break;
      }
    }
  }
  if (config.search_goodput && config.trace_file.empty()) {
    // Goodput: bisect on the Poisson rate for >= 90% SLO attainment.
    double lo = 0, hi = config.max_rate;
    for (int it = 0; it < 5; ++it) {
      const double rate = it == 0 ? hi : (lo + hi) / 2;
      ServeBenchConfig probe = config;
      probe.concurrency = 0;
      probe.workload.rate = rate;
      // Fresh prompts per probe: reusing them would turn later probes into
      // prefix-cache hits and inflate goodput.
      probe.workload.seed =
          config.workload.seed + 7919 * static_cast<uint64_t>(it + 1);
      ASSIGN_OR_RETURN(auto probe_specs, MakeWorkload(probe.workload));
      double d = 0;
      auto res = Execute(probe, probe_specs, &d, target);
      const ServeReport pr =
          Summarise(res, d, config.slo_ttft_s, config.slo_itl_s);
      std::fprintf(stderr,
                   "[bench] goodput probe %.2f req/s: %.0f%% within SLO\n",
                   rate, 100 * pr.slo_attainment);
      if (pr.slo_attainment >= 0.9) {
        lo = rate;
        if (it == 0) break;
      } else {
        hi = rate;
      }
    }
    report.goodput_rate = lo;
  }
  return report;
}

std::string ServeReport::ToJson() const {
  auto pct = [](const Percentiles& p) {
    json::OrderedValue v;
    v["p50"] = p.p50;
    v["p90"] = p.p90;
    v["p99"] = p.p99;
    v["mean"] = p.mean;
    return v;
  };
  json::OrderedValue out;
  out["requests"] = requests;
  out["succeeded"] = succeeded;
  out["failed"] = failed;
  out["duration_s"] = duration_s;
  out["request_rate"] = request_rate;
  out["ttft_s"] = pct(ttft);
  out["itl_s"] = pct(itl);
  out["e2e_s"] = pct(e2e);
  out["requests_per_s"] = requests_per_s;
  out["output_tokens_per_s"] = output_tokens_per_s;
  out["input_tokens_per_s"] = input_tokens_per_s;
  out["prompt_tokens"] = prompt_tokens;
  out["completion_tokens"] = completion_tokens;
  out["cached_prompt_tokens"] = cached_prompt_tokens;
  out["prefix_hit_rate"] = prefix_hit_rate;
  out["slo_attainment"] = slo_attainment;
  out["goodput_rate"] = goodput_rate;
  return json::Dump(out);
}

std::string ServeReport::ToTable() const {
  std::string out =
      absl::StrFormat("requests %d (ok %d, failed %d) in %.2f s\n", requests,
                      succeeded, failed, duration_s);
  absl::StrAppendFormat(&out, "%-22s %10s %10s %10s %10s\n", "latency (ms)",
                        "p50", "p90", "p99", "mean");
  for (auto [name, p] : {std::pair{"time to first token", &ttft},
                         {"inter-token", &itl},
                         {"end to end", &e2e}}) {
    absl::StrAppendFormat(&out, "%-22s %10.1f %10.1f %10.1f %10.1f\n", name,
                          1e3 * p->p50, 1e3 * p->p90, 1e3 * p->p99,
                          1e3 * p->mean);
  }
  absl::StrAppendFormat(
      &out, "throughput: %.2f req/s, %.1f output tok/s, %.1f input tok/s\n",
      requests_per_s, output_tokens_per_s, input_tokens_per_s);
  absl::StrAppendFormat(&out,
                        "prefix-cache hit rate: %.1f%% of prompt tokens\n",
                        100 * prefix_hit_rate);
  absl::StrAppendFormat(&out, "within SLO: %.1f%%", 100 * slo_attainment);
  if (goodput_rate >= 0)
    absl::StrAppendFormat(&out, ", goodput %.2f req/s", goodput_rate);
  return out + "\n";
}

absl::Status WriteCdfSvg(const ServeReport& report, const std::string& path) {
  std::vector<double> v = report.ttft_samples;
  std::sort(v.begin(), v.end());
  const double w = 640, h = 400, m = 50;
  const double xmax = v.empty() ? 1 : std::max(v.back(), 1e-3);
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" "
      "height=\"%.0f\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" "
      "fill=\"white\"/>\n"
      "<text x=\"%.0f\" y=\"20\">TTFT CDF (%d requests)</text>\n"
      "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" "
      "stroke=\"black\"/>\n"
      "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" "
      "stroke=\"black\"/>\n"
      "<text x=\"%.0f\" y=\"%.0f\">%.3f s</text><text x=\"5\" "
      "y=\"%.0f\">1.0</text>\n",
      w, h, m, static_cast<int>(v.size()), m, h - m, w - m, h - m, m, m, m,
      h - m, w - m - 40, h - m + 20, xmax, m);
  std::string points;
  for (size_t i = 0; i < v.size(); ++i) {
    const double x = m + (w - 2 * m) * v[i] / xmax;
    const double y = (h - m) - (h - 2 * m) * static_cast<double>(i + 1) /
                                   static_cast<double>(v.size());
    absl::StrAppendFormat(&points, "%.1f,%.1f ", x, y);
  }
  svg += absl::StrFormat(
      "<polyline fill=\"none\" stroke=\"steelblue\" stroke-width=\"2\" "
      "points=\"%s\"/>\n</svg>\n",
      points);
  std::ofstream out(path);
  out << svg;
  if (!out)
    return absl::PermissionDeniedError(absl::StrCat(path, ": cannot write"));
  return absl::OkStatus();
}

}  // namespace pdserve::bench
