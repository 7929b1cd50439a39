#include "model/moe.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/engine.h"
#include "engine/test_util.h"

namespace pdserve::engine {
namespace {

// A MoE family preset (seed 1) written and loaded once per test binary.
std::shared_ptr<const ModelWeights> PresetWeights(const std::string& preset) {
  static std::map<std::string, std::shared_ptr<const ModelWeights>> cache;
  auto& slot = cache[preset];
  if (!slot) {
    const std::string dir = testing::TempDir("moe_" + preset);
    ModelInitOptions opts;
    opts.preset = preset;
    opts.out_dir = dir;
    opts.seed = 1;
    auto s = WriteRandomModel(opts);
    EXPECT_TRUE(s.ok()) << s;
    auto w = ModelWeights::Load(dir);
    EXPECT_TRUE(w.ok()) << w.status();
    slot = std::make_shared<const ModelWeights>(std::move(*w));
  }
  return slot;
}

std::vector<float> Activations(int64_t m, int64_t hidden, int salt) {
  std::vector<float> x(m * hidden);
  for (int64_t i = 0; i < m * hidden; ++i)
    x[i] = std::sin(0.37f * static_cast<float>(i) + salt) * 1.5f;
  return x;
}

TEST(MoeRoutingTest, Top2IsRenormalisedOverTheChosenExperts) {
  const float logits[] = {0.0f, 2.0f, 1.0f, -1.0f};
  int32_t experts[2];
  float weights[2];
  RouteTopK(logits, 1, 4, 2, /*renormalize=*/true, experts, weights);
  EXPECT_EQ(experts[0], 1);
  EXPECT_EQ(experts[1], 2);
  // softmax over the chosen two: e^2 / (e^2 + e^1).
  EXPECT_NEAR(weights[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-6);
  EXPECT_NEAR(weights[0] + weights[1], 1.0, 1e-6);
}

TEST(MoeRoutingTest, WithoutNormTopkProbWeightsAreTheFullSoftmax) {
  const float logits[] = {0.0f, 2.0f, 1.0f, -1.0f};
  int32_t experts[2];
  float weights[2];
  RouteTopK(logits, 1, 4, 2, /*renormalize=*/false, experts, weights);
  const double z = 1 + std::exp(2.0) + std::exp(1.0) + std::exp(-1.0);
  EXPECT_NEAR(weights[0], std::exp(2.0) / z, 1e-6);
  EXPECT_NEAR(weights[1], std::exp(1.0) / z, 1e-6);
}

TEST(MoeRoutingTest, TiesGoToTheLowerExpertId) {
  const float logits[] = {1.0f, 3.0f, 3.0f, 1.0f, 3.0f};
  int32_t experts[3];
  float weights[3];
  RouteTopK(logits, 1, 5, 3, true, experts, weights);
  EXPECT_EQ(experts[0], 1);
  EXPECT_EQ(experts[1], 2);
  EXPECT_EQ(experts[2], 4);
  const float flat[] = {0.5f, 0.5f, 0.5f, 0.5f};
  RouteTopK(flat, 1, 4, 2, true, experts, weights);
  EXPECT_EQ(experts[0], 0);
  EXPECT_EQ(experts[1], 1);
  EXPECT_FLOAT_EQ(weights[0], 0.5f);
}

TEST(MoeConfigTest, Qwen3MoeSparseLayersFollowStepAndMlpOnlyLayers) {
  auto c = ModelConfig::FromJson(R"({
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
    "norm_topk_prob": true, "decoder_sparse_step": 2,
    "mlp_only_layers": [3]})",
                                 "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->qk_norm);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_EQ(c->moe_intermediate_size, 16);
  // (i + 1) % 2 == 0 -> 1, 3, 5; 3 is dense by mlp_only_layers.
  const std::vector<bool> sparse = {false, true, false, false, false, true};
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(c->IsMoeLayer(i), sparse[i]) << i;
  // The config survives a round trip through config.json.
  auto again = ModelConfig::FromJson(c->ToJson(), "round trip");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->num_experts, 4);
  EXPECT_EQ(again->decoder_sparse_step, 2);
  EXPECT_EQ(again->mlp_only_layers, std::vector<int64_t>{3});
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(again->IsMoeLayer(i), sparse[i]);
}

TEST(MoeConfigTest, MixtralDefaultsAndBadTopK) {
  const std::string base = R"({
    "architectures": ["MixtralForCausalLM"], "vocab_size": 100,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2)";
  auto c = ModelConfig::FromJson(base + "}", "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_experts, 8);
  EXPECT_EQ(c->num_experts_per_tok, 2);
  EXPECT_EQ(c->moe_intermediate_size, 64);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_TRUE(c->IsMoeLayer(0) && c->IsMoeLayer(1));
  auto bad = ModelConfig::FromJson(
      base + R"(, "num_local_experts": 4, "num_experts_per_tok": 5})",
      "config.json");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MoeWeightsTest, Qwen3MoePresetHasOneDenseLayer) {
  auto w = PresetWeights("qwen3-moe");
  ASSERT_EQ(w->layers.size(), 3u);
  for (int l : {0, 2}) {
    EXPECT_FALSE(w->layers[l].moe.empty()) << l;
    EXPECT_TRUE(w->layers[l].gate_up.empty()) << l;
    EXPECT_EQ(w->layers[l].moe.gate_up.size(), 8u);
  }
  EXPECT_TRUE(w->layers[1].moe.empty());
  EXPECT_FALSE(w->layers[1].gate_up.empty());
}

// A DeepSeek router config over 8 experts in 4 groups of 2.
ModelConfig DeepseekRouting(const std::string& arch, ModelConfig::MoeTopk topk,
                            int64_t k, bool norm, double scale) {
  ModelConfig c;
  c.architecture = arch;
  c.num_experts = 8;
  c.num_experts_per_tok = k;
  c.n_group = 4;
  c.topk_group = 2;
  c.moe_topk = topk;
  c.moe_scoring = topk == ModelConfig::MoeTopk::kNoauxTc
                      ? ModelConfig::MoeScoring::kSigmoid
                      : ModelConfig::MoeScoring::kSoftmax;
  c.norm_topk_prob = norm;
  c.routed_scaling_factor = scale;
  return c;
}

TEST(DeepseekRoutingTest, GroupLimitedGreedyChoosesOnlyInsideTheBestGroups) {
  // Groups {0,1} {2,3} {4,5} {6,7}; group maxima 1.0, 3.0, 2.9, 2.0. The
  // best two groups are 1 and 2, so expert 7 (2.0, above 4's 1.5) is out.
  const float logits[] = {1.0f, 0.5f, 3.0f, 0.0f, 2.9f, 1.5f, 2.0f, 2.0f};
  const ModelConfig c = DeepseekRouting(
      "DeepseekV2ForCausalLM", ModelConfig::MoeTopk::kGroupLimitedGreedy, 3,
      false, 16.0);
  int32_t experts[3];
  float weights[3];
  RouteDeepseek(logits, 1, c, nullptr, experts, weights);
  EXPECT_EQ(experts[0], 2);
  EXPECT_EQ(experts[1], 4);
  EXPECT_EQ(experts[2], 5);
  double z = 0;
  for (float l : logits) z += std::exp(double{l});
  // V2 without norm_topk_prob: the full softmax times routed_scaling_factor.
  EXPECT_NEAR(weights[0], 16.0 * std::exp(3.0) / z, 1e-5);
  EXPECT_NEAR(weights[2], 16.0 * std::exp(1.5) / z, 1e-5);
  // Greedy ignores the groups and takes 7 (ties to the lower id: 6 first).
  const ModelConfig g = DeepseekRouting(
      "DeepseekV2ForCausalLM", ModelConfig::MoeTopk::kGreedy, 3, true, 16.0);
  RouteDeepseek(logits, 1, g, nullptr, experts, weights);
  EXPECT_EQ(experts[0], 2);
  EXPECT_EQ(experts[1], 4);
  EXPECT_EQ(experts[2], 6);
  // V2 with norm_topk_prob renormalises and does not scale.
  EXPECT_NEAR(weights[0] + weights[1] + weights[2], 1.0, 1e-6);
}

TEST(DeepseekRoutingTest, NoauxTcChoosesByBiasedScoreAndWeighsByTheSigmoid) {
  const float logits[] = {2.0f, 1.9f, 0.0f, 0.1f, -1.0f, 1.0f, 0.5f, 0.4f};
  // Bias lifts expert 4 (group 2) and sinks expert 1.
  const float bias[] = {0.0f, -0.5f, 0.0f, 0.0f, 0.9f, 0.0f, 0.0f, 0.0f};
  const ModelConfig c = DeepseekRouting(
      "DeepseekV3ForCausalLM", ModelConfig::MoeTopk::kNoauxTc, 2, true, 2.5);
  int32_t experts[2];
  float weights[2];
  RouteDeepseek(logits, 1, c, bias, experts, weights);
  auto sig = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
  // Group scores (sum of the two best biased): g0 sig(2)+sig(1.9)-0.5,
  // g1 sig(0)+sig(.1), g2 sig(-1)+.9+sig(1), g3 sig(.5)+sig(.4): g2 and g0.
  // Then by biased score: 0 (0.881), 4 (0.269 + 0.9 = 1.169) first.
  EXPECT_EQ(experts[0], 4);
  EXPECT_EQ(experts[1], 0);
  const double w4 = sig(-1.0), w0 = sig(2.0);
  // Renormalised unbiased sigmoids, then always times 2.5 (V3).
  EXPECT_NEAR(weights[0], 2.5 * w4 / (w4 + w0), 1e-6);
  EXPECT_NEAR(weights[1], 2.5 * w0 / (w4 + w0), 1e-6);
  EXPECT_NEAR(weights[0] + weights[1], 2.5, 1e-5);
}

TEST(MoeConfigTest, DeepseekLayersFollowFirstKDenseAndFrequency) {
  auto c = ModelConfig::FromJson(R"({
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 100,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 4,
    "q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4, "v_head_dim": 6, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 12,
    "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
    "first_k_dense_replace": 2, "moe_layer_freq": 2,
    "routed_scaling_factor": 2.5,
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096}})",
                                 "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  // V3 defaults: noaux_tc, sigmoid, norm_topk_prob.
  EXPECT_EQ(c->moe_topk, ModelConfig::MoeTopk::kNoauxTc);
  EXPECT_EQ(c->moe_scoring, ModelConfig::MoeScoring::kSigmoid);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_TRUE(c->IsMla());
  EXPECT_EQ(c->head_dim, 12);  // qk_nope + qk_rope, not the config's 4
  const std::vector<bool> sparse = {false, false, true, false, true, false};
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(c->IsMoeLayer(i), sparse[i]) << i;
  auto again = ModelConfig::FromJson(c->ToJson(), "round trip");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->q_lora_rank, 16);
  EXPECT_EQ(again->yarn.factor, 40);
  EXPECT_EQ(again->routed_scaling_factor, 2.5);
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(again->IsMoeLayer(i), sparse[i]);
  // The KV cache holds one latent row per token: 8 + 4 wide, one "head".
  const KvCacheSpec spec = c->KvSpec(16, DType::kBF16);
  EXPECT_TRUE(spec.mla());
  EXPECT_EQ(spec.num_kv_heads, 1);
  EXPECT_EQ(spec.head_dim, 12);
  EXPECT_EQ(spec.BytesPerToken(), 6 * 12 * 2);
  EXPECT_EQ(spec.LayerBlockBytes(), 16 * 12 * 2);
  // A top-k the chosen groups cannot hold is refused.
  std::string text = c->ToJson();
  text.replace(text.find("\"num_experts_per_tok\": 2"), 25,
               "\"num_experts_per_tok\": 5");
  EXPECT_EQ(ModelConfig::FromJson(text, "config.json").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MoeWeightsTest, DeepseekPresetsHaveADenseFirstLayerAndSharedExperts) {
  for (const char* preset : {"deepseek-v2", "deepseek-v3"}) {
    auto w = PresetWeights(preset);
    const ModelConfig& c = w->config;
    ASSERT_EQ(w->layers.size(), 3u) << preset;
    EXPECT_TRUE(w->layers[0].moe.empty()) << preset;
    EXPECT_FALSE(w->layers[0].gate_up.empty()) << preset;
    for (int l : {1, 2}) {
      const MoeWeights& m = w->layers[l].moe;
      EXPECT_FALSE(m.empty()) << preset << " " << l;
      EXPECT_EQ(m.shared_gate_up.rows(),
                2 * c.n_shared_experts * c.moe_intermediate_size);
      EXPECT_EQ(m.score_bias.size(),
                c.moe_topk == ModelConfig::MoeTopk::kNoauxTc ? 8u : 0u);
    }
    // MLA: no fused qkv; q LoRA only in V3's preset.
    const MlaWeights& a = w->layers[0].mla;
    EXPECT_TRUE(w->layers[0].qkv.empty());
    EXPECT_EQ(a.q_proj.empty(), c.q_lora_rank > 0) << preset;
    EXPECT_EQ(a.uk_t.size(), static_cast<size_t>(c.num_heads));
    EXPECT_EQ(w->layers[0].o_proj.cols(), c.num_heads * c.v_head_dim);
  }
}

