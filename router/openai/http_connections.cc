#include "router/openai/http_connections.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "router/openai/errors.h"

namespace pdserve::router::openai {
namespace {

thread_local int t_connection_fd = -1;
thread_local bool t_shedding = false;

// Milliseconds left until `deadline`, for poll(2) (at least 0).
int MillisUntil(absl::Time deadline) {
  const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
  return static_cast<int>(std::clamp<int64_t>(ms, 0, 1 << 30));
}

// One poll(2) for `events` on `fd`, retried on EINTR: > 0 when ready.
int PollOne(int fd, short events, int timeout_ms) {
  pollfd p{fd, events, 0};
  int n;
  do {
    n = poll(&p, 1, timeout_ms);
  } while (n < 0 && errno == EINTR);
  return n;
}

// What httplib's request parser reads and writes: a connected socket, in
// TLS when `ssl` is set. Reads and writes wait at most the server's
// timeouts, as httplib's own SocketStream does.
class ConnectionStream final : public httplib::Stream {
 public:
  ConnectionStream(int fd, SSL* ssl, absl::Duration read_timeout,
                   absl::Duration write_timeout)
      : fd_(fd),
        ssl_(ssl),
        read_ms_(static_cast<int>(absl::ToInt64Milliseconds(read_timeout))),
        write_ms_(static_cast<int>(absl::ToInt64Milliseconds(write_timeout))) {}

  bool is_readable() const override {
    return (ssl_ != nullptr && SSL_pending(ssl_) > 0) ||
           PollOne(fd_, POLLIN, read_ms_) > 0;
  }
  bool is_writable() const override {
    return PollOne(fd_, POLLOUT, write_ms_) > 0;
  }
  ssize_t read(char* ptr, size_t size) override {
    if (!is_readable()) return -1;
    if (ssl_ != nullptr) {
      const int n = SSL_read(ssl_, ptr,
                             static_cast<int>(std::min<size_t>(size, 1 << 30)));
      return n > 0 ? n : -1;
    }
    ssize_t n;
    do {
      n = recv(fd_, ptr, size, 0);
    } while (n < 0 && errno == EINTR);
    return n;
  }
  ssize_t write(const char* ptr, size_t size) override {
    if (!is_writable()) return -1;
    if (ssl_ != nullptr) {
      const int n = SSL_write(
          ssl_, ptr, static_cast<int>(std::min<size_t>(size, 1 << 30)));
      return n > 0 ? n : -1;
    }
    ssize_t n;
    do {
      n = send(fd_, ptr, size, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    return n;
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    Address(getpeername, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    Address(getsockname, ip, port);
  }
  socket_t socket() const override { return fd_; }

 private:
  void Address(int (*get)(int, sockaddr*, socklen_t*), std::string& ip,
               int& port) const {
    sockaddr_storage a{};
    socklen_t len = sizeof(a);
    if (get(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) return;
    char buf[INET6_ADDRSTRLEN] = {};
    if (a.ss_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(&a);
      inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf));
      port = ntohs(in->sin_port);
    } else if (a.ss_family == AF_INET6) {
      const auto* in = reinterpret_cast<const sockaddr_in6*>(&a);
      inet_ntop(AF_INET6, &in->sin6_addr, buf, sizeof(buf));
      port = ntohs(in->sin6_port);
    }
    ip = buf;
  }

  const int fd_;
  SSL* const ssl_;
  const int read_ms_, write_ms_;
};

// httplib deletes the TaskQueue new_task_queue returns; this one forwards to
// the pool FrontHttpServer owns.
class PoolRef final : public httplib::TaskQueue {
 public:
  explicit PoolRef(ConnectionPool* pool) : pool_(pool) {}
  void enqueue(std::function<void()> fn) override {
    pool_->enqueue(std::move(fn));
  }
  void shutdown() override { pool_->shutdown(); }

 private:
  ConnectionPool* const pool_;
};

}  // namespace

int CurrentConnectionFd() { return t_connection_fd; }

ConnectionPool::ConnectionPool(const ConnectionLimits& limits)
    : limits_(limits) {
  for (int i = 0; i < limits_.threads; ++i)
    threads_.emplace_back([this] { Work(); });
}

ConnectionPool::~ConnectionPool() { shutdown(); }

bool ConnectionPool::Shedding() { return t_shedding; }

void ConnectionPool::enqueue(std::function<void()> fn) {
  {
    absl::MutexLock l(&mu_);
    if (!stop_ && active_ + static_cast<int64_t>(jobs_.size()) <
                      limits_.threads + limits_.max_queued) {
      jobs_.push_back(std::move(fn));
      return;
    }
    ++shed_;
  }
  // Past the queue: FrontHttpServer sees the flag and hands the connection
  // to its shedder instead of serving it (this runs on the accept loop).
  t_shedding = true;
  fn();
  t_shedding = false;
}

void ConnectionPool::Work() {
  while (true) {
    std::function<void()> fn;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(this, &ConnectionPool::HasWork));
      if (jobs_.empty()) return;  // stopping, nothing left to serve
      fn = std::move(jobs_.front());
      jobs_.pop_front();
      if (yields_ > 0) --yields_;
      ++active_;
    }
    fn();
    absl::MutexLock l(&mu_);
    --active_;
  }
}

void ConnectionPool::shutdown() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
}

