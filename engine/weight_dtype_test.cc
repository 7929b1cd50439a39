// The equivalence contract with every weight dtype, through the Engine:
// batched == alone, chunked prefill == whole, prefix-cache hit == cold.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/engine.h"
#include "engine/test_util.h"
#include "model/model_init.h"

namespace pdserve::engine {
namespace {

class WeightDtypeEngineTest : public ::testing::TestWithParam<WeightDtype> {
 protected:
  static std::shared_ptr<const ModelWeights> Weights(WeightDtype d) {
    static std::map<WeightDtype, std::shared_ptr<const ModelWeights>> cache;
    auto& slot = cache[d];
    if (!slot) {
      static const std::string dir = [] {
        const std::string out = testing::TempDir("weight_dtype_model");
        ModelInitOptions opts;
        opts.preset = "tiny";
        opts.out_dir = out;
        opts.seed = 3;
        EXPECT_TRUE(WriteRandomModel(opts).ok());
        return out;
      }();
      auto w = ModelWeights::Load(dir, d);
      EXPECT_TRUE(w.ok()) << w.status();
      slot = std::make_shared<const ModelWeights>(std::move(*w));
    }
    return slot;
  }
  std::unique_ptr<Engine> Make(EngineConfig config = {}) {
    config.weight_dtype = GetParam();
    auto e = Engine::Create(Weights(GetParam()), config);
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(*e);
  }
  static EngineRequest Req(const std::string& id, int len, int salt,
                           uint32_t max_tokens, float temperature) {
    return testing::SyntheticRequest(id, len, salt, max_tokens, temperature,
                                     /*offset=*/5);
  }
  static std::map<std::string, std::vector<int32_t>> Drain(
      Engine* e, std::map<std::string, StepOutput>* last = nullptr) {
    return testing::DrainEngine(e, last);
  }
};

TEST_P(WeightDtypeEngineTest, BatchedAndChunkedEqualAlone) {
  std::map<std::string, std::vector<int32_t>> alone;
  for (int i = 0; i < 4; ++i) {
    auto e = Make();
    ASSERT_TRUE(e->AddRequest(Req(absl::StrCat("r", i), 9 + 14 * i, i, 10,
                                  i % 2 ? 0.9f : 0.0f))
                    .ok());
    auto out = Drain(e.get());
    alone.insert(out.begin(), out.end());
  }
  EngineConfig cfg;
  cfg.max_num_batched_tokens = 11;  // every prompt but the first is chunked
  auto e = Make(cfg);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(e->AddRequest(Req(absl::StrCat("r", i), 9 + 14 * i, i, 10,
                                  i % 2 ? 0.9f : 0.0f))
                    .ok());
  }
  EXPECT_EQ(Drain(e.get()), alone) << WeightDtypeName(GetParam());
}

TEST_P(WeightDtypeEngineTest, PrefixCacheHitEqualsCold) {
  auto e = Make();
  ASSERT_TRUE(e->AddRequest(Req("cold", 40, 4, 8, 0.7f)).ok());
  const auto cold = Drain(e.get());
  ASSERT_TRUE(e->AddRequest(Req("warm", 40, 4, 8, 0.7f)).ok());
  std::map<std::string, StepOutput> last;
  const auto warm = Drain(e.get(), &last);
  EXPECT_EQ(last.at("warm").cached_prompt_tokens, 32);
  EXPECT_EQ(warm.at("warm"), cold.at("cold")) << WeightDtypeName(GetParam());
}

// int8-b32 is int8 storage with block scales: its own numbers, so its own
// fingerprint (workers with per-row int8 must not share its prefix blocks),
// and closer to fp32 than per-row int8 on the same checkpoint.
TEST(WeightDtypeTest, Int8BlockScalesAreTheirOwnStorage) {
  const std::string dir = testing::TempDir("weight_dtype_b32_model");
  ModelInitOptions opts;
  opts.preset = "tiny";
  opts.out_dir = dir;
  opts.seed = 8;
  ASSERT_TRUE(WriteRandomModel(opts).ok());
  auto fp32 = ModelWeights::Load(dir, WeightDtype::kF32);
  auto row = ModelWeights::Load(dir, WeightDtype::kI8);
  auto block = ModelWeights::Load(dir, WeightDtype::kI8B32);
  ASSERT_TRUE(fp32.ok() && row.ok() && block.ok());
  EXPECT_EQ(block->dtype, DType::kI8);
  EXPECT_EQ(block->StorageName(), "int8-b32");
  EXPECT_EQ(row->StorageName(), "int8");
  EXPECT_EQ(block->layers[0].gate_up.int8_scaling(),
            kernels::Int8Scaling::kBlock32);
  EXPECT_NE(block->fingerprint, row->fingerprint);
  EXPECT_EQ(ParseWeightDtype("int8-b32"), WeightDtype::kI8B32);
  EXPECT_STREQ(WeightDtypeName(WeightDtype::kI8B32), "int8-b32");
  auto err = [&](const ModelWeights& w) {
    const auto a = fp32->layers[0].down.ToFloat(),
               b = w.layers[0].down.ToFloat();
    double e = 0, m = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      e += std::fabs(a[i] - b[i]);
      m += std::fabs(a[i]);
    }
    return e / m;
  };
  EXPECT_LT(err(*block), err(*row));
}

