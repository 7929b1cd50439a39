#include "kv_transfer/ipc/pool_fd_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace pdserve::kv_transfer::ipc {
namespace {

constexpr char kPrefix[] = "shm-fd";
constexpr size_t kTokenHex = 32;
// Room for more fds than any answer carries, so extras are seen (and
// closed) rather than silently truncated.
constexpr int kMaxFdsSeen = 8;

std::string RandomHex(size_t digits) {
  std::random_device random;
  std::string out;
  while (out.size() < digits) {
    absl::StrAppend(&out, absl::Hex(random(), absl::kZeroPad8));
  }
  out.resize(digits);
  return out;
}

socklen_t AbstractAddress(const std::string& name, sockaddr_un* a) {
  *a = {};
  a->sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof(a->sun_path) - 1);
  std::memcpy(a->sun_path + 1, name.data(), n);  // sun_path[0] = 0: abstract
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

void SetTimeouts(int fd, absl::Duration timeout) {
  const int64_t us = std::max<int64_t>(1, absl::ToInt64Microseconds(timeout));
  timeval tv{static_cast<time_t>(us / 1000000),
             static_cast<suseconds_t>(us % 1000000)};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

// Receives one message with up to kMaxFdsSeen attached fds (all returned,
// owned by the caller). Returns the bytes read (<= 0 on error/EOF).
ssize_t ReceiveWithFds(int sock, char* buf, size_t size, std::vector<int>* fds,
                       bool* truncated) {
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsSeen)];
  iovec iov{buf, size};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  const ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  if (n < 0) return n;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr;
       c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      fds->push_back(fd);
    }
  }
  *truncated = (msg.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) != 0;
  return n;
}

void CloseAll(const std::vector<int>& fds) {
  for (int fd : fds) close(fd);
}

// A connected client socket to `name`, with its server's credentials.
absl::StatusOr<int> ConnectTo(const std::string& name, absl::Duration timeout,
                              ucred* server) {
  const int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (sock < 0) {
    return absl::UnavailableError(
        absl::StrCat("shm: socket(): ", std::strerror(errno)));
  }
  SetTimeouts(sock, timeout);
  sockaddr_un a;
  const socklen_t len = AbstractAddress(name, &a);
  if (connect(sock, reinterpret_cast<sockaddr*>(&a), len) != 0) {
    const int err = errno;
    close(sock);
    return absl::UnavailableError(absl::StrCat(
        "shm: the decode worker's pool socket @", name,
        " cannot be reached: ", std::strerror(err),
        " (gone, or in another network namespace: shm needs both workers on "
        "one node)"));
  }
  socklen_t cl = sizeof *server;
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, server, &cl) != 0) {
    close(sock);
    return absl::UnavailableError("shm: SO_PEERCRED on the pool socket failed");
  }
  return sock;
}

}  // namespace

std::string PoolFdHandle::Format() const {
  return absl::StrCat(kPrefix, ":", socket, ":", token, ":", dev, ":", ino);
}

absl::StatusOr<PoolFdHandle> PoolFdHandle::Parse(const std::string& handle) {
  std::vector<std::string> parts = absl::StrSplit(handle, ':');
  PoolFdHandle h;
  if (parts.size() != 5 || parts[0] != kPrefix || parts[1].empty() ||
      parts[1].size() > 100 || parts[2].size() != kTokenHex ||
      !absl::SimpleAtoi(parts[3], &h.dev) ||
      !absl::SimpleAtoi(parts[4], &h.ino)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm: \"", handle.substr(0, 120),
        "\" is not a pool fd handle (shm-fd:<socket>:<token>:<dev>:<ino>)"));
  }
  h.socket = std::move(parts[1]);
  h.token = std::move(parts[2]);
  return h;
}

