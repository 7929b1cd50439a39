// Runs the real `pdserve` binary the way users do and checks what they see.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

namespace {

using ::testing::HasSubstr;
using ::testing::Not;

struct Result {
  int exit_code = -1;
  std::string out;  // stdout only
};

class CliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(std::filesystem::temp_directory_path() /
                           ("pdserve_cli_" + std::to_string(::getpid())));
    std::filesystem::create_directories(*dir_);
    ASSERT_EQ(Run("model init --preset tiny --out " + Model() + " --seed 5")
                  .exit_code,
              0);
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(*dir_, ec);
    delete dir_;
    dir_ = nullptr;
  }
  static std::string Model() { return *dir_ + "/tiny"; }
  static Result Run(const std::string& args) {
    Result r;
    const std::string cmd =
        std::string(PDSERVE_BIN) + " " + args + " 2>" + *dir_ + "/stderr";
    FILE* p = popen(cmd.c_str(), "r");
    std::array<char, 4096> buf;
    size_t n;
    while ((n = fread(buf.data(), 1, buf.size(), p)) > 0)
      r.out.append(buf.data(), n);
    const int status = pclose(p);
    r.exit_code =
        WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return r;
  }
  static std::string Stderr() {
    std::ifstream in(*dir_ + "/stderr");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  static std::string* dir_;
};
std::string* CliTest::dir_ = nullptr;

TEST_F(CliTest, KvBudgetReproducesTheReferenceFigures) {
  auto r = Run("kv-budget --layers 2 --kv-heads 4 --head-dim 8 --dtype fp16");
  ASSERT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out, HasSubstr("\"bytes_per_token\": 256"));
  r =
      Run("kv-budget --layers 32 --kv-heads 8 --head-dim 128 --dtype fp16 "
          "--tokens 8192 --memory 1GiB");
  ASSERT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out, HasSubstr("\"bytes_per_token\": 131072"));
  EXPECT_THAT(r.out, HasSubstr("\"bytes\": 1073741824"));
  EXPECT_THAT(r.out, HasSubstr("\"tokens_fit\": 8192"));
  r = Run("kv-budget --layers 0 --kv-heads 4 --head-dim 8");
  EXPECT_EQ(r.exit_code, 2);
}

// MLA (DeepSeek-V2's full config: 60 layers, kv_lora_rank 512, rope key 64,
// bf16): (512 + 64) x 60 x 2 = 69,120 B per token, beside the MHA cache of
// its 128 heads of 128 dims: 2 x 60 x 128 x 128 x 2 = 3,932,160 B.
TEST_F(CliTest, KvBudgetReportsMlaLatentBytesBesideMha) {
  auto r =
      Run("kv-budget --layers 60 --kv-lora-rank 512 --qk-rope-head-dim 64 "
          "--dtype bf16 --kv-heads 128 --head-dim 128 --tokens 1000");
  ASSERT_EQ(r.exit_code, 0) << Stderr();
  EXPECT_THAT(r.out, HasSubstr("\"bytes_per_token\": 69120"));
  EXPECT_THAT(r.out, HasSubstr("\"bytes\": 69120000"));
  EXPECT_THAT(r.out, HasSubstr("\"mha_bytes_per_token\": 3932160"));
  // Without heads there is no MHA figure, and the latent needs both flags.
  r =
      Run("kv-budget --layers 60 --kv-lora-rank 512 --qk-rope-head-dim 64 "
          "--dtype bf16");
  ASSERT_EQ(r.exit_code, 0) << Stderr();
  EXPECT_THAT(r.out, HasSubstr("\"bytes_per_token\": 69120"));
  EXPECT_THAT(r.out, Not(HasSubstr("mha_bytes_per_token")));
  r = Run("kv-budget --layers 60 --kv-lora-rank 512 --dtype bf16");
  EXPECT_EQ(r.exit_code, 2);
}

