#include "bench/engine_bench.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <span>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/json.h"
#include "common/status_macros.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/fma_peak.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/packed_gemm.h"
#include "kernels/cpu/step_profile.h"
#include "kernels/cpu/task_pool.h"
#include "kv_cache/kv_cache.h"
#include "model/llama_model.h"
#include "model/weights.h"

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

std::string ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  std::getline(in, text);
  return std::string(absl::StripAsciiWhitespace(text));
}

// FLOPs of the matrices for one token (2 per multiply-add), without the
// output matrix.
double LayerMatrixFlops(const engine::ModelConfig& c) {
  const double h = c.hidden_size, q = c.num_heads * c.head_dim,
               kv = c.num_kv_heads * c.head_dim, inter = c.intermediate_size;
  return 2.0 * c.num_layers * (h * (q + 2 * kv) + q * h + 3 * inter * h);
}
double OutputFlops(const engine::ModelConfig& c) {
  return 2.0 * c.vocab_size * c.hidden_size;
}
// Attention (QKᵀ and PV) of one query token over `context` tokens.
double AttentionFlops(const engine::ModelConfig& c, double context) {
  return 4.0 * c.num_layers * c.num_heads * c.head_dim * context;
}

// Logits of every position of `tokens`, prefilled in chunks of 256.
absl::StatusOr<std::vector<float>> AllLogits(
    std::shared_ptr<const engine::ModelWeights> w,
    const std::vector<int32_t>& tokens,
    kernels::MatMulMode mode = kernels::MatMulMode::kDeterministic) {
  const auto& c = w->config;
  const int64_t n = static_cast<int64_t>(tokens.size());
  const engine::KvCacheSpec spec = c.KvSpec(16, DType::kF32);
  ASSIGN_OR_RETURN(auto pool, engine::KvPool::Create(spec, (n + 15) / 16));
  std::vector<int32_t> table((n + 15) / 16);
  std::iota(table.begin(), table.end(), 0);
  engine::LlamaModel model(w, mode);
  std::vector<float> logits, chunk;
  for (int64_t p = 0; p < n; p += 256) {
    const int64_t len = std::min<int64_t>(256, n - p);
    engine::LlamaModel::SeqInput in{
        std::span<const int32_t>(tokens).subspan(p, len),
        static_cast<int32_t>(p), table, engine::LlamaModel::Logits::kAll};
    RETURN_IF_ERROR(model.Forward({&in, 1}, pool.get(), &chunk));
    logits.insert(logits.end(), chunk.begin(), chunk.end());
  }
  return logits;
}

// Means per step of `steps` profiled steps whose Engine::Step wall times add
// up to `step_ns`. "other" is the step time no phase covers (the engine loop
// between phases, output building, the backend call).
StepProfileFigure ProfileFigure(std::string name, const kernels::StepProfile& p,
                                int32_t steps, int64_t step_ns) {
  StepProfileFigure f;
  f.step = std::move(name);
  f.steps = steps;
  const double per = 1.0 / std::max(steps, 1);
  f.step_ms = step_ns * per / 1e6;
  int64_t covered = 0;
  for (int i = 0; i < kernels::kNumPhases; ++i) {
    if (p.calls[i] == 0) continue;
    covered += p.ns[i];
    f.phases.push_back({kernels::PhaseName(static_cast<kernels::Phase>(i)),
                        p.ns[i] * per / 1e6, 0, p.calls[i] * per});
  }
  f.phases.push_back({"other", (step_ns - covered) * per / 1e6, 0, 0});
  for (auto& ph : f.phases) ph.share = f.step_ms > 0 ? ph.ms / f.step_ms : 0;
  f.gemm_calls = p.gemm_calls * per;
  f.parallel_regions = p.parallel_regions * per;
  f.barriers = p.barriers * per;
  f.fork_ms = p.fork_ns * per / 1e6;
  f.join_ms = p.join_ns * per / 1e6;
  f.barrier_ms = p.barrier_ns * per / 1e6;
  f.pack_ms = p.pack_ns * per / 1e6;
  return f;
}

