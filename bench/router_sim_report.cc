// The figures of `pdserve sim route`: one run's SimRun from the simulation's
// counters, and the report's JSON, text table and SVG chart.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/router_sim.h"
#include "bench/router_sim_internal.h"
#include "common/json.h"
#include "common/status_macros.h"

namespace pdserve::bench {
namespace router_sim_internal {

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t rank =
      static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

double MaxOverMean(const std::vector<int64_t>& v) {
  if (v.empty()) return 0;
  int64_t sum = 0, max = 0;
  for (int64_t x : v) {
    sum += x;
    max = std::max(max, x);
  }
  return sum > 0 ? static_cast<double>(max) * static_cast<double>(v.size()) /
                       static_cast<double>(sum)
                 : 1.0;
}

SimRun Simulation::Report() {
  SimRun run;
  run.policy = policy_name_;
  run.prefill_workers = num_prefill_;
  run.decode_workers = num_decode_;
  run.requests = served_;
  run.rejected = rejected_;
  run.input_tokens = input_tokens_;
  run.hit_tokens = hit_tokens_;
  run.hit_ratio = input_tokens_ > 0 ? static_cast<double>(hit_tokens_) /
                                          static_cast<double>(input_tokens_)
                                    : 0;
  std::vector<int64_t> computed, decoded;
  for (const auto& p : prefill_) computed.push_back(p.computed_total);
  for (const auto& d : decode_) decoded.push_back(d.decoded);
  run.imbalance = MaxOverMean(computed);
  run.decode_imbalance = MaxOverMean(decoded);
  run.local_prefills = local_prefills_;
  run.ttft_p50_ms = Percentile(ttft_ms_, 0.5);
  run.ttft_p99_ms = Percentile(ttft_ms_, 0.99);
  run.prefill_queue_p50_ms = Percentile(prefill_queue_ms_, 0.5);
  run.prefill_queue_p99_ms = Percentile(prefill_queue_ms_, 0.99);
  run.decode_admit_p50_ms = Percentile(decode_admit_ms_, 0.5);
  run.decode_admit_p99_ms = Percentile(decode_admit_ms_, 0.99);
  run.tpot_p50_ms = Percentile(tpot_ms_, 0.5);
  run.tpot_p99_ms = Percentile(tpot_ms_, 0.99);
  if (oracle_) {
    run.decision_p50_us = run.decision_p99_us = run.hash_p50_us =
        run.hash_p99_us = run.route_p50_us = run.route_p99_us =
            run.reference_p50_us = run.reference_p99_us =
                run.decision_min_p50_us = run.decision_min_p99_us =
                    std::numeric_limits<double>::quiet_NaN();
  } else {
    run.decision_p50_us = Percentile(decision_us_, 0.5);
    run.decision_p99_us = Percentile(decision_us_, 0.99);
    run.hash_p50_us = Percentile(hash_us_, 0.5);
    run.hash_p99_us = Percentile(hash_us_, 0.99);
    run.route_p50_us = Percentile(route_us_, 0.5);
    run.route_p99_us = Percentile(route_us_, 0.99);
    run.reference_p50_us = Percentile(reference_us_, 0.5);
    run.reference_p99_us = Percentile(reference_us_, 0.99);
    run.decision_min_p50_us = run.decision_p50_us;
    run.decision_min_p99_us = run.decision_p99_us;
    run.decision_us = decision_us_;
    const router::PrefixIndex::MemoryUsage m = index_.Memory();
    run.index_hashes = static_cast<int64_t>(m.hashes);
    run.index_entries = static_cast<int64_t>(m.holders);
    run.index_bytes = static_cast<int64_t>(m.bytes);
    run.index_bytes_per_block = m.holders ? static_cast<double>(m.bytes) /
                                                static_cast<double>(m.holders)
                                          : 0;
  }
  run.events_lost = events_lost_;
  run.resyncs = resyncs_;
  run.makespan_s = static_cast<double>(makespan_) / 1e6;
  run.pulled_tokens = pulled_tokens_;
  run.tier_hit_tokens = tier_hit_tokens_;
  run.peer_pulls = peer_pulls_;
  run.peer_pulls_failed = peer_pulls_failed_;
  run.peer_pulls_partial = peer_pulls_partial_;
  run.pulled_tier_tokens = pulled_tier_tokens_;
  run.held_missed_tokens = held_missed_tokens_;
  run.prefill_pool_tokens = prefill_pool_tokens_;
  run.decode_pool_tokens = decode_pool_tokens_;
  return run;
}

}  // namespace router_sim_internal

using router_sim_internal::IsOracle;
using router_sim_internal::kOracle;
using router_sim_internal::kUnbounded;

double SimReport::HitVsUnbounded(const SimRun& run) const {
  for (const SimRun& o : runs) {
    if (o.policy == kUnbounded && o.prefill_workers == run.prefill_workers &&
        o.decode_workers == run.decode_workers) {
      return o.hit_ratio > 0 ? run.hit_ratio / o.hit_ratio
                             : std::numeric_limits<double>::quiet_NaN();
    }
  }
  return std::numeric_limits<double>::quiet_NaN();
}

double SimReport::HitVsOracle(const SimRun& run) const {
  for (const SimRun& o : runs) {
    if (o.policy == kOracle && o.prefill_workers == run.prefill_workers &&
        o.decode_workers == run.decode_workers) {
      return o.hit_ratio > 0 ? run.hit_ratio / o.hit_ratio
                             : std::numeric_limits<double>::quiet_NaN();
    }
  }
  return std::numeric_limits<double>::quiet_NaN();
}

std::string SimReport::ToJson() const {
  const SimConfig& c = config;
  json::OrderedValue out = {
      {"config",
       {{"trace", c.trace_path},
        {"trace_requests", trace_requests},
        {"policies", c.policies},
        {"prefill_workers", c.prefill_workers},
        {"decode_workers", c.decode_workers},
        {"prefill_cache_tokens", c.prefill_cache_tokens},
        {"decode_kv_tokens", c.decode_kv_tokens},
        {"block_size", c.block_size},
        {"time_scale", c.time_scale},
        {"max_requests", c.max_requests},
        {"decision_replays", c.decision_replays},
        {"prefill_us_per_token", c.prefill_us_per_token},
        {"prefill_overhead_ms", c.prefill_overhead_ms},
        {"decode_step_ms", c.decode_step_ms},
        {"decode_step_per_seq_ms", c.decode_step_per_seq_ms},
        {"decode_step_per_kctx_ms", c.decode_step_per_kctx_ms},
        {"transfer_us_per_token", c.transfer_us_per_token},
        {"heartbeat_ms", c.heartbeat_ms},
        {"event_delay_ms", c.event_delay_ms},
        {"event_loss", c.event_loss},
        {"resync_delay_ms", c.resync_delay_ms},
        {"seed", c.seed},
        {"w_prefill", c.policy.w_prefill},
        {"w_decode", c.policy.w_decode},
        {"local_prefill_threshold", c.policy.local_prefill_threshold},
        {"cache_threshold", c.policy.cache_threshold},
        {"balance_slack", c.policy.balance_slack},
        {"pool_fraction", c.pool_fraction},
        {"pull_overhead_ms", c.pull_overhead_ms},
        {"tier_multiple", c.tier_multiple},
        {"tier_read_us_per_token", c.tier_read_us_per_token},
        {"working_set_tokens", working_set_tokens}}},
      {"runs", json::OrderedValue::array()}};
  for (const SimRun& r : runs) {
    out["runs"].push_back({{"policy", r.policy},
                           {"prefill_workers", r.prefill_workers},
                           {"decode_workers", r.decode_workers},
                           {"requests", r.requests},
                           {"rejected", r.rejected},
                           {"input_tokens", r.input_tokens},
                           {"hit_tokens", r.hit_tokens},
                           {"hit_ratio", r.hit_ratio},
                           {"hit_vs_oracle", HitVsOracle(r)},
                           {"imbalance", r.imbalance},
                           {"decode_imbalance", r.decode_imbalance},
                           {"local_prefills", r.local_prefills},
                           {"ttft_p50_ms", r.ttft_p50_ms},
                           {"ttft_p99_ms", r.ttft_p99_ms},
                           {"prefill_queue_p50_ms", r.prefill_queue_p50_ms},
                           {"prefill_queue_p99_ms", r.prefill_queue_p99_ms},
                           {"decode_admit_p50_ms", r.decode_admit_p50_ms},
                           {"decode_admit_p99_ms", r.decode_admit_p99_ms},
                           {"tpot_p50_ms", r.tpot_p50_ms},
                           {"tpot_p99_ms", r.tpot_p99_ms},
                           {"decision_p50_us", r.decision_p50_us},
                           {"decision_p99_us", r.decision_p99_us},
                           {"hash_p50_us", r.hash_p50_us},
                           {"hash_p99_us", r.hash_p99_us},
                           {"route_p50_us", r.route_p50_us},
                           {"route_p99_us", r.route_p99_us},
                           {"reference_p50_us", r.reference_p50_us},
                           {"reference_p99_us", r.reference_p99_us},
                           {"decision_replays", r.decision_replays},
                           {"decision_min_p50_us", r.decision_min_p50_us},
                           {"decision_min_p99_us", r.decision_min_p99_us},
                           {"index_hashes", r.index_hashes},
                           {"index_entries", r.index_entries},
                           {"index_bytes", r.index_bytes},
                           {"index_bytes_per_block", r.index_bytes_per_block},
                           {"events_lost", r.events_lost},
                           {"resyncs", r.resyncs},
                           {"makespan_s", r.makespan_s},
                           {"hit_vs_unbounded", HitVsUnbounded(r)},
                           {"pulled_tokens", r.pulled_tokens},
                           {"tier_hit_tokens", r.tier_hit_tokens},
                           {"peer_pulls", r.peer_pulls},
                           {"peer_pulls_failed", r.peer_pulls_failed},
                           {"peer_pulls_partial", r.peer_pulls_partial},
                           {"pulled_tier_tokens", r.pulled_tier_tokens},
                           {"held_missed_tokens", r.held_missed_tokens},
                           {"prefill_pool_tokens", r.prefill_pool_tokens},
                           {"decode_pool_tokens", r.decode_pool_tokens}});
  }
  return json::Dump(out) + "\n";
}

std::string SimReport::ToTable() const {
  // Fixed-point with `digits` decimals; "-" for NaN (no figure).
  auto num = [](double v, int digits) {
    return std::isnan(v) ? std::string("-")
                         : absl::StrFormat("%.*f", digits, v);
  };
  std::string out = absl::StrFormat(
      "%-16s %5s %4s %7s %7s %6s %9s %9s %9s %9s %8s %8s %8s %8s %8s %8s %8s\n",
      "policy", "P", "D", "hit", "/oracle", "imbal", "ttft_p50", "ttft_p99",
      "queue_p50", "queue_p99", "tpot_p50", "dec_p50", "dec_p99", "min_p99",
      "ref_p99", "hash_p99", "B/block");
  absl::StrAppend(
      &out, absl::StrFormat("%-16s %5s %4s %7s %7s %6s %9s %9s %9s %9s %8s %8s "
                            "%8s %8s %8s %8s %8s\n",
                            "", "", "", "", "", "", "ms", "ms", "ms", "ms",
                            "ms", "us", "us", "us", "us", "us", ""));
  for (const SimRun& r : runs) {
    absl::StrAppend(
        &out,
        absl::StrFormat("%-16s %5d %4d %7s %7s %6s %9s %9s %9s %9s %8s %8s %8s "
                        "%8s %8s %8s %8s\n",
                        r.policy, r.prefill_workers, r.decode_workers,
                        num(r.hit_ratio, 3), num(HitVsOracle(r), 3),
                        num(r.imbalance, 2), num(r.ttft_p50_ms, 0),
                        num(r.ttft_p99_ms, 0), num(r.prefill_queue_p50_ms, 0),
                        num(r.prefill_queue_p99_ms, 0), num(r.tpot_p50_ms, 1),
                        num(r.decision_p50_us, 1), num(r.decision_p99_us, 1),
                        num(r.decision_min_p99_us, 1),
                        num(r.reference_p99_us, 1), num(r.hash_p99_us, 1),
                        IsOracle(r.policy) ? std::string("-")
                                           : num(r.index_bytes_per_block, 0)));
  }
  return out;
}

std::string SimReport::ToSvg() const {
  // Two panels side by side: hit ratio and imbalance against prefill workers
  // on a log2 axis; one colour per policy.
  static constexpr const char* kColours[] = {"#1f77b4", "#d62728", "#2ca02c",
                                             "#ff7f0e", "#7f7f7f", "#9467bd",
                                             "#8c564b", "#e377c2"};
  constexpr double kW = 1000, kH = 460, kPanelW = 400, kPanelH = 300, kTop = 85;
  const double left[2] = {80, 580};
  std::vector<int32_t> sizes = config.prefill_workers;
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  const double x_lo = std::log2(std::max(1, sizes.empty() ? 1 : sizes.front()));
  const double x_hi = std::log2(std::max(1, sizes.empty() ? 1 : sizes.back()));
  // Axes: hit ratio from 0 to a tenth above the best; imbalance from 1 (even)
  // to the next half above the worst.
  double hit_hi = 0.1, imb_hi = 1.5;
  for (const SimRun& r : runs) {
    if (std::isfinite(r.hit_ratio)) hit_hi = std::max(hit_hi, r.hit_ratio);
    if (std::isfinite(r.imbalance)) imb_hi = std::max(imb_hi, r.imbalance);
  }
  hit_hi = std::min(1.0, std::ceil(hit_hi * 10 + 0.5) / 10);
  imb_hi = std::ceil(imb_hi * 2) / 2;
  const double y_lo[2] = {0, 1}, y_hi[2] = {hit_hi, imb_hi};
  auto px = [&](int panel, int32_t n) {
    const double t = x_hi > x_lo ? (std::log2(n) - x_lo) / (x_hi - x_lo) : 0.5;
    return left[panel] + t * kPanelW;
  };
  auto py = [&](int panel, double v) {
    return kTop + kPanelH -
           (std::clamp(v, y_lo[panel], y_hi[panel]) - y_lo[panel]) /
               (y_hi[panel] - y_lo[panel]) * kPanelH;
  };
  std::string out = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" "
      "height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%%\" "
      "height=\"100%%\" fill=\"white\"/>\n",
      kW, kH, kW, kH);
  absl::StrAppendFormat(&out,
                        "<text x=\"%.0f\" y=\"22\" font-size=\"15\" "
                        "text-anchor=\"middle\">pdserve router simulation: "
                        "%d decode workers, %d cache tokens per prefill "
                        "worker, time scale %g</text>\n",
                        kW / 2, config.decode_workers,
                        config.prefill_cache_tokens, config.time_scale);
  const char* titles[2] = {"prefix-hit ratio of input tokens",
                           "imbalance: max / mean prefill tokens computed"};
  for (int panel = 0; panel < 2; ++panel) {
    const double x0 = left[panel], y0 = kTop;
    absl::StrAppendFormat(&out,
                          "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.0f\" "
                          "height=\"%.0f\" fill=\"none\" stroke=\"#444\"/>\n",
                          x0, y0, kPanelW, kPanelH);
    absl::StrAppendFormat(
        &out, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n",
        x0 + kPanelW / 2, y0 - 8, titles[panel]);
    absl::StrAppendFormat(&out,
                          "<text x=\"%.1f\" y=\"%.1f\" "
                          "text-anchor=\"middle\">prefill workers</text>\n",
                          x0 + kPanelW / 2, y0 + kPanelH + 36);
    for (int32_t n : sizes) {
      const double x = px(panel, n);
      absl::StrAppendFormat(
          &out,
          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
          "stroke=\"#ddd\"/>\n"
          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%d</text>\n",
          x, y0, x, y0 + kPanelH, x, y0 + kPanelH + 16, n);
    }
    const int ticks = 5;
    for (int i = 0; i <= ticks; ++i) {
      const double v = y_lo[panel] + (y_hi[panel] - y_lo[panel]) * i / ticks;
      const double y = py(panel, v);
      absl::StrAppendFormat(
          &out,
          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
          "stroke=\"#ddd\"/>\n"
          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%.2f</text>\n",
          x0, y, x0 + kPanelW, y, x0 - 6, y + 4, v);
    }
    for (size_t p = 0; p < config.policies.size(); ++p) {
      const std::string& name = config.policies[p];
      const char* colour =
          kColours[p % (sizeof(kColours) / sizeof(kColours[0]))];
      std::vector<std::pair<double, double>> pts;
      for (int32_t n : sizes) {
        for (const SimRun& r : runs) {
          if (r.policy != name || r.prefill_workers != n) continue;
          pts.emplace_back(px(panel, n),
                           py(panel, panel == 0 ? r.hit_ratio : r.imbalance));
        }
      }
      std::string poly;
      for (const auto& [x, y] : pts)
        absl::StrAppendFormat(&poly, "%s%.1f,%.1f", poly.empty() ? "" : " ", x,
                              y);
      const char* dash = name == kOracle ? " stroke-dasharray=\"6,4\"" : "";
      if (pts.size() > 1) {
        absl::StrAppendFormat(&out,
                              "<polyline points=\"%s\" fill=\"none\" "
                              "stroke=\"%s\" stroke-width=\"2\"%s/>\n",
                              poly, colour, dash);
      }
      for (const auto& [x, y] : pts) {
        absl::StrAppendFormat(
            &out, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"%s\"/>\n",
            x, y, colour);
      }
    }
  }
  // Legend.
  double lx = 80;
  for (size_t p = 0; p < config.policies.size(); ++p) {
    const char* colour = kColours[p % (sizeof(kColours) / sizeof(kColours[0]))];
    absl::StrAppendFormat(&out,
                          "<line x1=\"%.0f\" y1=\"46\" x2=\"%.0f\" y2=\"46\" "
                          "stroke=\"%s\" stroke-width=\"3\"/>"
                          "<text x=\"%.0f\" y=\"50\">%s</text>\n",
                          lx, lx + 24, colour, lx + 30, config.policies[p]);
    lx += 40 + 8.0 * static_cast<double>(config.policies[p].size());
  }
  return out + "</svg>\n";
}

namespace {

absl::Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) {
    return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  }
  f << text;
  f.close();
  if (!f) return absl::DataLossError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace

absl::Status SimReport::WriteSvg(const std::string& path) const {
  return WriteText(path, ToSvg());
}

std::string SimReport::SvgPathFor(const std::string& json_path) {
  constexpr absl::string_view kJson = ".json";
  if (absl::EndsWith(json_path, kJson)) {
    return absl::StrCat(json_path.substr(0, json_path.size() - kJson.size()),
                        ".svg");
  }
  return json_path + ".svg";
}

absl::Status SimReport::WriteFiles(const std::string& json_path) const {
  RETURN_IF_ERROR(WriteText(json_path, ToJson()));
  return WriteSvg(SvgPathFor(json_path));
}

}  // namespace pdserve::bench
