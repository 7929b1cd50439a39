// Peer pull from a holder's KV tier, end to end: real router and
// worker processes on loopback, every worker with a small pool over a
// host-memory tier. Round robin puts a prompt on prefill worker A, later
// prompts push it out of A's and the decode worker's pools into their tiers,
// and the repeat lands on prefill worker B, which pulls the prefix from a
// holder's tier: the tokens equal the local reference path, the holder
// counts blocks sent from its tier, and no block stays referenced.
#include <gtest/gtest.h>

#include <filesystem>

#include "tests/cluster.h"

namespace pdserve::testing {
namespace {

using std::chrono::seconds;

// The router's index agrees with the workers' tiers (blocks stored there).
bool IndexHasTheTiers(Cluster& c) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + seconds(5));
  v1::ListWorkersResponse resp;
  if (!c.stub->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp).ok())
    return false;
  int64_t indexed = 0;
  for (const auto& w : resp.workers()) indexed += w.indexed_tier_blocks();
  const double stored =
      SumOverWorkers(c, "pdserve_kv_tier_blocks{state=\"stored\"}");
  return indexed > 0 && static_cast<double>(indexed) == stored;
}

TEST(PeerPullTierServingTest, PrefixPushedIntoTheTiersIsPulledFromOne) {
  const std::string model =
      std::filesystem::temp_directory_path() /
      ("pdserve_peer_pull_tier_" + std::to_string(::getpid()));
  RunPdserve("model init --preset tiny --out " + model + " --seed 3");
  ASSERT_TRUE(std::filesystem::exists(model + "/config.json"));
  {
    // tiny: 512 B/token in fp32, 8 KiB a block: pools of 48 blocks hold one
    // and a half prompts; tiers of 4 MiB hold them all.
    Cluster c = Cluster::Start(
        model, 2, 1,
        {"--policy=round_robin", "--local-prefill-threshold=-1", "--peer-pull",
         "--peer-pull-min-speedup=0.01"},
        {"--kv-cache-memory=384KiB", "--kv-offload-memory=4MiB"});
    auto ask = [&](int f, const std::string& question) {
      const std::string prompt = Family(f) + question;
      auto got = Generate(c.stub.get(), Request(prompt, 8));
      EXPECT_TRUE(got.status.ok()) << got.status.error_message();
      EXPECT_EQ(got.tokens, LocalTokens(model, prompt, 8)) << "family " << f;
      return got;
    };
    // Requests 0..4 alternate A, B, A, B, A: family 1 on A, then pushed out
    // of A's and the decode worker's pools by families 2..5.
    const auto first = ask(1, "Question: what is seven times six?");
    for (int f = 2; f <= 5; ++f) ask(f, "Question: and then?");
    ASSERT_TRUE(WaitUntil([&] { return IndexHasTheTiers(c); }, seconds(10)));
    // Request 5 goes to B, which lacks family 1 and pulls it.
    const auto again = ask(1, "Question: what is six times seven?");
    EXPECT_NE(again.last.prefill_worker(), first.last.prefill_worker());
    EXPECT_EQ(
        SumOverWorkers(c, "pdserve_kv_peer_pull_total{outcome=\"pulled\"}"), 1);
    EXPECT_GT(
        SumOverWorkers(
            c, "pdserve_kv_peer_pull_served_blocks_total{source=\"tier\"}"),
        0);
    EXPECT_GT(again.last.usage().cached_prompt_tokens(), 0u);
    ExpectNoActiveBlocks(c);
  }
  std::error_code ec;
  std::filesystem::remove_all(model, ec);
}

}  // namespace
}  // namespace pdserve::testing
