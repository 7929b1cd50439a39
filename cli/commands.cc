// The table of subcommands and their help texts.
#include <unistd.h>

#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/engine_bench.h"
#include "bench/kv_tier_sim.h"
#include "bench/router_sim.h"
#include "bench/serve_bench.h"
#include "bench/transfer_bench.h"
#include "cli/command.h"
#include "cli/flag_table.h"
#include "cli/flags.h"
#include "common/tls.h"

ABSL_FLAG(std::string, batch_sizes, "1,8,32",
          "bench engine: decode batch sizes");
ABSL_FLAG(int32_t, prefill_tokens, 512,
          "bench engine: prompt length for the prefill figure");
ABSL_FLAG(int32_t, decode_steps, 32,
          "bench engine: timed decode steps per batch size");
ABSL_FLAG(int32_t, decode_context, 128,
          "bench engine: prompt length of each sequence before decode timing");
ABSL_FLAG(int32_t, accuracy_positions, 0,
          "bench engine: also compare bf16, fp16 and int8 weights' logits with "
          "fp32 over this many positions (0: skip)");
ABSL_FLAG(bool, profile, false,
          "bench engine: also print a per-step breakdown by phase (embedding, "
          "norms, each GEMM, rope, KV write, attention, lm_head, sampling, "
          "scheduling; GEMMs' fork/join, barriers and packing) from extra "
          "profiled steps");
ABSL_FLAG(std::string, cold, "all",
          "bench engine: what is cold when a timed decode step starts: all "
          "(every cache, as the triad before it leaves them) or weights-kv "
          "(an untimed step runs after the triad, then the weights and the KV "
          "cache are flushed from the caches: they stream from memory with "
          "code, page tables and activations warm, as in back-to-back steps "
          "of a model larger than the last-level cache); either way the "
          "kernel helper threads are awake, as between back-to-back steps");
ABSL_FLAG(std::string, workload, "synthetic",
          "bench serve: chat, multiturn, longdoc, mixed or synthetic");
ABSL_FLAG(std::string, trace, "",
          "bench serve: JSONL trace to replay instead of a workload");
ABSL_FLAG(int32_t, num_requests, 32, "bench serve: requests per run");
ABSL_FLAG(double, rate, 0,
          "bench serve: Poisson arrival rate in requests/s (0 with "
          "--concurrency: closed loop)");
ABSL_FLAG(int32_t, concurrency, 0,
          "bench serve: closed-loop clients (0: open loop at --rate)");
ABSL_FLAG(int32_t, input_len, 128, "bench serve: prompt length unit in bytes");
ABSL_FLAG(int32_t, output_len, 32, "bench serve: output tokens per request");
ABSL_FLAG(double, slo_ttft, 2.0, "bench serve: TTFT SLO in seconds");
ABSL_FLAG(double, slo_itl, 0.2,
          "bench serve: inter-token latency SLO in seconds");
ABSL_FLAG(bool, goodput, false,
          "bench serve: search for the highest rate with >= 90% within SLO");
ABSL_FLAG(double, max_rate, 16, "bench serve: upper end of the goodput search");
ABSL_FLAG(std::string, cdf_svg, "",
          "bench serve: write the TTFT CDF plot here");
ABSL_FLAG(std::string, openai_url, "",
          "bench serve: drive an OpenAI-compatible server at this base URL "
          "(http://HOST:PORT/v1) instead of --router; --model is then the "
          "served model name (default: the first of /v1/models)");
ABSL_FLAG(std::string, transfer_tokens, "1024,4096,16384",
          "bench transfer: sequence lengths in tokens");
ABSL_FLAG(int32_t, repetitions, 3,
          "bench transfer: timed repetitions per size");
ABSL_FLAG(std::string, prefill_sweep, "",
          "sim route: prefill worker counts to sweep, e.g. 4,16,64,256");
ABSL_FLAG(int64_t, cache_tokens, 900000,
          "sim route: prefix cache per prefill worker, in tokens");
ABSL_FLAG(double, time_scale, 1.0,
          "sim route: arrival time multiplier (< 1 raises the load)");
ABSL_FLAG(int64_t, max_requests, 0,
          "sim route: first N trace requests (0 = all)");