absl::StatusOr<std::vector<AccuracyFigure>> MeasureAccuracy(
    const std::string& dir, int32_t positions) {
  ASSIGN_OR_RETURN(engine::ModelWeights ref_loaded,
                   engine::ModelWeights::Load(dir, engine::WeightDtype::kF32));
  auto ref_w =
      std::make_shared<const engine::ModelWeights>(std::move(ref_loaded));
  const int64_t vocab = ref_w->config.vocab_size;
  const int32_t n = static_cast<int32_t>(
      std::min<int64_t>(positions, ref_w->config.max_position_embeddings));
  std::vector<int32_t> tokens(n);
  for (int32_t i = 0; i < n; ++i)
    tokens[i] = static_cast<int32_t>((uint64_t{2654435761u} * i + 12345) %
                                     static_cast<uint64_t>(vocab));
  std::fprintf(stderr, "[bench] accuracy: fp32 reference, %d positions...\n",
               n);
  ASSIGN_OR_RETURN(std::vector<float> ref, AllLogits(ref_w, tokens));
  ref_w.reset();
  std::vector<AccuracyFigure> out;
  // The last three are bf16 weights with --matmul bf16dot (bf16
  // activations), and int8-b32 and per-row int8 weights with --matmul
  // int8dot (int8 activations too).
  const std::pair<engine::WeightDtype, kernels::MatMulMode> variants[] = {
      {engine::WeightDtype::kBF16, kernels::MatMulMode::kDeterministic},
      {engine::WeightDtype::kF16, kernels::MatMulMode::kDeterministic},
      {engine::WeightDtype::kI8, kernels::MatMulMode::kDeterministic},
      {engine::WeightDtype::kI8B32, kernels::MatMulMode::kDeterministic},
      {engine::WeightDtype::kBF16, kernels::MatMulMode::kBf16Dot},
      {engine::WeightDtype::kI8B32, kernels::MatMulMode::kInt8Dot},
      {engine::WeightDtype::kI8, kernels::MatMulMode::kInt8Dot}};
  for (const auto& [d, mode] : variants) {
    const std::string name =
        absl::StrCat(engine::WeightDtypeName(d),
                     mode == kernels::MatMulMode::kInt8Dot   ? "/int8dot"
                     : mode == kernels::MatMulMode::kBf16Dot ? "/bf16dot"
                                                             : "");
    std::fprintf(stderr, "[bench] accuracy: %s...\n", name.c_str());
    ASSIGN_OR_RETURN(engine::ModelWeights loaded,
                     engine::ModelWeights::Load(dir, d, mode));
    auto w = std::make_shared<const engine::ModelWeights>(std::move(loaded));
    ASSIGN_OR_RETURN(std::vector<float> got, AllLogits(w, tokens, mode));
    AccuracyFigure f;
    f.dtype = name;
    f.positions = n;
    int32_t agree = 0;
    for (int32_t p = 0; p < n; ++p) {
      const float* r = ref.data() + int64_t{p} * vocab;
      const float* g = got.data() + int64_t{p} * vocab;
      double err = 0, mag = 0;
      for (int64_t j = 0; j < vocab; ++j) {
        err = std::max(err, std::fabs(double(r[j]) - g[j]));
        mag = std::max(mag, std::fabs(double(r[j])));
      }
      const double rel = mag > 0 ? err / mag : err;
      f.max_rel_error = std::max(f.max_rel_error, rel);
      f.mean_rel_error += rel / n;
      agree += std::max_element(r, r + vocab) - r ==
               std::max_element(g, g + vocab) - g;
    }
    f.top1_agreement = static_cast<double>(agree) / n;
    out.push_back(f);
  }
  return out;
}

}  // namespace

int64_t LastLevelCacheBytes(const std::string& sysfs_cpu0_cache) {
  int64_t best_level = 0, bytes = 0;
  std::error_code ec;
  for (const auto& entry :
       std::filesystem::directory_iterator(sysfs_cpu0_cache, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("index", 0) != 0) continue;
    int64_t level = 0;
    if (!absl::SimpleAtoi(ReadSmallFile(entry.path() / "level"), &level))
      continue;
    const std::string type = ReadSmallFile(entry.path() / "type");
    if (type == "Instruction") continue;
    std::string size = ReadSmallFile(entry.path() / "size");  // "300M", "2048K"
    int64_t factor = 1;
    if (!size.empty()) {
      const char unit = absl::ascii_toupper(size.back());
      if (unit == 'K') factor = 1024;
      if (unit == 'M') factor = 1024 * 1024;
      if (unit == 'G') factor = int64_t{1} << 30;
      if (factor > 1) size.pop_back();
    }
    int64_t value = 0;
    if (!absl::SimpleAtoi(size, &value)) continue;
    if (level > best_level) {
      best_level = level;
      bytes = value * factor;
    }
  }
  return bytes;
}

absl::Status EngineBenchConfig::Validate() const {
  if (model_dir.empty())
    return absl::InvalidArgumentError("--model is required");
  if (prefill_tokens < 1 || decode_context < 1 || decode_steps < 1 ||
      batch_sizes.empty()) {
    return absl::InvalidArgumentError("benchmark sizes must be positive");
  }
  return engine.Validate();
}

const char* ColdName(EngineBenchConfig::Cold cold) {
  return cold == EngineBenchConfig::Cold::kAll ? "all" : "weights-kv";
}

std::optional<EngineBenchConfig::Cold> ParseCold(std::string_view name) {
  if (name == "all") return EngineBenchConfig::Cold::kAll;
  if (name == "weights-kv") return EngineBenchConfig::Cold::kWeightsKv;
  return std::nullopt;
}

void FlushFromCaches(const void* p, size_t bytes) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  for (uintptr_t line = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
       line < end; line += 64) {
    _mm_clflush(reinterpret_cast<const void*>(line));
  }
}