bool ConnectionPool::HasWork() const { return stop_ || !jobs_.empty(); }
bool Shedder::HasWork() const { return stop_ || !fds_.empty(); }
bool HangupWatcher::Idle() const { return running_ == 0; }

bool ConnectionPool::TakeYield() {
  absl::MutexLock l(&mu_);
  // Connections no free thread will take: each gets one idle one's thread.
  const int64_t waiting =
      active_ + static_cast<int64_t>(jobs_.size()) - limits_.threads;
  if (waiting <= yields_) return false;
  ++yields_;
  return true;
}

ConnectionPool::Stats ConnectionPool::stats() const {
  absl::MutexLock l(&mu_);
  return Stats{active_, static_cast<int64_t>(jobs_.size()), shed_};
}

Shedder::Shedder(int max_pending, int retry_after_s)
    : max_pending_(max_pending), response_([retry_after_s] {
        HttpError e = FromGrpc(
            grpc::Status(grpc::StatusCode::UNAVAILABLE,
                         "the server has more connections than it can serve; "
                         "retry later"),
            0);
        const std::string body = ErrorJson(e);
        return absl::StrCat(
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: "
            "application/json\r\nRetry-After: ",
            retry_after_s,
            "\r\nConnection: close\r\nContent-Length: ", body.size(),
            "\r\n\r\n", body);
      }()) {
  thread_ = std::thread([this] { Run(); });
}

Shedder::~Shedder() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  thread_.join();
  absl::MutexLock l(&mu_);
  for (int fd : fds_) close(fd);
}

void Shedder::Shed(int fd) {
  absl::MutexLock l(&mu_);
  if (stop_ || static_cast<int>(fds_.size()) >= max_pending_) {
    close(fd);
    return;
  }
  fds_.push_back(fd);
}

void Shedder::Run() {
  char sink[4096];
  // Reads what the client has sent, waiting up to `ms` for the first bytes.
  auto drain = [&](int fd, int ms) {
    const absl::Time until = absl::Now() + absl::Milliseconds(ms);
    for (size_t total = 0; total < (64 << 10);) {
      if (PollOne(fd, POLLIN, MillisUntil(until)) <= 0) return;
      const ssize_t n = recv(fd, sink, sizeof(sink), MSG_DONTWAIT);
      if (n <= 0) return;
      total += static_cast<size_t>(n);
    }
  };
  while (true) {
    int fd;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(this, &Shedder::HasWork));
      if (stop_) return;
      fd = fds_.front();
      fds_.pop_front();
    }
    drain(fd, 100);
    send(fd, response_.data(), response_.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    ::shutdown(fd, SHUT_WR);
    drain(fd, 100);  // until the client closes: no reset before it reads
    close(fd);
  }
}

HangupWatcher::HangupWatcher() : wake_fd_(eventfd(0, EFD_NONBLOCK)) {
  thread_ = std::thread([this] { Run(); });
}

HangupWatcher::~HangupWatcher() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  Wake();
  thread_.join();
  close(wake_fd_);
}

void HangupWatcher::Wake() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
}

uint64_t HangupWatcher::Watch(int fd, std::function<void()> on_hangup) {
  uint64_t id;
  {
    absl::MutexLock l(&mu_);
    id = next_id_++;
    entries_[id] = Entry{fd, std::move(on_hangup)};
  }
  Wake();
  return id;
}

void HangupWatcher::Unwatch(uint64_t id) {
  absl::MutexLock l(&mu_);
  entries_.erase(id);
  // A callback already running finishes before the caller goes on.
  while (running_ == id) mu_.Await(absl::Condition(this, &HangupWatcher::Idle));
}

