// SIGINT/SIGTERM for the serving commands, through a self-pipe: the signal
// handler only write()s one byte (async-signal-safe); a normal thread waits
// on the pipe and does the shutdown work (drain, join, notify) that must not
// run inside a handler.
//
// Thread-safety: Install once, before waiting; Wait may be called from any
// one thread at a time.
#pragma once

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace pdserve::cli {

// Creates the pipe and installs the handlers for SIGINT and SIGTERM.
// Idempotent.
absl::Status InstallStopSignalHandlers();

// Waits up to `timeout` (InfiniteDuration: forever) for SIGINT or SIGTERM.
// True if one arrived (and consumes it).
bool WaitForStopSignal(absl::Duration timeout = absl::InfiniteDuration());

}  // namespace pdserve::cli