ABSL_FLAG(int32_t, decision_replays, 1,
          "sim route: simulate each policy and cluster size this many times "
          "and report each request's fastest decision (decision_min_p99_us)");
ABSL_FLAG(double, pool_fraction, 0,
          "sim route: > 0 sizes every worker's KV pool as this fraction of "
          "the trace's working set over the worker count (instead of "
          "--cache-tokens)");
ABSL_FLAG(bool, tiers, false,
          "sim route: model the KV tier instead (pool only, pool + tier, "
          "unbounded) on the trace");
ABSL_FLAG(double, tier_multiple, 4, "sim route --tiers: tier size / pool size");
ABSL_FLAG(bool, pull_from_tiers, true,
          "sim route, +tier+pull policies: holders serve pulls from their "
          "tier too (false: from their pool only)");
ABSL_FLAG(bool, tier_refresh_on_hit, true,
          "sim route, +tier policies: a tier hit refreshes the block in the "
          "tier's LRU, as the engine's tier does (false: for comparison)");
ABSL_FLAG(std::string, pool_fractions, "0.0625,0.125,0.25,0.5",
          "sim route --tiers: pool sizes as fractions of the working set");
ABSL_FLAG(double, tier_read_gbps, 2.0,
          "sim route --tiers: tier read rate in GB/s (1e9 B/s)");
ABSL_FLAG(int64_t, kv_bytes_per_token, 131072,
          "sim route --tiers: KV bytes per token (pdserve kv-budget)");
ABSL_DECLARE_FLAG(std::string, out);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(int32_t, prefill);
ABSL_DECLARE_FLAG(int32_t, decode);
ABSL_DECLARE_FLAG(std::string, policy);
ABSL_DECLARE_FLAG(std::string, router);

namespace pdserve::cli {

int ReportError(const absl::Status& status) {
  std::fprintf(stderr, "pdserve: error: %s\n",
               std::string(status.message()).c_str());
  return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

int RunBenchEngine(const std::vector<std::string>&) {
  bench::EngineBenchConfig config;
  config.model_dir = absl::GetFlag(FLAGS_model);
  auto engine = EngineConfigFromFlags();
  if (!engine.ok()) return ReportError(engine.status());
  config.engine = *engine;
  config.prefill_tokens = absl::GetFlag(FLAGS_prefill_tokens);
  config.decode_steps = absl::GetFlag(FLAGS_decode_steps);
  config.decode_context = absl::GetFlag(FLAGS_decode_context);
  config.accuracy_positions = absl::GetFlag(FLAGS_accuracy_positions);
  config.profile = absl::GetFlag(FLAGS_profile);
  const auto cold = bench::ParseCold(absl::GetFlag(FLAGS_cold));
  if (!cold) {
    return ReportError(absl::InvalidArgumentError(
        absl::StrCat("--cold must be all or weights-kv, not \"",
                     absl::GetFlag(FLAGS_cold), "\"")));
  }
  config.cold = *cold;
  config.batch_sizes.clear();
  for (absl::string_view p : absl::StrSplit(absl::GetFlag(FLAGS_batch_sizes),
                                            ',', absl::SkipWhitespace())) {
    int32_t b;
    if (!absl::SimpleAtoi(p, &b) || b < 1) {
      return ReportError(absl::InvalidArgumentError(
          "--batch-sizes must list positive integers"));
    }
    config.batch_sizes.push_back(b);
  }
  auto result = bench::RunEngineBench(config);
  if (!result.ok()) return ReportError(result.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", result->ToJson().c_str());
  } else {
    std::printf("%s", result->ToTable().c_str());
  }
  return 0;
}

absl::StatusOr<std::vector<int32_t>> ParseIntList(const std::string& text,
                                                  const char* flag) {
  std::vector<int32_t> out;
  for (absl::string_view p :
       absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int32_t v;
    if (!absl::SimpleAtoi(p, &v) || v < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, " must list positive integers"));
    }
    out.push_back(v);
  }
  if (out.empty())
    return absl::InvalidArgumentError(absl::StrCat(flag, " is empty"));
  return out;
}

