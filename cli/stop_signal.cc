#include "cli/stop_signal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace pdserve::cli {
namespace {

// [read end, write end]; -1 until installed. Read by the handler, so plain
// ints written once before the handlers are installed.
int g_pipe[2] = {-1, -1};

void OnStopSignal(int) {
  const int saved = errno;
  // Non-blocking: a full pipe already holds a wake-up.
  [[maybe_unused]] const ssize_t n = write(g_pipe[1], "s", 1);
  errno = saved;
}

}  // namespace

absl::Status InstallStopSignalHandlers() {
  if (g_pipe[0] >= 0) return absl::OkStatus();
  int fds[2];
  if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::InternalError(
        absl::StrCat("pipe2 for signal handling: ", std::strerror(errno)));
  }
  g_pipe[0] = fds[0];
  g_pipe[1] = fds[1];
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : {SIGINT, SIGTERM}) {
    if (sigaction(sig, &sa, nullptr) != 0) {
      return absl::InternalError(
          absl::StrCat("sigaction: ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

bool WaitForStopSignal(absl::Duration timeout) {
  if (g_pipe[0] < 0) return false;
  const absl::Time until = timeout == absl::InfiniteDuration()
                               ? absl::InfiniteFuture()
                               : absl::Now() + timeout;
  while (true) {
    int wait_ms = -1;
    if (until != absl::InfiniteFuture()) {
      const absl::Duration left = until - absl::Now();
      if (left <= absl::ZeroDuration()) return false;
      wait_ms = static_cast<int>(
          std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, INT_MAX));
    }
    pollfd p{g_pipe[0], POLLIN, 0};
    const int r = poll(&p, 1, wait_ms);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    char buf[64];
    if (read(g_pipe[0], buf, sizeof(buf)) > 0) return true;
  }
}

}  // namespace pdserve::cli
