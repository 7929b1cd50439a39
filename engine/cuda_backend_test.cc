// The CUDA backend against the CPU backend on the `tiny` preset: with
// gpu_reference_math (fp32 GEMMs, fp32 attention) a batch of greedy
// generations, prefilled in chunks after a cached prefix and then decoded
// together, yields the CPU's tokens exactly. With the serving math (bf16
// GEMMs and KV, tensor-core prefill) the logits stay within 5% of their
// range. Needs a CUDA device; skips with the reason when none is found.
#include "engine/cuda_backend.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/engine.h"
#include "engine/sampling.h"
#include "engine/test_util.h"

namespace pdserve::engine {
namespace {

std::string NoGpuReason() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess)
    return std::string("no CUDA device: ") + cudaGetErrorString(error);
  if (count == 0) return "no CUDA device: cudaGetDeviceCount reports 0";
  return "";
}

BackendConfig ConfigFor(const ModelWeights& w, Device device, DType kv_dtype,
                        bool reference_math) {
  BackendConfig c;
  c.device = device;
  c.kv = {static_cast<int32_t>(w.config.num_layers),
          static_cast<int32_t>(w.config.num_kv_heads),
          static_cast<int32_t>(w.config.head_dim), 16, kv_dtype};
  c.kv_cache_bytes = int64_t{64} << 20;
  c.gpu_memory_utilization = 0.5;
  c.gpu_reference_math = reference_math;
  c.max_num_batched_tokens = 256;
  return c;
}

struct Generation {
  std::vector<std::vector<int32_t>> tokens;  // generated, per sequence
  std::vector<float> first_logits;           // of each sequence's prompt
};

// Greedy generation of `new_tokens` for each prompt, batched: prompts are
// prefilled in chunks of `chunk` tokens (all sequences in each step), then
// decoded one token per sequence per step. Blocks are handed out in a
// shuffled order, as a BlockManager would after some traffic.
Generation Generate(Backend* backend,
                    const std::vector<std::vector<int32_t>>& prompts,
                    int new_tokens, int chunk, int64_t vocab_size) {
  const int bs = backend->kv_spec().block_size;
  const int n = static_cast<int>(prompts.size());
  std::vector<int32_t> ids(static_cast<size_t>(backend->num_blocks()));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(5));
  std::vector<std::vector<int32_t>> seq_tokens = prompts, tables(n);
  std::vector<int32_t> computed(n, 0);
  size_t next_block = 0;
  Generation out;
  out.tokens.resize(n);
  std::vector<std::pair<float, int32_t>> scratch;
  while (true) {
    std::vector<LlamaModel::SeqInput> inputs;
    std::vector<int> who;
    for (int s = 0; s < n; ++s) {
      if (static_cast<int>(out.tokens[s].size()) >= new_tokens) continue;
      const int len = static_cast<int>(seq_tokens[s].size());
      const int take = std::min(chunk, len - computed[s]);
      while (static_cast<int>(tables[s].size()) * bs < computed[s] + take)
        tables[s].push_back(ids[next_block++]);
      const bool completes = computed[s] + take == len;
      inputs.push_back(
          {std::span<const int32_t>(seq_tokens[s]).subspan(computed[s], take),
           computed[s], tables[s],
           completes ? LlamaModel::Logits::kLast : LlamaModel::Logits::kNone});
      who.push_back(s);
    }
    if (inputs.empty()) break;
    std::vector<float> logits;
    const absl::Status st = backend->Forward(inputs, &logits);
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) break;
    int64_t row = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const int s = who[i];
      computed[s] += static_cast<int32_t>(inputs[i].tokens.size());
      if (inputs[i].logits != LlamaModel::Logits::kLast) continue;
      const float* l = logits.data() + row * vocab_size;
      ++row;
      if (out.tokens[s].empty()) {
        out.first_logits.insert(out.first_logits.end(), l, l + vocab_size);
      }
      SamplingParams greedy;
      const int32_t t =
          SampleToken(l, vocab_size, greedy,
                      static_cast<int64_t>(seq_tokens[s].size()), &scratch);
      seq_tokens[s].push_back(t);
      out.tokens[s].push_back(t);
    }
  }
  return out;
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string reason = NoGpuReason();
    if (!reason.empty()) GTEST_SKIP() << reason;
    RegisterCudaBackend();
    weights_ = testing::TinyWeights("tiny");
    std::mt19937 rng(11);
    std::uniform_int_distribution<int32_t> tok(
        0, static_cast<int32_t>(weights_->config.vocab_size) - 1);
    for (int len : {5, 16, 37}) {
      std::vector<int32_t> p(len);
      for (auto& t : p) t = tok(rng);
      prompts_.push_back(p);
    }
  }
  int64_t vocab() const { return weights_->config.vocab_size; }
  std::shared_ptr<const ModelWeights> weights_;
  std::vector<std::vector<int32_t>> prompts_;
};

