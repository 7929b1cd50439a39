// Disaggregated serving with --kv-transport shm, real processes on loopback
// (tests/cluster.h): a prefill and a decode worker on this node, the decode
// pool in a memfd the prefill worker maps. Tokens must equal a colocated
// worker's, greedy and seeded (the equivalence contract), and the bytes must
// really have moved over shm.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "absl/strings/str_cat.h"
#include "tests/cluster.h"

namespace pdserve::testing {
namespace {

using ::testing::HasSubstr;

class ShmServingTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ =
        new std::string(std::filesystem::temp_directory_path() /
                        ("pdserve_shm_serving_" + std::to_string(::getpid())));
    RunCli(PDSERVE_BIN,
           "model init --preset tiny --out " + *model_ + " --seed 5");
    ASSERT_TRUE(std::filesystem::exists(*model_ + "/config.json"));
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*model_);
    delete model_;
  }
  static std::string* model_;
};
std::string* ShmServingTest::model_ = nullptr;

TEST_F(ShmServingTest, DisaggregatedOverShmEqualsColocatedGreedyAndSeeded) {
  for (const char* dtype : {"fp32", "int8"}) {
    const std::vector<std::string> flags = {"--kv-transport=shm",
                                            absl::StrCat("--kv-dtype=", dtype),
                                            "--block-size=8"};
    Cluster disagg =
        Cluster::Start(*model_, 1, 1, {"--local-prefill-threshold=-1"}, flags);
    Cluster coloc =
        Cluster::Start(*model_, 0, 1, {},
                       {absl::StrCat("--kv-dtype=", dtype), "--block-size=8"});
    std::string prompt = "Shared memory moves the prompt's KV: ";
    for (int i = 0; i < 10; ++i)
      absl::StrAppend(&prompt, "block ", i, " of it. ");
    for (auto [temp, seed] : {std::pair{0.0f, 0ull}, {0.8f, 1234ull}}) {
      auto a = Generate(disagg.stub.get(), Request(prompt, 16, temp, seed));
      auto b = Generate(coloc.stub.get(), Request(prompt, 16, temp, seed));
      ASSERT_TRUE(a.status.ok()) << a.status.error_message();
      ASSERT_TRUE(b.status.ok()) << b.status.error_message();
      EXPECT_EQ(a.tokens.size(), 16u);
      EXPECT_EQ(a.tokens, b.tokens) << dtype << " temperature " << temp;
      EXPECT_THAT(a.last.prefill_worker(), HasSubstr("prefill@"));
      EXPECT_THAT(a.last.decode_worker(), HasSubstr("decode@"));
    }
    // The bytes went through shared memory: the prefill process has the
    // decode worker's memfd pool mapped (the memfd carries its creator's
    // pid, and the decode worker passed it over its pool socket).
    std::ifstream maps(absl::StrCat("/proc/", disagg.prefill[0].pid, "/maps"));
    const std::string mapped((std::istreambuf_iterator<char>(maps)),
                             std::istreambuf_iterator<char>());
    EXPECT_THAT(mapped, HasSubstr(absl::StrCat("memfd:pdserve-kv-pool-",
                                               disagg.decode[0].pid)))
        << dtype;
    const double sent =
        MetricValue(Scrape(disagg.prefill[0].metrics_port),
                    "pdserve_kv_transfer_bytes_total{direction=\"sent\"}");
    EXPECT_GT(sent, 0) << dtype;
    const double received =
        MetricValue(Scrape(disagg.decode[0].metrics_port),
                    "pdserve_kv_transfer_bytes_total{direction=\"received\"}");
    EXPECT_EQ(received, sent) << dtype;
  }
}

// A prefill worker that mapped the decode pool is killed: the next request
// is retried on the other prefill worker over shm, tokens are unchanged, and
// no worker keeps an active block.
TEST_F(ShmServingTest, KilledPrefillWorkerIsRetriedAndLeavesNoBlocks) {
  Cluster c = Cluster::Start(*model_, 2, 1, {"--local-prefill-threshold=0"},
                             {"--kv-transport=shm"});
  std::string prompt = "A prompt that survives a dead prefill worker: ";
  for (int i = 0; i < 8; ++i) absl::StrAppend(&prompt, "line ", i, ". ");
  auto warm = Generate(c.stub.get(), Request(prompt, 3));
  ASSERT_TRUE(warm.status.ok()) << warm.status.error_message();
  for (auto& p : c.prefill) {
    if (warm.last.prefill_worker() == "prefill@" + p.address) Kill(&p);
  }
  auto res = Generate(c.stub.get(), Request(prompt, 8));
  ASSERT_TRUE(res.status.ok()) << res.status.error_message();
  const std::string local =
      RunCli(PDSERVE_BIN, absl::StrCat("generate --model ", *model_,
                                       " --json --ignore-eos --max-tokens 8",
                                       " --prompt '", prompt, "'"));
  EXPECT_EQ(res.tokens, IdsFromJson(local));
  ExpectNoActiveBlocks(c);
}

TEST_F(ShmServingTest, CudaIpcOnACpuWorkerIsAClearError) {
  const std::string out =
      RunCli(PDSERVE_BIN,
             "worker --role decode --insecure --port 0 --metrics-port 0 "
             "--kv-transport cuda_ipc --model " +
                 *model_ + " 2>&1 | cat");
  EXPECT_THAT(out, HasSubstr("cuda_ipc"));
  EXPECT_THAT(out, HasSubstr("--device cuda"));
}

}  // namespace
}  // namespace pdserve::testing
