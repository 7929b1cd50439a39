// Minimal leveled logging to stderr: `PDSERVE_LOG(INFO) << "...";`.
// Thread-safe: each message is formatted privately and written with one call.
#pragma once

#include <sstream>
#include <string>

namespace pdserve {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Messages below this level are dropped. Default kInfo; PDSERVE_LOG_LEVEL
// (debug|info|warning|error) in the environment overrides it at start-up.
void SetMinLogLevel(LogLevel level);
LogLevel MinLogLevel();

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};

}  // namespace pdserve

#define PDSERVE_LOG_LEVEL_DEBUG ::pdserve::LogLevel::kDebug
#define PDSERVE_LOG_LEVEL_INFO ::pdserve::LogLevel::kInfo
#define PDSERVE_LOG_LEVEL_WARNING ::pdserve::LogLevel::kWarning
#define PDSERVE_LOG_LEVEL_ERROR ::pdserve::LogLevel::kError

#define PDSERVE_LOG(severity)                                               \
  if (PDSERVE_LOG_LEVEL_##severity < ::pdserve::MinLogLevel()) {            \
  } else                                                                    \
    ::pdserve::LogMessage(PDSERVE_LOG_LEVEL_##severity, __FILE__, __LINE__) \
        .stream()
