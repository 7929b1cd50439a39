#include "cli/flag_table.h"

#include <algorithm>
#include <set>
#include <thread>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "common/dtype.h"
#include "common/metric_handles.h"
#include "engine/backend.h"
#include "kernels/cpu/matmul.h"
#include "kv_transfer/transport.h"
#include "model/model_init.h"
#include "model/weights.h"
#include "router/policy.h"
#include "wire/enums.h"

namespace pdserve::cli {
namespace {

// The value this process holds for flag `name` (every name in the table is a
// defined flag: flag_table_test checks it).
std::string Current(absl::string_view name) {
  const absl::CommandLineFlag* f = absl::FindCommandLineFlag(name);
  return f == nullptr ? "" : f->CurrentValue();
}

// The flags this process's command line named (Abseil names), as
// CheckCommandLineFlags saw them.
std::set<std::string>& GivenFlags() {
  static std::set<std::string>* given = new std::set<std::string>();
  return *given;
}

absl::Status Refused(absl::string_view flag, absl::string_view value) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", absl::StrReplaceAll(flag, {{"_", "-"}}), ": \"", value,
                   "\" is not one of its values"));
}

absl::Status CheckKvDtype(const std::string& v) {
  return ParseDType(v) ? absl::OkStatus() : Refused("kv_dtype", v);
}
absl::Status CheckMatmul(const std::string& v) {
  return kernels::ParseMatMulMode(v) ? absl::OkStatus() : Refused("matmul", v);
}
absl::Status CheckWeightDtype(const std::string& v) {
  return engine::ParseWeightDtype(v) ? absl::OkStatus()
                                     : Refused("weight_dtype", v);
}
absl::Status CheckDevice(const std::string& v) {
  return engine::ParseDevice(v) ? absl::OkStatus() : Refused("device", v);
}
// "auto" is resolved by the command (up: shm or cuda_ipc; a worker: grpc).
absl::Status CheckKvTransport(const std::string& v) {
  if (v == "auto") return absl::OkStatus();
  return kv_transfer::ParseKvTransport(v).status();
}
absl::Status CheckRole(const std::string& v) {
  return wire::ParseRole(v) ? absl::OkStatus() : Refused("role", v);
}
absl::Status CheckPolicy(const std::string& v) {
  return router::Policy::Create(v, router::PolicyConfig(), nullptr).status();
}
absl::Status CheckPreset(const std::string& v) {
  return engine::PresetConfig(v).status();
}
absl::Status CheckPresetDtype(const std::string& v) {
  // Empty: the preset's own dtype.
  return v.empty() ? absl::OkStatus() : engine::ParseModelFileDtype(v).status();
}
absl::Status CheckKvBudgetDtype(const std::string& v) {
  return v.empty() || ParseDType(v) ? absl::OkStatus() : Refused("dtype", v);
}

std::vector<const char*> PresetChoices() {
  std::vector<const char*> out;
  for (const std::string& n : engine::PresetNames()) {
    // The table lives as long as the process: keep the names with it.
    static std::set<std::string>* names = new std::set<std::string>();
    out.push_back(names->insert(n).first->c_str());
  }
  return out;
}

