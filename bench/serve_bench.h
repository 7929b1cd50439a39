// `pdserve bench serve`: a load generator against a running router. Open-loop
// Poisson arrivals at a rate, or a closed loop at a concurrency; reports TTFT,
// inter-token and end-to-end latency percentiles, throughput, prefix-cache
// hit rate, and goodput (the highest rate at which >= 90% of requests meet
// both SLOs, found by a search over rates). One run at a time; the runner
// uses its own client threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/serve_workload.h"

namespace pdserve::bench {

struct ServeBenchConfig {
  std::string router;  // host:port of pdserve's gRPC router
  // Or any OpenAI-compatible server (pdserve's HTTP front, vLLM, SGLang,
  // llama.cpp): its base URL, such as http://127.0.0.1:8000/v1. Requests go
  // to POST {url}/completions with "stream": true and include_usage; TTFT is
  // the first SSE chunk with text, ITL the gaps between chunks spread over
  // the tokens that usage reports. $OPENAI_API_KEY, when set, is sent as the
  // bearer token.
  std::string openai_url;
  std::string openai_model;  // "model"; empty: the first of GET {url}/models
  WorkloadConfig workload;
  std::string trace_file;   // replaces the named workload
  int32_t concurrency = 0;  // > 0: closed loop with this many clients
  double slo_ttft_s = 2.0;
  double slo_itl_s = 0.2;
  bool search_goodput = false;  // repeat at increasing rates to find goodput
  double max_rate = 16;         // upper end of the goodput search (requests/s)
  bool progress = true;         // live progress bar on stderr
  absl::Status Validate() const;
};

struct RequestResult {
  bool ok = false;
  std::string error;
  double ttft_s = 0;
  double e2e_s = 0;
  std::vector<double> itl_s;
  uint32_t prompt_tokens = 0;
  uint32_t completion_tokens = 0;
  uint32_t cached_prompt_tokens = 0;
};

struct Percentiles {
  double p50 = 0, p90 = 0, p99 = 0, mean = 0;
};
// Nearest-rank percentiles (p in (0,1]: the ceil(p*n)-th smallest value).
Percentiles ComputePercentiles(std::vector<double> values);

struct ServeReport {
  int32_t requests = 0, succeeded = 0, failed = 0;
  double duration_s = 0;
  double request_rate = 0;  // offered (open loop), 0 for closed loop
  Percentiles ttft, itl, e2e;
  double requests_per_s = 0, output_tokens_per_s = 0, input_tokens_per_s = 0;
  int64_t prompt_tokens = 0, completion_tokens = 0, cached_prompt_tokens = 0;
  double prefix_hit_rate = 0;
  double slo_attainment = 0;         // fraction meeting both SLOs
  double goodput_rate = -1;          // requests/s; -1 when not searched
  std::vector<double> ttft_samples;  // for the CDF plot
  std::string ToJson() const;
  std::string ToTable() const;
};

// Runs one schedule against the router.
absl::StatusOr<ServeReport> RunServeBench(const ServeBenchConfig& config);
// Summarises results (exposed for tests).
ServeReport Summarise(const std::vector<RequestResult>& results,
                      double duration_s, double slo_ttft_s, double slo_itl_s);
// Writes a latency CDF (TTFT, e2e) as SVG.
absl::Status WriteCdfSvg(const ServeReport& report, const std::string& path);

}  // namespace pdserve::bench
