#include "common/metrics.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace pdserve::metrics {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

bool IsValidName(std::string_view name, bool allow_colon) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = absl::ascii_isalpha(c) || c == '_' ||
                    (allow_colon && c == ':') ||
                    (i > 0 && absl::ascii_isdigit(c));
    if (!ok) return false;
  }
  return true;
}

// Prometheus rejects the whole scrape on one invalid UTF-8 string, so label
// values (which may come from requests) and help are checked up front.
// Rejects overlong forms, surrogates and code points above U+10FFFF.
bool IsValidUtf8(std::string_view s) {
  static constexpr uint32_t kMinCodePoint[] = {0, 0, 0x80, 0x800, 0x10000};
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char lead = s[i];
    int len;
    uint32_t code_point;
    if (lead < 0x80) {
      ++i;
      continue;
    } else if ((lead & 0xE0) == 0xC0) {
      len = 2;
      code_point = lead & 0x1F;
    } else if ((lead & 0xF0) == 0xE0) {
      len = 3;
      code_point = lead & 0x0F;
    } else if ((lead & 0xF8) == 0xF0) {
      len = 4;
      code_point = lead & 0x07;
    } else {
      return false;
    }
    if (s.size() - i < static_cast<size_t>(len)) return false;
    for (int k = 1; k < len; ++k) {
      const unsigned char next = s[i + k];
      if ((next & 0xC0) != 0x80) return false;
      code_point = (code_point << 6) | (next & 0x3F);
    }
    if (code_point < kMinCodePoint[len] || code_point > 0x10FFFF ||
        (code_point >= 0xD800 && code_point <= 0xDFFF)) {
      return false;
    }
    i += len;
  }
  return true;
}

// Series names a family renders; two families may not share any.
std::vector<std::string> SeriesNames(MetricType type, const std::string& name) {
  if (type != MetricType::kHistogram) return {name};
  return {name, absl::StrCat(name, "_bucket"), absl::StrCat(name, "_sum"),
          absl::StrCat(name, "_count")};
}

absl::Status ValidateFamily(MetricType type, const std::string& name,
                            const std::string& help,
                            const std::vector<std::string>& label_names) {
  if (!IsValidName(name, /*allow_colon=*/true) || name.starts_with("__")) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid metric name \"", absl::CEscape(name), "\""));
  }
  if (type == MetricType::kCounter && !name.ends_with("_total")) {
    return absl::InvalidArgumentError(
        absl::StrCat("counter ", name, " must be named with a _total suffix"));
  }
  if (help.empty() || !IsValidUtf8(help)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metric ", name, " needs non-empty UTF-8 help"));
  }
  for (size_t i = 0; i < label_names.size(); ++i) {
    const std::string& label = label_names[i];
    if (!IsValidName(label, /*allow_colon=*/false) || label.starts_with("__")) {
      return absl::InvalidArgumentError(
          absl::StrCat("metric ", name, ": invalid label name \"",
                       absl::CEscape(label), "\""));
    }
    if (type == MetricType::kHistogram && label == "le") {
      return absl::InvalidArgumentError(absl::StrCat(
          "histogram ", name, " may not use the reserved label \"le\""));
    }
    if (std::find(label_names.begin(), label_names.begin() + i, label) !=
        label_names.begin() + i) {
      return absl::InvalidArgumentError(
          absl::StrCat("metric ", name, ": duplicate label name ", label));
    }
  }
  return absl::OkStatus();
}

absl::Status NormalizeBounds(const std::string& name,
                             std::vector<double>& bounds) {
  if (!bounds.empty() && bounds.back() == kInf) bounds.pop_back();
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i]) || (i > 0 && bounds[i] <= bounds[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("histogram ", name,
                       ": bucket bounds must be finite and strictly "
                       "increasing, got [",
                       absl::StrJoin(bounds, ", "), "]"));
    }
  }
  return absl::OkStatus();
}