// `up`'s rewrites of a value for its children.
std::optional<std::string> UpModel(const UpChild& c) { return c.model; }
// Workers share the machine: unless --threads is given, the cores are
// divided by what each worker does (UpWorkerThreads), so kernel threads of
// different processes do not fight over one core.
std::optional<std::string> UpThreads(const UpChild& c) {
  int64_t threads = 0;
  (void)absl::SimpleAtoi(Current("threads"), &threads);
  if (threads > 0) return std::to_string(threads);
  return std::to_string(UpWorkerThreads(
      c.role, static_cast<int>(std::thread::hardware_concurrency()),
      c.num_prefill, c.num_workers));
}
// One GPU shared by every worker: each takes an equal part of the fraction.
std::optional<std::string> UpGpuMemory(const UpChild& c) {
  double f = 0.9;
  (void)absl::SimpleAtod(Current("gpu_memory_utilization"), &f);
  return absl::StrCat(f / std::max(1, c.num_workers));
}
// Every worker of `up` is on this node, so prefill writes straight into the
// decode pool: cuda_ipc on a GPU (NCCL cannot join two ranks on one GPU), shm
// on CPU (measured 2.6-3.8x grpc's GB/s by `pdserve bench transfer`,
// kv_transfer/README.md).
std::optional<std::string> UpKvTransport(const UpChild&) {
  const std::string t = Current("kv_transport");
  if (t != "auto") return t;
  return Current("device") == "cuda" ? "cuda_ipc" : "shm";
}
// `up`'s CPU workers share this host's cores, lent through the core share
// to whichever has work. Sending each layer's KV as the forward pass writes
// it overlaps a shm copy (about a millisecond for a 512-token `small` prompt)
// with compute, but each layer's send is a control-stream round trip (a
// manifest the decode worker's gRPC threads answer) and a copy, run on the
// cores the prefill kernels use: on 2 cores the prefill worker's time in
// steps per prompt rose 15%, and 1P+1D served fewer tokens/s in 7 of 8
// alternating pairs (bench/RESULTS.md). Unless given, up's CPU workers send
// the KV once the prompt's forward pass is done.
std::optional<std::string> UpKvLayerwise(const UpChild&) {
  if (GivenFlags().count("kv_layerwise") || Current("device") == "cuda")
    return Current("kv_layerwise");
  return "false";
}
// The core share `up` made (or was given) for its workers.
std::optional<std::string> UpCoreShare(const UpChild& c) {
  return c.core_share;
}
// A disk tier gets a directory per worker (a tier empties its directory at
// start-up).
std::optional<std::string> UpKvOffloadDir(const UpChild& c) {
  const std::string dir = Current("kv_offload_dir");
  if (dir.empty()) return std::nullopt;
  return absl::StrCat(dir, "/", c.role, "-", c.index);
}
// The router's public ports: up's defaults (the contract's 50051 and 9400,
// and the OpenAI front on 8000) where not given.
std::optional<std::string> UpPortOr(const char* flag, int fallback) {
  int64_t v = -1;
  (void)absl::SimpleAtoi(Current(flag), &v);
  return std::to_string(v < 0 ? fallback : v);
}
// Every worker of `up` shares one host's cores, so sending a short prompt to
// the prefill worker buys no compute: it only queues behind long prompts
// there and adds a KV transfer. Unless given, up's router prefills a prompt
// that fits one prefill chunk (the prefill worker's default
// --long-prefill-chunk, 128) on the decode worker, and the prefill worker
// takes the long ones (the router's own default is 32; measured on 2 cores
// in bench/RESULTS.md, section 4).
constexpr int kUpLocalPrefillThreshold = 128;
std::optional<std::string> UpLocalPrefillThreshold(const UpChild&) {
  if (GivenFlags().count("local_prefill_threshold"))
    return Current("local_prefill_threshold");
  return std::to_string(kUpLocalPrefillThreshold);
}
std::optional<std::string> UpPort(const UpChild&) {
  return UpPortOr("port", 50051);
}
std::optional<std::string> UpMetricsPort(const UpChild&) {
  return UpPortOr("metrics_port", 9400);
}
std::optional<std::string> UpHttpPort(const UpChild&) {
  return UpPortOr("http_port", 8000);
}
// Plaintext unless TLS files are given: `up` is for local use.
std::optional<std::string> UpInsecure(const UpChild&) {
  const bool no_files = Current("tls_cert").empty() &&
                        Current("tls_key").empty() && Current("tls_ca").empty();
  return Current("insecure") == "true" || no_files ? "true" : "false";
}

// The TLS files go on only when up runs with TLS (--insecure wins, as a
// plaintext cluster has no use for them).
std::optional<std::string> UpTlsFile(const char* flag, const UpChild& c) {
  return *UpInsecure(c) == "true" ? "" : Current(flag);
}
std::optional<std::string> UpTlsCert(const UpChild& c) {
  return UpTlsFile("tls_cert", c);
}
std::optional<std::string> UpTlsKey(const UpChild& c) {
  return UpTlsFile("tls_key", c);
}
std::optional<std::string> UpTlsCa(const UpChild& c) {
  return UpTlsFile("tls_ca", c);
}