class MoeMlpTest : public ::testing::TestWithParam<std::string> {};

// A token's MoE output is bit-identical alone and in any batch, and matches a
// per-token float64 evaluation of the same weights.
TEST_P(MoeMlpTest, OutputIsBatchInvariantAndMatchesPerTokenMath) {
  auto weights = PresetWeights(GetParam());
  const ModelConfig& c = weights->config;
  const MoeWeights& w = weights->layers[0].moe;
  ASSERT_FALSE(w.empty());
  const int64_t h = c.hidden_size, m = 23;
  const std::vector<float> x = Activations(m, h, 3);
  MoeMlp mlp;
  std::vector<float> batched(m * h), alone(h);
  mlp.Forward(w, c, x.data(), m, kernels::MatMulMode::kDeterministic,
              batched.data());
  std::vector<int> experts_used(c.num_experts, 0);
  const std::vector<float> router = w.router.ToFloat();
  for (int64_t t = 0; t < m; ++t) {
    mlp.Forward(w, c, &x[t * h], 1, kernels::MatMulMode::kDeterministic,
                alone.data());
    for (int64_t i = 0; i < h; ++i) {
      ASSERT_EQ(alone[i], batched[t * h + i]) << "token " << t << " dim " << i;
    }
    // float64: softmax, top-k, renormalised, the chosen experts' SwiGLU.
    std::vector<double> p(c.num_experts);
    double z = 0;
    for (int64_t e = 0; e < c.num_experts; ++e) {
      double s = 0;
      for (int64_t i = 0; i < h; ++i)
        s += double{x[t * h + i]} * router[e * h + i];
      p[e] = s;
    }
    const double mx = *std::max_element(p.begin(), p.end());
    for (double& v : p) z += (v = std::exp(v - mx));
    std::vector<int> order(c.num_experts);
    for (int e = 0; e < c.num_experts; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return p[a] > p[b]; });
    double chosen = 0;
    for (int r = 0; r < c.num_experts_per_tok; ++r) chosen += p[order[r]];
    std::vector<double> want(h, 0.0);
    const int64_t inter = c.moe_intermediate_size;
    for (int r = 0; r < c.num_experts_per_tok; ++r) {
      const int e = order[r];
      ++experts_used[e];
      const double weight = c.norm_topk_prob ? p[e] / chosen : p[e] / z;
      const std::vector<float> gu = w.gate_up[e].ToFloat();
      const std::vector<float> dn = w.down[e].ToFloat();
      std::vector<double> act(inter);
      for (int64_t j = 0; j < inter; ++j) {
        double g = 0, u = 0;
        for (int64_t i = 0; i < h; ++i) {
          g += double{x[t * h + i]} * gu[j * h + i];
          u += double{x[t * h + i]} * gu[(inter + j) * h + i];
        }
        act[j] = g / (1 + std::exp(-g)) * u;
      }
      for (int64_t i = 0; i < h; ++i) {
        double s = 0;
        for (int64_t j = 0; j < inter; ++j) s += act[j] * dn[i * inter + j];
        want[i] += weight * s;
      }
    }
    for (int64_t i = 0; i < h; ++i) {
      EXPECT_NEAR(batched[t * h + i], want[i], 1e-4 * (1 + std::abs(want[i])))
          << "token " << t << " dim " << i;
    }
  }
  // The batch spread over several experts (the grouping was exercised).
  int used = 0;
  for (int n : experts_used) used += n > 0;
  EXPECT_GE(used, 4);
}