// prometheus-cpp 1.0.1's TextSerializer escapes label values but writes HELP
// verbatim, so a backslash or newline in help would corrupt the scrape. The
// format escapes both in help (and nothing else).
std::string EscapeHelp(std::string_view help) {
  std::string out;
  out.reserve(help.size());
  for (const char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// prometheus-cpp keeps a child's labels in a std::map, so they come out sorted
// by name; put them back in the family's declaration order.
void OrderLabels(const std::vector<std::string>& label_names,
                 std::vector<prometheus::ClientMetric::Label>& labels) {
  std::vector<prometheus::ClientMetric::Label> ordered;
  ordered.reserve(labels.size());
  for (const std::string& name : label_names) {
    auto it = std::find_if(labels.begin(), labels.end(),
                           [&](const auto& l) { return l.name == name; });
    if (it != labels.end()) ordered.push_back(std::move(*it));
  }
  labels = std::move(ordered);
}

}  // namespace

void Counter::Increment(double delta) {
  // prometheus-cpp drops negative deltas but would add NaN.
  if (!(delta > 0)) return;
  backend_.Increment(delta);
}

double Counter::Value() const { return backend_.Value(); }

void Gauge::Set(double value) { backend_.Set(value); }

void Gauge::Increment(double delta) { backend_.Increment(delta); }

double Gauge::Value() const { return backend_.Value(); }

void Histogram::Observe(double value) {
  // prometheus-cpp would count NaN in +Inf and make the sum NaN for good.
  if (std::isnan(value)) return;
  backend_.Observe(value);
}

std::vector<uint64_t> Histogram::CumulativeCounts() const {
  const prometheus::ClientMetric snapshot = backend_.Collect();
  std::vector<uint64_t> counts;
  counts.reserve(snapshot.histogram.bucket.size());
  for (const auto& bucket : snapshot.histogram.bucket) {
    counts.push_back(bucket.cumulative_count);
  }
  return counts;
}

uint64_t Histogram::Count() const {
  return backend_.Collect().histogram.sample_count;
}

double Histogram::Sum() const {
  return backend_.Collect().histogram.sample_sum;
}

template <typename Metric>
MetricFamily<Metric>::MetricFamily(std::string name, std::string help,
                                   std::vector<std::string> label_names,
                                   std::vector<double> bounds,
                                   prometheus::Family<Backend>& backend)
    : FamilyBase(std::move(name), std::move(help),
                 std::is_same_v<Metric, Counter> ? MetricType::kCounter
                 : std::is_same_v<Metric, Gauge> ? MetricType::kGauge
                                                 : MetricType::kHistogram,
                 std::move(label_names)),
      bounds_(std::move(bounds)),
      backend_(backend) {
  if (this->label_names().empty()) (void)WithLabels({});
}

template <typename Metric>
absl::StatusOr<Metric*> MetricFamily<Metric>::WithLabels(
    absl::Span<const std::string_view> values) {
  if (values.size() != label_names().size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metric ", name(), " has labels [", absl::StrJoin(label_names(), ","),
        "] but got ", values.size(), " values"));
  }
  for (const std::string_view value : values) {
    if (!IsValidUtf8(value)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "metric ", name(), ": label value \"",
          absl::CEscape(absl::string_view(value.data(), value.size())),
          "\" is not valid UTF-8"));
    }
  }
  std::vector<std::string> key(values.begin(), values.end());
  absl::MutexLock lock(&mu_);
  std::unique_ptr<Metric>& child = children_[key];
  if (child == nullptr) {
    prometheus::Labels labels;
    for (size_t i = 0; i < key.size(); ++i) labels[label_names()[i]] = key[i];
    // Names and values were checked above, so prometheus-cpp has nothing to
    // throw for; exceptions still stop here rather than cross into callers.
    try {
      if constexpr (std::is_same_v<Metric, Histogram>) {
        child.reset(new Histogram(backend_.Add(labels, bounds_), bounds_));
      } else {
        child.reset(new Metric(backend_.Add(labels)));
      }
    } catch (const std::exception& e) {
      children_.erase(key);
      return absl::InternalError(
          absl::StrCat("metric ", name(), ": prometheus-cpp: ", e.what()));
    }
  }
  return child.get();
}

template <typename Metric>
std::vector<std::pair<std::vector<std::string>, const Metric*>>
MetricFamily<Metric>::Children() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<std::vector<std::string>, const Metric*>> children;
  children.reserve(children_.size());
  for (const auto& [values, metric] : children_) {
    children.emplace_back(values, metric.get());
  }
  return children;
}

template class MetricFamily<Counter>;
template class MetricFamily<Gauge>;
template class MetricFamily<Histogram>;

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> bounds;
  for (int i = 0; i < count; ++i) {
    bounds.push_back(start);
    start *= factor;
  }
  return bounds;
}

std::vector<double> LinearBuckets(double start, double width, int count) {
  std::vector<double> bounds;
  for (int i = 0; i < count; ++i) bounds.push_back(start + i * width);
  return bounds;
}

std::vector<double> DefaultLatencyBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
          0.5,   1,      2.5,   5,    10,    25,   60};
}

Registry::Registry() : backend_(std::make_unique<prometheus::Registry>()) {}

Registry::~Registry() = default;

Registry& Registry::Default() {
  static Registry* const registry = new Registry();
  return *registry;
}

absl::StatusOr<CounterFamily*> Registry::AddCounter(
    std::string_view name, std::string_view help,
    std::vector<std::string> label_names) {
  return Add<Counter>(MetricType::kCounter, name, help, std::move(label_names),
                      {});
}

absl::StatusOr<GaugeFamily*> Registry::AddGauge(
    std::string_view name, std::string_view help,
    std::vector<std::string> label_names) {
  return Add<Gauge>(MetricType::kGauge, name, help, std::move(label_names), {});
}

absl::StatusOr<HistogramFamily*> Registry::AddHistogram(
    std::string_view name, std::string_view help, std::vector<double> bounds,
    std::vector<std::string> label_names) {
  if (absl::Status status = NormalizeBounds(std::string(name), bounds);
      !status.ok()) {
    return status;
  }
  return Add<Histogram>(MetricType::kHistogram, name, help,
                        std::move(label_names), std::move(bounds));
}

