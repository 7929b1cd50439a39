#include "bench/serve_bench.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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

// Runs `specs` open loop (arrival times) or closed loop (concurrency).
std::vector<RequestResult> Execute(const ServeBenchConfig& config,
                                   const std::vector<RequestSpec>& specs,
                                   double* duration_s) {
  auto channel =
      grpc::CreateChannel(config.router, grpc::InsecureChannelCredentials());
  auto stub = v1::Router::NewStub(channel);
  std::vector<RequestResult> results(specs.size());
  std::atomic<int> done{0};
  std::atomic<size_t> next{0};
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  if (config.concurrency > 0) {
    for (int c = 0; c < config.concurrency; ++c) {
      threads.emplace_back([&] {
        for (size_t i = next++; i < specs.size(); i = next++) {
          results[i] = RunOne(stub.get(), specs[i]);
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
        results[i] = RunOne(stub.get(), specs[i]);
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
  if (router.empty()) return absl::InvalidArgumentError("--router is required");
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
  double duration = 0;
  auto results = Execute(config, specs, &duration);
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
      auto res = Execute(probe, probe_specs, &d);
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
    return absl::StrFormat(
        "{\"p50\": %.6f, \"p90\": %.6f, \"p99\": %.6f, \"mean\": %.6f}", p.p50,
        p.p90, p.p99, p.mean);
  };
  return absl::StrFormat(
      "{\"requests\": %d, \"succeeded\": %d, \"failed\": %d, \"duration_s\": "
      "%.3f, \"request_rate\": %.3f, "
      "\"ttft_s\": %s, \"itl_s\": %s, \"e2e_s\": %s, \"requests_per_s\": %.3f, "
      "\"output_tokens_per_s\": %.1f, "
      "\"input_tokens_per_s\": %.1f, \"prompt_tokens\": %d, "
      "\"completion_tokens\": %d, "
      "\"cached_prompt_tokens\": %d, \"prefix_hit_rate\": %.4f, "
      "\"slo_attainment\": %.4f, \"goodput_rate\": %.3f}",
      requests, succeeded, failed, duration_s, request_rate, pct(ttft),
      pct(itl), pct(e2e), requests_per_s, output_tokens_per_s,
      input_tokens_per_s, prompt_tokens, completion_tokens,
      cached_prompt_tokens, prefix_hit_rate, slo_attainment, goodput_rate);
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
