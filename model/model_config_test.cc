#include "model/model_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

namespace pdserve::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class ModelConfigTest : public ::testing::Test {
 protected:
  static std::string Config(const std::string& arch,
                            const std::string& extra = "") {
    return absl::StrCat(R"({"architectures": [")", arch,
                        R"("], "vocab_size": 100, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 8192)",
                        extra, "}");
  }
};

TEST_F(ModelConfigTest, Qwen3HasQkNormAndNoBias) {
  auto c = ModelConfig::FromJson(
      Config("Qwen3ForCausalLM", R"(, "head_dim": 16, "attention_bias": false,
      "sliding_window": null, "use_sliding_window": false)"),
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->qk_norm);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_EQ(c->max_position_embeddings, 8192);
  EXPECT_THAT(c->ToJson(), HasSubstr("\"model_type\": \"qwen3\""));
}

TEST_F(ModelConfigTest, Qwen2DefaultsToQkvBias) {
  auto c = ModelConfig::FromJson(
      Config("Qwen2ForCausalLM", R"(, "sliding_window": 4096,
      "use_sliding_window": false)"),
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->attention_bias);
  EXPECT_FALSE(c->qk_norm);
  EXPECT_EQ(c->max_position_embeddings, 8192);  // window switched off
}

TEST_F(ModelConfigTest, MistralSlidingWindowCapsTheContext) {
  auto c = ModelConfig::FromJson(
      Config("MistralForCausalLM", R"(, "sliding_window": 4096)"),
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_position_embeddings, 4096);
}

TEST_F(ModelConfigTest, UnsupportedArchitectureIsNamed) {
  auto c = ModelConfig::FromJson(Config("GPTNeoXForCausalLM"), "config.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("unsupported architecture \"GPTNeoXForCausalLM\" in "
                        "\"architectures\""));
}

TEST_F(ModelConfigTest, EveryEosIdEndsGeneration) {
  auto c = ModelConfig::FromJson(
      Config("LlamaForCausalLM", R"(, "eos_token_id": [7, 9])"), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->eos_token_id, 7);
  ASSERT_TRUE(c->AddGenerationConfig(
                   R"({"bos_token_id": 1, "eos_token_id": [9, 11]})", "g.json")
                  .ok());
  EXPECT_THAT(c->eos_token_ids, ElementsAre(7, 9, 11));
  EXPECT_TRUE(c->IsEos(11));
  EXPECT_FALSE(c->IsEos(8));
  EXPECT_EQ(c->bos_token_id, 1);
  EXPECT_THAT(c->ToJson(), HasSubstr("\"eos_token_id\": [7, 9, 11]"));
  EXPECT_FALSE(
      c->AddGenerationConfig(R"({"eos_token_id": 100})", "g.json").ok());
}

// Found by tests/fuzz/model_config_fuzz: a config without EOS was written
// back as "eos_token_id": -1, which then failed to load.
TEST_F(ModelConfigTest, ConfigWithoutEosRoundTrips) {
  auto c = ModelConfig::FromJson(Config("LlamaForCausalLM"), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->eos_token_id, -1);
  auto again = ModelConfig::FromJson(c->ToJson(), "round trip");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->eos_token_id, -1);
  EXPECT_TRUE(again->eos_token_ids.empty());
}

// Found by tests/fuzz/model_config_fuzz: a rope_scaling factor beyond float
// range was accepted and became infinite (NaN logits).
TEST_F(ModelConfigTest, RopeScalingFactorBeyondFloatIsRejected) {
  auto c = ModelConfig::FromJson(
      Config("LlamaForCausalLM",
             R"(, "rope_scaling": {"rope_type": "llama3", "factor": 1e300})"),
      "config.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("rope_scaling"));
}

}  // namespace
}  // namespace pdserve::engine
