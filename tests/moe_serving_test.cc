// The equivalence contract on the Mixture-of-Experts presets (mixtral,
// qwen3-moe, and the MLA + MoE deepseek-v2/v3), end to end: router + 2 prefill
// + 2 decode workers (the topology `pdserve up --prefill 2 --decode 2` starts),
// a colocated worker, and the local `pdserve generate --model` path give the
// same tokens, greedy and seeded, with and without prefix-cache hits. Real
// processes on loopback.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>

#include "nlohmann/json.hpp"
#include "tests/cluster.h"

namespace pdserve::testing {
namespace {

using ::testing::HasSubstr;

std::string RunCli(const std::string& args) {
  return testing::RunCli(PDSERVE_BIN, args);
}

class MoeServingTest : public ::testing::TestWithParam<std::string> {};

TEST_P(MoeServingTest, DisaggregatedColocatedAndLocalAgreeWithPrefixHits) {
  const std::string model =
      (std::filesystem::temp_directory_path() /
       absl::StrCat("pdserve_moe_serving_", GetParam(), "_", ::getpid()))
          .string();
  RunCli(absl::StrCat("model init --preset ", GetParam(), " --out ", model,
                      " --seed 4"));
  ASSERT_TRUE(std::filesystem::exists(model + "/config.json"));
  Cluster disagg =
      Cluster::Start(model, 2, 2, {"--local-prefill-threshold=-1"});
  Cluster coloc = Cluster::Start(model, 0, 1);
  std::string system = "System: ";
  for (int i = 0; i < 6; ++i)
    absl::StrAppend(&system, "rule ", i, " is to route every token well. ");
  for (auto [temp, seed] : {std::pair{0.0f, 0ull}, {0.9f, 41ull}}) {
    for (const char* question : {"Which expert?", "Which expert? Say why."}) {
      const std::string prompt = system + question;
      const std::string local = RunCli(absl::StrCat(
          "generate --model ", model, " --json --ignore-eos --max-tokens 16",
          " --temperature ", temp, " --seed ", seed, " --prompt '", prompt,
          "'"));
      const std::vector<uint32_t> want = IdsFromJson(local);
      ASSERT_EQ(want.size(), 16u) << local;
      // Twice on the cluster: the second run hits the prefix cache.
      for (int run = 0; run < 2; ++run) {
        auto a = Generate(disagg.stub.get(), Request(prompt, 16, temp, seed));
        ASSERT_TRUE(a.status.ok()) << a.status.error_message();
        EXPECT_EQ(a.tokens, want)
            << GetParam() << " disaggregated, temperature " << temp << " run "
            << run << ": " << prompt;
        EXPECT_THAT(a.last.prefill_worker(), HasSubstr("prefill@"));
        EXPECT_THAT(a.last.decode_worker(), HasSubstr("decode@"));
        if (run == 1) {
          EXPECT_GT(a.last.usage().cached_prompt_tokens(), 0u);
        }
        auto b = Generate(coloc.stub.get(), Request(prompt, 16, temp, seed));
        ASSERT_TRUE(b.status.ok()) << b.status.error_message();
        EXPECT_EQ(b.tokens, want) << GetParam() << " colocated, run " << run;
      }
    }
  }
  std::filesystem::remove_all(model);
}

// int8 latent blocks (two scales per span) through the same topology: the
// disaggregated tokens equal the colocated worker's and the local engine's
// with --kv-dtype int8, with prefix hits on the second run.
TEST(MlaServingTest, Int8LatentKvDisaggregatedEqualsColocatedAndLocal) {
  const std::string model =
      (std::filesystem::temp_directory_path() /
       absl::StrCat("pdserve_mla_int8_serving_", ::getpid()))
          .string();
  RunCli("model init --preset deepseek-v3 --out " + model + " --seed 6");
  ASSERT_TRUE(std::filesystem::exists(model + "/config.json"));
  const std::vector<std::string> int8 = {"--kv-dtype=int8"};
  Cluster disagg =
      Cluster::Start(model, 2, 2, {"--local-prefill-threshold=-1"}, int8);
  Cluster coloc = Cluster::Start(model, 0, 1, {}, int8);
  std::string prompt = "Latent rows, ";
  for (int i = 0; i < 6; ++i) absl::StrAppend(&prompt, "block ", i, " of 16. ");
  for (auto [temp, seed] : {std::pair{0.0f, 0ull}, {0.8f, 9ull}}) {
    const std::vector<uint32_t> want = IdsFromJson(RunCli(absl::StrCat(
        "generate --model ", model, " --kv-dtype int8 --json --ignore-eos",
        " --max-tokens 12 --temperature ", temp, " --seed ", seed,
        " --prompt '", prompt, "'")));
    ASSERT_EQ(want.size(), 12u);
    for (int run = 0; run < 2; ++run) {
      auto a = Generate(disagg.stub.get(), Request(prompt, 12, temp, seed));
      ASSERT_TRUE(a.status.ok()) << a.status.error_message();
      EXPECT_EQ(a.tokens, want) << "disaggregated, run " << run;
      EXPECT_THAT(a.last.prefill_worker(), HasSubstr("prefill@"));
      if (run == 1) EXPECT_GT(a.last.usage().cached_prompt_tokens(), 0u);
      auto b = Generate(coloc.stub.get(), Request(prompt, 12, temp, seed));
      ASSERT_TRUE(b.status.ok()) << b.status.error_message();
      EXPECT_EQ(b.tokens, want) << "colocated, run " << run;
    }
  }
  std::filesystem::remove_all(model);
}

// deepseek-v2/v3 are MLA + MoE: the prefill workers ship latent blocks.
INSTANTIATE_TEST_SUITE_P(Families, MoeServingTest,
                         ::testing::Values("mixtral", "qwen3-moe",
                                           "deepseek-v2", "deepseek-v3"),
                         [](const auto& info) {
                           const std::string& p = info.param;
                           return p == "mixtral"       ? "Mixtral"
                                  : p == "qwen3-moe"   ? "Qwen3Moe"
                                  : p == "deepseek-v2" ? "DeepseekV2"
                                                       : "DeepseekV3";
                         });

}  // namespace
}  // namespace pdserve::testing