void HangupWatcher::Run() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;
  while (true) {
    fds.assign(1, pollfd{wake_fd_, POLLIN, 0});
    ids.assign(1, 0);
    {
      absl::MutexLock l(&mu_);
      if (stop_) return;
      for (const auto& [id, e] : entries_) {
        // POLLRDHUP without POLLIN: a pipelined next request is no hangup.
        fds.push_back(pollfd{e.fd, POLLRDHUP, 0});
        ids.push_back(id);
      }
    }
    if (poll(fds.data(), fds.size(), -1) < 0 && errno != EINTR) return;
    uint64_t drained;
    [[maybe_unused]] ssize_t n = ::read(wake_fd_, &drained, sizeof(drained));
    for (size_t i = 1; i < fds.size(); ++i) {
      if ((fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) == 0) continue;
      std::function<void()> callback;
      {
        absl::MutexLock l(&mu_);
        auto it = entries_.find(ids[i]);
        if (it == entries_.end()) continue;  // unwatched meanwhile
        callback = std::move(it->second.on_hangup);
        entries_.erase(it);
        running_ = ids[i];
      }
      callback();
      absl::MutexLock l(&mu_);
      running_ = 0;  // wakes an Unwatch waiting for it (Idle)
    }
  }
}

FrontHttpServer::FrontHttpServer(const ConnectionLimits& limits,
                                 SSL_CTX* ssl_ctx)
    : limits_(limits),
      ssl_ctx_(ssl_ctx),
      shedder_(limits.max_shedding, limits.retry_after_s),
      pool_(limits) {
  new_task_queue = [this] { return new PoolRef(&pool_); };
}

FrontHttpServer::~FrontHttpServer() {
  pool_.shutdown();  // no connection uses the context any more
  if (ssl_ctx_ != nullptr) SSL_CTX_free(ssl_ctx_);
}

bool FrontHttpServer::AwaitRequest(int fd, SSL* ssl, bool served_one) {
  if (ssl != nullptr && SSL_pending(ssl) > 0) return true;
  const absl::Time until = absl::Now() + limits_.keep_alive_idle;
  // Short slices: a connection queued behind this idle one gets its thread
  // within one slice.
  constexpr int kSliceMs = 20;
  while (svr_sock_ != INVALID_SOCKET) {
    const int left = MillisUntil(until);
    if (left == 0) return false;
    const int n = PollOne(fd, POLLIN, std::min(left, kSliceMs));
    if (n > 0) return true;
    if (n < 0) return false;
    // Only a connection that was served gives way: a new one's request may
    // still be on its way.
    if (served_one && pool_.TakeYield()) return false;
  }
  return false;
}

bool FrontHttpServer::process_and_close_socket(socket_t sock) {
  if (ConnectionPool::Shedding()) {
    if (ssl_ctx_ == nullptr) {
      shedder_.Shed(sock);
    } else {
      // A 503 would need a TLS handshake first: the refusal is the close.
      ::shutdown(sock, SHUT_RDWR);
      close(sock);
    }
    return true;
  }
  SSL* ssl = nullptr;
  if (ssl_ctx_ != nullptr) {
    ssl = SSL_new(ssl_ctx_);
    if (ssl == nullptr || SSL_set_fd(ssl, sock) != 1 || SSL_accept(ssl) != 1) {
      if (ssl != nullptr) SSL_free(ssl);
      ::shutdown(sock, SHUT_RDWR);
      close(sock);
      return false;
    }
  }
  ConnectionStream strm(
      sock, ssl,
      absl::Seconds(read_timeout_sec_) + absl::Microseconds(read_timeout_usec_),
      absl::Seconds(write_timeout_sec_) +
          absl::Microseconds(write_timeout_usec_));
  t_connection_fd = sock;
  bool ok = true;
  for (int left = limits_.keep_alive_max_requests;
       left > 0 &&
       AwaitRequest(sock, ssl, left < limits_.keep_alive_max_requests);
       --left) {
    bool closed = false;
    ok = process_request(strm, left == 1, closed, nullptr);
    if (!ok || closed) break;
  }
  t_connection_fd = -1;
  if (ssl != nullptr) {
    SSL_shutdown(ssl);
    SSL_free(ssl);
  }
  ::shutdown(sock, SHUT_RDWR);
  close(sock);
  return ok;
}

}  // namespace pdserve::router::openai