// Every server process: the router and the workers.
constexpr uint32_t kServers = kRouter | kWorkerCommands;

}  // namespace

const std::vector<FlagSpec>& AllFlags() {
  using U = UpForward;
  static const std::vector<FlagSpec>* table = new std::vector<FlagSpec>{
      // Engine (every process that builds an engine; up: every worker).
      {"model",
       kEngineCommands | kRouter | kModelLogits | kBenchServe | kUp,
       U::kAll,
       {},
       nullptr,
       UpModel},
      {"kv_dtype",
       kEngineCommands | kBenchTransfer,
       U::kWorkers,
       {"fp32", "bf16", "fp16", "int8", "fp8"},
       CheckKvDtype},
      {"block_size", kEngineCommands | kBenchTransfer | kKvBudget | kSimRoute,
       U::kWorkers},
      {"kv_cache_memory", kEngineCommands, U::kWorkers},
      {"max_num_seqs", kEngineCommands, U::kWorkers},
      {"max_num_batched_tokens", kEngineCommands, U::kWorkers},
      {"long_prefill_chunk", kEngineCommands, U::kWorkers},
      {"max_model_len", kEngineCommands, U::kWorkers},
      {"enable_prefix_caching", kEngineCommands, U::kWorkers},
      {"kv_offload_dir",
       kEngineCommands,
       U::kWorkers,
       {},
       nullptr,
       UpKvOffloadDir},
      {"kv_offload_bytes", kEngineCommands, U::kWorkers},
      {"kv_offload_memory", kEngineCommands, U::kWorkers},
      {"matmul",
       kEngineCommands,
       U::kWorkers,
       {"deterministic", "bf16dot", "int8dot", "blas"},
       CheckMatmul},
      {"weight_dtype",
       kEngineCommands | kModelLogits,
       U::kWorkers,
       {"auto", "fp32", "bf16", "fp16", "int8", "int8-b32"},
       CheckWeightDtype},
      {"threads",
       kEngineCommands | kModelLogits,
       U::kWorkers,
       {},
       nullptr,
       UpThreads},
      {"device", kEngineCommands, U::kWorkers, {"cpu", "cuda"}, CheckDevice},
      {"gpu_memory_utilization",
       kEngineCommands,
       U::kWorkers,
       {},
       nullptr,
       UpGpuMemory},
      {"gpu_reference_math", kEngineCommands, U::kWorkers},
      // Worker processes.
      {"role", kWorker, U::kNone, {"prefill", "decode", "both"}, CheckRole},
      {"kv_transport",
       kWorkerCommands,
       U::kWorkers,
       {"grpc", "shm", "cuda_ipc", "nccl", "auto"},
       CheckKvTransport,
       UpKvTransport},
      {"kv_cuda_device", kWorkerCommands, U::kWorkers},
      {"core_share", kWorkerCommands, U::kWorkers, {}, nullptr, UpCoreShare},
      {"kv_layerwise",
       kWorkerCommands,
       U::kWorkers,
       {},
       nullptr,
       UpKvLayerwise},
      {"kv_stream_queue_bytes", kWorkerCommands, U::kWorkers},
      {"admission_timeout_ms", kWorkerCommands, U::kWorkers},
      {"drain_timeout_ms", kWorkerCommands, U::kWorkers},
      {"advertise", kWorkerCommands},
      // Every server (up listens on 127.0.0.1 only).
      {"host", kServers},
      {"port", kServers, U::kRouter, {}, nullptr, UpPort},
      {"metrics_port", kServers, U::kRouter, {}, nullptr, UpMetricsPort},
      {"router", kWorkerCommands | kGenerate | kBenchServe},
      {"insecure", kServers, U::kAll, {}, nullptr, UpInsecure},
      {"tls_cert", kServers | kGenerate, U::kAll, {}, nullptr, UpTlsCert},
      {"tls_key", kServers | kGenerate, U::kAll, {}, nullptr, UpTlsKey},
      {"tls_ca", kServers | kGenerate, U::kAll, {}, nullptr, UpTlsCa},
      {"tls_reload_seconds", kServers, U::kAll},
      // The router.
      {"http_port", kRouter, U::kRouter, {}, nullptr, UpHttpPort},
      {"served_model_name", kRouter, U::kRouter},
      {"http_max_connections", kRouter, U::kRouter},
      {"http_max_queued_connections", kRouter, U::kRouter},
      {"http_keep_alive_timeout_ms", kRouter, U::kRouter},
      {"http_max_body_bytes", kRouter, U::kRouter},
      {"prefill_workers", kRouter},
      {"decode_workers", kRouter},
      {"both_workers", kRouter},
      {"policy",
       kRouter,
       U::kRouter,
       {"cache_aware", "round_robin", "least_loaded", "cache_threshold"},
       CheckPolicy},
      {"w_prefill", kRouter, U::kRouter},
      {"w_decode", kRouter, U::kRouter},
      {"local_prefill_threshold",
       kRouter,
       U::kRouter,
       {},
       nullptr,
       UpLocalPrefillThreshold},
      {"max_retries", kRouter, U::kRouter},
      {"peer_pull", kRouter, U::kRouter},
      {"peer_pull_min_speedup", kRouter, U::kRouter},
      {"worker_heartbeat_ms", kRouter, U::kRouter},
      {"worker_status_timeout_ms", kRouter, U::kRouter},
      {"worker_max_missed_polls", kRouter, U::kRouter},
      {"worker_forget_after_ms", kRouter, U::kRouter},
      {"auth_tokens", kRouter, U::kRouter},
      {"tenant_max_concurrent", kRouter, U::kRouter},
      {"tenant_tokens_per_minute", kRouter, U::kRouter},
      {"shared_prefix_cache", kRouter, U::kRouter},
      {"request_timeout_ms", kRouter, U::kRouter},
      {"max_message_bytes", kRouter, U::kRouter},
      {"max_prompt_tokens", kRouter, U::kRouter},
      {"max_output_tokens", kRouter, U::kRouter},
      {"max_stop_strings", kRouter, U::kRouter},
      {"max_stop_string_bytes", kRouter, U::kRouter},
      {"max_streams_per_connection", kRouter, U::kRouter},
      {"max_inflight_requests", kRouter, U::kRouter},
      // up itself.
      {"prefill", kUp | kSimRoute},
      {"decode", kUp | kSimRoute},
      // generate.
      {"prompt", kGenerate},
      {"max_tokens", kGenerate},
      {"temperature", kGenerate},
      {"top_p", kGenerate},
      {"top_k", kGenerate},
      {"seed", kGenerate | kModelInit | kBenchServe | kSimRoute},
      {"stop", kGenerate},
      {"ignore_eos", kGenerate},
      {"cache_salt", kGenerate},
      {"logprobs", kGenerate},
      {"top_logprobs", kGenerate},
      {"json_schema", kGenerate},
      {"regex", kGenerate},
      {"grammar", kGenerate},
      {"timeout_ms", kGenerate},
      {"tls", kGenerate},
      {"tls_server_name", kGenerate},
      {"auth_token", kGenerate},
      {"json",
       kGenerate | kBenchEngine | kBenchServe | kBenchTransfer | kSimRoute},
      // model init, model logits, kv-budget.
      {"preset", kModelInit, U::kNone, PresetChoices(), CheckPreset},
      {"out", kModelInit | kSimRoute},
      {"dtype",
       kModelInit,
       U::kNone,
       {"fp32", "fp16", "bf16"},
       CheckPresetDtype},
      {"dtype",
       kKvBudget,
       U::kNone,
       {"fp32", "bf16", "fp16", "int8", "fp8"},
       CheckKvBudgetDtype},
      {"tokens", kModelLogits | kKvBudget},
      {"all_positions", kModelLogits},
      {"layers", kKvBudget},
      {"kv_heads", kKvBudget},
      {"head_dim", kKvBudget},
      {"kv_lora_rank", kKvBudget},
      {"qk_rope_head_dim", kKvBudget},
      {"memory", kKvBudget},
      // tokenize, detokenize.
      {"tokenizer", kTokenize | kDetokenize},
      {"text", kTokenize},
      {"file", kTokenize},
      {"messages", kTokenize},
      {"add_generation_prompt", kTokenize},
      {"add_special_tokens", kTokenize},
      {"ids", kDetokenize},
      {"skip_special_tokens", kDetokenize},
      // bench engine.
      {"batch_sizes", kBenchEngine},
      {"prefill_tokens", kBenchEngine},
      {"decode_steps", kBenchEngine},
      {"decode_context", kBenchEngine},
      {"accuracy_positions", kBenchEngine},
      {"profile", kBenchEngine},
      {"cold", kBenchEngine},
      // bench serve.
      {"workload", kBenchServe},
      {"trace", kBenchServe | kSimRoute},
      {"num_requests", kBenchServe},
      {"rate", kBenchServe},
      {"concurrency", kBenchServe},
      {"input_len", kBenchServe},
      {"output_len", kBenchServe},
      {"slo_ttft", kBenchServe},
      {"slo_itl", kBenchServe},
      {"goodput", kBenchServe},
      {"max_rate", kBenchServe},
      {"cdf_svg", kBenchServe},
      {"openai_url", kBenchServe},
      // bench transfer.
      {"transfer_tokens", kBenchTransfer},
      {"repetitions", kBenchTransfer},
      // sim route (its --policy takes lists and "+pull"/"+tier" suffixes).
      {"policy", kSimRoute},
      {"prefill_sweep", kSimRoute},
      {"cache_tokens", kSimRoute},
      {"time_scale", kSimRoute},
      {"max_requests", kSimRoute},
      {"decision_replays", kSimRoute},
      {"pool_fraction", kSimRoute},
      {"tiers", kSimRoute},
      {"tier_multiple", kSimRoute},
      {"pull_from_tiers", kSimRoute},
      {"tier_refresh_on_hit", kSimRoute},
      {"pool_fractions", kSimRoute},
      {"tier_read_gbps", kSimRoute},
      {"kv_bytes_per_token", kSimRoute},
  };
  return *table;
}

