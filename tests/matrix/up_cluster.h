// Test helper: a `pdserve up` cluster as a user starts it (one `up` process,
// its workers and router as children), the endpoints it prints, the
// config-info metrics each child reports, and a small HTTP client for the
// OpenAI front.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "tests/cluster.h"

namespace pdserve::testing {

struct UpChildProc {
  std::string name;  // "prefill-0", "decode-1", "both-0", "router"
  std::string address;
  int metrics_port = 0;
};

// A free TCP port on loopback (bound, then released: for --http-port).
inline int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

class UpCluster {
 public:
  // Runs `pdserve up ARGS` and waits for its "Ctrl-C stops everything."
  // line. On failure, ok() is false and error() holds up's output.
  static UpCluster Start(const std::vector<std::string>& args) {
    UpCluster c;
    int out[2];
    if (pipe(out) != 0) return c;
    c.pid_ = fork();
    if (c.pid_ == 0) {
      dup2(out[1], 1);
      dup2(out[1], 2);
      close(out[0]);
      std::vector<std::string> copy = {PdserveBin(), "up"};
      copy.insert(copy.end(), args.begin(), args.end());
      std::vector<char*> argv;
      for (auto& a : copy) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(copy[0].c_str(), argv.data());
      _exit(127);
    }
    close(out[1]);
    FILE* in = fdopen(out[0], "r");
    const std::regex child(
        R"(^  (\S+)\s+grpc (\S+)\s+metrics http://127\.0\.0\.1:(\d+)/metrics)");
    char line[4096];
    while (fgets(line, sizeof(line), in) != nullptr) {
      const std::string s(line);
      c.output_ += s;
      std::smatch m;
      if (std::regex_search(s, m, child)) {
        c.children_.push_back(
            {m[1].str(), m[2].str(), std::atoi(m[3].str().c_str())});
      }
      if (s.find("Ctrl-C stops everything.") != std::string::npos) {
        c.ok_ = true;
        break;
      }
    }
    // Keep draining up's output (its children's logs) so nobody blocks.
    std::thread([in] {
      char buf[4096];
      while (fgets(buf, sizeof(buf), in) != nullptr) {
      }
      fclose(in);
    }).detach();
    if (!c.ok_) c.Stop();
    return c;
  }

  bool ok() const { return ok_; }
  const std::string& output() const { return output_; }
  const std::vector<UpChildProc>& children() const { return children_; }
  std::vector<UpChildProc> workers() const {
    std::vector<UpChildProc> w;
    for (const auto& c : children_)
      if (c.name != "router") w.push_back(c);
    return w;
  }
  UpChildProc router() const {
    for (const auto& c : children_)
      if (c.name == "router") return c;
    return {};
  }

  // SIGTERM to up, which stops its children; SIGKILL after 60 s.
  void Stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    const auto until =
        std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (waitpid(pid_, nullptr, WNOHANG) != pid_) {
      if (std::chrono::steady_clock::now() > until) {
        kill(pid_, SIGKILL);
        waitpid(pid_, nullptr, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    pid_ = -1;
  }

  ~UpCluster() { Stop(); }
  UpCluster() = default;
  UpCluster(UpCluster&& o) noexcept { *this = std::move(o); }
  UpCluster& operator=(UpCluster&& o) noexcept {
    pid_ = o.pid_;
    o.pid_ = -1;
    ok_ = o.ok_;
    output_ = std::move(o.output_);
    children_ = std::move(o.children_);
    return *this;
  }

 private:
  pid_t pid_ = -1;
  bool ok_ = false;
  std::string output_;
  std::vector<UpChildProc> children_;
};

// flag -> value of every `<prefix>_config_info{flag,value}` series.
inline std::map<std::string, std::string> ConfigInfo(
    const std::string& metrics, const std::string& prefix) {
  std::map<std::string, std::string> out;
  const std::regex series(
      prefix +
      R"re(_config_info\{flag="([^"]+)",value="((?:[^"\\]|\\.)*)"\} 1)re");
  for (std::sregex_iterator it(metrics.begin(), metrics.end(), series), end;
       it != end; ++it) {
    out[(*it)[1].str()] = (*it)[2].str();
  }
  return out;
}

// HTTP/1.0 POST of a JSON body to 127.0.0.1:port; the response body ("" on
// a connection failure).
inline std::string HttpPost(int port, const std::string& path,
                            const std::string& body, int* status = nullptr) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string req = "POST " + path +
                          " HTTP/1.0\r\nHost: localhost\r\nContent-Type: "
                          "application/json\r\nContent-Length: " +
                          std::to_string(body.size()) + "\r\n\r\n" + body;
  (void)!write(fd, req.data(), req.size());
  std::string out;
  char buf[8192];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
  close(fd);
  if (status != nullptr) {
    *status = 0;
    if (out.size() > 12) *status = std::atoi(out.substr(9, 3).c_str());
  }
  const size_t at = out.find("\r\n\r\n");
  if (at == std::string::npos) return "";
  std::string head = out.substr(0, at), rest = out.substr(at + 4);
  if (head.find("chunked") == std::string::npos) return rest;
  // Chunked transfer coding: "<hex size>\r\n<data>\r\n"..., then "0\r\n".
  std::string decoded;
  size_t pos = 0;
  while (pos < rest.size()) {
    const size_t eol = rest.find("\r\n", pos);
    if (eol == std::string::npos) break;
    const size_t size = std::stoul(rest.substr(pos, eol - pos), nullptr, 16);
    if (size == 0) break;
    decoded += rest.substr(eol + 2, size);
    pos = eol + 2 + size + 2;
  }
  return decoded;
}

}  // namespace pdserve::testing