INSTANTIATE_TEST_SUITE_P(Families, MoeMlpTest,
                         ::testing::Values("mixtral", "qwen3-moe"),
                         [](const auto& info) {
                           return info.param == "mixtral" ? "Mixtral"
                                                          : "Qwen3Moe";
                         });

// The equivalence contract on the MoE presets, through the engine.
class MoeEngineTest : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<Engine> Make(EngineConfig config = {}) {
    auto e = Engine::Create(PresetWeights(GetParam()), config, nullptr);
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(*e);
  }
  static EngineRequest Req(const std::string& id, int len, int salt,
                           uint32_t max_tokens, float temperature) {
    return testing::SyntheticRequest(id, len, salt, max_tokens, temperature,
                                     /*offset=*/7);
  }
  static std::map<std::string, std::vector<int32_t>> Drain(
      Engine* e, std::map<std::string, StepOutput>* last = nullptr) {
    return testing::DrainEngine(e, last);
  }
};

TEST_P(MoeEngineTest, BatchedAndChunkedEqualsAloneGreedyAndSeeded) {
  std::map<std::string, std::vector<int32_t>> alone;
  for (int i = 0; i < 4; ++i) {
    auto e = Make();
    ASSERT_TRUE(e->AddRequest(Req(absl::StrCat("r", i), 9 + 14 * i, i, 12,
                                  i % 2 ? 0.9f : 0.0f))
                    .ok());
    auto out = Drain(e.get());
    alone.insert(out.begin(), out.end());
  }
  // Different requests produce different streams (the test can fail).
  EXPECT_NE(alone.at("r0"), alone.at("r2"));
  EngineConfig cfg;
  cfg.max_num_batched_tokens = 7;  // chunked prefill, mixed with decodes
  auto e = Make(cfg);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(e->AddRequest(Req(absl::StrCat("r", i), 9 + 14 * i, i, 12,
                                  i % 2 ? 0.9f : 0.0f))
                    .ok());
  }
  EXPECT_EQ(Drain(e.get()), alone);
}