bool CommandAccepts(const FlagSpec& spec, uint32_t command) {
  if ((spec.commands & command) != 0) return true;
  return command == kUp && spec.up != UpForward::kNone;
}

const FlagSpec* FindFlag(absl::string_view name, uint32_t command) {
  for (const FlagSpec& s : AllFlags()) {
    if (name == s.name && CommandAccepts(s, command)) return &s;
  }
  return nullptr;
}

namespace {

std::string Dashed(absl::string_view name) {
  return absl::StrReplaceAll(name, {{"_", "-"}});
}

// What --help shows after a flag's name: its choices, or the kind of value
// (nothing for a boolean).
std::string ValueName(const FlagSpec& s, const absl::CommandLineFlag& f) {
  if (!s.choices.empty()) return absl::StrJoin(s.choices, "|");
  if (f.IsOfType<bool>()) return "";
  if (f.IsOfType<int32_t>() || f.IsOfType<int64_t>() ||
      f.IsOfType<uint32_t>() || f.IsOfType<uint64_t>())
    return "N";
  if (f.IsOfType<double>() || f.IsOfType<float>()) return "X";
  return "VALUE";
}

// "  --kv-dtype fp32|bf16|...\n      KV cache dtype ... (default: fp32)\n"
std::string OneFlagHelp(const FlagSpec& s) {
  const absl::CommandLineFlag* f = absl::FindCommandLineFlag(s.name);
  if (f == nullptr) return absl::StrCat("  --", Dashed(s.name), "\n");
  const std::string value = ValueName(s, *f);
  const std::string def = f->DefaultValue();
  return absl::StrCat("  --", Dashed(s.name), value.empty() ? "" : " ", value,
                      "\n      ", f->Help(),
                      " (default: ", def.empty() ? "\"\"" : def, ")\n");
}

}  // namespace

