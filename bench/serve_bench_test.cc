#include "bench/serve_bench.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

#include "tests/cluster.h"

namespace pdserve::bench {
namespace {

using ::testing::HasSubstr;

TEST(ServeBenchTest, NearestRankPercentiles) {
  std::vector<double> v;
  for (int i = 100; i >= 1; --i) v.push_back(i);  // 1..100, unsorted
  const Percentiles p = ComputePercentiles(v);
  EXPECT_EQ(p.p50, 50);
  EXPECT_EQ(p.p90, 90);
  EXPECT_EQ(p.p99, 99);
  EXPECT_DOUBLE_EQ(p.mean, 50.5);
  const Percentiles three = ComputePercentiles({3, 1, 2});
  EXPECT_EQ(three.p50, 2);
  EXPECT_EQ(three.p99, 3);
  EXPECT_EQ(ComputePercentiles({}).p50, 0);
}

TEST(ServeBenchTest, SummaryCountsTokensHitsAndSlo) {
  std::vector<RequestResult> r(4);
  for (int i = 0; i < 4; ++i) {
    r[i].ok = i != 3;
    r[i].ttft_s = 0.1 * (i + 1);
    r[i].e2e_s = r[i].ttft_s + 0.5;
    r[i].itl_s = {0.1, 0.1, 0.1, 0.1, 0.1};
    r[i].prompt_tokens = 100;
    r[i].completion_tokens = 6;
    r[i].cached_prompt_tokens = i == 0 ? 0 : 64;
  }
  const ServeReport s = Summarise(r, 2.0, /*slo_ttft=*/0.25, /*slo_itl=*/0.2);
  EXPECT_EQ(s.succeeded, 3);
  EXPECT_EQ(s.failed, 1);
  EXPECT_EQ(s.prompt_tokens, 300);
  EXPECT_EQ(s.completion_tokens, 18);
  EXPECT_DOUBLE_EQ(s.prefix_hit_rate, 128.0 / 300);
  EXPECT_DOUBLE_EQ(s.requests_per_s, 1.5);
  EXPECT_DOUBLE_EQ(s.slo_attainment, 0.5);  // 2 of 4 within TTFT 0.25 s
  EXPECT_DOUBLE_EQ(s.ttft.p50, 0.2);
}

TEST(ServeBenchTest, TraceParserNamesTheBadLine) {
  const std::string good =
      R"({"arrival_s": 0.5, "prompt": "hi", "max_tokens": 3}
{"arrival_s": 1, "prompt_tokens": 20, "max_tokens": 2, "prefix_group": "g"}

{"arrival_s": 2, "prompt_tokens": 20, "max_tokens": 2, "prefix_group": "g"}
)";
  auto ok = ParseTrace(good, "t.jsonl");
  ASSERT_TRUE(ok.ok()) << ok.status();
  ASSERT_EQ(ok->size(), 3u);
  EXPECT_EQ((*ok)[1].prompt.substr(0, 20),
            (*ok)[2].prompt.substr(0, 20));  // shared group prefix
  const std::pair<std::string, std::string> bad[] = {
      {"{\"arrival_s\": 0, \"prompt\": \"x\", \"max_tokens\": 1}\n{not json}\n",
       "t.jsonl:2"},
      {"{\"arrival_s\": -1, \"prompt\": \"x\", \"max_tokens\": 1}\n",
       "t.jsonl:1"},
      {"\n\n{\"arrival_s\": 0, \"max_tokens\": 1}\n", "t.jsonl:3"},
      {"{\"arrival_s\": 0, \"prompt\": \"x\", \"max_tokens\": 0}\n",
       "t.jsonl:1"},
      {"[1,2]\n", "t.jsonl:1"},
  };
  for (const auto& [text, where] : bad) {
    auto r = ParseTrace(text, "t.jsonl");
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(where))
        << r.status();
  }
}

TEST(ServeBenchTest, MultiturnInterleavesConversationsThatExtendEachOther) {
  WorkloadConfig c;
  c.name = "multiturn";
  c.num_requests = 36;
  c.input_len = 448;
  c.output_len = 8;
  c.seed = 3;
  auto w = MakeWorkload(c);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_EQ(w->size(), 36u);
  const int conversations = 36 / kMultiturnTurns;
  std::map<std::string, std::vector<int>> turns;  // group -> request indices
  for (int i = 0; i < 36; ++i) turns[(*w)[i].prefix_group].push_back(i);
  ASSERT_EQ(static_cast<int>(turns.size()), conversations);
  std::vector<double> reuse;
  std::set<std::string> heads;
  for (const auto& [group, idx] : turns) {
    ASSERT_EQ(static_cast<int>(idx.size()), kMultiturnTurns) << group;
    EXPECT_EQ((*w)[idx[0]].prompt.size(), 448u) << group;
    heads.insert((*w)[idx[0]].prompt.substr(0, 16));
    for (size_t k = 1; k < idx.size(); ++k) {
      // Interleaved: every other conversation has a turn in between.
      EXPECT_EQ(idx[k] - idx[k - 1], conversations) << group;
      const std::string& prev = (*w)[idx[k - 1]].prompt;
      const std::string& cur = (*w)[idx[k]].prompt;
      ASSERT_GT(cur.size(), prev.size()) << group << " turn " << k;
      EXPECT_EQ(cur.compare(0, prev.size(), prev), 0)
          << group << " turn " << k << " does not extend turn " << k - 1;
      reuse.push_back(static_cast<double>(prev.size()) / cur.size());
    }
  }
  // No two conversations share their first KV block (16 tokens).
  EXPECT_EQ(static_cast<int>(heads.size()), conversations);
  for (double r : reuse) {
    EXPECT_GE(r, kMultiturnMinReuse - 0.01);
    EXPECT_LE(r, kMultiturnMaxReuse + 0.01);
  }
  std::sort(reuse.begin(), reuse.end());
  const double median = reuse[reuse.size() / 2];
  EXPECT_GT(median, 0.8);
  EXPECT_LT(median, 0.9);
  // Deterministic for a seed; another seed draws other turns.
  auto again = MakeWorkload(c);
  ASSERT_TRUE(again.ok());
  for (int i = 0; i < 36; ++i) EXPECT_EQ((*again)[i].prompt, (*w)[i].prompt);
  c.seed = 4;
  auto other = MakeWorkload(c);
  ASSERT_TRUE(other.ok());
  EXPECT_NE((*other)[35].prompt, (*w)[35].prompt);
  // A count that is not a multiple of the turns: the last round is short.
  c.num_requests = 10;
  auto ten = MakeWorkload(c);
  ASSERT_TRUE(ten.ok());
  ASSERT_EQ(ten->size(), 10u);
  EXPECT_EQ((*ten)[0].prefix_group, "conv0");
  EXPECT_EQ((*ten)[1].prefix_group, "conv1");
  EXPECT_EQ((*ten)[9].prefix_group, "conv1");
  EXPECT_EQ(
      (*ten)[9].prompt.compare(0, (*ten)[7].prompt.size(), (*ten)[7].prompt),
      0);
}