int RunBenchServe(const std::vector<std::string>&) {
  bench::ServeBenchConfig c;
  c.router = absl::GetFlag(FLAGS_router);
  c.openai_url = absl::GetFlag(FLAGS_openai_url);
  if (!c.openai_url.empty()) c.openai_model = absl::GetFlag(FLAGS_model);
  c.workload.name = absl::GetFlag(FLAGS_workload);
  c.workload.num_requests = absl::GetFlag(FLAGS_num_requests);
  c.workload.rate = absl::GetFlag(FLAGS_rate);
  c.workload.input_len = absl::GetFlag(FLAGS_input_len);
  c.workload.output_len = absl::GetFlag(FLAGS_output_len);
  c.workload.seed =
      absl::GetFlag(FLAGS_seed) == 0 ? 1 : absl::GetFlag(FLAGS_seed);
  c.trace_file = absl::GetFlag(FLAGS_trace);
  c.concurrency = absl::GetFlag(FLAGS_concurrency);
  c.slo_ttft_s = absl::GetFlag(FLAGS_slo_ttft);
  c.slo_itl_s = absl::GetFlag(FLAGS_slo_itl);
  c.search_goodput = absl::GetFlag(FLAGS_goodput);
  c.max_rate = absl::GetFlag(FLAGS_max_rate);
  c.progress = isatty(2);
  auto report = bench::RunServeBench(c);
  if (!report.ok()) return ReportError(report.status());
  if (!absl::GetFlag(FLAGS_cdf_svg).empty()) {
    if (auto s = bench::WriteCdfSvg(*report, absl::GetFlag(FLAGS_cdf_svg));
        !s.ok())
      return ReportError(s);
  }
  std::printf("%s", absl::GetFlag(FLAGS_json)
                        ? (report->ToJson() + "\n").c_str()
                        : report->ToTable().c_str());
  return report->failed > 0 ? 1 : 0;
}

int RunBenchTransfer(const std::vector<std::string>&) {
  // Sender and receiver in this process, on loopback: plaintext on purpose.
  if (absl::Status s = tls::Install(tls::TlsConfig::Plaintext()); !s.ok())
    return ReportError(s);
  bench::TransferBenchConfig c;
  auto tokens =
      ParseIntList(absl::GetFlag(FLAGS_transfer_tokens), "--transfer-tokens");
  if (!tokens.ok()) return ReportError(tokens.status());
  c.tokens = *tokens;
  c.repetitions = absl::GetFlag(FLAGS_repetitions);
  auto dtype = ParseDType(absl::GetFlag(FLAGS_kv_dtype));
  if (!dtype)
    return ReportError(absl::InvalidArgumentError(
        "--kv-dtype must be fp32, bf16, fp16, int8 or fp8"));
  c.layouts =
      bench::DefaultTransferLayouts(*dtype, absl::GetFlag(FLAGS_block_size));
  auto result = bench::RunTransferBench(c);
  if (!result.ok()) return ReportError(result.status());
  std::printf("%s", absl::GetFlag(FLAGS_json)
                        ? (result->ToJson() + "\n").c_str()
                        : result->ToTable().c_str());
  return 0;
}

int RunSimTiers(const std::string& trace_path) {
  bench::TierSimConfig c;
  c.pool_fractions.clear();
  for (absl::string_view f : absl::StrSplit(absl::GetFlag(FLAGS_pool_fractions),
                                            ',', absl::SkipWhitespace())) {
    double v;
    if (!absl::SimpleAtod(f, &v)) {
      return ReportError(absl::InvalidArgumentError(
          absl::StrCat("--pool-fractions: cannot parse \"", f, "\"")));
    }
    c.pool_fractions.push_back(v);
  }
  c.tier_multiple = absl::GetFlag(FLAGS_tier_multiple);
  c.tier_read_gbps = absl::GetFlag(FLAGS_tier_read_gbps);
  c.kv_bytes_per_token = absl::GetFlag(FLAGS_kv_bytes_per_token);
  c.max_requests = absl::GetFlag(FLAGS_max_requests);
  auto trace = bench::LoadMooncakeTrace(trace_path);
  if (!trace.ok()) return ReportError(trace.status());
  auto report = bench::RunTierSim(c, *trace);
  if (!report.ok()) return ReportError(report.status());
  std::printf("%s", absl::GetFlag(FLAGS_json)
                        ? (report->ToJson() + "\n").c_str()
                        : report->ToTable().c_str());
  return 0;
}

