#include "common/metrics.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/metrics_http.h"
#include "prometheus/metric_family.h"

#ifndef PDSERVE_PROMTOOL
#define PDSERVE_PROMTOOL ""
#endif

namespace pdserve::metrics {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

class MetricsTest : public ::testing::Test {
 protected:
  // Registers a family or fails the test; keeps the tests to the point.
  template <typename Family>
  static Family* Must(absl::StatusOr<Family*> family) {
    EXPECT_TRUE(family.ok()) << family.status();
    return family.ok() ? *family : nullptr;
  }

  Registry registry_;
};

TEST_F(MetricsTest, RendersEveryKindInExpositionFormat) {
  CounterFamily* requests = Must(registry_.AddCounter(
      "pdserve_requests_total", "Requests finished.", {"role", "code"}));
  Must(requests->WithLabels({"prefill", "ok"}))->Increment(3);
  Must(requests->WithLabels({"decode", "ok"}))->Increment();
  Must(registry_.AddGauge("pdserve_queue_depth", "Queued requests."))
      ->WithLabels({})
      .value()
      ->Set(-2.5);
  HistogramFamily* ttft = Must(registry_.AddHistogram(
      "pdserve_ttft_seconds", "Time to first token.", {0.1, 1}, {"role"}));
  Histogram* prefill_ttft = Must(ttft->WithLabels({"prefill"}));
  prefill_ttft->Observe(0.05);
  prefill_ttft->Observe(0.5);
  prefill_ttft->Observe(7);

  EXPECT_EQ(registry_.Render(),
            "# HELP pdserve_queue_depth Queued requests.\n"
            "# TYPE pdserve_queue_depth gauge\n"
            "pdserve_queue_depth -2.5\n"
            "# HELP pdserve_requests_total Requests finished.\n"
            "# TYPE pdserve_requests_total counter\n"
            "pdserve_requests_total{role=\"decode\",code=\"ok\"} 1\n"
            "pdserve_requests_total{role=\"prefill\",code=\"ok\"} 3\n"
            "# HELP pdserve_ttft_seconds Time to first token.\n"
            "# TYPE pdserve_ttft_seconds histogram\n"
            "pdserve_ttft_seconds_count{role=\"prefill\"} 3\n"
            "pdserve_ttft_seconds_sum{role=\"prefill\"} 7.55\n"
            "pdserve_ttft_seconds_bucket{role=\"prefill\",le=\"0.1\"} 1\n"
            "pdserve_ttft_seconds_bucket{role=\"prefill\",le=\"1\"} 2\n"
            "pdserve_ttft_seconds_bucket{role=\"prefill\",le=\"+Inf\"} 3\n");
}

TEST_F(MetricsTest, UnlabelledFamiliesRenderZeroAndLabelledOnesWaitForUse) {
  Must(registry_.AddCounter("idle_total", "Never incremented."));
  CounterFamily* labelled =
      Must(registry_.AddCounter("labelled_total", "Labelled.", {"kind"}));
  EXPECT_EQ(registry_.Render(),
            "# HELP idle_total Never incremented.\n"
            "# TYPE idle_total counter\n"
            "idle_total 0\n");
  Must(labelled->WithLabels({"a"}));
  EXPECT_THAT(registry_.Render(), HasSubstr("labelled_total{kind=\"a\"} 0\n"));
}

TEST_F(MetricsTest, CounterOnlyGoesUp) {
  Counter* counter =
      *Must(registry_.AddCounter("tokens_total", "Tokens."))->WithLabels({});
  counter->Increment(2.5);
  counter->Increment(-4);
  counter->Increment(std::numeric_limits<double>::quiet_NaN());
  counter->Increment();
  EXPECT_DOUBLE_EQ(counter->Value(), 3.5);
  EXPECT_THAT(registry_.Render(), HasSubstr("\ntokens_total 3.5\n"));
}

TEST_F(MetricsTest, GaugeSetsIncrementsAndDecrements) {
  Gauge* gauge = *Must(registry_.AddGauge("free_blocks", "Free KV blocks."))
                      ->WithLabels({});
  gauge->Set(10);
  gauge->Increment(5);
  gauge->Decrement();
  gauge->Decrement(20);
  EXPECT_DOUBLE_EQ(gauge->Value(), -6);
  EXPECT_THAT(registry_.Render(), HasSubstr("\nfree_blocks -6\n"));
  gauge->Set(12345678);
  EXPECT_THAT(registry_.Render(), HasSubstr("\nfree_blocks 12345678\n"));
}

TEST_F(MetricsTest, HistogramBucketsAreCumulativeAndInclusive) {
  Histogram* latency = *Must(registry_.AddHistogram("latency_seconds",
                                                    "Latency.", {0.01, 0.1, 1}))
                            ->WithLabels({});
  for (double v : {0.005, 0.01, 0.02, 0.1, 0.5, 2.0, 3.0}) latency->Observe(v);
  latency->Observe(std::numeric_limits<double>::quiet_NaN());

  // A value equal to a bound counts in that bucket (le = "less or equal").
  EXPECT_THAT(latency->CumulativeCounts(), ElementsAre(2, 4, 5, 7));
  EXPECT_EQ(latency->Count(), 7u);
  EXPECT_NEAR(latency->Sum(), 5.635, 1e-12);
  const std::string text = registry_.Render();
  EXPECT_THAT(text, HasSubstr("latency_seconds_count 7\n"
                              "latency_seconds_sum 5.635\n"
                              "latency_seconds_bucket{le=\"0.01\"} 2\n"
                              "latency_seconds_bucket{le=\"0.1\"} 4\n"
                              "latency_seconds_bucket{le=\"1\"} 5\n"
                              "latency_seconds_bucket{le=\"+Inf\"} 7\n"));
}

TEST_F(MetricsTest, BucketHelpersGiveIncreasingBounds) {
  EXPECT_THAT(ExponentialBuckets(1, 2, 4), ElementsAre(1, 2, 4, 8));
  EXPECT_THAT(LinearBuckets(0, 0.5, 3), ElementsAre(0, 0.5, 1));
  const std::vector<double> latency = DefaultLatencyBuckets();
  EXPECT_DOUBLE_EQ(latency.front(), 0.001);
  EXPECT_DOUBLE_EQ(latency.back(), 60);
  EXPECT_TRUE(std::is_sorted(latency.begin(), latency.end()));
  EXPECT_TRUE(registry_.AddHistogram("a_seconds", "A.", latency).ok());
  // A trailing +Inf is implied, so it is accepted and dropped.
  HistogramFamily* b = Must(registry_.AddHistogram(
      "b_seconds", "B.", {1, std::numeric_limits<double>::infinity()}));
  EXPECT_THAT(b->bounds(), ElementsAre(1));
}

TEST_F(MetricsTest, EscapesLabelValuesAndHelp) {
  CounterFamily* family = Must(registry_.AddCounter(
      "escaped_total", "Help with \\ backslash,\nnewline and \"quotes\".",
      {"path"}));
  Must(family->WithLabels({"a\\b \"c\"\nd é"}))->Increment();
  EXPECT_EQ(registry_.Render(),
            "# HELP escaped_total Help with \\\\ backslash,\\nnewline and "
            "\"quotes\".\n"
            "# TYPE escaped_total counter\n"
            "escaped_total{path=\"a\\\\b \\\"c\\\"\\nd é\"} 1\n");
}

TEST_F(MetricsTest, LabelsRenderInDeclarationOrderAndSeriesSortByValue) {
  // Declared out of alphabetical order: scrapers and tests match the series
  // text literally, so the declared order is the rendered one.
  CounterFamily* rejections = Must(registry_.AddCounter(
      "rejections_total", "Rejections.", {"tenant", "limit"}));
  Must(rejections->WithLabels({"meter", "tokens_per_minute"}))->Increment();
  Must(rejections->WithLabels({"alpha", "concurrency"}))->Increment(2);
  Must(rejections->WithLabels({"meter", "concurrency"}))->Increment(3);
  Must(registry_.AddGauge("a_gauge", "Registered last, renders first."));
  EXPECT_EQ(registry_.Render(),
            "# HELP a_gauge Registered last, renders first.\n"
            "# TYPE a_gauge gauge\n"
            "a_gauge 0\n"
            "# HELP rejections_total Rejections.\n"
            "# TYPE rejections_total counter\n"
            "rejections_total{tenant=\"alpha\",limit=\"concurrency\"} 2\n"
            "rejections_total{tenant=\"meter\",limit=\"concurrency\"} 3\n"
            "rejections_total{tenant=\"meter\",limit=\"tokens_per_minute\"} "
            "1\n");
}

TEST_F(MetricsTest, CollectRunsCollectorsAndKeepsHelpUnescaped) {
  GaugeFamily* depth =
      Must(registry_.AddGauge("queue_depth", "Queued\nrequests.", {"role"}));
  Gauge* prefill = Must(depth->WithLabels({"prefill"}));
  Registry::CollectorHandle handle =
      registry_.AddCollector([&] { prefill->Set(4); });
  const prometheus::Collectable& collectable = registry_;
  const std::vector<prometheus::MetricFamily> families = collectable.Collect();
  ASSERT_EQ(families.size(), 1u);
  EXPECT_EQ(families[0].name, "queue_depth");
  // Escaping is the text format's business (Render), not the snapshot's.
  EXPECT_EQ(families[0].help, "Queued\nrequests.");
  EXPECT_EQ(families[0].type, prometheus::MetricType::Gauge);
  ASSERT_EQ(families[0].metric.size(), 1u);
  EXPECT_EQ(families[0].metric[0].gauge.value, 4);
  ASSERT_EQ(families[0].metric[0].label.size(), 1u);
  EXPECT_EQ(families[0].metric[0].label[0].name, "role");
  EXPECT_EQ(families[0].metric[0].label[0].value, "prefill");
}

TEST_F(MetricsTest, RejectsInvalidNamesLabelsHelpAndBuckets) {
  const auto invalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(registry_.AddGauge("", "Help.").status().code(), invalid);
  EXPECT_EQ(registry_.AddGauge("1abc", "Help.").status().code(), invalid);
  EXPECT_EQ(registry_.AddGauge("a-b", "Help.").status().code(), invalid);
  EXPECT_EQ(registry_.AddGauge("a b", "Help.").status().code(), invalid);
  EXPECT_TRUE(registry_.AddGauge("ns:sub_g0", "Help.").ok());
  EXPECT_TRUE(registry_.AddGauge("_leading", "Help.").ok());
  EXPECT_EQ(registry_.AddGauge("__reserved", "Help.").status().code(), invalid);
  // Counters carry the _total suffix the caller gives; nothing is appended.
  EXPECT_EQ(registry_.AddCounter("requests", "Help.").status().code(), invalid);
  EXPECT_EQ(registry_.AddGauge("g", "").status().code(), invalid);
  EXPECT_EQ(registry_.AddGauge("g", "bad \xff utf8").status().code(), invalid);
  EXPECT_EQ(registry_.AddGauge("g", "Help.", {"a:b"}).status().code(), invalid);
  EXPECT_EQ(registry_.AddGauge("g", "Help.", {"0a"}).status().code(), invalid);
  EXPECT_EQ(registry_.AddGauge("g", "Help.", {"__reserved"}).status().code(),
            invalid);
  EXPECT_EQ(registry_.AddGauge("g", "Help.", {"x", "x"}).status().code(),
            invalid);
  EXPECT_EQ(registry_.AddHistogram("h", "Help.", {1}, {"le"}).status().code(),
            invalid);
  EXPECT_EQ(registry_.AddHistogram("h", "Help.", {1, 1}).status().code(),
            invalid);
  EXPECT_EQ(registry_.AddHistogram("h", "Help.", {2, 1}).status().code(),
            invalid);
  EXPECT_EQ(registry_
                .AddHistogram("h", "Help.",
                              {std::numeric_limits<double>::quiet_NaN()})
                .status()
                .code(),
            invalid);
  EXPECT_EQ(registry_.AddHistogram("h", "Help.", ExponentialBuckets(1, 1, 3))
                .status()
                .code(),
            invalid);
  // Rejected registrations leave nothing behind.
  EXPECT_THAT(registry_.Render(), Not(HasSubstr("# TYPE g ")));
  EXPECT_THAT(registry_.Render(), Not(HasSubstr("# TYPE h ")));
}

TEST_F(MetricsTest, ReRegisteringReturnsTheSameFamilyOnlyWhenItMatches) {
  CounterFamily* first =
      Must(registry_.AddCounter("shared_total", "Shared.", {"role"}));
  EXPECT_EQ(Must(registry_.AddCounter("shared_total", "Shared.", {"role"})),
            first);
  const auto exists = absl::StatusCode::kAlreadyExists;
  EXPECT_EQ(
      registry_.AddGauge("shared_total", "Shared.", {"role"}).status().code(),
      exists);
  EXPECT_EQ(registry_.AddCounter("shared_total", "Shared.", {"other"})
                .status()
                .code(),
            exists);
  EXPECT_EQ(registry_.AddCounter("shared_total", "Different.", {"role"})
                .status()
                .code(),
            exists);

  HistogramFamily* h = Must(registry_.AddHistogram("h_seconds", "H.", {1, 2}));
  EXPECT_EQ(Must(registry_.AddHistogram("h_seconds", "H.", {1, 2})), h);
  EXPECT_EQ(registry_.AddHistogram("h_seconds", "H.", {1, 3}).status().code(),
            exists);
  // Names that would render the same series as another family.
  EXPECT_EQ(registry_.AddGauge("h_seconds_count", "C.").status().code(),
            exists);
  Must(registry_.AddGauge("g_bucket", "G."));
  EXPECT_EQ(registry_.AddHistogram("g", "G.", {1}).status().code(), exists);
}

TEST_F(MetricsTest, WithLabelsReturnsStableChildrenAndChecksValues) {
  GaugeFamily* family =
      Must(registry_.AddGauge("blocks", "Blocks.", {"state", "pool"}));
  Gauge* free_blocks = Must(family->WithLabels({"free", "gpu"}));
  for (int i = 0; i < 100; ++i) {
    Must(family->WithLabels({absl::StrCat("s", i), "gpu"}));
  }
  EXPECT_EQ(Must(family->WithLabels({"free", "gpu"})), free_blocks);
  EXPECT_EQ(family->WithLabels({"free"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(family->WithLabels({"free", "gpu", "x"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(family->WithLabels({"\xc3\x28", "gpu"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(family->WithLabels({"\xed\xa0\x80", "gpu"}).status().code(),
            absl::StatusCode::kInvalidArgument);  // UTF-16 surrogate
  EXPECT_EQ(family->Children().size(), 101u);
}

TEST_F(MetricsTest, ConcurrentUpdatesGiveExactTotals) {
  Counter* counter =
      *Must(registry_.AddCounter("ops_total", "Ops."))->WithLabels({});
  Gauge* gauge =
      *Must(registry_.AddGauge("in_flight", "In flight."))->WithLabels({});
  Histogram* histogram =
      *Must(registry_.AddHistogram("op_seconds", "Op latency.", {0.5}))
           ->WithLabels({});
  constexpr int kThreads = 4;
  constexpr int kPerThread = 100000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kPerThread; ++i) {
        counter->Increment();
        gauge->Increment(2);
        gauge->Decrement();
        histogram->Observe(i % 2 == 0 ? 0.25 : 1.0);
      }
    });
  }
  // Rendering concurrently with updates must be safe.
  for (int i = 0; i < 20; ++i) registry_.Render();
  for (std::thread& thread : threads) thread.join();

  constexpr int kTotal = kThreads * kPerThread;
  EXPECT_EQ(counter->Value(), kTotal);
  EXPECT_EQ(gauge->Value(), kTotal);
  EXPECT_THAT(histogram->CumulativeCounts(), ElementsAre(kTotal / 2, kTotal));
  EXPECT_EQ(histogram->Sum(), kTotal / 2 * 0.25 + kTotal / 2 * 1.0);
  EXPECT_THAT(registry_.Render(),
              HasSubstr(absl::StrCat("\nops_total ", kTotal, "\n")));
}

TEST_F(MetricsTest, CollectorsRefreshGaugesBeforeEachRenderUntilReset) {
  Gauge* used = *Must(registry_.AddGauge("kv_blocks", "KV blocks.", {"state"}))
                     ->WithLabels({"used"});
  int calls = 0;
  Registry::CollectorHandle handle =
      registry_.AddCollector([&] { used->Set(++calls * 10); });
  EXPECT_THAT(registry_.Render(), HasSubstr("kv_blocks{state=\"used\"} 10\n"));
  EXPECT_THAT(registry_.Render(), HasSubstr("kv_blocks{state=\"used\"} 20\n"));

  Registry::CollectorHandle moved = std::move(handle);
  handle.Reset();  // Moved-from: does nothing.
  registry_.Render();
  EXPECT_EQ(calls, 3);
  moved.Reset();
  registry_.Render();
  EXPECT_EQ(calls, 3);
}

// A tiny HTTP/1.1 client over a plain socket, so the test exercises the real
// server the way a Prometheus scraper does.
struct HttpResponse {
  int status = 0;
  std::string headers;
  std::string body;
};

// Sends `request` to 127.0.0.1:`port` and returns all bytes received until
// the server closes the connection.
std::string Exchange(int port, const std::string& request) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) {
    ADD_FAILURE() << "socket: " << std::strerror(errno);
    return "";
  }
  timeval timeout{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &address.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) !=
      0) {
    ADD_FAILURE() << "connect to port " << port << ": " << std::strerror(errno);
    close(fd);
    return "";
  }
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n =
        send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += n;
  }
  std::string raw;
  char buffer[4096];
  ssize_t n;
  while ((n = recv(fd, buffer, sizeof(buffer), 0)) > 0) raw.append(buffer, n);
  close(fd);
  return raw;
}

HttpResponse Fetch(int port, const std::string& method,
                   const std::string& path) {
  const std::string raw =
      Exchange(port, absl::StrCat(method, " ", path,
                                  " HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                  "Connection: close\r\n\r\n"));
  HttpResponse response;
  const size_t header_end = raw.find("\r\n\r\n");
  if (!absl::StartsWith(raw, "HTTP/1.1 ") || header_end == std::string::npos) {
    ADD_FAILURE() << "malformed response: " << raw;
    return response;
  }
  response.status = std::stoi(raw.substr(9, 3));
  response.headers = raw.substr(0, header_end + 2);
  response.body = raw.substr(header_end + 4);
  return response;
}

TEST_F(MetricsTest, HttpServerServesMetricsAndHealthzOnAnyFreePort) {
  Must(registry_.AddCounter("scrapes_total", "Scrapes."))
      ->WithLabels({})
      .value()
      ->Increment(7);
  auto server = MetricsHttpServer::Start(&registry_, "127.0.0.1", 0);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);

  const HttpResponse metrics = Fetch((*server)->port(), "GET", "/metrics");
  EXPECT_EQ(metrics.status, 200);
  EXPECT_THAT(metrics.headers,
              HasSubstr("Content-Type: text/plain; version=0.0.4; "
                        "charset=utf-8\r\n"));
  EXPECT_EQ(metrics.body, registry_.Render());
  EXPECT_THAT(metrics.body, HasSubstr("\nscrapes_total 7\n"));

  const HttpResponse health = Fetch((*server)->port(), "GET", "/healthz");
  EXPECT_EQ(health.status, 200);
  EXPECT_EQ(health.body, "ok");

  const HttpResponse head = Fetch((*server)->port(), "HEAD", "/metrics");
  EXPECT_EQ(head.status, 200);
  EXPECT_EQ(head.body, "");
}

TEST_F(MetricsTest, HttpServerRejectsOtherPathsAndMethods) {
  auto server = MetricsHttpServer::Start(&registry_, "127.0.0.1", 0);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  EXPECT_EQ(Fetch(port, "GET", "/").status, 404);
  EXPECT_EQ(Fetch(port, "GET", "/metricsx").status, 404);
  EXPECT_EQ(Fetch(port, "GET", "/metrics/extra").status, 404);
  EXPECT_EQ(Fetch(port, "GET", "/../etc/passwd").status, 404);
  const HttpResponse post = Fetch(port, "POST", "/metrics");
  EXPECT_EQ(post.status, 405);
  EXPECT_THAT(post.headers, HasSubstr("Allow: GET, HEAD\r\n"));
  // Malformed and oversized requests are refused without harm.
  EXPECT_THAT(Exchange(port, "\x01\x02 garbage\r\n\r\n"),
              Not(HasSubstr(" 200 ")));
  EXPECT_THAT(
      Exchange(port, absl::StrCat("GET /metrics HTTP/1.1\r\nX: ",
                                  std::string(1 << 20, 'a'), "\r\n\r\n")),
      Not(HasSubstr(" 200 ")));
  // Still serving after the bad requests.
  EXPECT_EQ(Fetch(port, "GET", "/healthz").status, 200);
}

TEST_F(MetricsTest, HttpServerReportsBadAddressesAndTakenPorts) {
  EXPECT_EQ(
      MetricsHttpServer::Start(&registry_, "localhost", 0).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MetricsHttpServer::Start(&registry_, "127.0.0.1,1.2.3.4", 0)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MetricsHttpServer::Start(&registry_, "::1", 0).status().code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(
      MetricsHttpServer::Start(&registry_, "127.0.0.1", 70000).status().code(),
      absl::StatusCode::kInvalidArgument);
  auto first = MetricsHttpServer::Start(&registry_, "127.0.0.1", 0);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second =
      MetricsHttpServer::Start(&registry_, "127.0.0.1", (*first)->port());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(MetricsTest, PromtoolAcceptsRenderedText) {
  const std::string promtool = PDSERVE_PROMTOOL;
  if (promtool.empty() || absl::EndsWith(promtool, "-NOTFOUND") ||
      access(promtool.c_str(), X_OK) != 0) {
    FAIL() << "promtool not found (PDSERVE_PROMTOOL=\"" << promtool
           << "\"). Install the `prometheus` Debian package "
              "(apt-get install prometheus) and re-run cmake.";
  }

  CounterFamily* requests = Must(registry_.AddCounter(
      "pdserve_requests_total", "Requests \"finished\",\nby role \\ model.",
      {"role", "model"}));
  Must(requests->WithLabels({"prefill", "llama \"3\"\n\\8b"}))->Increment(3);
  Must(requests->WithLabels({"decode", "ünïcödé ✓"}))->Increment(0.5);
  Must(requests->WithLabels({"", "empty role"}));
  Must(registry_.AddCounter("pdserve_idle_total", "Never incremented."));
  GaugeFamily* blocks =
      Must(registry_.AddGauge("pdserve_kv_blocks", "KV blocks.", {"state"}));
  Must(blocks->WithLabels({"free"}))->Set(-1e-9);
  Must(blocks->WithLabels({"used"}))->Set(1e300);
  Must(blocks->WithLabels({"nan"}))->Set(std::nan(""));
  Must(blocks->WithLabels({"inf"}))
      ->Set(-std::numeric_limits<double>::infinity());
  HistogramFamily* ttft = Must(registry_.AddHistogram(
      "pdserve_ttft_seconds", "TTFT.", DefaultLatencyBuckets(), {"role"}));
  Histogram* prefill = Must(ttft->WithLabels({"prefill"}));
  for (double v : {0.0005, 0.003, 0.2, 0.2, 9.0, 100.0}) prefill->Observe(v);
  Must(ttft->WithLabels({"decode"}));
  Must(registry_.AddHistogram("pdserve_batch_tokens", "Batch size in tokens.",
                              ExponentialBuckets(1, 2, 12)))
      ->WithLabels({})
      .value()
      ->Observe(300);
  const std::string text = registry_.Render();

  const std::string path =
      absl::StrCat(::testing::TempDir(), "/pdserve_metrics_promtool.prom");
  {
    std::ofstream file(path, std::ios::binary);
    file << text;
    ASSERT_TRUE(file.good()) << "cannot write " << path;
  }
  const std::string command =
      absl::StrCat("'", promtool, "' check metrics < '", path, "' 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr) << "cannot run " << command;
  std::string output;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) {
    output.append(buffer, n);
  }
  const int status = pclose(pipe);
  ASSERT_TRUE(WIFEXITED(status)) << command << " did not exit normally";
  EXPECT_EQ(WEXITSTATUS(status), 0) << command << " failed:\n"
                                    << output << "\nrendered text:\n"
                                    << text;
  std::remove(path.c_str());
}

}  // namespace
}  // namespace pdserve::metrics