TEST(ServeBenchTest, LiveClusterRequestAndTokenCountsMatchTheSchedule) {
  const std::string model = std::filesystem::temp_directory_path() /
                            ("pdserve_bench_" + std::to_string(::getpid()));
  ASSERT_EQ(
      std::system((std::string(PDSERVE_BIN) +
                   " model init --preset tiny --out " + model + " 2>/dev/null")
                      .c_str()),
      0);
  auto cluster = testing::Cluster::Start(model, 1, 1);
  ServeBenchConfig c;
  c.router = cluster.router.address;
  c.workload.name = "synthetic";
  c.workload.num_requests = 9;
  c.workload.input_len = 40;
  c.workload.output_len = 7;
  c.concurrency = 3;
  c.progress = false;
  auto report = RunServeBench(c);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->requests, 9);
  EXPECT_EQ(report->succeeded, 9);
  EXPECT_EQ(report->completion_tokens, 9 * 7);
  EXPECT_EQ(report->prompt_tokens, 9 * 41);  // byte tokenizer: 40 bytes + BOS
  EXPECT_GT(report->ttft.p50, 0);
  EXPECT_LE(report->ttft.p50, report->ttft.p99);
  // Open loop: arrivals follow the Poisson schedule, so the run lasts at
  // least until the last arrival.
  c.concurrency = 0;
  c.workload.rate = 20;
  auto specs = MakeWorkload(c.workload);
  ASSERT_TRUE(specs.ok());
  auto open = RunServeBench(c);
  ASSERT_TRUE(open.ok());
  EXPECT_EQ(open->succeeded, 9);
  EXPECT_GE(open->duration_s, specs->back().arrival_s);
  const std::string svg =
      std::filesystem::temp_directory_path() / "pdserve_cdf_test.svg";
  ASSERT_TRUE(WriteCdfSvg(*open, svg).ok());
  EXPECT_GT(std::filesystem::file_size(svg), 200u);
  std::filesystem::remove(svg);
  std::filesystem::remove_all(model);
}

// A free TCP port on loopback (bound and released; the router takes it
// right after).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

TEST(ServeBenchTest, OpenAiModeCountsTheSameAsGrpcMode) {
  const std::string model =
      std::filesystem::temp_directory_path() /
      ("pdserve_bench_openai_" + std::to_string(::getpid()));
  ASSERT_EQ(
      std::system((std::string(PDSERVE_BIN) +
                   " model init --preset tiny --out " + model + " 2>/dev/null")
                      .c_str()),
      0);
  const int http_port = FreePort();
  auto cluster = testing::Cluster::Start(
      model, 1, 1,
      {"--http-port=" + std::to_string(http_port), "--served-model-name=m"});
  ServeBenchConfig c;
  c.workload.name = "synthetic";
  c.workload.num_requests = 9;
  c.workload.input_len = 40;
  c.workload.output_len = 7;
  c.concurrency = 3;
  c.progress = false;
  c.router = cluster.router.address;
  auto grpc = RunServeBench(c);
  ASSERT_TRUE(grpc.ok()) << grpc.status();
  c.router.clear();
  c.openai_url = "http://127.0.0.1:" + std::to_string(http_port) + "/v1";
  auto http = RunServeBench(c);  // the model name comes from /v1/models
  ASSERT_TRUE(http.ok()) << http.status();
  EXPECT_EQ(http->succeeded, 9);
  EXPECT_EQ(http->completion_tokens, grpc->completion_tokens);
  EXPECT_EQ(http->prompt_tokens, grpc->prompt_tokens);
  EXPECT_GT(http->ttft.p50, 0);
  // 7 tokens per request: 6 inter-token gaps each.
  EXPECT_GT(http->itl.p50, 0);
  // A model the server does not serve fails every request (404).
  c.openai_model = "not-served";
  auto wrong = RunServeBench(c);
  ASSERT_TRUE(wrong.ok()) << wrong.status();
  EXPECT_EQ(wrong->failed, 9);
  c.openai_url = "127.0.0.1:1";
  EXPECT_FALSE(RunServeBench(c).ok());
  std::filesystem::remove_all(model);
}

}  // namespace
}  // namespace pdserve::bench