template <typename Metric>
absl::StatusOr<MetricFamily<Metric>*> Registry::Add(
    MetricType type, std::string_view name_view, std::string_view help_view,
    std::vector<std::string> label_names, std::vector<double> bounds) {
  std::string name(name_view);
  std::string help(help_view);
  if (absl::Status status = ValidateFamily(type, name, help, label_names);
      !status.ok()) {
    return status;
  }
  absl::MutexLock lock(&mu_);
  if (auto it = families_.find(name); it != families_.end()) {
    FamilyBase& existing = *it->second;
    if (existing.type() == type && existing.help() == help &&
        existing.label_names() == label_names &&
        static_cast<MetricFamily<Metric>&>(existing).bounds() == bounds) {
      return static_cast<MetricFamily<Metric>*>(&existing);
    }
    return absl::AlreadyExistsError(absl::StrCat(
        "metric ", name,
        " is already registered with a different type, help, labels or "
        "buckets"));
  }
  const std::vector<std::string> series = SeriesNames(type, name);
  for (const std::string& s : series) {
    if (auto it = series_owner_.find(s); it != series_owner_.end()) {
      return absl::AlreadyExistsError(
          absl::StrCat("metric ", name, " would render series ", s,
                       ", which belongs to metric ", it->second));
    }
  }
  prometheus::Family<typename MetricFamily<Metric>::Backend>* backend;
  // Validated above, and the name is new to backend_ (its families are only
  // ever added here), so prometheus-cpp should not throw; if it does, the
  // exception stops here.
  try {
    if constexpr (std::is_same_v<Metric, Counter>) {
      backend =
          &prometheus::BuildCounter().Name(name).Help(help).Register(*backend_);
    } else if constexpr (std::is_same_v<Metric, Gauge>) {
      backend =
          &prometheus::BuildGauge().Name(name).Help(help).Register(*backend_);
    } else {
      backend = &prometheus::BuildHistogram().Name(name).Help(help).Register(
          *backend_);
    }
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("metric ", name, ": prometheus-cpp: ", e.what()));
  }
  for (const std::string& s : series) series_owner_.emplace(s, name);
  auto* family =
      new MetricFamily<Metric>(name, std::move(help), std::move(label_names),
                               std::move(bounds), *backend);
  families_.emplace(std::move(name), std::unique_ptr<FamilyBase>(family));
  return family;
}

Registry::CollectorHandle::CollectorHandle(CollectorHandle&& other) noexcept
    : registry_(std::exchange(other.registry_, nullptr)),
      id_(std::exchange(other.id_, 0)) {}

Registry::CollectorHandle& Registry::CollectorHandle::operator=(
    CollectorHandle&& other) noexcept {
  if (this != &other) {
    Reset();
    registry_ = std::exchange(other.registry_, nullptr);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

void Registry::CollectorHandle::Reset() {
  if (registry_ != nullptr) registry_->RemoveCollector(id_);
  registry_ = nullptr;
  id_ = 0;
}

Registry::CollectorHandle Registry::AddCollector(
    std::function<void()> collect) {
  absl::MutexLock lock(&collect_mu_);
  const uint64_t id = next_collector_id_++;
  collectors_.emplace(id, std::move(collect));
  return CollectorHandle(this, id);
}

void Registry::RemoveCollector(uint64_t id) {
  absl::MutexLock lock(&collect_mu_);
  collectors_.erase(id);
}

std::vector<prometheus::MetricFamily> Registry::Collect() const {
  {
    absl::MutexLock lock(&collect_mu_);
    for (const auto& [id, collect] : collectors_) collect();
  }
  absl::ReaderMutexLock lock(&mu_);
  // prometheus-cpp leaves out a family with no child yet (a labelled family
  // nobody has resolved a child of), whose HELP/TYPE alone would be noise.
  std::vector<prometheus::MetricFamily> families = backend_->Collect();
  for (prometheus::MetricFamily& family : families) {
    if (auto it = families_.find(family.name); it != families_.end()) {
      for (prometheus::ClientMetric& metric : family.metric) {
        OrderLabels(it->second->label_names(), metric.label);
      }
    }
    // Labels are now in the same order in every child, so comparing the
    // (name, value) lists compares the values.
    std::sort(
        family.metric.begin(), family.metric.end(),
        [](const prometheus::ClientMetric& a,
           const prometheus::ClientMetric& b) { return a.label < b.label; });
  }
  std::sort(families.begin(), families.end(),
            [](const prometheus::MetricFamily& a,
               const prometheus::MetricFamily& b) { return a.name < b.name; });
  return families;
}

std::string Registry::Render() const {
  std::vector<prometheus::MetricFamily> families = Collect();
  for (prometheus::MetricFamily& family : families) {
    family.help = EscapeHelp(family.help);
  }
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace pdserve::metrics