TEST_F(CliTest, GenerateStreamsOnlyTheTextAndIsDeterministic) {
  auto a = Run("generate --model " + Model() +
               " --prompt hello --max-tokens 12 --temperature 0.9 --seed 7");
  auto b = Run("generate --model " + Model() +
               " --prompt hello --max-tokens 12 --temperature 0.9 --seed 7");
  ASSERT_EQ(a.exit_code, 0) << Stderr();
  EXPECT_FALSE(a.out.empty());
  EXPECT_EQ(a.out, b.out);
  auto j =
      Run("generate --model " + Model() +
          " --prompt hello --max-tokens 12 --temperature 0.9 --seed 7 --json");
  ASSERT_EQ(j.exit_code, 0);
  EXPECT_THAT(j.out, HasSubstr("\"finish_reason\": \"length\""));
  EXPECT_THAT(j.out, HasSubstr("\"completion_tokens\": 12"));
  EXPECT_THAT(j.out, HasSubstr("\"prompt_tokens\": 6"));
  // Batch-invariant kernels: a bf16 KV cache or tiny step budget must not
  // matter for the fp32 path, so chunked prefill gives the same text.
  auto c = Run("generate --model " + Model() +
               " --prompt hello --max-tokens 12 --temperature 0.9 --seed 7 "
               "--max-num-batched-tokens 2");
  EXPECT_EQ(c.out, a.out);
}

TEST_F(CliTest, StopStringsEndTheTextBeforeTheMatch) {
  auto full = Run("generate --model " + Model() +
                  " --prompt abc --max-tokens 40 --ignore-eos --json");
  ASSERT_EQ(full.exit_code, 0);
  auto plain = Run("generate --model " + Model() +
                   " --prompt abc --max-tokens 40 --ignore-eos");
  ASSERT_GE(plain.out.size(), 6u);
  // Use a stop string taken from the middle of the real output.
  const std::string stop = plain.out.substr(3, 2);
  if (stop.find('\'') != std::string::npos) GTEST_SKIP() << "quote in sample";
  auto s = Run("generate --model " + Model() +
               " --prompt abc --max-tokens 40 --ignore-eos --stop '" + stop +
               "' --stop 'zzzz' --json");
  ASSERT_EQ(s.exit_code, 0) << Stderr();
  EXPECT_THAT(s.out, HasSubstr("\"finish_reason\": \"stop\""));
  auto t =
      Run("generate --model " + Model() +
          " --prompt abc --max-tokens 40 --ignore-eos --stop '" + stop + "'");
  EXPECT_EQ(t.out, plain.out.substr(0, plain.out.find(stop)));
}

TEST_F(CliTest, BadInputGivesClearErrorsNotCrashes) {
  auto r = Run("generate --model " + Model() + " --prompt x --max-tokens 0");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(Stderr(), HasSubstr("max_tokens"));
  r = Run("generate --model " + Model() + " --prompt x --temperature -1");
  EXPECT_EQ(r.exit_code, 2);
  r = Run("generate --model /nonexistent --prompt x");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(Stderr(), HasSubstr("/nonexistent"));
  r = Run("model logits --model " + Model() + " --tokens 1,x");
  EXPECT_EQ(r.exit_code, 2);
  r = Run("model logits --model " + Model() + " --tokens 1,99999");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(Stderr(), HasSubstr("vocabulary"));
  // A truncated checkpoint.
  const std::string broken = *dir_ + "/broken";
  std::filesystem::create_directories(broken);
  std::filesystem::copy_file(Model() + "/config.json", broken + "/config.json",
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::copy_file(Model() + "/model.safetensors",
                             broken + "/model.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::resize_file(
      broken + "/model.safetensors",
      std::filesystem::file_size(broken + "/model.safetensors") / 2);
  r = Run("model logits --model " + broken + " --tokens 1,2");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(Stderr(), HasSubstr("model.safetensors"));
  EXPECT_THAT(Stderr(), HasSubstr("truncated"));
  r = Run("no-such-command");
  EXPECT_EQ(r.exit_code, 2);
}

TEST_F(CliTest, RouterRegistryFlagsAreValidated) {
  const std::string router = "router --model " + Model() +
                             " --insecure --decode-workers 127.0.0.1:1"
                             " --port 0 --metrics-port 0";
  auto r = Run(router + " --worker-max-missed-polls 0");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(Stderr(), HasSubstr("--worker-max-missed-polls"));
  r = Run(router + " --worker-heartbeat-ms -5");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(Stderr(), HasSubstr("--worker-heartbeat-ms"));
  r = Run("router --help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out + Stderr(), HasSubstr("--worker-status-timeout-ms"));
}

TEST_F(CliTest, EveryCommandHasHelp) {
  for (const char* cmd : {"model init", "model logits", "generate", "kv-budget",
                          "bench engine"}) {
    auto r = Run(std::string(cmd) + " --help");
    EXPECT_EQ(r.exit_code, 0) << cmd;
    EXPECT_THAT(r.out, HasSubstr(std::string("usage: pdserve ") + cmd));
  }
  auto top = Run("--help");
  EXPECT_EQ(top.exit_code, 0);
  EXPECT_THAT(top.out, HasSubstr("kv-budget"));
}

}  // namespace
