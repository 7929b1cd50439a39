#include "bench/engine_bench.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "engine/weights.h"

namespace pdserve::bench {
namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since)
      .count();
}

engine::EngineRequest Request(const std::string& id, int32_t len, int32_t salt,
                              uint32_t max_tokens) {
  engine::EngineRequest r;
  r.id = id;
  for (int32_t i = 0; i < len; ++i)
    r.prompt.push_back((i * 7 + salt * 13 + 1) % 256);
  r.sampling.max_tokens = max_tokens;
  r.sampling.ignore_eos = true;
  r.cache_salt = id;  // no prefix sharing between benchmark requests
  return r;
}

}  // namespace

absl::Status EngineBenchConfig::Validate() const {
  if (model_dir.empty())
    return absl::InvalidArgumentError("--model is required");
  if (prefill_tokens < 1 || decode_context < 1 || decode_steps < 1 ||
      batch_sizes.empty()) {
    return absl::InvalidArgumentError("benchmark sizes must be positive");
  }
  return engine.Validate();
}

double MeasureTriadBandwidth(int64_t bytes) {
  const int64_t n = std::max<int64_t>(bytes / 12, 1 << 16);
  std::unique_ptr<float[]> a(new float[n]), b(new float[n]), c(new float[n]);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    a[i] = 0;
    b[i] = 1;
    c[i] = 2;
  }
  double best = 1e30;
  for (int pass = 0; pass < 6; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    const float s = 0.5f + pass;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
    best = std::min(best, Seconds(t0));
  }
  volatile float sink = a[n / 2];
  (void)sink;
  return 3.0 * 4.0 * static_cast<double>(n) / best / 1e9;
}

absl::StatusOr<EngineBenchResult> RunEngineBench(
    const EngineBenchConfig& config) {
  RETURN_IF_ERROR(config.Validate());
  ASSIGN_OR_RETURN(engine::ModelWeights loaded,
                   engine::ModelWeights::Load(config.model_dir));
  auto weights =
      std::make_shared<const engine::ModelWeights>(std::move(loaded));
  EngineBenchResult result;
  result.weight_bytes = weights->ParameterBytes();
  std::fprintf(stderr, "[bench] STREAM triad over %lld MiB...\n",
               static_cast<long long>(config.stream_bytes >> 20));
  result.stream_gb_per_s = MeasureTriadBandwidth(config.stream_bytes);

  // Prefill: one long prompt in one step (budget = prompt length), best of 3.
  {
    engine::EngineConfig ec = config.engine;
    ec.max_num_batched_tokens =
        std::max(ec.max_num_batched_tokens, config.prefill_tokens);
    ec.enable_prefix_caching = false;
    ASSIGN_OR_RETURN(auto eng, engine::Engine::Create(weights, ec));
    std::fprintf(stderr, "[bench] prefill %d tokens...\n",
                 config.prefill_tokens);
    double best = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      RETURN_IF_ERROR(eng->AddRequest(
          Request(absl::StrCat("p", rep), config.prefill_tokens, rep, 1)));
      const auto t0 = std::chrono::steady_clock::now();
      while (eng->HasWork()) RETURN_IF_ERROR(eng->Step().status());
      best = std::min(best, Seconds(t0));
    }
    result.prefill_tokens_per_s = config.prefill_tokens / best;
  }

  const int64_t bytes_per_token = [&] {
    engine::KvCacheSpec s{static_cast<int32_t>(weights->config.num_layers),
                          static_cast<int32_t>(weights->config.num_kv_heads),
                          static_cast<int32_t>(weights->config.head_dim),
                          config.engine.block_size, config.engine.kv_dtype};
    return s.BytesPerToken();
  }();
  for (int32_t batch : config.batch_sizes) {
    engine::EngineConfig ec = config.engine;
    ec.max_num_seqs = std::max(ec.max_num_seqs, batch);
    ec.max_num_batched_tokens =
        std::max(ec.max_num_batched_tokens, batch * config.decode_context);
    ASSIGN_OR_RETURN(auto eng, engine::Engine::Create(weights, ec));
    std::fprintf(stderr, "[bench] decode batch %d...\n", batch);
    for (int32_t i = 0; i < batch; ++i) {
      RETURN_IF_ERROR(
          eng->AddRequest(Request(absl::StrCat("d", i), config.decode_context,
                                  i, config.decode_steps + 8)));
    }
    // Warm up: prefill everything and run a few decode steps.
    for (int i = 0; i < 4; ++i) RETURN_IF_ERROR(eng->Step().status());
    if (eng->Stats().num_running != batch || eng->Stats().num_waiting != 0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "batch ", batch,
          " does not fit in the KV cache; raise --kv-cache-memory"));
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (int32_t s = 0; s < config.decode_steps; ++s)
      RETURN_IF_ERROR(eng->Step().status());
    const double secs = Seconds(t0);
    DecodeFigure f;
    f.batch = batch;
    f.step_ms = secs / config.decode_steps * 1e3;
    f.tokens_per_s = static_cast<double>(batch) * config.decode_steps / secs;
    // Each step reads every weight once plus each sequence's KV so far
    // (average context over the timed window).
    const double avg_ctx =
        config.decode_context + 3 + config.decode_steps / 2.0;
    f.bytes_per_step = static_cast<double>(result.weight_bytes) +
                       batch * avg_ctx * bytes_per_token;
    f.roofline_ratio = f.bytes_per_step / (secs / config.decode_steps) /
                       (result.stream_gb_per_s * 1e9);
    result.decode.push_back(f);
  }
  return result;
}

std::string EngineBenchResult::ToJson() const {
  std::string out = absl::StrFormat(
      "{\"stream_triad_gb_per_s\": %.3f, \"weight_bytes\": %d, "
      "\"prefill_tokens_per_s\": %.1f, "
      "\"decode\": [",
      stream_gb_per_s, weight_bytes, prefill_tokens_per_s);
  for (size_t i = 0; i < decode.size(); ++i) {
    const auto& d = decode[i];
    absl::StrAppendFormat(
        &out,
        "%s{\"batch\": %d, \"tokens_per_s\": %.1f, \"step_ms\": %.3f, "
        "\"bytes_per_step\": %.0f, \"roofline_ratio\": %.3f}",
        i ? ", " : "", d.batch, d.tokens_per_s, d.step_ms, d.bytes_per_step,
        d.roofline_ratio);
  }
  return out + "]}";
}

std::string EngineBenchResult::ToTable() const {
  std::string out = absl::StrFormat(
      "STREAM triad bandwidth : %8.2f GB/s\nweights read per step  : %8.1f MB\n"
      "prefill                : %8.1f tokens/s\n\n"
      "%6s %12s %10s %14s %10s\n",
      stream_gb_per_s, weight_bytes / 1e6, prefill_tokens_per_s, "batch",
      "tokens/s", "step ms", "GB/s achieved", "roofline");
  for (const auto& d : decode) {
    absl::StrAppendFormat(&out, "%6d %12.1f %10.3f %14.2f %10.2f\n", d.batch,
                          d.tokens_per_s, d.step_ms,
                          d.bytes_per_step / (d.step_ms / 1e3) / 1e9,
                          d.roofline_ratio);
  }
  return out;
}

}  // namespace pdserve::bench