int RunSimRoute(const std::vector<std::string>&) {
  bench::SimConfig c;
  c.trace_path = absl::GetFlag(FLAGS_trace);
  if (c.trace_path.empty())
    return ReportError(absl::InvalidArgumentError("--trace FILE is required"));
  if (absl::GetFlag(FLAGS_tiers)) return RunSimTiers(c.trace_path);
  if (!absl::GetFlag(FLAGS_prefill_sweep).empty()) {
    auto sweep =
        ParseIntList(absl::GetFlag(FLAGS_prefill_sweep), "--prefill-sweep");
    if (!sweep.ok()) return ReportError(sweep.status());
    c.prefill_workers = *sweep;
  } else {
    c.prefill_workers = {absl::GetFlag(FLAGS_prefill)};
  }
  c.decode_workers = absl::GetFlag(FLAGS_decode);
  const std::string policy = absl::GetFlag(FLAGS_policy);
  if (policy != "all")
    c.policies = absl::StrSplit(policy, ',', absl::SkipWhitespace());
  c.prefill_cache_tokens = absl::GetFlag(FLAGS_cache_tokens);
  c.block_size = absl::GetFlag(FLAGS_block_size);
  c.time_scale = absl::GetFlag(FLAGS_time_scale);
  c.max_requests = absl::GetFlag(FLAGS_max_requests);
  c.decision_replays = absl::GetFlag(FLAGS_decision_replays);
  c.pool_fraction = absl::GetFlag(FLAGS_pool_fraction);
  c.tier_multiple = absl::GetFlag(FLAGS_tier_multiple);  // "+tier" policies
  c.pull_from_tiers = absl::GetFlag(FLAGS_pull_from_tiers);
  c.tier_refresh_on_hit = absl::GetFlag(FLAGS_tier_refresh_on_hit);
  c.seed = absl::GetFlag(FLAGS_seed) == 0 ? 1 : absl::GetFlag(FLAGS_seed);
  auto report = bench::RunRouterSim(c, [](const bench::SimRun& r) {
    std::fprintf(stderr, "[sim] %s done\n", r.policy.c_str());
  });
  if (!report.ok()) return ReportError(report.status());
  if (!absl::GetFlag(FLAGS_out).empty()) {
    if (auto s = report->WriteFiles(absl::GetFlag(FLAGS_out)); !s.ok())
      return ReportError(s);
  }
  std::printf("%s", absl::GetFlag(FLAGS_json)
                        ? (report->ToJson() + "\n").c_str()
                        : report->ToTable().c_str());
  return 0;
}

