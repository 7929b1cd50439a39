// The router's metrics (ARCHITECTURE.md, metrics contract), declared once
// and registered at start-up; the request path only increments them.
// Thread-safe (the metric handles are).
#pragma once

#include <array>
#include <string>
#include <string_view>

#include "common/metric_handles.h"
#include "common/metrics.h"

namespace pdserve::router {

struct RouterMetrics {
  explicit RouterMetrics(metrics::Registry& r)
      : requests(metrics::Must(r.AddCounter(
            "pdserve_requests_total", "Finished requests by finish reason",
            {"finish_reason"}))),
        ttft(metrics::HistogramChild(
            r, "pdserve_time_to_first_token_seconds",
            "Time from request arrival to its first token",
            metrics::DefaultLatencyBuckets())),
        itl(metrics::HistogramChild(
            r, "pdserve_inter_token_latency_seconds",
            "Time between consecutive tokens",
            metrics::ExponentialBuckets(0.001, 1.6, 20))),
        duration(metrics::HistogramChild(r, "pdserve_request_duration_seconds",
                                         "End-to-end request time",
                                         metrics::DefaultLatencyBuckets())),
        route_time(metrics::HistogramChild(
            r, "pdserve_router_route_seconds",
            "Time to choose a request's workers: the up-worker snapshot, the "
            "prompt's block hashes and the policy's decision",
            metrics::ExponentialBuckets(1e-6, 2, 18))),
        prompt_tokens(metrics::CounterChild(r, "pdserve_prompt_tokens_total",
                                            "Prompt tokens received")),
        generation_tokens(metrics::CounterChild(
            r, "pdserve_generation_tokens_total", "Tokens generated")),
        decisions(metrics::Must(r.AddCounter(
            "pdserve_prefill_decisions_total",
            "Where prompts were prefilled: remote (prefill worker) or local",
            {"mode"}))),
        retries(metrics::CounterChild(
            r, "pdserve_request_retries_total",
            "Requests re-sent to another worker (retry or migration)")),
        workers(metrics::Must(r.AddGauge("pdserve_workers",
                                         "Known workers by role and state",
                                         {"role", "state"}))),
        auth_failures(metrics::Must(r.AddCounter(
            "pdserve_auth_failures_total",
            "Public API calls refused for a missing or invalid bearer token, "
            "and RouterControl calls without a verified client certificate",
            {"reason"}))),
        tenant_rejections(metrics::Must(r.AddCounter(
            "pdserve_tenant_rejections_total",
            "Requests refused with RESOURCE_EXHAUSTED by a per-tenant limit",
            {"tenant", "limit"}))),
        limit_rejections(metrics::Must(r.AddCounter(
            "pdserve_limit_rejections_total",
            "Requests refused by a router-wide limit (overload is load "
            "shedding; the others are per-request bounds)",
            {"limit"}))),
        peer_pulls(metrics::Must(r.AddCounter(
            "pdserve_router_peer_pull_decisions_total",
            "With --peer-pull: remote prefills told to pull their prefix from "
            "a peer (pull), or not (no_holder: no live peer holds more; "
            "not_faster: recompute estimated faster; backed_off: the "
            "holders that would gain are backed off after failed pulls)",
            {"decision"}))),
        peer_pull_failures(metrics::Must(r.AddCounter(
            "pdserve_router_peer_pull_failures_total",
            "Peer pulls the prefill worker reported as not done, by reason "
            "(evicted: the holder no longer had the blocks; failed: "
            "unreachable holder or failed transfer; refused: the holder "
            "refused the grant; busy: the holder was at its pull caps; "
            "no_blocks: the puller had no room)",
            {"reason"}))),
        peer_pull_backoffs(metrics::CounterChild(
            r, "pdserve_router_peer_pull_backoffs_total",
            "Times a holder was backed off (not chosen for pulls for a while) "
            "after a failed, refused or busy pull")) {
    for (const char* d : {"pull", "no_holder", "not_faster", "backed_off"})
      metrics::Must(peer_pulls->WithLabels({d}));
    for (const char* reason :
         {"evicted", "failed", "refused", "busy", "no_blocks"})
      metrics::Must(peer_pull_failures->WithLabels({reason}));
    for (const char* reason : {"missing", "invalid", "no_client_cert"})
      metrics::Must(auth_failures->WithLabels({reason}));
    for (const char* limit :
         {"overload", "prompt_tokens", "max_tokens", "stop_strings",
          "stop_string_bytes", "cache_salt_bytes", "request_id_bytes",
          "deadline"})
      metrics::Must(limit_rejections->WithLabels({limit}));
    for (size_t i = 0; i < kFinishReasons.size(); ++i)
      finished[i] = metrics::Must(requests->WithLabels({kFinishReasons[i]}));
    remote = metrics::Must(decisions->WithLabels({"remote"}));
    local = metrics::Must(decisions->WithLabels({"local"}));
  }
  metrics::CounterFamily* requests;
  // Every finish_reason label value; "error" (the last) also stands for any
  // reason not listed, so no input can make a new label or fail a lookup.
  static constexpr std::array<const char*, 5> kFinishReasons = {
      "length", "stop", "eos", "cancelled", "error"};
  std::array<metrics::Counter*, kFinishReasons.size()> finished{};
  metrics::Counter* Finished(std::string_view reason) {
    for (size_t i = 0; i < kFinishReasons.size(); ++i) {
      if (reason == kFinishReasons[i]) return finished[i];
    }
    return finished.back();
  }
  metrics::Histogram* ttft;
  metrics::Histogram* itl;
  metrics::Histogram* duration;
  metrics::Histogram* route_time;
  metrics::Counter* prompt_tokens;
  metrics::Counter* generation_tokens;
  metrics::CounterFamily* decisions;
  metrics::Counter* remote;
  metrics::Counter* local;
  metrics::Counter* retries;
  metrics::GaugeFamily* workers;
  metrics::CounterFamily* auth_failures;
  metrics::CounterFamily* tenant_rejections;
  metrics::CounterFamily* limit_rejections;
  metrics::CounterFamily* peer_pulls;
  metrics::CounterFamily* peer_pull_failures;
  metrics::Counter* peer_pull_backoffs;
  // `decision`: "pull" or a PeerPullDecision::reason.
  void CountPeerPull(const std::string& decision) {
    metrics::Must(peer_pulls->WithLabels({decision}))->Increment();
  }
  void PeerPullFailure(const char* reason) {
    metrics::Must(peer_pull_failures->WithLabels({reason}))->Increment();
  }
  void AuthFailure(const char* reason) {
    metrics::Must(auth_failures->WithLabels({reason}))->Increment();
  }
  void LimitRejection(const char* limit) {
    metrics::Must(limit_rejections->WithLabels({limit}))->Increment();
  }
};

}  // namespace pdserve::router
