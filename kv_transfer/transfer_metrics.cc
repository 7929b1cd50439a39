#include "kv_transfer/transfer_metrics.h"

namespace pdserve::kv_transfer {

TransferMetrics::TransferMetrics(metrics::Registry& r)
    : bytes_sent(metrics::CounterChild(r, "pdserve_kv_transfer_bytes_total",
                                       "KV cache bytes moved between workers",
                                       {"direction"}, {"sent"})),
      bytes_received(metrics::CounterChild(
          r, "pdserve_kv_transfer_bytes_total",
          "KV cache bytes moved between workers", {"direction"}, {"received"})),
      duration(metrics::HistogramChild(
          r, "pdserve_kv_transfer_duration_seconds",
          "Time from the start to the end of one request's KV transfer",
          metrics::ExponentialBuckets(0.0005, 2, 16))),
      in_flight(
          metrics::GaugeChild(r, "pdserve_kv_transfers_in_flight",
                              "KV transfers currently sending or receiving")),
      overlapped_bytes(metrics::CounterChild(
          r, "pdserve_kv_transfer_overlapped_bytes_total",
          "KV bytes sent while the prefill forward pass was still running")),
      failures_(metrics::Must(
          r.AddCounter("pdserve_kv_transfer_failures_total",
                       "KV transfers or chunks rejected or failed, by reason",
                       {"reason"}))) {
  // Pre-create the common reasons so they render as 0 from the start.
  for (const char* reason :
       {"handshake", "out_of_range", "bad_length", "timeout", "sender_aborted",
        "unknown_reservation", "incomplete", "deadline", "send_error"}) {
    metrics::Must(failures_->WithLabels({reason}));
  }
}

void TransferMetrics::Failure(const std::string& reason) {
  metrics::Must(failures_->WithLabels({reason}))->Increment();
}

ReceiverCounters TransferMetrics::ForReceiver() {
  return {[this](const std::string& reason) { Failure(reason); },
          [this](uint64_t bytes) {
            bytes_received->Increment(static_cast<double>(bytes));
          },
          [this](double seconds) { duration->Observe(seconds); }};
}

}  // namespace pdserve::kv_transfer
