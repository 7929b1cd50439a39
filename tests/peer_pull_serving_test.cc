// Peer pull end to end: real router and worker processes on
// loopback. Round-robin routing sends a repeated prompt to the prefill worker
// that lacks its prefix; with --peer-pull it pulls the blocks from the worker
// that has them, and the tokens stay identical to the local reference path.
#include <gtest/gtest.h>

#include <filesystem>

#include "absl/strings/match.h"
#include "tests/cluster.h"

namespace pdserve::testing {
namespace {

using std::chrono::seconds;

// Confirmed (event-fed) index entries across the cluster's workers.
int64_t IndexedBlocks(Cluster& c) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + seconds(5));
  v1::ListWorkersResponse resp;
  if (!c.stub->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp).ok())
    return -1;
  int64_t n = 0;
  for (const auto& w : resp.workers()) n += w.indexed_blocks();
  return n;
}

class PeerPullServingTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ =
        new std::string(std::filesystem::temp_directory_path() /
                        ("pdserve_peer_pull_" + std::to_string(::getpid())));
    RunPdserve("model init --preset tiny --out " + *model_ + " --seed 3");
    ASSERT_TRUE(std::filesystem::exists(*model_ + "/config.json"));
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(*model_, ec);
    delete model_;
    model_ = nullptr;
  }
  static std::string* model_;
};
std::string* PeerPullServingTest::model_ = nullptr;

// The KV transport of the cluster's workers: grpc (what `pdserve worker`
// picks), or shm (what `pdserve up` picks on CPU: prefill writes into the
// decode worker's pool, and a pulled prefix is written by the holder straight
// into the puller's pool).
class PeerPullOverTransportTest
    : public PeerPullServingTest,
      public ::testing::WithParamInterface<std::string> {
 protected:
  std::vector<std::string> WorkerFlags() const {
    return {"--kv-transport=" + GetParam()};
  }
};

TEST_P(PeerPullOverTransportTest,
       RepeatedPromptOnTheOtherPrefillWorkerIsPulled) {
  // min speedup 0.01: pull whenever the index has a holder, whatever the
  // rates this loaded test machine measures.
  Cluster c =
      Cluster::Start(*model_, 2, 1,
                     {"--policy=round_robin", "--local-prefill-threshold=-1",
                      "--peer-pull", "--peer-pull-min-speedup=0.01"},
                     WorkerFlags());
  const std::string prompt = Family(1) + "Question: what is seven times six?";
  const std::vector<uint32_t> local = LocalTokens(*model_, prompt, 16, 0, 0);
  ASSERT_FALSE(local.empty());
  auto first = Generate(c.stub.get(), Request(prompt, 16));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(first.tokens, local);
  // The index learns who holds the prompt from the workers' KV events.
  ASSERT_TRUE(WaitUntil([&] { return IndexedBlocks(c) > 0; }, seconds(10)));
  auto second = Generate(c.stub.get(), Request(prompt, 16));
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(second.tokens, local);
  EXPECT_NE(second.last.prefill_worker(), first.last.prefill_worker());
  EXPECT_EQ(SumOverWorkers(c, "pdserve_kv_peer_pull_total{outcome=\"pulled\"}"),
            1);
  EXPECT_GT(SumOverWorkers(c, "pdserve_kv_peer_pull_blocks_total"), 0);
  EXPECT_EQ(
      SumOverWorkers(c, "pdserve_kv_peer_pull_served_total{outcome=\"sent\"}"),
      1);
  EXPECT_EQ(SumOverWorkers(
                c, "pdserve_kv_peer_pull_served_total{outcome=\"refused\"}"),
            0);
  EXPECT_GT(second.last.usage().cached_prompt_tokens(), 0u);
  // The router's side: nobody held the prompt the first time; the pull it
  // asked for the second time was reported done, so no holder is backed off.
  const std::string router_metrics = Scrape(c.router.metrics_port);
  EXPECT_EQ(MetricValue(router_metrics,
                        "pdserve_router_peer_pull_decisions_total{decision="
                        "\"no_holder\"}"),
            1);
  EXPECT_EQ(MetricValue(router_metrics,
                        "pdserve_router_peer_pull_decisions_total{decision="
                        "\"pull\"}"),
            1);
  EXPECT_EQ(MetricValue(router_metrics,
                        "pdserve_router_peer_pull_failures_total{reason="
                        "\"failed\"}"),
            0);
  EXPECT_EQ(
      MetricValue(router_metrics, "pdserve_router_peer_pull_backoffs_total"),
      0);
  ExpectNoActiveBlocks(c);
}