const std::vector<Command>& AllCommands() {
  // Descriptions say what a command does; the flag list under each is
  // generated from cli/flag_table.cc (names, values, defaults).
  static const std::vector<Command> commands = {
      {"model init",
       "write a deterministic random-weight model (Hugging Face layout)",
       kModelInit,
       "Writes config.json, model.safetensors and a byte-level tokenizer (256 "
       "byte\ntokens + BOS/EOS). The same preset and seed always give the "
       "same files;\nconfig.json's torch_dtype names the dtype the weights "
       "are written in.\n\n"
       "Presets (--preset): tiny (tests), small (demo, the default), one per "
       "supported\nfamily in that family's config shape at tiny size (llama2, "
       "llama3, llama3.1,\nmistral, qwen2, qwen3, mixtral, qwen3-moe, "
       "deepseek-v2, deepseek-v3), and\nllama3.2-1b at full size (bf16 unless "
       "--dtype says otherwise).\n",
       RunModelInit},
      {"model logits", "print the logits of a token sequence as JSON",
       kModelLogits,
       "Prints {\"logits\": [...]} for the last position, or one list per "
       "position\nwith --all-positions. fp32 KV cache: this is the accuracy "
       "reference path.\n",
       RunModelLogits},
      {"up",
       "run router + prefill + decode workers on localhost (the embedded "
       "default)",
       kUp,
       "Starts N prefill and M decode workers (or, with --prefill 0, M "
       "colocated\n--role both workers) and a router, as child processes on "
       "127.0.0.1, and prints\ntheir endpoints. Without --model it creates "
       "the default small model under\n~/.cache/pdserve/models. Plaintext "
       "(--insecure) unless given --tls-cert,\n--tls-key and --tls-ca: for "
       "local use. Ctrl-C stops everything. Every worker\nand router flag "
       "below is passed on; --kv-transport auto is shm on CPU and\ncuda_ipc "
       "with --device cuda, --threads 0 splits the cores between the "
       "workers,\n--kv-offload-dir DIR gives each worker DIR/<role>-<i>, and "
       "the router's ports\ndefault to 50051 (gRPC), 9400 (metrics) and 8000 "
       "(OpenAI API; 0: off).\n",
       RunUp},
      {"router", "the public Router service", kRouter,
       "Worker lists take host:port or dns:NAME:PORT (every address of NAME, "
       "e.g. a\nKubernetes headless Service). Workers started with --router "
       "register themselves.\nCertificates (mTLS with every worker, TLS for "
       "clients) or an explicit --insecure\nare required; "
       "docs/security.md explains tokens, tenants and limits. "
       "--peer-pull\nlets "
       "the prefill worker pull a prefix it lacks from a peer's pool when "
       "faster\nthan recompute. Ports default to 50051 (gRPC) and 9400 "
       "(metrics); the OpenAI\nAPI is off unless --http-port is given.\n",
       RunRouter},
      {"prefill", "a prefill worker", kPrefill,
       "A worker with --role prefill: computes prompts' KV and ships it to "
       "decode\nworkers. Listens on any free port unless --port is given.\n",
       RunPrefillWorker},
      {"decode", "a decode worker", kDecode,
       "A worker with --role decode: reserves KV blocks for a request, "
       "receives the\nprompt's KV and decodes. Listens on any free port "
       "unless --port is given.\n",
       RunDecodeWorker},
      {"worker",
       "a worker of any role (--role both: colocated prefill + decode)",
       kWorker,
       "A worker of the given role; --role both prefills and decodes itself "
       "(colocated).\n",
       RunWorker},
      {"generate", "generate text through a router, or in-process with --model",
       kGenerate,
       "With --router ADDR: through a router. With --model DIR: in-process, "
       "with no\nservices (the reference path; the engine flags apply).\n"
       "Streams exactly the generated text to stdout; --json prints token ids, "
       "text,\nfinish reason and usage instead. --stop may repeat. "
       "--timeout-ms sets a\ndeadline (router only). With --router: --tls-ca "
       "FILE (or --tls: system roots)\nconnects with TLS, --tls-cert/--tls-key "
       "present a client certificate,\n--auth-token T (default "
       "$PDSERVE_AUTH_TOKEN) sends a bearer token.\n",
       RunGenerate},
      {"kv-budget", "KV cache size arithmetic as JSON", kKvBudget,
       "bytes_per_token = 2 x layers x kv_heads x head_dim x dtype bytes; with "
       "MLA\n(--kv-lora-rank R --qk-rope-head-dim D: DeepSeek-V2/V3) layers x "
       "(kv_lora_rank +\nqk_rope_head_dim) x dtype bytes, beside the MHA "
       "figure. With --tokens, the bytes\nand blocks for T tokens; with "
       "--memory, the blocks and tokens that fit (int8\nblocks include their "
       "fp32 per-(block, head) scales). --dtype defaults to fp16.\n",
       RunKvBudget},
      {"bench engine",
       "prefill/decode throughput and the decode roofline ratio", kBenchEngine,
       "Reports prefill tokens/s, decode tokens/s per batch size, and the "
       "decode\nroofline ratio: bytes a step must read (weights + KV) per "
       "second divided by\nthe STREAM-triad bandwidth measured in the same "
       "run, over at least 4x the\nlast-level cache (sysfs). Each decode "
       "row's \"of read\" divides the same bytes\na second by a plain read "
       "of the step's weights (a join after each matrix)\nin the same "
       "rounds. Prefill and each decode batch also report GFLOP/s as a\n"
       "fraction of the FMA peak of the GEMM path, measured in the same run. "
       "With\n--accuracy-positions, bf16/fp16/int8 logits are compared with "
       "fp32 (max and mean\nrelative error, top-1 agreement).\n",
       RunBenchEngine},
      {"tokenize",
       "token ids of a text (or a chat) with a model's tokenizer, as JSON",
       kTokenize,
       "--tokenizer PATH is a model or tokenizer directory (tokenizer.json, "
       "\ntokenizer_config.json) or its tokenizer.json; the text comes from "
       "--text,\n--file or --messages. Prints {\"ids\": [...], \"count\": N, "
       "\"tokens\": [...]}; BOS/EOS\nare added as the tokenizer config says "
       "unless --add-special-tokens=false.\n--messages takes a JSON list of "
       "{\"role\", \"content\"} and renders it with the\nmodel's chat template "
       "(Llama-3, ChatML/Qwen, Mistral) first; the output then\nalso has "
       "\"chat_template\" and \"prompt\".\n",
       RunTokenize},
      {"detokenize", "the text of token ids with a model's tokenizer, as JSON",
       kDetokenize,
       "Prints {\"text\": ..., \"tokens\": [...]} for --ids. Special tokens "
       "(BOS, EOS, chat\nmarkers) are left out of the text unless "
       "--skip-special-tokens=false. Bytes that\ndo not form valid UTF-8 "
       "become U+FFFD.\n",
       RunDetokenize},
      {"sim route",
       "replay a Mooncake trace through the real router index and policies",
       kSimRoute,
       "A discrete-event simulation of a cluster driving pdserve's own "
       "PrefixIndex, KV\nevent handling and Policy objects. Reports hit "
       "ratio, prefill imbalance,\nestimated TTFT, decision latency and index "
       "memory per policy and worker count;\n--out also writes an SVG. "
       "--policy takes all, or a comma-separated list of\ncache_aware, "
       "cache_threshold, least_loaded, round_robin, oracle, each with "
       "\"+pull\"\nand/or \"+tier\" (peer pull; a tier of --tier-multiple x "
       "the pool per prefill\nworker; \"+tier+dtier\": on decode workers "
       "too), or \"unbounded\" (the oracle with an\nunbounded cache). --tiers "
       "models the KV tier instead (pool only, pool + tier,\nunbounded).\n",
       RunSimRoute},
      {"bench serve",
       "load generator against a router: latency percentiles, throughput, "
       "goodput",
       kBenchServe,
       "Drives --router ADDR, or an OpenAI-compatible server at --openai-url "
       "(--model is\nthen the served model name). Open loop: Poisson arrivals "
       "at --rate requests/s;\nclosed loop: --concurrency clients. Trace "
       "lines: {\"arrival_s\": 0.5, \"prompt\":\n\"...\" | \"prompt_tokens\": "
       "300, \"max_tokens\": 32, \"prefix_group\": \"g1\"}. Goodput:\nthe "
       "highest rate at which >= 90% of requests meet both SLOs (TTFT, and "
       "the\nrequest's mean inter-token latency), found by bisection.\n"
       "multiturn: ceil(--num-requests / 6) conversations of 6 turns, "
       "interleaved\nround-robin (turn k of every conversation, then turn k + "
       "1); turn 0 is\n--input-len bytes, each later turn is the previous "
       "prompt + an answer-like text\n(<= --output-len bytes) + a new user "
       "message, reusing 0.75-0.95 of its prompt\n(median 0.85, like the "
       "Mooncake conversation trace's follow-up turns).\n",
       RunBenchServe},
      {"bench transfer", "KV transfer throughput over grpc vs raw loopback TCP",
       kBenchTransfer,
       "Moves the KV blocks of sequences of each length for the small layout "
       "(--kv-dtype)\nand an 8B-shaped layout (32 layers, 8 KV heads, head_dim "
       "128, bf16) through the\ngrpc transport on loopback, verifies the "
       "bytes, and compares with a plain TCP\nsocket moving the same bytes.\n",
       RunBenchTransfer},
  };
  return commands;
}

std::string CommandUsage(const Command& c) {
  return absl::StrCat("usage: pdserve ", c.name, " [FLAGS]\n\n", c.description,
                      "\n", FlagHelp(c.id));
}

}  // namespace pdserve::cli
