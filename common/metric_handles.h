// Start-up helpers that resolve a metric child in one call. Registration can
// only fail on a programming error (bad name, conflicting re-registration),
// so these log and abort instead of threading a Status through every
// constructor. Thread-safe (the registry is).
#pragma once

#include <cstdlib>
#include <string>
#include <vector>

#include "common/logging.h"
#include "common/metrics.h"

namespace pdserve::metrics {

template <typename T>
T Must(absl::StatusOr<T> v) {
  if (!v.ok()) {
    PDSERVE_LOG(ERROR) << "metric registration failed: " << v.status();
    std::abort();
  }
  return *std::move(v);
}

inline Counter* CounterChild(Registry& r, std::string_view name,
                             std::string_view help,
                             std::vector<std::string> labels = {},
                             std::vector<std::string_view> values = {}) {
  return Must(
      Must(r.AddCounter(name, help, std::move(labels)))->WithLabels(values));
}
inline Gauge* GaugeChild(Registry& r, std::string_view name,
                         std::string_view help,
                         std::vector<std::string> labels = {},
                         std::vector<std::string_view> values = {}) {
  return Must(
      Must(r.AddGauge(name, help, std::move(labels)))->WithLabels(values));
}
inline Histogram* HistogramChild(Registry& r, std::string_view name,
                                 std::string_view help,
                                 std::vector<double> bounds,
                                 std::vector<std::string> labels = {},
                                 std::vector<std::string_view> values = {}) {
  return Must(
      Must(r.AddHistogram(name, help, std::move(bounds), std::move(labels)))
          ->WithLabels(values));
}

}  // namespace pdserve::metrics
