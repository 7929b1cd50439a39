#include "kv_transfer/nccl/communicator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace pdserve::kv_transfer::nccl {

absl::Status AwaitCompletion(Completion& completion, absl::Time deadline,
                             const char* what) {
  absl::Duration backoff = absl::Microseconds(5);
  while (true) {
    absl::StatusOr<bool> done = completion.Poll();
    if (!done.ok()) return done.status();
    if (*done) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("timed out waiting for ", what));
    }
    absl::SleepFor(std::min(backoff, deadline - now));
    backoff = std::min(backoff * 2, absl::Milliseconds(1));
  }
}

}  // namespace pdserve::kv_transfer::nccl
