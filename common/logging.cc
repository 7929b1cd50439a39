#include "common/logging.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace pdserve {
namespace {

LogLevel LevelFromEnv() {
  const char* env = std::getenv("PDSERVE_LOG_LEVEL");
  if (env == nullptr) return LogLevel::kInfo;
  if (std::strcmp(env, "debug") == 0) return LogLevel::kDebug;
  if (std::strcmp(env, "warning") == 0) return LogLevel::kWarning;
  if (std::strcmp(env, "error") == 0) return LogLevel::kError;
  return LogLevel::kInfo;
}

std::atomic<int>& MinLevel() {
  static std::atomic<int> level{static_cast<int>(LevelFromEnv())};
  return level;
}

}  // namespace

void SetMinLogLevel(LogLevel level) { MinLevel() = static_cast<int>(level); }
LogLevel MinLogLevel() { return static_cast<LogLevel>(MinLevel().load()); }

LogMessage::LogMessage(LogLevel level, const char* file, int line)
    : level_(level) {
  static const char kLetters[] = {'D', 'I', 'W', 'E'};
  const char* base = std::strrchr(file, '/');
  stream_ << kLetters[static_cast<int>(level)]
          << absl::FormatTime("%m%d %H:%M:%E3S", absl::Now(),
                              absl::LocalTimeZone())
          << " " << getpid() << " " << (base ? base + 1 : file) << ":" << line
          << "] ";
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  const std::string text = stream_.str();
  // One write() per message keeps lines from interleaving across threads.
  ssize_t unused = ::write(STDERR_FILENO, text.data(), text.size());
  (void)unused;
  (void)level_;
}

}  // namespace pdserve