std::string FlagHelp(uint32_t command) {
  std::string own, workers, router, all;
  std::set<std::string> seen;
  for (const FlagSpec& s : AllFlags()) {
    if (!CommandAccepts(s, command) || !seen.insert(s.name).second) continue;
    if (command != kUp) {
      own += OneFlagHelp(s);
      continue;
    }
    switch (s.up) {
      case UpForward::kNone:
        own += OneFlagHelp(s);
        break;
      case UpForward::kWorkers:
        workers += OneFlagHelp(s);
        break;
      case UpForward::kRouter:
        router += OneFlagHelp(s);
        break;
      case UpForward::kAll:
        all += OneFlagHelp(s);
        break;
    }
  }
  if (command != kUp) return absl::StrCat("flags:\n", own);
  return absl::StrCat("flags of up itself:\n", own,
                      "\nflags passed on to every worker and the router:\n",
                      all, "\nflags passed on to every worker:\n", workers,
                      "\nflags passed on to the router:\n", router);
}

absl::Status CheckCommandLineFlags(const std::string& command_name,
                                   uint32_t command,
                                   const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "--") break;  // the rest is positional
    if (a.rfind("--", 0) != 0) continue;
    std::string name = a.substr(2, a.find('=') - 2);
    if (const FlagSpec* s = FindFlag(name, command); s != nullptr) {
      GivenFlags().insert(s->name);
      continue;
    }
    // Abseil's --noNAME form of a boolean.
    if (name.rfind("no", 0) == 0) {
      const FlagSpec* s = FindFlag(name.substr(2), command);
      const absl::CommandLineFlag* f =
          s == nullptr ? nullptr : absl::FindCommandLineFlag(s->name);
      if (f != nullptr && f->IsOfType<bool>()) {
        GivenFlags().insert(s->name);
        continue;
      }
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "pdserve ", command_name, " does not take --", Dashed(name),
        " (pdserve ", command_name, " --help lists its flags)"));
  }
  return absl::OkStatus();
}