namespace {

// The matrices a dense decode step streams, in the order it reads them.
std::vector<const kernels::WeightMatrix*> StepMatrices(
    const engine::ModelWeights& weights) {
  std::vector<const kernels::WeightMatrix*> order;
  for (const engine::LayerWeights& l : weights.layers) {
    for (const kernels::WeightMatrix* m :
         {&l.qkv, &l.o_proj, &l.gate_up, &l.down}) {
      order.push_back(m);
    }
  }
  order.push_back(&weights.output_matrix());
  return order;
}

void FlushMatrices(std::span<const kernels::WeightMatrix* const> matrices) {
  for (const kernels::WeightMatrix* m : matrices) {
    if (!m->empty())
      FlushFromCaches(m->data(), static_cast<size_t>(m->bytes()));
  }
}

// Every matrix a decode step streams, and every block of the engine's host
// KV cache that a sequence holds, out of the caches. (Flushing the whole
// pool instead walks every page of it, and the step then starts with its
// TLB and page-walk caches refilled with the pool's pages.)
void FlushWeightsAndKv(const engine::ModelWeights& weights,
                       engine::Engine& eng) {
  FlushMatrices(StepMatrices(weights));
  engine::KvStorage& kv = eng.kv_storage();
  if (kv.memory().kind == engine::MemoryKind::kHost) {
    for (int32_t layer = 0; layer < kv.spec().num_layers; ++layer) {
      for (int64_t b = 0; b < kv.num_blocks(); ++b) {
        if (eng.block_manager().RefCount(static_cast<int32_t>(b)) == 0)
          continue;
        const engine::KvSpan span = kv.Span(layer, b);
        FlushFromCaches(span.data, span.data_bytes);
        if (span.scales != nullptr)
          FlushFromCaches(span.scales, span.scale_bytes);
      }
    }
  }
  _mm_mfence();
}

// The four 16-byte words of a 64-byte line, combined with XOR.
__m128i XorOfLine(const char* line) {
  const auto* w = reinterpret_cast<const __m128i*>(line);
  return _mm_xor_si128(
      _mm_xor_si128(_mm_loadu_si128(w), _mm_loadu_si128(w + 1)),
      _mm_xor_si128(_mm_loadu_si128(w + 2), _mm_loadu_si128(w + 3)));
}

// Reads every matrix a decode step streams, in step order, from flushed
// caches, with a join after each one (as the step's GEMMs wait for their
// inputs): each of `threads` threads reads one contiguous share of the
// matrix in eight streams, prefetching 1 KiB ahead in each. No arithmetic,
// no attention: the rate a batch-1 step's weight stream is compared with.
// Adds the whole 64-byte lines read to *bytes and returns the seconds.
double TimeJoinedWeightRead(const engine::ModelWeights& weights, int threads,
                            double* bytes) {
  const std::vector<const kernels::WeightMatrix*> order = StepMatrices(weights);
  FlushMatrices(order);
  _mm_mfence();
  kernels::WakeKernelHelpers(threads);
  std::vector<int64_t> sinks(static_cast<size_t>(threads) * 8, 0);
  const auto t0 = std::chrono::steady_clock::now();
  for (const kernels::WeightMatrix* m : order) {
    if (m->empty()) continue;
    const auto* base = reinterpret_cast<const char*>(m->data());
    const int64_t lines = m->bytes() / 64;
    *bytes += static_cast<double>(lines) * 64;
    kernels::RunChunks(threads, 1, threads, [&](int64_t t, int64_t, bool) {
      const int64_t begin = lines * t / threads,
                    end = lines * (t + 1) / threads;
      // Eight streams at once, as a batch-1 GEMM tile reads eight panels.
      constexpr int kStreams = 8;
      const int64_t per = (end - begin) / kStreams;
      __m128i acc = _mm_setzero_si128();
      for (int64_t i = 0; i < per; ++i) {
        for (int k = 0; k < kStreams; ++k) {
          const char* line = base + (begin + k * per + i) * 64;
          _mm_prefetch(line + 1024, _MM_HINT_T0);
          acc = _mm_xor_si128(acc, XorOfLine(line));
        }
      }
      for (int64_t i = begin + kStreams * per; i < end; ++i) {
        acc = _mm_xor_si128(acc, XorOfLine(base + i * 64));
      }
      // One slot per thread, 64 bytes apart: the result is kept, so the
      // loads stay, and no two threads write one line.
      sinks[static_cast<size_t>(t) * 8] ^= _mm_cvtsi128_si64(acc);
    });
  }
  const double secs = Seconds(t0);
  volatile int64_t keep =
      std::accumulate(sinks.begin(), sinks.end(), int64_t{0});
  (void)keep;
  return secs;
}

// Writes every page of the engine's host KV pool once (zeros over zeros).
// The pool's pages are backed on first write (kv_cache.h), so a fresh
// engine's first pass through its blocks also pays the page faults; a
// serving worker pays them once over its life, and the figures here are of
// the steps after that.
void TouchHostKv(engine::Engine& eng) {
  engine::KvStorage& kv = eng.kv_storage();
  if (kv.memory().kind != engine::MemoryKind::kHost) return;
  for (int32_t layer = 0; layer < kv.spec().num_layers; ++layer) {
    for (int64_t b = 0; b < kv.num_blocks(); ++b) {
      const engine::KvSpan span = kv.Span(layer, b);
      std::memset(span.data, 0, span.data_bytes);
      if (span.scales != nullptr) std::memset(span.scales, 0, span.scale_bytes);
    }
  }
}

}  // namespace

