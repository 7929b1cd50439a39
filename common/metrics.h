// Prometheus metrics: counters, gauges and histograms with labels, kept in a
// Registry and rendered in the text exposition format 0.0.4.
//
// This is a thin facade over prometheus-cpp (Debian prometheus-cpp-dev): every
// family is a prometheus::Family in one prometheus::Registry and rendering is
// prometheus::TextSerializer's. The facade adds what pdserve's callers rely on
// and prometheus-cpp 1.0.1 does not give:
//   - registration returns a Status instead of throwing, and rejects what
//     Prometheus would reject at scrape time (bad names, non-UTF-8 help or
//     label values, `le` on a histogram, colliding series, counters without
//     `_total`);
//   - families declare their label names, children are resolved by position,
//     and a series renders its labels in declaration order (tests and
//     dashboards match `{tenant="a",limit="b"}` literally; prometheus-cpp
//     would sort them by name);
//   - families render sorted by name, children by label values, so output is
//     deterministic;
//   - counters ignore NaN as well as negative deltas, histograms ignore NaN;
//   - collectors that refresh gauges lazily just before each render.
//
// Each component declares its metrics once, at start-up: it registers a family
// (name, help, label names) and resolves every label combination it will use
// to a child with WithLabels(). Families and children are never removed, so
// the returned pointers stay valid for the registry's lifetime and the hot
// path is one update with no lookup:
//
//   ASSIGN_OR_RETURN(CounterFamily* requests,
//                    registry.AddCounter("pdserve_requests_total",
//                                        "Requests finished.", {"role"}));
//   ASSIGN_OR_RETURN(Counter* prefill_requests,
//                    requests->WithLabels({"prefill"}));
//   ...
//   prefill_requests->Increment();
//
// Values that are cheaper to read than to track (say KV blocks by state) can
// be refreshed lazily by a collector that sets gauges just before rendering.
//
// Thread-safety: everything here is thread-safe. Registration and WithLabels
// take a mutex. Counter and Gauge updates are lock-free atomics; a Histogram
// observation takes that histogram's own short mutex (prometheus-cpp's), so a
// histogram's buckets, count and sum are always read in the same instant.
// Render may run concurrently with updates.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "prometheus/collectable.h"

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace pdserve::metrics {

enum class MetricType { kCounter, kGauge, kHistogram };

template <typename Metric>
class MetricFamily;

// A monotonically increasing value, such as requests served or tokens
// generated.
class Counter {
 public:
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;

  // Adds `delta`. Negative and NaN deltas are ignored: a counter never falls.
  void Increment(double delta = 1);
  double Value() const;

 private:
  friend class MetricFamily<Counter>;
  using Backend = prometheus::Counter;
  explicit Counter(prometheus::Counter& backend) : backend_(backend) {}

  prometheus::Counter& backend_;
};

// A value that goes up and down, such as queue depth or free KV blocks.
class Gauge {
 public:
  Gauge(const Gauge&) = delete;
  Gauge& operator=(const Gauge&) = delete;

  void Set(double value);
  void Increment(double delta = 1);
  void Decrement(double delta = 1) { Increment(-delta); }
  double Value() const;

 private:
  friend class MetricFamily<Gauge>;
  using Backend = prometheus::Gauge;
  explicit Gauge(prometheus::Gauge& backend) : backend_(backend) {}

  prometheus::Gauge& backend_;
};

// Counts observations (typically latencies in seconds) into fixed buckets.
class Histogram {
 public:
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  // Records one observation in the first bucket whose bound is >= `value`.
  // NaN is ignored.
  void Observe(double value);

  // Finite upper bounds, not including +Inf.
  std::span<const double> bounds() const { return bounds_; }
  // Element i counts observations <= bounds()[i]; the extra last element is
  // the +Inf bucket and equals the total count.
  std::vector<uint64_t> CumulativeCounts() const;
  uint64_t Count() const;
  double Sum() const;

 private:
  friend class MetricFamily<Histogram>;
  using Backend = prometheus::Histogram;
  // `bounds` must outlive the histogram (the family owns them).
  Histogram(prometheus::Histogram& backend, std::span<const double> bounds)
      : backend_(backend), bounds_(bounds) {}

  prometheus::Histogram& backend_;
  const std::span<const double> bounds_;
};

// What every family has, whatever its metric type.
class FamilyBase {
 public:
  virtual ~FamilyBase() = default;
  FamilyBase(const FamilyBase&) = delete;
  FamilyBase& operator=(const FamilyBase&) = delete;

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  MetricType type() const { return type_; }
  const std::vector<std::string>& label_names() const { return label_names_; }

 protected:
  FamilyBase(std::string name, std::string help, MetricType type,
             std::vector<std::string> label_names)
      : name_(std::move(name)),
        help_(std::move(help)),
        type_(type),
        label_names_(std::move(label_names)) {}

 private:
  const std::string name_;
  const std::string help_;
  const MetricType type_;
  const std::vector<std::string> label_names_;
};

// All metrics of one name and type, one child per combination of label
// values. A family without labels has exactly one child, created at
// registration, so it renders (as 0) before its first update.
template <typename Metric>
class MetricFamily final : public FamilyBase {
 public:
  // Returns the child for `values` (one per label name, in declaration order,
  // valid UTF-8), creating it on first use. The pointer is stable for the
  // registry's lifetime; resolve it once and keep it. INVALID_ARGUMENT when
  // the count is wrong or a value is not UTF-8.
  absl::StatusOr<Metric*> WithLabels(absl::Span<const std::string_view> values)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Children sorted by label values, for tests.
  std::vector<std::pair<std::vector<std::string>, const Metric*>> Children()
      const ABSL_LOCKS_EXCLUDED(mu_);

  // Finite bucket bounds; empty unless Metric is Histogram.
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  friend class Registry;
  using Backend = typename Metric::Backend;
  MetricFamily(std::string name, std::string help,
               std::vector<std::string> label_names, std::vector<double> bounds,
               prometheus::Family<Backend>& backend);

  const std::vector<double> bounds_;
  // Owned by the Registry's prometheus::Registry.
  prometheus::Family<Backend>& backend_;
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<Metric>> children_
      ABSL_GUARDED_BY(mu_);
};

using CounterFamily = MetricFamily<Counter>;
using GaugeFamily = MetricFamily<Gauge>;
using HistogramFamily = MetricFamily<Histogram>;

// Bucket helpers. Invalid arguments (start <= 0, factor <= 1, width <= 0)
// give bounds that AddHistogram rejects; count <= 0 gives no finite bucket.
// {start, start*factor, start*factor^2, ...}, `count` bounds.
std::vector<double> ExponentialBuckets(double start, double factor, int count);
// {start, start+width, start+2*width, ...}, `count` bounds.
std::vector<double> LinearBuckets(double start, double width, int count);
// Latency bounds in seconds: 1-2.5-5 steps from 1 ms to 25 s, then 60 s.
std::vector<double> DefaultLatencyBuckets();

// Owns metric families and renders them. Families are never unregistered.
// It is a prometheus::Collectable, so prometheus-cpp's exporters can serve it
// too; Collect() runs the collectors like Render() does.
class Registry final : public prometheus::Collectable {
 public:
  Registry();
  ~Registry() override;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // The process-wide registry served by the `pdserve` binary. Never destroyed.
  static Registry& Default();

  // Register a family. Metric names match [a-zA-Z_:][a-zA-Z0-9_:]*, do not
  // start with `__`, and counter names end in `_total` (given by the caller,
  // never appended). Label names match [a-zA-Z_][a-zA-Z0-9_]*, do not start
  // with `__`, are distinct, and a histogram may not use `le`. Help must be
  // non-empty UTF-8.
  //
  // Registering a name again returns the existing family when type, help,
  // label names (and buckets) match, so components may share a metric;
  // otherwise ALREADY_EXISTS. Names whose rendered series would collide (a
  // histogram `x` and a counter `x_count`) are ALREADY_EXISTS too. Other
  // invalid input is INVALID_ARGUMENT.
  absl::StatusOr<CounterFamily*> AddCounter(
      std::string_view name, std::string_view help,
      std::vector<std::string> label_names = {}) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<GaugeFamily*> AddGauge(
      std::string_view name, std::string_view help,
      std::vector<std::string> label_names = {}) ABSL_LOCKS_EXCLUDED(mu_);
  // `bounds`: finite, strictly increasing; a trailing +Inf is dropped since
  // the +Inf bucket is always present.
  absl::StatusOr<HistogramFamily*> AddHistogram(
      std::string_view name, std::string_view help, std::vector<double> bounds,
      std::vector<std::string> label_names = {}) ABSL_LOCKS_EXCLUDED(mu_);

  // Keeps a collector registered until destroyed or Reset(). Movable.
  class CollectorHandle {
   public:
    CollectorHandle() = default;
    CollectorHandle(CollectorHandle&& other) noexcept;
    CollectorHandle& operator=(CollectorHandle&& other) noexcept;
    ~CollectorHandle() { Reset(); }

    // Unregisters the collector; if a Render is running it, waits for it to
    // return. Do not call while holding a lock the collector takes.
    void Reset();

   private:
    friend class Registry;
    CollectorHandle(Registry* registry, uint64_t id)
        : registry_(registry), id_(id) {}

    Registry* registry_ = nullptr;
    uint64_t id_ = 0;
  };

  // Runs `collect` at the start of every Render (and Collect), in
  // registration order and one collector at a time, so it can refresh gauges
  // lazily. It must not call Render, Collect or AddCollector on this
  // registry, nor reset any handle. The registry must outlive the handle.
  [[nodiscard]] CollectorHandle AddCollector(std::function<void()> collect)
      ABSL_LOCKS_EXCLUDED(collect_mu_);

  // Runs the collectors, then snapshots every family that has a child:
  // families sorted by name, children by label values, each child's labels in
  // declaration order.
  std::vector<prometheus::MetricFamily> Collect() const
      ABSL_LOCKS_EXCLUDED(mu_, collect_mu_) override;

  // Collect() in the Prometheus text format 0.0.4, by
  // prometheus::TextSerializer.
  std::string Render() const ABSL_LOCKS_EXCLUDED(mu_, collect_mu_);

 private:
  template <typename Metric>
  absl::StatusOr<MetricFamily<Metric>*> Add(
      MetricType type, std::string_view name, std::string_view help,
      std::vector<std::string> label_names, std::vector<double> bounds)
      ABSL_LOCKS_EXCLUDED(mu_);
  void RemoveCollector(uint64_t id) ABSL_LOCKS_EXCLUDED(collect_mu_);

  // Lock order: collect_mu_, then mu_ (a collector may register families),
  // then a family's mutex, then prometheus-cpp's own.
  mutable absl::Mutex mu_;
  // Holds every family's values; families_ holds the facade over each.
  const std::unique_ptr<prometheus::Registry> backend_;
  std::map<std::string, std::unique_ptr<FamilyBase>, std::less<>> families_
      ABSL_GUARDED_BY(mu_);
  // Every series name rendered by a family (`x`, `x_bucket`, ...) -> family.
  std::map<std::string, std::string, std::less<>> series_owner_
      ABSL_GUARDED_BY(mu_);

  mutable absl::Mutex collect_mu_;
  uint64_t next_collector_id_ ABSL_GUARDED_BY(collect_mu_) = 1;
  std::map<uint64_t, std::function<void()>> collectors_
      ABSL_GUARDED_BY(collect_mu_);
};

}  // namespace pdserve::metrics
