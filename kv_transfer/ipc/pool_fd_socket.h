// How the shm transport hands a decode worker's KV pool to a prefill worker:
// the pool's memfd itself, passed over a Unix socket with SCM_RIGHTS.
//
// The exporting process (PoolFdServer) listens on one abstract Unix socket
// ("@pdserve-kv-<pid>-<random>") and serves each exported memfd under a
// random 128-bit token. A peer learns the handle (socket, token, and the
// memfd's st_dev/st_ino) only from the exporter's handshake reply on the
// KvTransfer.Control stream, connects, and asks for the fd by its token;
// the server answers only peers of its own user (SO_PEERCRED). The peer
// receives the open file itself, so nothing can swap the file between a
// check and an open, and the kernel tells it which process passed it
// (SO_PEERCRED of the server), which the receiving side checks against the
// pool's name (peer_memory.cc).
//
// Each connection carries one request (SOCK_SEQPACKET): a byte 'F' (fetch
// the fd) or 'A' (is the token still exported?) and the token; the answer
// is one status byte, with the fd attached to a 'Y' for 'F'. Any fd a client
// attaches is closed unread. The server serves connections one at a time,
// each bounded by kRequestTimeout, so a client that never sends delays
// others by at most that.
//
// Thread-safe.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pdserve::kv_transfer::ipc {

// The handle string of one exported region:
// "shm-fd:<socket name>:<token hex>:<st_dev>:<st_ino>".
struct PoolFdHandle {
  std::string socket;  // abstract socket name, without the leading NUL
  std::string token;   // 32 hex digits
  uint64_t dev = 0;    // the memfd the exporter declares it passes
  uint64_t ino = 0;

  std::string Format() const;
  // INVALID_ARGUMENT unless `handle` has the form above.
  static absl::StatusOr<PoolFdHandle> Parse(const std::string& handle);
};

// What a peer's server passed: the fd (owned by the caller) and the pid the
// kernel reports for the server's end (its listen() caller).
struct ReceivedPoolFd {
  int fd = -1;
  pid_t peer_pid = 0;
};

// Fetches the fd under `handle`. UNAVAILABLE when the socket is gone (the
// exporter exited), no longer exports the token, or does not answer within
// `timeout`; FAILED_PRECONDITION when the server runs as another user, or
// answers with other than exactly one fd.
absl::StatusOr<ReceivedPoolFd> FetchPoolFd(const PoolFdHandle& handle,
                                           absl::Duration timeout);

enum class ExportState { kExported, kGone, kUnknown };
// Whether the server still exports `handle`'s token: kGone when the socket
// is gone or the token unknown, kUnknown when it did not answer in time (a
// stopped process), so callers unmap only what is known dead.
ExportState QueryPoolFd(const PoolFdHandle& handle, absl::Duration timeout);

class PoolFdServer {
 public:
  static constexpr absl::Duration kRequestTimeout = absl::Milliseconds(500);

  // Binds the socket and starts the serving thread; UNAVAILABLE on failure.
  static absl::StatusOr<std::unique_ptr<PoolFdServer>> Start();
  ~PoolFdServer();  // stops the thread, closes every exported fd

  // Exports a dup of `fd` (which must be a regular file) under a new token.
  absl::StatusOr<std::string> Add(int fd);
  // Stops exporting `handle` and closes its dup. Unknown handles: no-op.
  void Remove(const std::string& handle);

  // Requests refused (unknown token, other user, malformed), and fds that
  // clients attached (closed unread): for tests and the soak.
  int64_t refused() const { return refused_.load(); }
  int64_t fds_dropped() const { return fds_dropped_.load(); }
  const std::string& socket_name() const { return name_; }

 private:
  PoolFdServer(int listen_fd, int wake_fd, std::string name);
  void Run();
  void ServeOne(int conn);

  const int listen_fd_;
  const int wake_fd_;  // eventfd: wakes Run to stop
  const std::string name_;
  struct Entry {
    int fd;
    std::string handle;
  };
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> by_token_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> refused_{0};
  std::atomic<int64_t> fds_dropped_{0};
  std::thread thread_;
};

}  // namespace pdserve::kv_transfer::ipc