TriadArrays::TriadArrays(int64_t bytes)
    : n_(std::max<int64_t>(bytes / 12, 1 << 16)),
      a_(new float[n_]),
      b_(new float[n_]),
      c_(new float[n_]) {
  float* a = a_.get();
  float* b = b_.get();
  float* c = c_.get();
  const int64_t n = n_;
  const int threads = std::max(1, kernels::KernelThreads());
  // Each thread first touches the part it measures.
  kernels::RunOnOwnThreads(threads, [&](int t) {
    for (int64_t i = n * t / threads; i < n * (t + 1) / threads; ++i) {
      a[i] = 0;
      b[i] = 1;
      c[i] = 2;
    }
  });
}

double TriadArrays::Measure(int passes) {
  float* a = a_.get();
  const float* b = b_.get();
  const float* c = c_.get();
  const int64_t n = n_;
  const int threads = std::max(1, kernels::KernelThreads());
  double best = 1e30;
  for (int pass = 0; pass < passes; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    const float s = 0.5f + pass;
    // Threads started for the pass, not an OpenMP team: nothing is left
    // polling for work when the timed step after the triad starts.
    kernels::RunOnOwnThreads(threads, [&](int t) {
      const int64_t end = n * (t + 1) / threads;
      for (int64_t i = n * t / threads; i < end; ++i) a[i] = b[i] + s * c[i];
    });
    best = std::min(best, Seconds(t0));
  }
  volatile float sink = a[n / 2];
  (void)sink;
  return 3.0 * 4.0 * static_cast<double>(n) / best / 1e9;
}