absl::StatusOr<ReceivedPoolFd> FetchPoolFd(const PoolFdHandle& handle,
                                           absl::Duration timeout) {
  ucred server{};
  absl::StatusOr<int> sock = ConnectTo(handle.socket, timeout, &server);
  if (!sock.ok()) return sock.status();
  auto fail = [&](absl::Status s) {
    close(*sock);
    return s;
  };
  if (server.uid != geteuid()) {
    return fail(absl::FailedPreconditionError(absl::StrCat(
        "shm: the pool socket @", handle.socket, " belongs to uid ", server.uid,
        ", not to this worker's uid ", geteuid(),
        " (shm needs both workers to run as one user)")));
  }
  const std::string request = absl::StrCat("F", handle.token);
  if (send(*sock, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    return fail(absl::UnavailableError(absl::StrCat(
        "shm: sending to the pool socket failed: ", std::strerror(errno))));
  }
  char status = 0;
  std::vector<int> fds;
  bool truncated = false;
  const ssize_t n = ReceiveWithFds(*sock, &status, 1, &fds, &truncated);
  close(*sock);
  if (n <= 0) {
    CloseAll(fds);
    return absl::UnavailableError(
        absl::StrCat("shm: the decode worker's pool socket @", handle.socket,
                     " did not answer in time"));
  }
  if (status == 'N') {
    CloseAll(fds);
    return absl::UnavailableError(
        "shm: the decode worker no longer exports this KV pool");
  }
  if (status != 'Y' || truncated || fds.size() != 1) {
    CloseAll(fds);
    return absl::FailedPreconditionError(absl::StrCat(
        "shm: the decode worker's pool socket answered '",
        absl::CEscape(std::string(1, status)), "' with ", fds.size(),
        " fds; exactly one KV pool memfd is expected"));
  }
  return ReceivedPoolFd{fds[0], server.pid};
}

ExportState QueryPoolFd(const PoolFdHandle& handle, absl::Duration timeout) {
  ucred server{};
  absl::StatusOr<int> sock = ConnectTo(handle.socket, timeout, &server);
  if (!sock.ok()) return ExportState::kGone;
  const std::string request = absl::StrCat("A", handle.token);
  char status = 0;
  std::vector<int> fds;
  bool truncated = false;
  ssize_t n = -1;
  if (send(*sock, request.data(), request.size(), MSG_NOSIGNAL) ==
      static_cast<ssize_t>(request.size())) {
    n = ReceiveWithFds(*sock, &status, 1, &fds, &truncated);
  }
  close(*sock);
  CloseAll(fds);
  if (n <= 0) return ExportState::kUnknown;
  if (status == 'Y') return ExportState::kExported;
  if (status == 'N') return ExportState::kGone;
  return ExportState::kUnknown;
}

absl::StatusOr<std::unique_ptr<PoolFdServer>> PoolFdServer::Start() {
  const std::string name =
      absl::StrCat("pdserve-kv-", getpid(), "-", RandomHex(16));
  const int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (sock < 0) {
    return absl::UnavailableError(
        absl::StrCat("shm: socket(): ", std::strerror(errno)));
  }
  sockaddr_un a;
  const socklen_t len = AbstractAddress(name, &a);
  if (bind(sock, reinterpret_cast<sockaddr*>(&a), len) != 0 ||
      listen(sock, 64) != 0) {
    const int err = errno;
    close(sock);
    return absl::UnavailableError(
        absl::StrCat("shm: cannot listen on the pool socket @", name, ": ",
                     std::strerror(err)));
  }
  const int wake = eventfd(0, EFD_CLOEXEC);
  if (wake < 0) {
    close(sock);
    return absl::UnavailableError("shm: eventfd() failed");
  }
  return std::unique_ptr<PoolFdServer>(new PoolFdServer(sock, wake, name));
}

PoolFdServer::PoolFdServer(int listen_fd, int wake_fd, std::string name)
    : listen_fd_(listen_fd), wake_fd_(wake_fd), name_(std::move(name)) {
  thread_ = std::thread([this] { Run(); });
}

PoolFdServer::~PoolFdServer() {
  stop_ = true;
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof one);
  thread_.join();
  close(listen_fd_);
  close(wake_fd_);
  absl::MutexLock l(&mu_);
  for (auto& [token, e] : by_token_) close(e.fd);
}

absl::StatusOr<std::string> PoolFdServer::Add(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(
        "shm: a KV region's fd is not a memfd and cannot be shared");
  }
  const int dup = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (dup < 0) {
    return absl::UnavailableError(absl::StrCat(
        "shm: dup of the KV pool fd failed: ", std::strerror(errno)));
  }
  PoolFdHandle h{name_, RandomHex(kTokenHex), static_cast<uint64_t>(st.st_dev),
                 static_cast<uint64_t>(st.st_ino)};
  std::string handle = h.Format();
  absl::MutexLock l(&mu_);
  by_token_[h.token] = Entry{dup, handle};
  return handle;
}

void PoolFdServer::Remove(const std::string& handle) {
  absl::StatusOr<PoolFdHandle> h = PoolFdHandle::Parse(handle);
  if (!h.ok()) return;
  absl::MutexLock l(&mu_);
  auto it = by_token_.find(h->token);
  if (it == by_token_.end() || it->second.handle != handle) return;
  close(it->second.fd);
  by_token_.erase(it);
}

void PoolFdServer::Run() {
  while (!stop_) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (stop_ || (p[1].revents & POLLIN)) return;
    if ((p[0].revents & POLLIN) == 0) continue;
    const int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    ServeOne(conn);
    close(conn);
  }
}

void PoolFdServer::ServeOne(int conn) {
  SetTimeouts(conn, kRequestTimeout);
  pollfd p{conn, POLLIN, 0};
  if (poll(&p, 1,
           static_cast<int>(absl::ToInt64Milliseconds(kRequestTimeout))) <= 0) {
    ++refused_;  // connected and sent nothing in time (or a liveness probe
                 // that only connects)
    return;
  }
  char buf[1 + kTokenHex + 1];
  std::vector<int> fds;
  bool truncated = false;
  const ssize_t n = ReceiveWithFds(conn, buf, sizeof buf, &fds, &truncated);
  // A client has no business passing fds to the exporter: close them unread.
  fds_dropped_ += static_cast<int64_t>(fds.size());
  CloseAll(fds);
  char status = 'E';
  int pass = -1;
  ucred client{};
  socklen_t cl = sizeof client;
  if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &client, &cl) != 0 ||
      client.uid != geteuid()) {
    status = 'U';
  } else if (n == static_cast<ssize_t>(1 + kTokenHex) && !truncated &&
             (buf[0] == 'F' || buf[0] == 'A')) {
    const std::string token(buf + 1, kTokenHex);
    absl::MutexLock l(&mu_);
    auto it = by_token_.find(token);
    if (it == by_token_.end()) {
      status = 'N';
    } else {
      status = 'Y';
      // A dup, so a concurrent Remove cannot close the fd being sent.
      if (buf[0] == 'F') pass = fcntl(it->second.fd, F_DUPFD_CLOEXEC, 0);
      if (buf[0] == 'F' && pass < 0) status = 'E';
    }
  }
  if (status != 'Y') ++refused_;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  iovec iov{&status, 1};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (pass >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &pass, sizeof pass);
  }
  (void)sendmsg(conn, &msg, MSG_NOSIGNAL);
  if (pass >= 0) close(pass);
}

}  // namespace pdserve::kv_transfer::ipc