// --matmul int8dot (int8 activations, exact integer sums), with block int8
// weights (activations per 32 values) and per-row int8 weights (activations
// per row): the equivalence contract holds with both, and each is its own
// numbers.
class Int8DotEngineTest : public ::testing::TestWithParam<WeightDtype> {};

TEST_P(Int8DotEngineTest, KeepsTheEquivalenceContract) {
  const WeightDtype dtype = GetParam();
  const std::string dir = testing::TempDir("weight_dtype_int8dot_model");
  ModelInitOptions opts;
  opts.preset = "tiny";
  opts.out_dir = dir;
  opts.seed = 5;
  ASSERT_TRUE(WriteRandomModel(opts).ok());
  const auto bf16 = ModelWeights::Load(dir, WeightDtype::kBF16,
                                       kernels::MatMulMode::kInt8Dot);
  EXPECT_EQ(bf16.status().code(), absl::StatusCode::kInvalidArgument);
  auto loaded = ModelWeights::Load(dir, dtype, kernels::MatMulMode::kInt8Dot);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto plain = ModelWeights::Load(dir, dtype);
  ASSERT_TRUE(plain.ok());
  EXPECT_NE(loaded->fingerprint, plain->fingerprint);
  auto weights = std::make_shared<const ModelWeights>(std::move(*loaded));
  auto make = [&](int32_t budget) {
    EngineConfig config;
    config.weight_dtype = dtype;
    config.matmul = kernels::MatMulMode::kInt8Dot;
    if (budget > 0) config.max_num_batched_tokens = budget;
    auto e = Engine::Create(weights, config);
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(*e);
  };
  auto req = [](const std::string& id, int len, int salt) {
    EngineRequest r;
    r.id = id;
    for (int i = 0; i < len; ++i)
      r.prompt.push_back((i * 31 + salt * 7 + 3) % 256);
    r.sampling.max_tokens = 8;
    r.sampling.temperature = salt % 2 ? 0.8f : 0.0f;
    r.sampling.seed = 7 + salt;
    r.sampling.ignore_eos = true;
    return r;
  };
  // 20 rows in one step (above the AMX threshold of 16 where the CPU has
  // it): prompts of 10..67 tokens, alone and together.
  std::map<std::string, std::vector<int32_t>> alone;
  for (int i = 0; i < 5; ++i) {
    auto e = make(0);
    ASSERT_TRUE(e->AddRequest(req(absl::StrCat("r", i), 10 + 14 * i, i)).ok());
    auto out = testing::DrainEngine(e.get());
    alone.insert(out.begin(), out.end());
  }
  for (int32_t budget : {11, 0}) {  // chunked prefill; one big prefill step
    auto e = make(budget);
    for (int i = 0; i < 5; ++i)
      ASSERT_TRUE(
          e->AddRequest(req(absl::StrCat("r", i), 10 + 14 * i, i)).ok());
    EXPECT_EQ(testing::DrainEngine(e.get()), alone) << "budget " << budget;
  }
  // A prefix hit (the first 32 tokens of r2) gives the cold tokens.
  auto e = make(11);
  ASSERT_TRUE(e->AddRequest(req("r2", 38, 2)).ok());
  testing::DrainEngine(e.get());
  ASSERT_TRUE(e->AddRequest(req("warm", 38, 2)).ok());
  std::map<std::string, StepOutput> last;
  const auto warm = testing::DrainEngine(e.get(), &last);
  EXPECT_EQ(last.at("warm").cached_prompt_tokens, 32);
  EXPECT_EQ(warm.at("warm"), alone.at("r2"));
}

INSTANTIATE_TEST_SUITE_P(Int8Weights, Int8DotEngineTest,
                         ::testing::Values(WeightDtype::kI8,
                                           WeightDtype::kI8B32),
                         [](const ::testing::TestParamInfo<WeightDtype>& info) {
                           std::string name = WeightDtypeName(info.param);
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

INSTANTIATE_TEST_SUITE_P(EveryWeightDtype, WeightDtypeEngineTest,
                         ::testing::Values(WeightDtype::kF32,
                                           WeightDtype::kBF16,
                                           WeightDtype::kF16, WeightDtype::kI8,
                                           WeightDtype::kI8B32),
                         [](const ::testing::TestParamInfo<WeightDtype>& info) {
                           std::string name = WeightDtypeName(info.param);
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

}  // namespace
}  // namespace pdserve::engine