absl::StatusOr<EngineBenchResult> RunEngineBench(
    const EngineBenchConfig& config) {
  RETURN_IF_ERROR(config.Validate());
  EngineBenchResult result;
  {
    std::ifstream in("/proc/loadavg");
    in >> result.load_average_1m;
  }
  ASSIGN_OR_RETURN(
      engine::ModelWeights loaded,
      engine::ModelWeights::Load(config.model_dir, config.engine.weight_dtype,
                                 config.engine.matmul));
  auto weights =
      std::make_shared<const engine::ModelWeights>(std::move(loaded));
  const engine::ModelConfig& mc = weights->config;
  const bool cold_weights_kv =
      config.cold == EngineBenchConfig::Cold::kWeightsKv;
  if (cold_weights_kv) {
    bool dense = !mc.IsMla();
    for (int64_t l = 0; l < mc.num_layers; ++l)
      dense = dense && !mc.IsMoeLayer(l);
    if (!dense) {
      return absl::InvalidArgumentError(
          "--cold weights-kv flushes dense layers' matrices only; this model "
          "has MLA or MoE layers (use --cold all)");
    }
  }
  result.weight_dtype = weights->StorageName();
  const bool bf16dot = config.engine.matmul == kernels::MatMulMode::kBf16Dot &&
                       kernels::DetectCpuFeatures().avx512bf16;
  const bool int8dot = config.engine.matmul == kernels::MatMulMode::kInt8Dot &&
                       kernels::Int8DotUsesVnni();
  // Per-row int8 weights on the AVX2 path of a CPU with AVX-VNNI, or
  // without it.
  const bool int8dot_avxvnni =
      config.engine.matmul == kernels::MatMulMode::kInt8Dot &&
      kernels::Int8DotKernelFor(1) == kernels::Int8DotKernel::kAvxVnni;
  const bool int8dot_avx2 =
      config.engine.matmul == kernels::MatMulMode::kInt8Dot &&
      kernels::Int8DotKernelFor(1) == kernels::Int8DotKernel::kAvx2;
  // int8dot takes AMX-INT8 from Int8DotAmxMinRows() rows on (batched decode
  // and prefill), VNNI below.
  const bool amx = int8dot && kernels::Int8DotAmxUsable() &&
                   kernels::Int8DotAmxMinRows() > 0;
  result.gemm_path =
      config.engine.matmul == kernels::MatMulMode::kBlas
          ? "blas"
          : absl::StrCat(
                kernels::GemmIsaName(kernels::ActiveGemmIsa()),
                bf16dot           ? "-bf16dot"
                : amx             ? absl::StrCat("-int8dot-amx(m>=",
                                                 kernels::Int8DotAmxMinRows(), ")-vnni")
                : int8dot         ? "-int8dot-vnni"
                : int8dot_avxvnni ? "-int8dot-avxvnni"
                : int8dot_avx2    ? "-int8dot-avx2"
                                  : "");
  result.int8dot_amx_min_rows = amx ? kernels::Int8DotAmxMinRows() : 0;
  result.cpu_features = kernels::DetectCpuFeatures().ToString();
  result.threads = kernels::KernelThreads();
  result.cold = ColdName(config.cold);
  result.weight_bytes = weights->ParameterBytes();
  result.llc_bytes = LastLevelCacheBytes();
  result.stream_bytes =
      config.stream_bytes > 0
          ? config.stream_bytes
          : std::max<int64_t>(4 * result.llc_bytes, int64_t{1} << 30);
  std::fprintf(stderr, "[bench] STREAM triad over %lld MiB (LLC %lld MiB)...\n",
               static_cast<long long>(result.stream_bytes >> 20),
               static_cast<long long>(result.llc_bytes >> 20));
  TriadArrays triad(result.stream_bytes);
  result.stream_gb_per_s = triad.Measure(6);
  // The peak of the path the matrices run on (blas: the best vector ISA).
  // (--matmul bf16dot: the VDPBF16PS peak; int8dot: VPDPBUSD's, in G int8
  // ops/s, against which a GEMM's multiply-adds count 2 as for fp32.)
  // With AMX: TDPBSSD's peak (full 64-byte k per instruction), which is
  // what prefill and the batches that take AMX are divided by; the VNNI peak
  // and TDPBSSD's at one block (32 k) per instruction, as the kernel issues
  // it, are reported beside it. int8dot on AVX-VNNI: its 256-bit VPDPBUSD's;
  // on AVX2 without it: the kernel's four-instruction sequence's.
  const kernels::GemmIsa peak_isa = kernels::ActiveGemmIsa();
  auto measure_peak = [&](double seconds) {
    return bf16dot ? kernels::MeasureBf16DotPeakGflops(result.threads, seconds)
           : amx   ? kernels::MeasureAmxInt8PeakGops(result.threads, seconds)
           : int8dot ? kernels::MeasureInt8DotPeakGops(result.threads, seconds)
           : int8dot_avxvnni
               ? kernels::MeasureAvxVnniPeakGops(result.threads, seconds)
           : int8dot_avx2
               ? kernels::MeasureAvx2DotPeakGops(result.threads, seconds)
               : kernels::MeasureFmaPeakGflops(peak_isa, result.threads,
                                               seconds);
  };
  result.fma_peak_gflops = measure_peak(0.3);
  std::fprintf(stderr, "[bench] %s peak %.1f G(FL)OP/s on %d threads\n",
               result.gemm_path.c_str(), result.fma_peak_gflops,
               result.threads);
  if (int8dot) {
    result.int8dot_vnni_peak_gops =
        kernels::MeasureInt8DotPeakGops(result.threads, 0.3);
    if (amx) {
      result.amx_int8_block_peak_gops =
          kernels::MeasureAmxInt8PeakGops(result.threads, 0.3, 32);
    }
    std::fprintf(stderr,
                 "[bench] int8dot: VPDPBUSD peak %.1f G ops/s, TDPBSSD at 32 "
                 "k per instruction %.1f G ops/s\n",
                 result.int8dot_vnni_peak_gops,
                 result.amx_int8_block_peak_gops);
  }

  // Prefill: one long prompt in one step (budget = prompt length), best of 3.
  {
    engine::EngineConfig ec = config.engine;
    ec.max_num_batched_tokens =
        std::max(ec.max_num_batched_tokens, config.prefill_tokens);
    ec.enable_prefix_caching = false;
    ASSIGN_OR_RETURN(auto eng, engine::Engine::Create(weights, ec));
    TouchHostKv(*eng);
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
    if (config.profile) {
      // Three more prefills with the timers on (each request: one prefill
      // step, then its one decode token's step, which is not counted).
      kernels::StepProfile prof;
      int64_t step_ns = 0;
      for (int rep = 0; rep < 3; ++rep) {
        RETURN_IF_ERROR(eng->AddRequest(Request(
            absl::StrCat("pp", rep), config.prefill_tokens, rep + 3, 1)));
        {
          kernels::ProfileCollector collect(&prof);
          const int64_t t0 = kernels::ProfileNowNs();
          RETURN_IF_ERROR(eng->Step().status());
          step_ns += kernels::ProfileNowNs() - t0;
        }
        while (eng->HasWork()) RETURN_IF_ERROR(eng->Step().status());
      }
      result.profile.push_back(ProfileFigure(
          absl::StrCat("prefill ", config.prefill_tokens), prof, 3, step_ns));
    }
    const double p = config.prefill_tokens;
    const double flops = p * LayerMatrixFlops(mc) + OutputFlops(mc) +
                         AttentionFlops(mc, (p + 1) / 2) * p;
    const double peak_after = measure_peak(0.3);
    result.fma_peak_gflops = std::max(result.fma_peak_gflops, peak_after);
    result.prefill_tokens = config.prefill_tokens;
    result.prefill_tokens_per_s = p / best;
    result.prefill_gflops = flops / best / 1e9;
    result.prefill_fma_peak_fraction =
        result.fma_peak_gflops > 0
            ? result.prefill_gflops / result.fma_peak_gflops
            : 0;
  }

  const int64_t bytes_per_token = [&] {
    return mc.KvSpec(config.engine.block_size, config.engine.kv_dtype)
        .BytesPerToken();
  }();
  // Decode: one engine per batch size, all warmed up first; then the timed
  // steps go round-robin over the batch sizes, each round starting with a
  // short triad and FMA-peak measurement. On a shared machine the load moves
  // during a run; interleaving puts every batch size and both limits under
  // the same conditions, so their ratios stay meaningful.
  struct Running {
    int32_t batch;
    std::unique_ptr<engine::Engine> eng;
    double secs = 0;
  };
  // Steps per decode round: with weights-kv an untimed one first.
  const int32_t round_steps = cold_weights_kv ? 2 : 1;
  // Before the timed step of `r`: the caches as config.cold says (the triad
  // has just evicted every one), and the kernel helpers awake. Between
  // back-to-back steps they poll for the next kernel; after the triad or
  // the flush they have slept, and the step's first kernels would run
  // before they wake (measured on `small`: 30 us of a 1 ms step).
  auto prepare = [&](Running& r) -> absl::Status {
    if (cold_weights_kv) {
      RETURN_IF_ERROR(r.eng->Step().status());
      FlushWeightsAndKv(*weights, *r.eng);
    }
    kernels::WakeKernelHelpers(kernels::KernelThreads());
    return absl::OkStatus();
  };
  std::vector<Running> running;
  for (int32_t batch : config.batch_sizes) {
    engine::EngineConfig ec = config.engine;
    ec.max_num_seqs = std::max(ec.max_num_seqs, batch);
    ec.max_num_batched_tokens =
        std::max(ec.max_num_batched_tokens, batch * config.decode_context);
    ASSIGN_OR_RETURN(auto eng, engine::Engine::Create(weights, ec));
    TouchHostKv(*eng);
    std::fprintf(stderr, "[bench] decode batch %d: warm-up...\n", batch);
    for (int32_t i = 0; i < batch; ++i) {
      // --profile runs decode_steps more steps after the timed ones.
      RETURN_IF_ERROR(eng->AddRequest(Request(
          absl::StrCat("d", i), config.decode_context, i,
          config.decode_steps * round_steps * (config.profile ? 2 : 1) + 8)));
    }
    // Warm up: prefill everything and run a few decode steps.
    for (int i = 0; i < 4; ++i) RETURN_IF_ERROR(eng->Step().status());
    if (eng->Stats().num_running != batch || eng->Stats().num_waiting != 0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "batch ", batch,
          " does not fit in the KV cache; raise --kv-cache-memory"));
    }
    running.push_back({batch, std::move(eng)});
  }
  double triad_sum = 0, peak_sum = 0, vnni_peak_sum = 0, read_secs = 0,
         read_bytes = 0;
  for (int32_t s = 0; s < config.decode_steps; ++s) {
    std::fprintf(stderr, "[bench] decode round %d/%d\n", s + 1,
                 config.decode_steps);
    // The peaks first, then the triad, so that every timed step follows the
    // triad (caches evicted, as in the profiled rounds below) rather than a
    // burst of FMAs on every core.
    peak_sum += measure_peak(0.15);
    // Batches below the AMX threshold run on VNNI: their own peak too.
    if (amx) {
      vnni_peak_sum += kernels::MeasureInt8DotPeakGops(result.threads, 0.15);
    }
    triad_sum += triad.Measure(3);
    read_secs += TimeJoinedWeightRead(*weights, result.threads, &read_bytes);
    for (Running& r : running) {
      RETURN_IF_ERROR(prepare(r));
      const auto t0 = std::chrono::steady_clock::now();
      RETURN_IF_ERROR(r.eng->Step().status());
      r.secs += Seconds(t0);
    }
  }
  if (config.profile) {
    // The same rounds again (a triad, which also evicts the caches as in the
    // timed rounds, then the caches as --cold says and one step of each batch
    // size), with the timers on.
    std::vector<kernels::StepProfile> profs(running.size());
    std::vector<int64_t> step_ns(running.size(), 0);
    for (int32_t s = 0; s < config.decode_steps; ++s) {
      std::fprintf(stderr, "[bench] profiled decode round %d/%d\n", s + 1,
                   config.decode_steps);
      triad.Measure(3);
      for (size_t i = 0; i < running.size(); ++i) {
        RETURN_IF_ERROR(prepare(running[i]));
        kernels::ProfileCollector collect(&profs[i]);
        const int64_t t0 = kernels::ProfileNowNs();
        RETURN_IF_ERROR(running[i].eng->Step().status());
        step_ns[i] += kernels::ProfileNowNs() - t0;
      }
    }
    for (size_t i = 0; i < running.size(); ++i) {
      StepProfileFigure f =
          ProfileFigure(absl::StrCat("decode batch ", running[i].batch),
                        profs[i], config.decode_steps, step_ns[i]);
      f.unprofiled_step_ms = running[i].secs / config.decode_steps * 1e3;
      result.profile.push_back(std::move(f));
    }
  }
  // Every timed step decoded the whole batch: no request ran out of tokens.
  for (const Running& r : running) {
    if (r.eng->Stats().num_running != r.batch) {
      return absl::InternalError(absl::StrCat(
          "decode batch ", r.batch, ": ", r.eng->Stats().num_running,
          " sequences left after the timed steps; the figures would count "
          "steps of a smaller batch"));
    }
  }
  result.decode_stream_gb_per_s = triad_sum / config.decode_steps;
  result.decode_weight_read_gb_per_s = read_bytes / read_secs / 1e9;
  result.decode_fma_peak_gflops = peak_sum / config.decode_steps;
  result.decode_int8dot_vnni_peak_gops = vnni_peak_sum / config.decode_steps;
  for (Running& r : running) {
    const double secs = r.secs;
    const int32_t batch = r.batch;
    DecodeFigure f;
    f.batch = batch;
    f.step_ms = secs / config.decode_steps * 1e3;
    f.tokens_per_s = static_cast<double>(batch) * config.decode_steps / secs;
    // Each step reads every weight once plus each sequence's KV so far
    // (average context over the timed window).
    const double avg_ctx =
        config.decode_context + 3 + round_steps * config.decode_steps / 2.0;
    f.bytes_per_step = static_cast<double>(result.weight_bytes) +
                       batch * avg_ctx * bytes_per_token;
    f.roofline_ratio = f.bytes_per_step / (secs / config.decode_steps) /
                       (result.decode_stream_gb_per_s * 1e9);
    f.weight_read_ratio = f.bytes_per_step / (secs / config.decode_steps) /
                          (result.decode_weight_read_gb_per_s * 1e9);
    f.flops_per_step = batch * (LayerMatrixFlops(mc) + OutputFlops(mc) +
                                AttentionFlops(mc, avg_ctx + 1));
    f.gflops = f.flops_per_step / (secs / config.decode_steps) / 1e9;
    const double peak = amx && batch < result.int8dot_amx_min_rows
                            ? result.decode_int8dot_vnni_peak_gops
                            : result.decode_fma_peak_gflops;
    f.fma_peak_fraction = peak > 0 ? f.gflops / peak : 0;
    result.decode.push_back(f);
  }
  running.clear();
  // Prefill's peak: the higher of the measurements taken before and after
  // it (the more conservative fraction).
  for (const DecodeFigure& one : result.decode) {
    if (one.batch != 1) continue;
    for (DecodeFigure& d : result.decode)
      d.speedup_vs_batch1 = d.tokens_per_s / one.tokens_per_s;
  }
  if (config.accuracy_positions > 0) {
    weights.reset();
    ASSIGN_OR_RETURN(
        result.accuracy,
        MeasureAccuracy(config.model_dir, config.accuracy_positions));
  }
  return result;
}

