// `--kv-dtype fp8` as users meet it through the real `pdserve` binary: a
// KV-budget spelling (1 byte an element plus per-(block, head) scales), and
// on the CPU a clear INVALID_ARGUMENT error (exit 2) naming the fix.
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

struct Result {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

class KvDtypeCliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ =
        new std::string(std::filesystem::temp_directory_path() /
                        ("pdserve_kv_dtype_cli_" + std::to_string(::getpid())));
    std::filesystem::create_directories(*dir_);
    ASSERT_EQ(Run("model init --preset tiny --out " + Model()).exit_code, 0);
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }
  static std::string Model() { return *dir_ + "/tiny"; }
  // Runs pdserve with `args`; a command that should fail at once but serves
  // instead is stopped after 60 s (exit 124) rather than hanging the test.
  static Result Run(const std::string& args) {
    Result r;
    const std::string err_path = *dir_ + "/stderr";
    const std::string cmd = "timeout 60 " + std::string(PDSERVE_BIN) + " " +
                            args + " 2>" + err_path;
    FILE* p = popen(cmd.c_str(), "r");
    std::array<char, 4096> buf;
    size_t n;
    while ((n = fread(buf.data(), 1, buf.size(), p)) > 0)
      r.out.append(buf.data(), n);
    const int status = pclose(p);
    r.exit_code =
        WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::ifstream in(err_path);
    r.err.assign(std::istreambuf_iterator<char>(in), {});
    return r;
  }
  static std::string* dir_;
};
std::string* KvDtypeCliTest::dir_ = nullptr;

TEST_F(KvDtypeCliTest, KvBudgetCountsOneBytePerElementPlusScales) {
  // Llama-3.2-1B's KV: 16 layers, 8 KV heads, head_dim 64.
  const Result r =
      Run("kv-budget --layers 16 --kv-heads 8 --head-dim 64 --dtype fp8 "
          "--block-size 16 --tokens 1024");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("\"dtype\": \"fp8\""));
  EXPECT_THAT(r.out, HasSubstr("\"bytes_per_token\": 16384"));
  // 16 tokens x 16384 B + 2 (K, V) x 16 layers x 8 heads x 4 B of scales.
  EXPECT_THAT(r.out, HasSubstr("\"bytes_per_block\": 263168"));
  EXPECT_THAT(r.out, HasSubstr("\"bytes\": 16777216"));
}

TEST_F(KvDtypeCliTest, Fp8OnTheCpuIsAnErrorThatNamesTheFix) {
  for (const std::string& cmd :
       {"generate --model " + Model() + " --prompt hi --max-tokens 2",
        "generate --model " + Model() + " --prompt hi --device cpu",
        "worker --insecure --role both --device cpu --port 0 --metrics-port 0 "
        "--model " +
            Model()}) {
    const Result r = Run(cmd + " --kv-dtype fp8");
    EXPECT_EQ(r.exit_code, 2) << cmd << "\n" << r.err;
    EXPECT_THAT(r.err, HasSubstr("--kv-dtype fp8")) << cmd;
    EXPECT_THAT(r.err, HasSubstr("--device cuda")) << cmd;
    EXPECT_THAT(r.err, HasSubstr("--kv-dtype int8")) << cmd;
    EXPECT_EQ(r.out, "") << cmd;
  }
  // int8 is the CPU's 1-byte KV and works.
  const Result ok = Run("generate --model " + Model() +
                        " --prompt hi --max-tokens 2 --kv-dtype int8");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
}

TEST_F(KvDtypeCliTest, UnknownKvDtypeListsFp8AndFp8IsNoWeightDtype) {
  const Result r =
      Run("generate --model " + Model() + " --prompt hi --kv-dtype fp4");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("int8 or fp8"));
  const Result init =
      Run("model init --preset tiny --dtype fp8 --out " + *dir_ + "/fp8");
  EXPECT_EQ(init.exit_code, 2);
  EXPECT_FALSE(std::filesystem::exists(*dir_ + "/fp8/config.json"));
}

}  // namespace
