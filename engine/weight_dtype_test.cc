// The equivalence contract with every weight dtype, through the Engine:
// batched == alone, chunked prefill == whole, prefix-cache hit == cold.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/engine.h"
#include "engine/model_init.h"
#include "engine/test_util.h"

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
    EngineRequest r;
    r.id = id;
    for (int i = 0; i < len; ++i)
      r.prompt.push_back((i * 29 + salt * 13 + 5) % 256);
    r.sampling.max_tokens = max_tokens;
    r.sampling.temperature = temperature;
    r.sampling.seed = 99 + salt;
    r.sampling.ignore_eos = true;
    return r;
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

INSTANTIATE_TEST_SUITE_P(EveryWeightDtype, WeightDtypeEngineTest,
                         ::testing::Values(WeightDtype::kF32,
                                           WeightDtype::kBF16,
                                           WeightDtype::kF16, WeightDtype::kI8),
                         [](const ::testing::TestParamInfo<WeightDtype>& info) {
                           return std::string(WeightDtypeName(info.param));
                         });

}  // namespace
}  // namespace pdserve::engine