INSTANTIATE_TEST_SUITE_P(Transports, PeerPullOverTransportTest,
                         ::testing::Values("grpc", "shm"),
                         [](const auto& info) { return info.param; });

// A holder whose pull fails (here: its process is stopped, so the pull
// times out) is reported by the prefill worker through the decode worker;
// the router counts the failure and backs that holder off. The request is
// recomputed with the same tokens.
TEST_F(PeerPullServingTest, FailedPullIsReportedAndBacksOffTheHolder) {
  Cluster c =
      Cluster::Start(*model_, 2, 1,
                     {"--policy=round_robin", "--local-prefill-threshold=-1",
                      "--peer-pull", "--peer-pull-min-speedup=0.01"},
                     {"--kv-transport=shm"});
  const std::string prompt = Family(2) + "Question: how many legs has a cat?";
  const std::vector<uint32_t> local = LocalTokens(*model_, prompt, 8, 0, 0);
  ASSERT_FALSE(local.empty());
  auto first = Generate(c.stub.get(), Request(prompt, 8));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  ASSERT_TRUE(WaitUntil([&] { return IndexedBlocks(c) > 0; }, seconds(10)));
  Proc* holder = nullptr;
  for (Proc& p : c.prefill) {
    if (absl::StrContains(first.last.prefill_worker(), p.address)) holder = &p;
  }
  ASSERT_NE(holder, nullptr) << first.last.prefill_worker();
  // Stopped, the holder answers nothing; the router's polls take a few
  // missed heartbeats to call it down, so the repeat (round robin: the other
  // prefill worker) is told to pull from it and the pull times out.
  ASSERT_EQ(kill(holder->pid, SIGSTOP), 0);
  auto second = Generate(c.stub.get(), Request(prompt, 8));
  kill(holder->pid, SIGCONT);
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(second.tokens, local);
  EXPECT_NE(second.last.prefill_worker(), first.last.prefill_worker());
  const std::string router_metrics = Scrape(c.router.metrics_port);
  EXPECT_EQ(MetricValue(router_metrics,
                        "pdserve_router_peer_pull_decisions_total{decision="
                        "\"pull\"}"),
            1);
  EXPECT_EQ(MetricValue(router_metrics,
                        "pdserve_router_peer_pull_failures_total{reason="
                        "\"failed\"}"),
            1);
  EXPECT_EQ(
      MetricValue(router_metrics, "pdserve_router_peer_pull_backoffs_total"),
      1);
  EXPECT_EQ(SumOverWorkers(c, "pdserve_kv_peer_pull_total{outcome=\"failed\"}"),
            1);
  ExpectNoActiveBlocks(c);
}

TEST_F(PeerPullServingTest, OutputsStayIdenticalToLocalWithPeerPullOn) {
  Cluster c =
      Cluster::Start(*model_, 2, 2,
                     {"--policy=round_robin", "--local-prefill-threshold=-1",
                      "--peer-pull", "--peer-pull-min-speedup=0.01"});
  // Three families asked in turn, each three times, greedy and seeded: most
  // repeats land on a prefill worker that pulls the family's prefix.
  for (int round = 0; round < 3; ++round) {
    for (int f = 1; f <= 3; ++f) {
      const std::string prompt =
          Family(f) + absl::StrCat("Question ", round, ": what next?");
      const float temp = f == 2 ? 0.9f : 0.0f;
      const uint64_t seed = f == 2 ? 77 : 0;
      auto got = Generate(c.stub.get(), Request(prompt, 12, temp, seed));
      ASSERT_TRUE(got.status.ok()) << got.status.error_message();
      EXPECT_EQ(got.tokens, LocalTokens(*model_, prompt, 12, temp, seed))
          << "family " << f << " round " << round;
    }
    WaitUntil([&] { return IndexedBlocks(c) > 0; }, seconds(10));
  }
  EXPECT_GT(SumOverWorkers(c, "pdserve_kv_peer_pull_total{outcome=\"pulled\"}"),
            0);
  ExpectNoActiveBlocks(c);
}

}  // namespace
}  // namespace pdserve::testing