TEST_P(MoeEngineTest, PrefixHitEqualsCold) {
  for (float temperature : {0.0f, 0.8f}) {
    auto cold = Make();
    ASSERT_TRUE(cold->AddRequest(Req("a", 50, 5, 8, temperature)).ok());
    const auto expected = Drain(cold.get()).at("a");
    auto e = Make();
    ASSERT_TRUE(e->AddRequest(Req("warm", 50, 5, 1, temperature)).ok());
    Drain(e.get());
    ASSERT_TRUE(e->AddRequest(Req("a", 50, 5, 8, temperature)).ok());
    std::map<std::string, StepOutput> last;
    const auto hit = Drain(e.get(), &last);
    EXPECT_EQ(last.at("a").cached_prompt_tokens, 48);
    EXPECT_EQ(hit.at("a"), expected) << "temperature " << temperature;
  }
}

// The latent pool through the engine: sized by latent bytes per block, its
// blocks published as KV events, evicted into a host-memory tier and read
// back from it with the same tokens as a cold run.
TEST(DeepseekEngineTest, LatentPoolEventsAndTierKeepTheTokens) {
  auto weights = PresetWeights("deepseek-v2");
  const KvCacheSpec spec = weights->config.KvSpec(16, DType::kF32);
  ASSERT_TRUE(spec.mla());
  auto req = [](const std::string& id, int salt) {
    EngineRequest r;
    r.id = id;
    for (int i = 0; i < 50; ++i) r.prompt.push_back((i * 31 + salt * 17) % 256);
    r.sampling.max_tokens = 6;
    r.sampling.ignore_eos = true;
    return r;
  };
  auto cold = Engine::Create(weights, EngineConfig{}, nullptr);
  ASSERT_TRUE(cold.ok()) << cold.status();
  ASSERT_TRUE((*cold)->AddRequest(req("a", 1)).ok());
  const auto want = testing::DrainEngine(cold->get()).at("a");

  EngineConfig cfg;
  cfg.kv_cache_bytes = 6 * spec.BytesPerBlock();  // 6 latent blocks
  cfg.kv_dtype = DType::kF32;
  cfg.kv_offload.memory_bytes = 64 * spec.BytesPerBlock();
  std::vector<KvEvent> events;
  auto e = Engine::Create(weights, cfg,
                          [&](const KvEvent& ev) { events.push_back(ev); });
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ((*e)->block_manager().num_blocks(), 6);
  ASSERT_TRUE((*e)->AddRequest(req("a", 1)).ok());
  EXPECT_EQ(testing::DrainEngine(e->get()).at("a"), want);
  size_t stored = 0;
  for (const KvEvent& ev : events) {
    if (ev.type == KvEvent::Type::kStored && ev.tier == KvTierKind::kPool)
      stored += ev.hashes.size();
  }
  EXPECT_EQ(stored, 3u);  // the prompt's 3 full blocks
  // Two other prompts push a's blocks out of the 6-block pool.
  for (int salt : {2, 3}) {
    ASSERT_TRUE((*e)->AddRequest(req(absl::StrCat("o", salt), salt)).ok());
    testing::DrainEngine(e->get());
  }
  bool removed = false;
  for (const KvEvent& ev : events) {
    removed |=
        ev.type == KvEvent::Type::kRemoved || ev.type == KvEvent::Type::kMoved;
  }
  EXPECT_TRUE(removed);
  ASSERT_TRUE((*e)->AddRequest(req("a2", 1)).ok());
  std::map<std::string, StepOutput> last;
  EXPECT_EQ(testing::DrainEngine(e->get(), &last).at("a2"), want);
  EXPECT_GT(last.at("a2").cached_prompt_tokens, 0);
}

// A name for each family preset's test instance.
std::string FamilyName(const std::string& preset) {
  if (preset == "mixtral") return "Mixtral";
  if (preset == "qwen3-moe") return "Qwen3Moe";
  if (preset == "deepseek-v2") return "DeepseekV2";
  return "DeepseekV3";
}

INSTANTIATE_TEST_SUITE_P(Families, MoeEngineTest,
                         ::testing::Values("mixtral", "qwen3-moe",
                                           "deepseek-v2", "deepseek-v3"),
                         [](const auto& info) {
                           return FamilyName(info.param);
                         });

}  // namespace
}  // namespace pdserve::engine
