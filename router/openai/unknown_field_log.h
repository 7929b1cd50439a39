// Logs and counts the request body fields the OpenAI front does not know
// (they are ignored, as OpenAI's SDKs send fields a server may not know):
// pdserve_openai_unknown_fields_total{endpoint}. Thread-safe.
#pragma once

#include <string>
#include <vector>

#include "common/metrics.h"
#include "router/openai/request.h"

namespace pdserve::router::openai {

class UnknownFieldLog {
 public:
  explicit UnknownFieldLog(metrics::Registry& registry);
  void Record(Endpoint endpoint, const std::vector<std::string>& fields);

 private:
  metrics::Counter* completions_ = nullptr;
  metrics::Counter* chat_ = nullptr;
};

}  // namespace pdserve::router::openai
