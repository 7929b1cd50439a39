// The table of subcommands and their help texts.
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/engine_bench.h"
#include "cli/command.h"
#include "cli/flags.h"

ABSL_FLAG(std::string, batch_sizes, "1,8,32", "bench engine: decode batch sizes");
ABSL_FLAG(int32_t, prefill_tokens, 512, "bench engine: prompt length for the prefill figure");
ABSL_FLAG(int32_t, decode_steps, 32, "bench engine: timed decode steps per batch size");

namespace pdserve::cli {
namespace {

constexpr char kEngineFlags[] =
    "engine flags:\n"
    "  --kv-dtype fp32|bf16|fp16|int8   KV cache dtype (default fp32)\n"
    "  --block-size N                   tokens per KV block (default 16)\n"
    "  --kv-cache-memory BYTES          KV cache budget, e.g. 512MiB (default 256MiB)\n"
    "  --max-num-seqs N                 running sequences per step (default 64)\n"
    "  --max-num-batched-tokens N       token budget per step (default 512)\n"
    "  --max-model-len N                prompt + output limit (default: model's)\n"
    "  --enable-prefix-caching=false    disable prefix-cache reuse\n"
    "  --matmul deterministic|blas      linear kernels (default deterministic: batch-invariant)\n"
    "  --threads N                      kernel threads (default: all cores)\n";

}  // namespace

int ReportError(const absl::Status& status) {
  std::fprintf(stderr, "pdserve: error: %s\n", std::string(status.message()).c_str());
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
  config.batch_sizes.clear();
  for (absl::string_view p : absl::StrSplit(absl::GetFlag(FLAGS_batch_sizes), ',', absl::SkipWhitespace())) {
    int32_t b;
    if (!absl::SimpleAtoi(p, &b) || b < 1) {
      return ReportError(absl::InvalidArgumentError("--batch-sizes must list positive integers"));
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

const std::vector<Command>& AllCommands() {
  static const std::vector<Command> commands = {
      {"model init", "write a deterministic random-weight model (Hugging Face layout)",
       "model init --preset tiny|small --out DIR [--seed N] [--dtype fp32|fp16|bf16]\n\n"
       "Writes config.json, model.safetensors and a byte-level tokenizer (256 byte\n"
       "tokens + BOS/EOS). The same preset and seed always give the same files.\n",
       RunModelInit},
      {"model logits", "print the logits of a token sequence as JSON",
       "model logits --model DIR --tokens 1,2,3 [--all-positions] [--threads N]\n\n"
       "Prints {\"logits\": [...]} for the last position, or one list per position\n"
       "with --all-positions. fp32 KV cache: this is the accuracy reference path.\n",
       RunModelLogits},
      {"generate", "generate text in-process (the reference path)",
       "generate --model DIR --prompt TEXT [--max-tokens N] [--temperature T] [--top-p P]\n"
       "         [--top-k K] [--seed S] [--stop STR]... [--ignore-eos] [--cache-salt S] [--json]\n"
       "         [engine flags]\n\n"
       "Streams exactly the generated text to stdout; --json prints token ids, text,\n"
       "finish reason and usage instead.\n\n" + std::string(kEngineFlags),
       RunGenerate},
      {"kv-budget", "KV cache size arithmetic as JSON",
       "kv-budget --layers L --kv-heads H --head-dim D [--dtype fp16] [--tokens T]\n"
       "          [--block-size 16] [--memory BYTES]\n\n"
       "bytes_per_token = 2 x layers x kv_heads x head_dim x dtype bytes. With --tokens,\n"
       "the bytes and blocks for T tokens; with --memory, the blocks and tokens that fit\n"
       "(int8 blocks include their fp32 per-(block, head) scales).\n",
       RunKvBudget},
      {"bench engine", "prefill/decode throughput and the decode roofline ratio",
       "bench engine --model DIR [--batch-sizes 1,8,32] [--prefill-tokens 512]\n"
       "             [--decode-steps 32] [--json] [engine flags]\n\n"
       "Reports prefill tokens/s, decode tokens/s per batch size, and the decode\n"
       "roofline ratio: bytes a step must read (weights + KV) per second divided by\n"
       "the STREAM-triad bandwidth measured in the same run.\n\n" + std::string(kEngineFlags),
       RunBenchEngine},
  };
  return commands;
}

}  // namespace pdserve::cli