std::string EngineBenchResult::ToJson() const {
  json::OrderedValue out;
  out["weight_dtype"] = weight_dtype;
  out["gemm_path"] = gemm_path;
  out["cpu_features"] = cpu_features;
  out["threads"] = threads;
  out["cold"] = cold;
  out["load_average_1m"] = load_average_1m;
  out["llc_bytes"] = llc_bytes;
  out["stream_bytes"] = stream_bytes;
  out["stream_triad_gb_per_s"] = stream_gb_per_s;
  out["fma_peak_gflops"] = fma_peak_gflops;
  out["int8dot_amx_min_rows"] = int8dot_amx_min_rows;
  out["int8dot_vnni_peak_gops"] = int8dot_vnni_peak_gops;
  out["amx_int8_block_peak_gops"] = amx_int8_block_peak_gops;
  out["weight_bytes"] = weight_bytes;
  out["prefill_tokens"] = prefill_tokens;
  out["prefill_tokens_per_s"] = prefill_tokens_per_s;
  out["prefill_gflops"] = prefill_gflops;
  out["prefill_fma_peak_fraction"] = prefill_fma_peak_fraction;
  out["decode_stream_triad_gb_per_s"] = decode_stream_gb_per_s;
  out["decode_weight_read_gb_per_s"] = decode_weight_read_gb_per_s;
  out["decode_fma_peak_gflops"] = decode_fma_peak_gflops;
  out["decode_int8dot_vnni_peak_gops"] = decode_int8dot_vnni_peak_gops;
  out["decode"] = json::OrderedValue::array();
  for (const auto& d : decode) {
    json::OrderedValue v;
    v["batch"] = d.batch;
    v["tokens_per_s"] = d.tokens_per_s;
    v["step_ms"] = d.step_ms;
    v["bytes_per_step"] = d.bytes_per_step;
    v["roofline_ratio"] = d.roofline_ratio;
    v["weight_read_ratio"] = d.weight_read_ratio;
    v["flops_per_step"] = d.flops_per_step;
    v["gflops"] = d.gflops;
    v["fma_peak_fraction"] = d.fma_peak_fraction;
    v["speedup_vs_batch1"] = d.speedup_vs_batch1;
    out["decode"].push_back(std::move(v));
  }
  out["accuracy"] = json::OrderedValue::array();
  for (const auto& a : accuracy) {
    json::OrderedValue v;
    v["dtype"] = a.dtype;
    v["positions"] = a.positions;
    v["max_rel_error"] = a.max_rel_error;
    v["mean_rel_error"] = a.mean_rel_error;
    v["top1_agreement"] = a.top1_agreement;
    out["accuracy"].push_back(std::move(v));
  }
  out["profile"] = json::OrderedValue::array();
  for (const auto& p : profile) {
    json::OrderedValue v;
    v["step"] = p.step;
    v["steps"] = p.steps;
    v["step_ms"] = p.step_ms;
    v["unprofiled_step_ms"] = p.unprofiled_step_ms;
    v["phases"] = json::OrderedValue::array();
    for (const auto& ph : p.phases) {
      json::OrderedValue e;
      e["name"] = ph.name;
      e["ms"] = ph.ms;
      e["share"] = ph.share;
      e["calls"] = ph.calls;
      v["phases"].push_back(std::move(e));
    }
    v["gemm_calls"] = p.gemm_calls;
    v["parallel_regions"] = p.parallel_regions;
    v["barriers"] = p.barriers;
    v["fork_ms"] = p.fork_ms;
    v["join_ms"] = p.join_ms;
    v["barrier_ms"] = p.barrier_ms;
    v["pack_ms"] = p.pack_ms;
    out["profile"].push_back(std::move(v));
  }
  return json::Dump(out);
}

