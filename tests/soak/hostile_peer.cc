#include "tests/soak/hostile_peer.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kv_transfer/ipc/ipc_messages.h"
#include "pdserve/v1/internal.grpc.pb.h"

namespace pdserve::soak {
namespace {

namespace ipc = kv_transfer::ipc;

constexpr char kHostileFdName[] = "soak-hostile-fd";

// Sends `bytes` to 127.0.0.1:port and reads the reply (up to 64 KiB).
bool Exchange(int port, const std::string& bytes, std::string* reply) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return false;
  }
  (void)!send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0 && reply->size() < (64 << 10))
    reply->append(buf, static_cast<size_t>(n));
  close(fd);
  return true;
}

std::string RandomBytes(std::mt19937_64* rng, size_t n) {
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>((*rng)());
  return out;
}

grpc::StatusCode CodeOf(absl::StatusCode c) {
  return static_cast<grpc::StatusCode>(static_cast<int>(c));
}

// The pool fd sockets ("@pdserve-kv-<pid>-...") of process `pid`.
std::vector<std::string> PoolSockets(pid_t pid) {
  std::vector<std::string> out;
  std::ifstream in("/proc/net/unix");
  const std::string prefix = absl::StrCat("@pdserve-kv-", pid, "-");
  std::string line;
  while (std::getline(in, line)) {
    const size_t at = line.find(prefix);
    if (at == std::string::npos) continue;
    const std::string name = line.substr(at + 1);
    if (std::find(out.begin(), out.end(), name) == out.end())
      out.push_back(name);
  }
  return out;
}

// Fds of process `pid` that are memfds this file created.
int HostileFdsHeldBy(pid_t pid) {
  namespace fs = std::filesystem;
  int n = 0;
  std::error_code ec;
  for (fs::directory_iterator it(absl::StrCat("/proc/", pid, "/fd"), ec), end;
       !ec && it != end; it.increment(ec)) {
    std::error_code e;
    const fs::path target = fs::read_symlink(it->path(), e);
    if (!e && absl::StrContains(target.string(), kHostileFdName)) ++n;
  }
  return n;
}

}  // namespace

HostileResult HttpHeaderGarbage(int port, const std::string& model,
                                std::mt19937_64* rng) {
  // Values gRPC metadata cannot carry, and headers no client should send.
  const std::string auth[] = {
      "Bearer a\tb",
      "Bearer a\x7f",
      "Bearer \xe9t\xe9",
      "Bearer \x01\x02\x03",
      std::string("Bearer a\0b", 10),
      "Bearer " + std::string(20000, 'x'),
      "",
      "Basic \xff\xfe\xfd",
  };
  const size_t which = (*rng)() % (std::size(auth) + 3);
  HostileResult r;
  std::string headers;
  if (which < std::size(auth)) {
    r.variant = absl::StrCat("http_header_authorization_", which);
    headers = absl::StrCat("Authorization: ", auth[which], "\r\n");
  } else if (which == std::size(auth)) {
    r.variant = "http_header_authorization_repeated";
    for (int i = 0; i < 50; ++i)
      absl::StrAppend(&headers, "Authorization: Bearer k", i, "\t\x7f\r\n");
  } else if (which == std::size(auth) + 1) {
    r.variant = "http_header_many";
    for (int i = 0; i < 500; ++i)
      absl::StrAppend(&headers, "X-Junk-", i, ": \xe9", i, "\r\n");
  } else {
    r.variant = "http_header_malformed_lines";
    headers = absl::StrCat("No colon here\r\n", RandomBytes(rng, 40),
                           ": x\r\n\xe9\xe9: \x7f\r\n");
  }
  const std::string body = absl::StrCat("{\"model\": \"", model,
                                        "\", \"prompt\": \"hi\", "
                                        "\"max_tokens\": 2}");
  const std::string request =
      absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: soak\r\n", headers,
                   "Content-Type: application/json\r\nConnection: close\r\n"
                   "Content-Length: ",
                   body.size(), "\r\n\r\n", body);
  std::string reply;
  r.answered = Exchange(port, request, &reply) && !reply.empty();
  r.message = reply.substr(0, reply.find("\r\n"));
  return r;
}

