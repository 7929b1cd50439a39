// `pdserve sim route`'s input: the Mooncake trace read and put in replay
// order, each request's synthesized prompt hashed into blocks once, the
// working set measured, then one Simulation per policy and cluster size (or
// --decision-replays of them).
#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "bench/router_sim.h"
#include "bench/router_sim_internal.h"
#include "common/status_macros.h"

namespace pdserve::bench {

using engine::BlockHash;
using router_sim_internal::kVocabSize;
using router_sim_internal::Micros;
using router_sim_internal::Percentile;
using router_sim_internal::Prepared;
using router_sim_internal::SimFingerprint;
using router_sim_internal::Simulation;

namespace {

// Simulates `policy` at `workers` prefill workers config.decision_replays
// times and returns the first run, with each request's fastest decision over
// all of them. A replay that routes differently (another hit ratio or
// imbalance) is an error: the replays are meant to repeat the same decisions
// on the same index.
absl::StatusOr<SimRun> Simulate(const SimConfig& config,
                                const std::vector<Prepared>& requests,
                                const std::string& policy, int32_t workers,
                                int64_t working_set_blocks,
                                int64_t max_request_blocks) {
  auto run_once = [&] {
    Simulation sim(config, requests, policy, workers, working_set_blocks,
                   max_request_blocks);
    return sim.Run();
  };
  ASSIGN_OR_RETURN(SimRun first, run_once());
  if (std::isnan(first.decision_p99_us)) return first;  // the oracle
  std::vector<double> fastest = first.decision_us;
  for (int32_t i = 1; i < config.decision_replays; ++i) {
    ASSIGN_OR_RETURN(const SimRun again, run_once());
    if (again.hit_ratio != first.hit_ratio ||
        again.imbalance != first.imbalance ||
        again.decision_us.size() != fastest.size()) {
      return absl::InternalError(
          absl::StrCat("replay ", i + 1, " of ", policy, " at ", workers,
                       " prefill workers routed differently from the first"));
    }
    for (size_t r = 0; r < fastest.size(); ++r)
      fastest[r] = std::min(fastest[r], again.decision_us[r]);
    ++first.decision_replays;
  }
  first.decision_min_p50_us = Percentile(fastest, 0.5);
  first.decision_min_p99_us = Percentile(fastest, 0.99);
  return first;
}

}  // namespace

absl::StatusOr<SimReport> RunRouterSim(
    const SimConfig& config,
    const std::function<void(const SimRun&)>& progress) {
  RETURN_IF_ERROR(config.Validate());
  ASSIGN_OR_RETURN(const std::vector<TraceRequest> trace,
                   LoadMooncakeTrace(config.trace_path));
  return RunRouterSim(config, trace, progress);
}

absl::StatusOr<SimReport> RunRouterSim(
    const SimConfig& config, const std::vector<TraceRequest>& trace,
    const std::function<void(const SimRun&)>& progress) {
  RETURN_IF_ERROR(config.Validate());
  if (trace.empty())
    return absl::InvalidArgumentError("the trace has no requests");
  SimReport report;
  report.config = config;
  // Replay order: by timestamp, ties in trace order.
  const size_t n = config.max_requests > 0
                       ? std::min<size_t>(trace.size(), config.max_requests)
                       : trace.size();
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return trace[a].timestamp_ms < trace[b].timestamp_ms;
  });
  const engine::ModelFingerprint fp = SimFingerprint(config.block_size);
  std::vector<Prepared> requests(n);
  for (size_t i = 0; i < n; ++i) {
    Prepared& p = requests[i];
    p.trace = &trace[order[i]];
    p.arrival = static_cast<Micros>(
        std::llround(static_cast<double>(p.trace->timestamp_ms) * 1000.0 *
                     config.time_scale));
    const std::vector<int32_t> tokens =
        SynthesizePrompt(*p.trace, config.seed, kVocabSize);
    engine::ExtendBlockHashes(fp, "", tokens, config.block_size, &p.hashes);
  }
  report.trace_requests = static_cast<int64_t>(n);
  // The working set: distinct full blocks over every prompt.
  int64_t max_request_blocks = 0;
  {
    absl::flat_hash_set<BlockHash, engine::BlockHashHasher> distinct;
    for (const Prepared& p : requests) {
      distinct.insert(p.hashes.begin(), p.hashes.end());
      max_request_blocks = std::max<int64_t>(
          max_request_blocks, (p.trace->input_length + p.trace->output_length +
                               config.block_size - 1) /
                                  config.block_size);
    }
    report.working_set_tokens =
        static_cast<int64_t>(distinct.size()) * config.block_size;
  }
  const int64_t working_set_blocks =
      report.working_set_tokens / config.block_size;
  for (int32_t workers : config.prefill_workers) {
    for (const std::string& policy : config.policies) {
      ASSIGN_OR_RETURN(SimRun run,
                       Simulate(config, requests, policy, workers,
                                working_set_blocks, max_request_blocks));
      if (progress) progress(run);
      report.runs.push_back(std::move(run));
    }
  }
  return report;
}

}  // namespace pdserve::bench
