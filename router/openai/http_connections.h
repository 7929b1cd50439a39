// How the HTTP front holds its connections, so that no number of clients can
// starve it: a fixed pool of connection threads behind a bounded queue (a
// connection past the queue gets 503 with Retry-After at once), an idle
// keep-alive timeout (and an idle connection gives its thread up as soon as
// another connection waits for one), and a watch that tells a handler its
// client hung up, so a non-streamed request nobody awaits is cancelled.
//
// cpp-httplib 0.11 runs each connection to its end on a TaskQueue thread and
// offers no hook between accept and the request, so FrontHttpServer takes
// over its per-connection loop (process_and_close_socket) and serves plain
// TCP and TLS streams of its own to httplib's request parser
// (process_request); routing, parsing and responses stay httplib's.
//
// Thread-safety: ConnectionPool and HangupWatcher are thread-safe;
// FrontHttpServer as httplib::Server.
#pragma once

#include <httplib.h>
#include <openssl/ssl.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pdserve::router::openai {

struct ConnectionLimits {
  int threads = 256;        // connections served at once
  int max_queued = 256;     // accepted connections waiting for a thread
  int max_shedding = 1024;  // refused connections being answered 503
  // An idle keep-alive connection is closed after this (and at once when a
  // queued connection waits for its thread).
  absl::Duration keep_alive_idle = absl::Seconds(5);
  int keep_alive_max_requests = 1000;  // requests per connection
  int retry_after_s = 1;               // on the 503 past the queue
};

// The connection the calling thread is serving (a FrontHttpServer handler),
// or -1 elsewhere.
int CurrentConnectionFd();

// The thread pool behind httplib's accept loop. Connections past `threads`
// wait in a queue of `max_queued`; past that the accept loop hands the
// connection to the shedder (a 503 with Retry-After), and past
// `max_shedding` refused connections are closed without a response.
class ConnectionPool final : public httplib::TaskQueue {
 public:
  explicit ConnectionPool(const ConnectionLimits& limits);
  ~ConnectionPool() override;

  void enqueue(std::function<void()> fn) override ABSL_LOCKS_EXCLUDED(mu_);
  void shutdown() override ABSL_LOCKS_EXCLUDED(mu_);

  // An idle keep-alive connection asks whether to give its thread up: true
  // once for each queued connection that no other idle one gave way to.
  bool TakeYield() ABSL_LOCKS_EXCLUDED(mu_);

  struct Stats {
    int64_t active = 0;  // connections on a thread
    int64_t queued = 0;  // waiting for one
    int64_t shed = 0;    // refused with 503 (or closed) since start
  };
  Stats stats() const ABSL_LOCKS_EXCLUDED(mu_);

  // Set on the accept loop's thread while it hands a refused connection to
  // FrontHttpServer (which then answers 503 instead of serving it).
  static bool Shedding();

 private:
  void Work() ABSL_LOCKS_EXCLUDED(mu_);
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ConnectionLimits limits_;
  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  int64_t active_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t yields_ ABSL_GUARDED_BY(mu_) = 0;  // granted, not yet picked up
  int64_t shed_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

// Answers refused connections with 503 + Retry-After on one thread: it reads
// what the client already sent (so closing does not reset the connection
// before the client reads the answer), writes the response, and closes.
class Shedder {
 public:
  Shedder(int max_pending, int retry_after_s);
  ~Shedder();
  // Takes ownership of `fd`; closes it at once when `max_pending` wait.
  void Shed(int fd) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const int max_pending_;
  const std::string response_;
  absl::Mutex mu_;
  std::deque<int> fds_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// Calls a callback once when the peer of a watched socket hangs up (FIN,
// reset or error), from its own thread. Used while a handler waits on a
// non-streamed generation, so the generation stops when nobody awaits it.
class HangupWatcher {
 public:
  HangupWatcher();
  ~HangupWatcher();

  // Watches `fd` until the returned id is passed to Unwatch.
  uint64_t Watch(int fd, std::function<void()> on_hangup)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Stops watching; once it returns the callback is not running and will not
  // run.
  void Unwatch(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Wake();

  struct Entry {
    int fd;
    std::function<void()> on_hangup;
  };
  int wake_fd_ = -1;  // an eventfd: the watch set changed, or stop
  absl::Mutex mu_;
  std::map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t running_ ABSL_GUARDED_BY(mu_) = 0;  // the callback's id, or 0
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// httplib::Server with the connection loop above: plain TCP, or TLS when
// `ssl_ctx` is set (the server owns it).
class FrontHttpServer final : public httplib::Server {
 public:
  FrontHttpServer(const ConnectionLimits& limits, SSL_CTX* ssl_ctx);
  ~FrontHttpServer() override;

  ConnectionPool& pool() { return pool_; }

 private:
  bool process_and_close_socket(socket_t sock) override;
  // Waits for the next request on a connection: false when it idles past
  // the timeout, the server stops, or (`served_one`: an idle keep-alive
  // connection) a queued connection wants the thread.
  bool AwaitRequest(int fd, SSL* ssl, bool served_one);

  const ConnectionLimits limits_;
  SSL_CTX* const ssl_ctx_;
  Shedder shedder_;
  // Owned here, not by httplib's accept loop (which deletes the TaskQueue it
  // gets from new_task_queue: a forwarding one), so stats outlive listening.
  ConnectionPool pool_;
};

}  // namespace pdserve::router::openai