HostileResult HostileShmStream(const std::string& address,
                               std::mt19937_64* rng) {
  HostileResult r;
  auto stub = v1::KvTransfer::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(15));
  auto stream = stub->Control(&ctx);
  auto write = [&](const std::string& payload) {
    v1::KvControlFrame f;
    f.set_payload(payload);
    return stream->Write(f);
  };
  ipc::OpenMessage open;
  open.kind = ipc::PeerMemoryKind::kShm;
  open.sender_id = "soak-hostile";
  open.reservation_id = (*rng)() | 1;
  open.request_id = "soak-forged";
  switch ((*rng)() % 6) {
    case 0:
      r.variant = "shm_open_unknown_reservation";
      write(ipc::EncodeMessage(open));
      break;
    case 1:
      r.variant = "shm_open_wrong_kind";
      open.kind = ipc::PeerMemoryKind::kCudaIpc;
      write(ipc::EncodeMessage(open));
      break;
    case 2: {
      r.variant = "shm_manifest_before_open";
      ipc::ManifestMessage m;
      m.spans = {{-1, 1 << 30}, {999, -5}, {0, 0}};
      write(ipc::EncodeMessage(m));
      break;
    }
    case 3:
      r.variant = "shm_garbage_frame";
      write(RandomBytes(rng, 1 + (*rng)() % 300));
      break;
    case 4: {
      r.variant = "shm_truncated_open";
      const std::string bytes = ipc::EncodeMessage(open);
      write(bytes.substr(0, 1 + (*rng)() % (bytes.size() - 1)));
      break;
    }
    default: {
      // Frames as fast as the stream takes them, never reading: the
      // worker's inbox is bounded, so this ends the stream rather than its
      // memory.
      r.variant = "shm_flood";
      const std::string junk = RandomBytes(rng, 64 << 10);
      for (int i = 0; i < 256 && write(junk); ++i) {
      }
      break;
    }
  }
  v1::KvControlFrame reply;
  if (stream->Read(&reply)) {
    absl::StatusOr<ipc::IpcMessage> m = ipc::DecodeMessage(reply.payload());
    const auto* rep = m.ok() ? std::get_if<ipc::ReplyMessage>(&*m) : nullptr;
    r.answered = true;
    if (rep == nullptr) {
      r.code = grpc::StatusCode::INTERNAL;
      r.message = "the worker answered with something that is not a reply";
    } else {
      r.code = CodeOf(rep->code);
      r.message = rep->message;
    }
  }
  ctx.TryCancel();
  const grpc::Status st = stream->Finish();
  if (!r.answered) {
    r.answered = st.error_code() != grpc::StatusCode::UNAVAILABLE;
    r.code = st.error_code();
    r.message = st.error_message();
  }
  return r;
}

HostileResult HostileShmSocket(pid_t pid, std::mt19937_64* rng,
                               int* leaked_fds) {
  *leaked_fds = 0;
  HostileResult r;
  const std::vector<std::string> sockets = PoolSockets(pid);
  if (sockets.empty()) {
    r.variant = "shm_socket_none";
    return r;
  }
  const std::string& name = sockets[(*rng)() % sockets.size()];
  const int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const std::string bare = name.substr(1);  // without the '@'
  std::memcpy(a.sun_path + 1, bare.data(),
              std::min(bare.size(), sizeof a.sun_path - 2));
  const socklen_t len =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + bare.size());
  timeval tv{3, 0};
  setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (connect(sock, reinterpret_cast<sockaddr*>(&a), len) != 0) {
    close(sock);
    r.variant = "shm_socket_gone";
    return r;
  }
  std::string request;
  int attach = 0;
  switch ((*rng)() % 5) {
    case 0:
      r.variant = "shm_socket_forged_token_with_fd";
      request = "F" + std::string(32, "0123456789abcdef"[(*rng)() % 16]);
      attach = 1;
      break;
    case 1:
      r.variant = "shm_socket_forged_liveness_probe";
      request = "A" + std::string(32, 'f');
      break;
    case 2:
      r.variant = "shm_socket_garbage_with_fds";
      request = RandomBytes(rng, 200);
      attach = 3;
      break;
    case 3:
      r.variant = "shm_socket_silent";
      break;
    default:
      r.variant = "shm_socket_forged_token_with_8_fds";
      request = "F" + std::string(32, 'e');
      attach = 8;
      break;
  }
  std::vector<int> fds;
  for (int i = 0; i < attach; ++i) {
    const int fd = memfd_create(kHostileFdName, MFD_CLOEXEC);
    if (fd >= 0) fds.push_back(fd);
  }
  if (!request.empty()) {
    iovec iov{request.data(), request.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(8 * sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (!fds.empty()) {
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(fds.size() * sizeof(int));
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
      std::memcpy(CMSG_DATA(c), fds.data(), fds.size() * sizeof(int));
    }
    (void)sendmsg(sock, &msg, MSG_NOSIGNAL);
  }
  for (int fd : fds) close(fd);
  // The answer: one status byte, and never an fd for a forged token.
  char status = 0;
  alignas(cmsghdr) char control[CMSG_SPACE(8 * sizeof(int))];
  iovec iov{&status, 1};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  const ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  int received = 0;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); n > 0 && c != nullptr;
       c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      close(fd);
      ++received;
    }
  }
  close(sock);
  r.answered = true;
  if (n <= 0) {
    // Closed without an answer: what a silent client gets.
    r.code = grpc::StatusCode::DEADLINE_EXCEEDED;
    r.message = "pool socket closed the connection";
  } else if (status == 'Y' || received > 0) {
    r.code = grpc::StatusCode::OK;  // an fd for a forged request: a failure
    r.message = absl::StrCat("pool socket answered 'Y' with ", received,
                             " fds to a forged request");
  } else {
    r.code = status == 'N'   ? grpc::StatusCode::NOT_FOUND
             : status == 'U' ? grpc::StatusCode::PERMISSION_DENIED
                             : grpc::StatusCode::INVALID_ARGUMENT;
    r.message =
        absl::StrCat("pool socket refused: '", std::string(1, status), "'");
  }
  *leaked_fds = HostileFdsHeldBy(pid);
  return r;
}

}  // namespace pdserve::soak
