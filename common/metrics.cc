#include "common/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

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

const char* TypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
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
  if (!IsValidName(name, /*allow_colon=*/true)) {
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

// Shortest text that parses back to `value`, in the forms Prometheus reads.
// Whole numbers below 2^53 (counts, token totals) print without an exponent.
void AppendNumber(double value, std::string& out) {
  if (std::isnan(value)) {
    out += "NaN";
  } else if (std::isinf(value)) {
    out += value > 0 ? "+Inf" : "-Inf";
  } else if (std::abs(value) < 0x1p53 && value == std::trunc(value)) {
    absl::StrAppend(&out, static_cast<int64_t>(value));
  } else {
    char buf[32];
    const auto result = std::to_chars(buf, buf + sizeof(buf), value);
    out.append(buf, result.ptr);
  }
}

// Help escapes backslash and newline; label values also escape '"'.
void AppendEscaped(std::string_view text, bool escape_quote, std::string& out) {
  for (const char c : text) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && escape_quote) {
      out += "\\\"";
    } else {
      out += c;
    }
  }
}

// Appends `{a="x",b="y"}` (with `le` last when given), or nothing when there
// are no labels at all.
void AppendLabels(const std::vector<std::string>& names,
                  const std::vector<std::string>& values, const double* le,
                  std::string& out) {
  if (names.empty() && le == nullptr) return;
  out += '{';
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += ',';
    absl::StrAppend(&out, names[i], "=\"");
    AppendEscaped(values[i], /*escape_quote=*/true, out);
    out += '"';
  }
  if (le != nullptr) {
    out += names.empty() ? "le=\"" : ",le=\"";
    AppendNumber(*le, out);
    out += '"';
  }
  out += '}';
}

void AppendSample(std::string_view series, const FamilyBase& family,
                  const std::vector<std::string>& values, const double* le,
                  double value, std::string& out) {
  out += series;
  AppendLabels(family.label_names(), values, le, out);
  out += ' ';
  AppendNumber(value, out);
  out += '\n';
}

template <typename Metric>
void AppendScalarFamily(const MetricFamily<Metric>& family, std::string& out) {
  for (const auto& [values, metric] : family.Children()) {
    AppendSample(family.name(), family, values, nullptr, metric->Value(), out);
  }
}

void AppendHistogramFamily(const HistogramFamily& family, std::string& out) {
  const std::string bucket = absl::StrCat(family.name(), "_bucket");
  for (const auto& [values, histogram] : family.Children()) {
    const std::vector<uint64_t> counts = histogram->CumulativeCounts();
    const std::span<const double> bounds = histogram->bounds();
    for (size_t i = 0; i < counts.size(); ++i) {
      const double le = i < bounds.size() ? bounds[i] : kInf;
      AppendSample(bucket, family, values, &le, counts[i], out);
    }
    AppendSample(absl::StrCat(family.name(), "_sum"), family, values, nullptr,
                 histogram->Sum(), out);
    AppendSample(absl::StrCat(family.name(), "_count"), family, values, nullptr,
                 counts.back(), out);
  }
}

}  // namespace

void Counter::Increment(double delta) {
  if (!(delta > 0)) return;
  value_.fetch_add(delta, std::memory_order_relaxed);
}

void Gauge::Increment(double delta) {
  value_.fetch_add(delta, std::memory_order_relaxed);
}

Histogram::Histogram(std::span<const double> bounds)
    : bounds_(bounds),
      bucket_counts_(new std::atomic<uint64_t>[bounds.size() + 1]()) {}

void Histogram::Observe(double value) {
  if (std::isnan(value)) return;
  const size_t bucket =
      std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  bucket_counts_[bucket].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(value, std::memory_order_relaxed);
}

std::vector<uint64_t> Histogram::CumulativeCounts() const {
  std::vector<uint64_t> counts(bounds_.size() + 1);
  uint64_t total = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    total += bucket_counts_[i].load(std::memory_order_relaxed);
    counts[i] = total;
  }
  return counts;
}

uint64_t Histogram::Count() const { return CumulativeCounts().back(); }

template <typename Metric>
MetricFamily<Metric>::MetricFamily(std::string name, std::string help,
                                   std::vector<std::string> label_names,
                                   std::vector<double> bounds)
    : FamilyBase(std::move(name), std::move(help),
                 std::is_same_v<Metric, Counter> ? MetricType::kCounter
                 : std::is_same_v<Metric, Gauge> ? MetricType::kGauge
                                                 : MetricType::kHistogram,
                 std::move(label_names)),
      bounds_(std::move(bounds)) {
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
  std::unique_ptr<Metric>& child = children_[std::move(key)];
  if (child == nullptr) {
    if constexpr (std::is_same_v<Metric, Histogram>) {
      child = std::make_unique<Histogram>(bounds_);
    } else {
      child = std::make_unique<Metric>();
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
  for (const std::string& s : series) series_owner_.emplace(s, name);
  auto* family = new MetricFamily<Metric>(
      name, std::move(help), std::move(label_names), std::move(bounds));
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

std::string Registry::Render() const {
  {
    absl::MutexLock lock(&collect_mu_);
    for (const auto& [id, collect] : collectors_) collect();
  }
  std::string out;
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [name, family] : families_) {
    // A labelled family with no children yet has nothing to show; its
    // HELP/TYPE lines alone would only add noise.
    std::string samples;
    switch (family->type()) {
      case MetricType::kCounter:
        AppendScalarFamily(static_cast<const CounterFamily&>(*family), samples);
        break;
      case MetricType::kGauge:
        AppendScalarFamily(static_cast<const GaugeFamily&>(*family), samples);
        break;
      case MetricType::kHistogram:
        AppendHistogramFamily(static_cast<const HistogramFamily&>(*family),
                              samples);
        break;
    }
    if (samples.empty()) continue;
    absl::StrAppend(&out, "# HELP ", name, " ");
    AppendEscaped(family->help(), /*escape_quote=*/false, out);
    absl::StrAppend(&out, "\n# TYPE ", name, " ", TypeName(family->type()),
                    "\n", samples);
  }
  return out;
}

}  // namespace pdserve::metrics