std::string EngineBenchResult::ToTable() const {
  std::string out = absl::StrFormat(
      "weights                : %s, %.1f MB read per step\n"
      "GEMM path              : %s on %d threads (cpu: %s)\n"
      "load average (1 min)   : %.2f\n"
      "STREAM triad           : %8.2f GB/s over %lld MiB (LLC %lld MiB)\n"
      "peak of the path       : %8.1f G(FL)OP/s\n"
      "prefill (%d tokens)    : %8.1f tokens/s, %.1f GFLOP/s = %.2f of peak\n"
      "decode rounds          : triad %.2f GB/s, FMA peak %.1f GFLOP/s "
      "(means); cold before each timed step: %s\n"
      "weight read            : %8.2f GB/s = %.2f of the triad (the step's "
      "weights alone, a join after each matrix; mean of the rounds)\n\n"
      "%6s %10s %10s %10s %9s %8s %9s %9s %8s\n",
      weight_dtype, weight_bytes / 1e6, gemm_path, threads, cpu_features,
      load_average_1m, stream_gb_per_s,
      static_cast<long long>(stream_bytes >> 20),
      static_cast<long long>(llc_bytes >> 20), fma_peak_gflops, prefill_tokens,
      prefill_tokens_per_s, prefill_gflops, prefill_fma_peak_fraction,
      decode_stream_gb_per_s, decode_fma_peak_gflops, cold,
      decode_weight_read_gb_per_s,
      decode_stream_gb_per_s > 0
          ? decode_weight_read_gb_per_s / decode_stream_gb_per_s
          : 0,
      "batch", "tokens/s", "step ms", "GB/s", "roofline", "of read", "GFLOP/s",
      "of peak", "x b=1");
  for (const auto& d : decode) {
    absl::StrAppendFormat(
        &out, "%6d %10.2f %10.2f %10.2f %9.2f %8.2f %9.1f %9.2f %8.2f\n",
        d.batch, d.tokens_per_s, d.step_ms,
        d.bytes_per_step / (d.step_ms / 1e3) / 1e9, d.roofline_ratio,
        d.weight_read_ratio, d.gflops, d.fma_peak_fraction,
        d.speedup_vs_batch1);
  }
  if (int8dot_vnni_peak_gops > 0) {
    absl::StrAppendFormat(
        &out,
        "\nint8dot: AMX-INT8 from batch %d on (0: not used); VPDPBUSD peak "
        "%.1f G ops/s, TDPBSSD at 32 k per instruction %.1f G ops/s\n",
        int8dot_amx_min_rows, int8dot_vnni_peak_gops, amx_int8_block_peak_gops);
  }
  for (const auto& p : profile) {
    absl::StrAppendFormat(&out, "\nprofile: %s, %d steps, %.3f ms/step", p.step,
                          p.steps, p.step_ms);
    if (p.unprofiled_step_ms > 0) {
      absl::StrAppendFormat(&out, " (unprofiled %.3f)", p.unprofiled_step_ms);
    }
    absl::StrAppendFormat(&out, "\n  %-16s %10s %7s %8s\n", "phase", "ms/step",
                          "share", "calls");
    for (const auto& ph : p.phases) {
      absl::StrAppendFormat(&out, "  %-16s %10.4f %6.1f%% %8.1f\n", ph.name,
                            ph.ms, 100 * ph.share, ph.calls);
    }
    absl::StrAppendFormat(
        &out,
        "  GEMMs: %.1f calls, %.1f parallel regions, %.1f k-block barriers "
        "per step; of their time (calling thread): fork %.4f ms, join %.4f "
        "ms, barriers %.4f ms, activation packing %.4f ms\n",
        p.gemm_calls, p.parallel_regions, p.barriers, p.fork_ms, p.join_ms,
        p.barrier_ms, p.pack_ms);
  }
  if (!accuracy.empty()) {
    absl::StrAppendFormat(&out, "\n%6s %10s %14s %14s %8s\n", "dtype",
                          "positions", "max rel err", "mean rel err", "top-1");
    for (const auto& a : accuracy) {
      absl::StrAppendFormat(&out, "%6s %10d %14.3g %14.3g %8.4f\n", a.dtype,
                            a.positions, a.max_rel_error, a.mean_rel_error,
                            a.top1_agreement);
    }
  }
  return out;
}

}  // namespace pdserve::bench