absl::Status CheckFlagValues(uint32_t command) {
  for (const FlagSpec& s : AllFlags()) {
    if (s.check == nullptr || !CommandAccepts(s, command)) continue;
    const std::string value = Current(s.name);
    if (absl::Status st = s.check(value); !st.ok()) {
      // "a, b or c", as the commands' own messages spell their choices.
      std::vector<const char*> head(s.choices.begin(), s.choices.end() - 1);
      return absl::InvalidArgumentError(
          absl::StrCat("--", Dashed(s.name), " must be ",
                       absl::StrJoin(head, ", "), head.empty() ? "" : " or ",
                       s.choices.back(), ", got \"", value, "\""));
    }
  }
  return absl::OkStatus();
}

int UpWorkerThreads(const std::string& role, int cores, int num_prefill,
                    int num_workers) {
  cores = std::max(cores, 1);
  num_workers = std::max(num_workers, 1);
  const int num_decode = num_workers - num_prefill;
  if (num_prefill <= 0 || num_decode <= 0)
    return std::max(1, cores / num_workers);
  const int decode = std::max(1, cores / (4 * num_decode));
  if (role == "prefill")
    return std::max(1, (cores - decode * num_decode) / num_prefill);
  return decode;
}

std::vector<std::string> UpChildArgs(const UpChild& child) {
  std::vector<std::string> args;
  std::set<std::string> seen;
  for (const FlagSpec& s : AllFlags()) {
    const bool to_router =
        s.up == UpForward::kRouter || s.up == UpForward::kAll;
    const bool to_workers =
        s.up == UpForward::kWorkers || s.up == UpForward::kAll;
    if (!(child.is_router ? to_router : to_workers)) continue;
    if (!seen.insert(s.name).second) continue;
    const std::optional<std::string> value =
        s.up_value != nullptr ? s.up_value(child)
                              : std::optional<std::string>(Current(s.name));
    if (!value) continue;
    args.push_back(absl::StrCat("--", Dashed(s.name), "=", *value));
  }
  return args;
}

void RegisterConfigInfo(metrics::Registry& registry, absl::string_view prefix,
                        uint32_t command) {
  auto* family = metrics::Must(registry.AddGauge(
      absl::StrCat(prefix, "_config_info"),
      "The value of each flag this process runs with (always 1)",
      {"flag", "value"}));
  std::set<std::string> seen;
  for (const FlagSpec& s : AllFlags()) {
    if ((s.commands & command) == 0 || !seen.insert(s.name).second) continue;
    const std::string value = Current(s.name);
    metrics::Must(family->WithLabels({s.name, value}))->Set(1);
  }
}

}  // namespace pdserve::cli
