// The KV-transfer metrics of one process, registered once at start-up
// (contract names). Thread-safe.
#pragma once

#include <string>

#include "common/metric_handles.h"
#include "kv_transfer/receiver.h"

namespace pdserve::kv_transfer {

class TransferMetrics {
 public:
  explicit TransferMetrics(metrics::Registry& r);
  metrics::Counter* bytes_sent;
  metrics::Counter* bytes_received;
  metrics::Histogram* duration;
  metrics::Gauge* in_flight;
  // Layer-wise streaming: bytes a prefill worker sent while the request's
  // forward pass was still running (transfer overlapping compute).
  metrics::Counter* overlapped_bytes;
  void Failure(const std::string& reason);
  // Counters for a KvReceiver feeding these metrics.
  ReceiverCounters ForReceiver();

 private:
  metrics::CounterFamily* failures_;
};

}  // namespace pdserve::kv_transfer
