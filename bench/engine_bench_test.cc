// bench engine's --profile: which phases a step reports and that the figures
// add up (timings themselves are not asserted).
#include "bench/engine_bench.h"

#include <unistd.h>

#include <filesystem>
#include <map>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/idle_cpu_testing.h"
#include "kernels/cpu/matmul.h"
#include "model/model_init.h"

namespace pdserve::bench {
namespace {

class EngineBenchProfileTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string((std::filesystem::temp_directory_path() /
                            ("engine_bench_test_" + std::to_string(::getpid())))
                               .string());
    engine::ModelInitOptions opts;
    opts.preset = "tiny";
    opts.out_dir = *dir_;
    ASSERT_TRUE(engine::WriteRandomModel(opts).ok());
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }
  static EngineBenchConfig Config(bool profile) {
    EngineBenchConfig c;
    c.model_dir = *dir_;
    c.prefill_tokens = 24;
    c.decode_context = 8;
    c.batch_sizes = {1, 3};
    c.decode_steps = 3;
    c.stream_bytes = 4 << 20;
    c.profile = profile;
    return c;
  }
  static std::string* dir_;
};
std::string* EngineBenchProfileTest::dir_ = nullptr;

using kernels::idle_cpu::ThreadIds;
using kernels::idle_cpu::ThreadsStartedSince;

// The triad runs right before every timed decode step: it may leave no
// thread behind (an OpenMP team keeps its threads after a region, polling
// for several milliseconds on the core the step's kernel helper needs).
TEST(TriadArraysTest, LeavesNoThreadBehind) {
  kernels::SetKernelThreads(2);
  TriadArrays triad(32 << 20);
  for (int round = 0; round < 3; ++round) {
    const auto before = ThreadIds();
    EXPECT_GT(triad.Measure(2), 0);
    EXPECT_EQ(ThreadsStartedSince(before), 0) << "round " << round;
  }
}

TEST_F(EngineBenchProfileTest, ReportsEveryPhaseOfPrefillAndEachDecodeBatch) {
  auto r = RunEngineBench(Config(true));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->profile.size(), 3u);
  EXPECT_EQ(r->profile[0].step, "prefill 24");
  EXPECT_EQ(r->profile[1].step, "decode batch 1");
  EXPECT_EQ(r->profile[2].step, "decode batch 3");
  EXPECT_EQ(r->profile[0].unprofiled_step_ms, 0);
  auto layers = engine::PresetConfig("tiny");
  ASSERT_TRUE(layers.ok());
  const double l = layers->num_layers;
  for (const StepProfileFigure& f : r->profile) {
    SCOPED_TRACE(f.step);
    EXPECT_GT(f.step_ms, 0);
    std::map<std::string, StepProfileFigure::Phase> by_name;
    double shares = 0, ms = 0;
    for (const auto& p : f.phases) {
      by_name[p.name] = p;
      shares += p.share;
      ms += p.ms;
    }
    // The phases and "other" partition the step.
    EXPECT_NEAR(shares, 1.0, 1e-9);
    EXPECT_NEAR(ms, f.step_ms, 1e-9 * f.step_ms + 1e-12);
    for (const char* name :
         {"qkv_gemm", "o_gemm", "gate_up_gemm", "down_gemm", "attention",
          "rope", "kv_write", "qkv_split", "silu_mul"}) {
      ASSERT_TRUE(by_name.count(name)) << name;
      EXPECT_DOUBLE_EQ(by_name[name].calls, l) << name;
    }
    // Input and post-attention norm per layer, and the final one.
    EXPECT_DOUBLE_EQ(by_name["rms_norm"].calls, 2 * l + 1);
    EXPECT_DOUBLE_EQ(by_name["lm_head"].calls, 1);
    EXPECT_DOUBLE_EQ(by_name["schedule"].calls, 1);
    EXPECT_DOUBLE_EQ(by_name["sampling"].calls, 1);
    EXPECT_DOUBLE_EQ(by_name["embedding"].calls, 1);
    EXPECT_TRUE(by_name.count("other"));
    EXPECT_DOUBLE_EQ(f.gemm_calls, 4 * l + 1);
    EXPECT_LE(f.parallel_regions, f.gemm_calls);
    EXPECT_GE(f.fork_ms, 0);
    EXPECT_GE(f.join_ms, 0);
  }
  EXPECT_GT(r->profile[1].unprofiled_step_ms, 0);
  EXPECT_THAT(r->ToTable(), ::testing::HasSubstr("profile: decode batch 3"));
  EXPECT_THAT(r->ToJson(), ::testing::HasSubstr("\"gate_up_gemm\""));
}

