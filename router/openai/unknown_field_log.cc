#include "router/openai/unknown_field_log.h"

#include "absl/strings/str_join.h"
#include "common/json.h"
#include "common/logging.h"
#include "common/metric_handles.h"

namespace pdserve::router::openai {

UnknownFieldLog::UnknownFieldLog(metrics::Registry& registry) {
  metrics::CounterFamily* family = metrics::Must(registry.AddCounter(
      "pdserve_openai_unknown_fields_total",
      "Request body fields the OpenAI front does not know (ignored)",
      {"endpoint"}));
  completions_ = metrics::Must(family->WithLabels({"/v1/completions"}));
  chat_ = metrics::Must(family->WithLabels({"/v1/chat/completions"}));
}

void UnknownFieldLog::Record(Endpoint endpoint,
                             const std::vector<std::string>& fields) {
  if (fields.empty()) return;
  (endpoint == Endpoint::kCompletions ? completions_ : chat_)
      ->Increment(static_cast<double>(fields.size()));
  // Names are client text: bounded before they reach the log.
  std::vector<std::string> shown;
  for (size_t i = 0; i < fields.size() && i < 8; ++i) {
    shown.push_back(json::Quote(fields[i].substr(0, 64)));
  }
  PDSERVE_LOG(INFO) << "ignoring unknown request field(s) "
                    << absl::StrJoin(shown, ", ")
                    << (fields.size() > shown.size() ? ", ..." : "");
}

}  // namespace pdserve::router::openai