TEST_F(CudaBackendTest, GreedyTokensEqualTheCpuBackendWithReferenceMath) {
  auto cpu = CreateBackend(
      weights_, ConfigFor(*weights_, Device::kCpu, DType::kF32, false));
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto gpu = CreateBackend(
      weights_, ConfigFor(*weights_, Device::kCuda, DType::kF32, true));
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_EQ((*gpu)->kv_storage()->memory().kind, MemoryKind::kDevice);
  EXPECT_EQ((*cpu)->kv_storage()->memory().kind, MemoryKind::kHost);
  EXPECT_GT((*gpu)->num_blocks(), 0);
  const Generation want = Generate(cpu->get(), prompts_, 32, 7, vocab());
  const Generation got = Generate(gpu->get(), prompts_, 32, 7, vocab());
  ASSERT_EQ(got.tokens.size(), want.tokens.size());
  for (size_t s = 0; s < want.tokens.size(); ++s)
    EXPECT_EQ(got.tokens[s], want.tokens[s]) << "sequence " << s;
}

TEST_F(CudaBackendTest, ServingMathLogitsStayCloseToTheCpu) {
  for (DType kv : {DType::kBF16, DType::kI8}) {
    auto cpu =
        CreateBackend(weights_, ConfigFor(*weights_, Device::kCpu, kv, false));
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    auto gpu =
        CreateBackend(weights_, ConfigFor(*weights_, Device::kCuda, kv, false));
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    const Generation want = Generate(cpu->get(), prompts_, 1, 64, vocab());
    const Generation got = Generate(gpu->get(), prompts_, 1, 64, vocab());
    ASSERT_EQ(got.first_logits.size(), want.first_logits.size());
    float range = 0;
    for (float x : want.first_logits) range = std::max(range, std::fabs(x));
    for (size_t i = 0; i < want.first_logits.size(); ++i) {
      ASSERT_NEAR(got.first_logits[i], want.first_logits[i], 0.05f * range)
          << DTypeName(kv) << " logit " << i;
    }
  }
}

// Through the Engine (`--device cuda`): continuous batching, chunked prefill
// and the scheduler on top of the CUDA backend give the CPU engine's greedy
// tokens.
TEST_F(CudaBackendTest, EngineOnCudaGeneratesTheCpuEnginesGreedyTokens) {
  auto run = [&](Device device) {
    EngineConfig c;
    c.device = device;
    c.kv_dtype = DType::kF32;
    c.gpu_memory_utilization = 0.5;
    c.gpu_reference_math = true;
    c.max_num_batched_tokens = 24;  // forces chunked prefill
    auto engine = Engine::Create(weights_, c);
    EXPECT_TRUE(engine.ok()) << engine.status();
    std::map<std::string, std::vector<int32_t>> out;
    if (!engine.ok()) return out;
    for (size_t i = 0; i < prompts_.size(); ++i) {
      EngineRequest r;
      r.id = absl::StrCat("r", i);
      r.prompt = prompts_[i];
      r.sampling.max_tokens = 20;
      r.sampling.ignore_eos = true;
      EXPECT_TRUE((*engine)->AddRequest(r).ok());
    }
    while ((*engine)->HasWork()) {
      auto step = (*engine)->Step();
      EXPECT_TRUE(step.ok()) << step.status();
      if (!step.ok()) break;
      for (const StepOutput& o : *step) {
        out[o.id].insert(out[o.id].end(), o.new_tokens.begin(),
                         o.new_tokens.end());
      }
    }
    return out;
  };
  const auto want = run(Device::kCpu);
  const auto got = run(Device::kCuda);
  ASSERT_EQ(want.size(), prompts_.size());
  EXPECT_EQ(got, want);
}

TEST(CudaBackendConfigTest, UnregisteredOrBadConfigIsAnError) {
  BackendConfig c;
  c.kv = {2, 2, 16, 16, DType::kF32};
  c.gpu_memory_utilization = 1.5;
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseDevice("cuda"), Device::kCuda);
  EXPECT_EQ(ParseDevice("cpu"), Device::kCpu);
  EXPECT_FALSE(ParseDevice("tpu").has_value());
}

}  // namespace
}  // namespace pdserve::engine