TEST_F(EngineBenchProfileTest, NoProfileUnlessAsked) {
  auto r = RunEngineBench(Config(false));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->profile.empty());
  EXPECT_THAT(r->ToTable(), ::testing::Not(::testing::HasSubstr("profile:")));
  ASSERT_EQ(r->decode.size(), 2u);
}

// Each round also reads the step's weights alone; every decode figure is
// divided by that rate as well as by the triad, from the same bytes.
TEST_F(EngineBenchProfileTest, ReportsTheWeightReadAndEachBatchAgainstIt) {
  auto r = RunEngineBench(Config(false));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(r->decode_weight_read_gb_per_s, 0);
  ASSERT_EQ(r->decode.size(), 2u);
  for (const DecodeFigure& d : r->decode) {
    SCOPED_TRACE(d.batch);
    EXPECT_GT(d.weight_read_ratio, 0);
    EXPECT_NEAR(d.weight_read_ratio * r->decode_weight_read_gb_per_s,
                d.roofline_ratio * r->decode_stream_gb_per_s,
                1e-9 * d.roofline_ratio * r->decode_stream_gb_per_s);
  }
  EXPECT_THAT(r->ToTable(), ::testing::HasSubstr("weight read "));
  EXPECT_THAT(r->ToTable(), ::testing::HasSubstr("of read"));
  EXPECT_THAT(r->ToJson(),
              ::testing::HasSubstr("\"decode_weight_read_gb_per_s\""));
  EXPECT_THAT(r->ToJson(), ::testing::HasSubstr("\"weight_read_ratio\""));
}

// With weights and KV flushed before each timed step (an untimed step
// first), every timed and profiled step still decodes the whole batch (the
// run fails otherwise), and the output names the mode.
TEST_F(EngineBenchProfileTest, ColdWeightsKvRunsEveryStepOnTheWholeBatch) {
  EngineBenchConfig c = Config(true);
  c.cold = EngineBenchConfig::Cold::kWeightsKv;
  auto r = RunEngineBench(c);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->decode.size(), 2u);
  for (const DecodeFigure& d : r->decode) EXPECT_GT(d.tokens_per_s, 0);
  EXPECT_EQ(r->cold, "weights-kv");
  EXPECT_THAT(r->ToTable(), ::testing::HasSubstr("cold before each timed "
                                                 "step: weights-kv"));
  EXPECT_THAT(r->ToJson(), ::testing::HasSubstr("\"cold\": \"weights-kv\""));
  EXPECT_EQ(RunEngineBench(Config(false))->cold, "all");
}

TEST(EngineBenchColdTest, NamesParseBothWaysAndOthersAreRefused) {
  for (auto cold :
       {EngineBenchConfig::Cold::kAll, EngineBenchConfig::Cold::kWeightsKv}) {
    EXPECT_EQ(ParseCold(ColdName(cold)), cold);
  }
  EXPECT_FALSE(ParseCold("weights").has_value());
  EXPECT_FALSE(ParseCold("").has_value());
}

TEST(EngineBenchColdTest, WeightsKvRefusesModelsWithMlaOrMoeLayers) {
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("engine_bench_mla_" + std::to_string(::getpid())))
                              .string();
  engine::ModelInitOptions opts;
  opts.preset = "deepseek-v2";
  opts.out_dir = dir;
  ASSERT_TRUE(engine::WriteRandomModel(opts).ok());
  EngineBenchConfig c;
  c.model_dir = dir;
  c.prefill_tokens = 8;
  c.decode_context = 8;
  c.batch_sizes = {1};
  c.decode_steps = 2;
  c.stream_bytes = 4 << 20;
  c.cold = EngineBenchConfig::Cold::kWeightsKv;
  auto r = RunEngineBench(c);
  std::filesystem::remove_all(dir);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
      << r.status();
}

}  // namespace
}  // namespace pdserve::bench
