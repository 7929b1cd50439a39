// How long dropping a worker from the router's prefix index blocks routing
// (a tool, not a test). One worker holds `--hashes` block hashes (default 1M,
// the scale of a trace replay's index); another holds a 256-block prompt.
// While ClearWorker drops the big one, a second thread routes that prompt
// (LeadingBlocksOfPrompt, the routing path) back to back and records each
// call's latency. Also times dropping a small worker while the big one stays,
// which should cost only the small worker's own entries.
//
// usage: prefix_index_clear_bench [HASHES] [ROUNDS]
// Prints one JSON object: the longest routing call seen during a clear (the
// stall), the longest one in a run of the same length with no clear (what
// the machine's scheduling alone adds), the median routing call, how many
// calls took over 5 ms in each, and the clear times, the worst of ROUNDS
// rounds (default 3).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "router/prefix_index.h"

namespace {

using pdserve::engine::BlockHash;
using pdserve::router::PrefixIndex;
using Clock = std::chrono::steady_clock;

// Spread like XXH3 output (the index's hasher takes the low word as is).
uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

std::vector<BlockHash> Hashes(size_t n, uint64_t salt) {
  std::vector<BlockHash> h(n);
  for (size_t i = 0; i < n; ++i) h[i] = {Mix(salt * 1'000'003 + i), Mix(~i)};
  return h;
}

double Ms(Clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

}  // namespace

int main(int argc, char** argv) {
  const size_t hashes =
      argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1'000'000;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 3;
  const std::vector<BlockHash> big = Hashes(hashes, 1);
  const std::vector<BlockHash> prompt = Hashes(256, 2);
  const std::vector<BlockHash> small = Hashes(1000, 3);
  double worst_stall = 0, worst_clear = 0, worst_small_clear = 0;
  double median_outside = 0, worst_no_clear = 0, worst_p999 = 0;
  size_t calls_during = 0, over_5ms_during = 0, over_5ms_idle = 0;
  for (int round = 0; round < rounds; ++round) {
    PrefixIndex index;
    index.Stored(0, big);
    index.Stored(1, prompt);
    index.Stored(2, small);
    std::vector<int32_t> counts;
    auto route = [&] {
      const auto t0 = Clock::now();
      index.LeadingBlocksOfPrompt(
          prompt.size(), [&](size_t i) { return prompt[i]; }, &counts);
      return Clock::now() - t0;
    };
    std::vector<double> outside;
    for (int i = 0; i < 2000; ++i) outside.push_back(Ms(route()));
    std::sort(outside.begin(), outside.end());
    median_outside = std::max(median_outside, outside[outside.size() / 2]);

    // Worker 2 (1,000 hashes) goes while worker 0 (the big one) stays.
    auto t0 = Clock::now();
    index.ClearWorker(2);
    worst_small_clear = std::max(worst_small_clear, Ms(Clock::now() - t0));

    std::atomic<bool> clearing{true}, started{false};
    std::vector<double> during;
    std::thread router([&] {
      started = true;
      while (clearing.load()) during.push_back(Ms(route()));
    });
    while (!started.load()) std::this_thread::yield();
    t0 = Clock::now();
    index.ClearWorker(0);
    const double clear_ms = Ms(Clock::now() - t0);
    clearing = false;
    router.join();
    std::sort(during.begin(), during.end());
    over_5ms_during += static_cast<size_t>(
        during.end() - std::upper_bound(during.begin(), during.end(), 5.0));
    if (!during.empty()) {
      worst_stall = std::max(worst_stall, during.back());
      worst_p999 = std::max(worst_p999, during[during.size() * 999 / 1000]);
    }
    worst_clear = std::max(worst_clear, clear_ms);
    // The same loop for as long, with no clear: what this machine's
    // scheduling alone puts into the longest call.
    double idle_worst = 0;
    const auto idle_until =
        Clock::now() +
        std::chrono::microseconds(static_cast<int64_t>(clear_ms * 1000));
    while (Clock::now() < idle_until) {
      const double ms = Ms(route());
      idle_worst = std::max(idle_worst, ms);
      over_5ms_idle += ms > 5.0;
    }
    worst_no_clear = std::max(worst_no_clear, idle_worst);
    calls_during += during.size();
    if (index.num_hashes() != prompt.size()) {
      std::fprintf(stderr, "index holds %zu hashes, want %zu\n",
                   index.num_hashes(), prompt.size());
      return 1;
    }
  }
  std::printf(
      "{\"hashes\": %zu, \"rounds\": %d, "
      "\"max_routing_call_during_clear_ms\": %.3f, "
      "\"p999_routing_call_during_clear_ms\": %.4f, "
      "\"max_routing_call_without_clear_ms\": %.3f, "
      "\"median_routing_call_ms\": %.4f, "
      "\"routing_calls_during_clears\": %zu, "
      "\"calls_over_5ms_during_clears\": %zu, "
      "\"calls_over_5ms_without_clear\": %zu, "
      "\"clear_big_worker_ms\": %.1f, "
      "\"clear_1000_hash_worker_beside_it_ms\": %.3f}\n",
      hashes, rounds, worst_stall, worst_p999, worst_no_clear, median_outside,
      calls_during, over_5ms_during, over_5ms_idle, worst_clear,
      worst_small_clear);
  return 0;
}
