// Where a KV tier hit's TTFT goes, in process (a tool, not a test): one
// Engine (no router, no gRPC, no engine loop) serves `bench serve`'s
// multiturn workload closed loop at concurrency 1, and each request's time
// to first token is split into admission (the step's scheduling: pool
// lookup, eviction with offers to the tier, tier loads) and forward passes.
// Prints one JSON line per request and a summary.
//   kv_tier_ttft MODEL_DIR off|mem|disk:DIR|pool|sweep [POOL_MIB=12]
//   [REQUESTS=36]
//                [INPUT_LEN=448] [OUTPUT_LEN=8] [THREADS=2]
// `pool`: a pool of 1 GiB instead (every follow-up is a pool hit: the
// baseline a tier hit can at best reach). `sweep`: prefill seconds of n new
// tokens over a cached context (pool hit), best of 3, n x context grid.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/serve_workload.h"
#include "engine/engine.h"
#include "kernels/cpu/matmul.h"
#include "model/weights.h"
#include "tokenizer/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

int main(int argc, char** argv) {
  using namespace pdserve;
  if (argc < 3 || argv[1][0] == '-') {
    std::fprintf(
        argc < 3 ? stderr : stdout,
        "usage: %s MODEL_DIR off|mem|disk:DIR|pool|sweep [POOL_MIB=12] "
        "[REQUESTS=36] [INPUT_LEN=448] [OUTPUT_LEN=8] [THREADS=2]\n",
        argv[0]);
    return argc < 3 ? 2 : 0;
  }
  const std::string model = argv[1], mode = argv[2];
  if (mode != "off" && mode != "mem" && mode != "pool" && mode != "sweep" &&
      mode.rfind("disk:", 0) != 0) {
    std::fprintf(stderr,
                 "unknown mode \"%s\" (off, mem, disk:DIR, pool, sweep)\n",
                 mode.c_str());
    return 2;
  }
  const int64_t pool_mib = argc > 3 ? std::atoll(argv[3]) : 12;
  bench::WorkloadConfig w;
  w.name = "multiturn";
  w.num_requests = argc > 4 ? std::atoi(argv[4]) : 36;
  w.input_len = argc > 5 ? std::atoi(argv[5]) : 448;
  w.output_len = argc > 6 ? std::atoi(argv[6]) : 8;
  kernels::SetKernelThreads(argc > 7 ? std::atoi(argv[7]) : 2);

  auto weights = engine::ModelWeights::Load(model);
  if (!weights.ok()) {
    std::fprintf(stderr, "%s\n", weights.status().ToString().c_str());
    return 1;
  }
  auto tok = engine::Tokenizer::Load(model);
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", tok.status().ToString().c_str());
    return 1;
  }
  engine::EngineConfig c;
  c.kv_cache_bytes = (mode == "pool" || mode == "sweep" ? 1024 : pool_mib)
                     << 20;
  if (mode == "mem") c.kv_offload.memory_bytes = int64_t{1} << 30;
  if (mode.rfind("disk:", 0) == 0) {
    c.kv_offload.dir = mode.substr(5);
    c.kv_offload.capacity_bytes = int64_t{1} << 30;
  }
  auto e = engine::Engine::Create(
      std::make_shared<engine::ModelWeights>(std::move(*weights)), c);
  if (!e.ok()) {
    std::fprintf(stderr, "%s\n", e.status().ToString().c_str());
    return 1;
  }
  if (mode == "sweep") {
    // Prefill time of `n` new tokens over a cached context of `ctx`
    // (a pool hit), best of 3, against `n` cold tokens.
    auto prefill_s = [&](int ctx, int n, int rep) {
      engine::EngineRequest r;
      r.id = absl::StrCat("s", ctx, "_", n, "_", rep);
      // The multiturn workload's text (a conversation's first turn).
      bench::WorkloadConfig one = w;
      one.num_requests = 1;
      one.input_len = ctx + n;
      one.seed = static_cast<uint64_t>(ctx * 131 + n * 7 + rep);
      r.prompt = (*tok)->Encode((*bench::MakeWorkload(one))[0].prompt);
      r.prompt.resize(static_cast<size_t>(ctx + n));
      r.sampling.max_tokens = 1;
      if (ctx > 0) {
        engine::EngineRequest warm = r;
        warm.id += "w";
        warm.prompt.resize(static_cast<size_t>(ctx) + 1);
        (void)(*e)->AddRequest(warm);
        while ((*e)->HasWork()) (void)(*e)->Step();
      }
      (void)(*e)->AddRequest(r);
      const auto t0 = Clock::now();
      while ((*e)->HasWork()) (void)(*e)->Step();
      return Since(t0);
    };
    for (int ctx : {0, 448, 896}) {
      for (int n : {48, 96, 192}) {
        std::string all;
        double best = 1e9;
        for (int rep = 0; rep < 3; ++rep) {
          const double t = prefill_s(ctx, n, rep);
          best = std::min(best, t);
          char b[32];
          std::snprintf(b, sizeof(b), "%s%.4f", rep ? ", " : "", t);
          all += b;
        }
        std::printf(
            "{\"context\": %d, \"new\": %d, \"prefill_s\": %.4f, "
            "\"runs\": [%s]}\n",
            ctx, n, best, all.c_str());
        std::fflush(stdout);
      }
    }
    return 0;
  }
  auto specs = bench::MakeWorkload(w);
  if (!specs.ok()) return 1;
  std::vector<double> ttft, follow_ttft;
  for (size_t i = 0; i < specs->size(); ++i) {
    engine::EngineRequest r;
    r.id = absl::StrCat("r", i);
    r.prompt = (*tok)->Encode((*specs)[i].prompt);
    r.sampling.max_tokens = (*specs)[i].max_tokens;
    r.sampling.ignore_eos = true;
    const auto t0 = Clock::now();
    if (auto s = (*e)->AddRequest(r); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
    const double load_before = (*e)->Stats().kv_tier.load_seconds;
    double first = -1;
    int cached = 0;
    std::string step_s;  // each step's seconds until the first token
    bool done = false;
    while (!done) {
      const auto ts = Clock::now();
      auto outs = (*e)->Step();
      if (!outs.ok()) {
        std::fprintf(stderr, "%s\n", outs.status().ToString().c_str());
        return 1;
      }
      // Nothing scheduled: the request waits for the disk tier's reader
      // thread (the engine thread reads no file); the wait counts in TTFT.
      if (outs->empty() && (*e)->kv_tier() != nullptr)
        (*e)->kv_tier()->WaitForReads(absl::Seconds(30));
      if (first < 0) {
        if (!step_s.empty()) step_s += ", ";
        char b[32];
        std::snprintf(b, sizeof(b), "%.4f", Since(ts));
        step_s += b;
      }
      for (const auto& o : *outs) {
        if (first < 0 && !o.new_tokens.empty()) {
          first = Since(t0);
          cached = o.cached_prompt_tokens;
        }
        done |= o.finish != engine::FinishReason::kNone;
      }
    }
    const double load_s = (*e)->Stats().kv_tier.load_seconds - load_before;
    ttft.push_back(first);
    if ((*specs)[i].prompt.size() > static_cast<size_t>(w.input_len))
      follow_ttft.push_back(first);
    std::printf(
        "{\"i\": %zu, \"prompt\": %zu, \"cached\": %d, \"ttft_s\": %.4f, "
        "\"step_s\": [%s], \"tier_load_s\": %.4f}\n",
        i, r.prompt.size(), cached, first, step_s.c_str(), load_s);
  }
  auto p = [](std::vector<double> v, double q) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[std::min(v.size() - 1, size_t(q * v.size()))];
  };
  const engine::EngineStats s = (*e)->Stats();
  std::printf(
      "{\"mode\": \"%s\", \"ttft_p50\": %.4f, \"ttft_p99\": %.4f, "
      "\"followup_ttft_p50\": %.4f, \"prefix_hit_tokens\": %lld, "
      "\"prefix_queried_tokens\": %lld, \"tier_hit_tokens\": %lld, "
      "\"tier_load_s\": %.4f}\n",
      mode.c_str(), p(ttft, 0.5), p(ttft, 0.99), p(follow_ttft, 0.5),
      static_cast<long long>(s.prefix_hit_tokens),
      static_cast<long long>(s.prefix_queried_tokens),
      static_cast<long long>(s.kv_tier.hit_tokens), s.kv_tier.load_seconds);
  return 0;
}
