// Test helper: real pdserve processes on loopback (workers on free ports, a
// router), a gRPC client for the public API, and metric scraping.
#pragma once

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "pdserve/v1/router.grpc.pb.h"

namespace pdserve::testing {

struct Proc {
  pid_t pid = -1;
  std::string role;
  std::string address;
  int metrics_port = 0;
  bool alive() const { return pid > 0; }
};

// The pdserve binary the tests start: $PDSERVE_BIN when set (the GPU check
// bundle runs away from the build tree), else the build tree's.
inline std::string PdserveBin() {
  const char* env = std::getenv("PDSERVE_BIN");
  return env != nullptr && *env != '\0' ? env : PDSERVE_BIN;
}

// Starts `pdserve ARGS` and waits for its "listening on" line.
inline Proc StartProcess(const std::string& role,
                         const std::vector<std::string>& args) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    close(fds[0]);
    std::vector<char*> argv;
    std::string bin = PdserveBin();
    argv.push_back(bin.data());
    std::vector<std::string> copy = args;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(bin.c_str(), argv.data());
    _exit(127);
  }
  close(fds[1]);
  FILE* in = fdopen(fds[0], "r");
  Proc p{pid, role, "", 0};
  char line[512];
  while (fgets(line, sizeof(line), in) != nullptr) {
    std::string s(line);
    const size_t at = s.find("listening on ");
    if (at == std::string::npos) continue;
    std::vector<std::string> parts =
        absl::StrSplit(s.substr(at + 13), ' ', absl::SkipWhitespace());
    p.address = parts[0];
    p.metrics_port = std::atoi(parts[2].c_str());
    break;
  }
  std::thread([in] {
    char buf[512];
    while (fgets(buf, sizeof(buf), in) != nullptr) {
    }
    fclose(in);
  }).detach();
  EXPECT_FALSE(p.address.empty()) << role << " did not start";
  return p;
}

// Polls `done` every 20 ms until it holds or `timeout` passes; returns
// whether it held. For states visible from outside (ListWorkers, /metrics,
// a client's stream), instead of sleeping for a guessed time.
inline bool WaitUntil(const std::function<bool()>& done,
                      std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// Sends `sig` and waits for the process to exit. A process still alive after
// `timeout` is SIGKILLed and false is returned (a hung drain fails the caller
// instead of hanging the test).
inline bool Kill(Proc* p, int sig = SIGKILL,
                 std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  if (p->pid <= 0) return true;
  kill(p->pid, sig);
  if (sig != SIGKILL) kill(p->pid, SIGCONT);  // a stopped process acts on it
  const bool exited = WaitUntil(
      [&] { return waitpid(p->pid, nullptr, WNOHANG) == p->pid; }, timeout);
  if (!exited) {
    kill(p->pid, SIGKILL);
    waitpid(p->pid, nullptr, 0);
  }
  p->pid = -1;
  return exited;
}

// HTTP GET of /metrics over a raw socket.
std::string Scrape(int port);
// Value of one exposition line ("name{labels}"), or -1.
double MetricValue(const std::string& text, const std::string& series);

inline bool HasTlsFlags(const std::vector<std::string>& flags) {
  for (const auto& f : flags)
    if (f.rfind("--tls-cert", 0) == 0 || f == "--insecure") return true;
  return false;
}

struct Cluster {
  std::vector<Proc> prefill, decode;
  Proc router;
  std::unique_ptr<v1::Router::Stub> stub;

  // n_prefill == 0 with colocated: `worker --role both` processes.
  // Plaintext (--insecure) unless the flags carry --tls-cert; then `creds`
  // are the test client's (a client certificate, for ListWorkers).
  static Cluster Start(
      const std::string& model, int n_prefill, int n_decode,
      const std::vector<std::string>& router_flags = {},
      const std::vector<std::string>& worker_flags_in = {},
      std::shared_ptr<grpc::ChannelCredentials> creds = nullptr) {
    Cluster c;
    std::vector<std::string> worker_flags = worker_flags_in;
    if (!HasTlsFlags(worker_flags)) worker_flags.push_back("--insecure");
    for (int i = 0; i < n_prefill + n_decode; ++i) {
      const bool is_prefill = i < n_prefill;
      const std::string role =
          is_prefill ? "prefill" : (n_prefill == 0 ? "both" : "decode");
      std::vector<std::string> args = {"worker",           "--role=" + role,
                                       "--model=" + model, "--port=0",
                                       "--metrics-port=0", "--threads=1"};
      args.insert(args.end(), worker_flags.begin(), worker_flags.end());
      (is_prefill ? c.prefill : c.decode).push_back(StartProcess(role, args));
    }
    std::vector<std::string> paddr, daddr;
    for (auto& p : c.prefill) paddr.push_back(p.address);
    for (auto& p : c.decode) daddr.push_back(p.address);
    std::vector<std::string> args = {"router", "--model=" + model, "--port=0",
                                     "--metrics-port=0"};
    if (n_prefill > 0) {
      args.push_back("--prefill-workers=" + absl::StrJoin(paddr, ","));
      args.push_back("--decode-workers=" + absl::StrJoin(daddr, ","));
    } else {
      args.push_back("--both-workers=" + absl::StrJoin(daddr, ","));
    }
    args.insert(args.end(), router_flags.begin(), router_flags.end());
    if (!HasTlsFlags(router_flags)) args.push_back("--insecure");
    c.router = StartProcess("router", args);
    c.stub = v1::Router::NewStub(grpc::CreateChannel(
        c.router.address,
        creds != nullptr ? creds : grpc::InsecureChannelCredentials()));
    c.WaitForWorkers(n_prefill + n_decode);
    return c;
  }

  // Workers the router lists as "up", or -1 if ListWorkers failed.
  int UpWorkers() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(5));
    v1::ListWorkersResponse resp;
    if (!stub->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp).ok())
      return -1;
    int up = 0;
    for (const auto& w : resp.workers()) up += w.state() == "up";
    return up;
  }

  void WaitForWorkers(int n) {
    if (!WaitUntil([&] { return UpWorkers() >= n; }, std::chrono::seconds(20)))
      ADD_FAILURE() << "workers did not come up";
  }

  std::vector<Proc*> All() {
    std::vector<Proc*> out;
    for (auto& p : prefill) out.push_back(&p);
    for (auto& p : decode) out.push_back(&p);
    out.push_back(&router);
    return out;
  }

  ~Cluster() {
    // Router first, so workers have no subscribers left to wait for.
    Kill(&router, SIGKILL);
    for (Proc* p : All()) Kill(p, SIGTERM);
  }
  Cluster() = default;
  Cluster(Cluster&&) = default;
  Cluster& operator=(Cluster&&) = default;
};

struct Result {
  grpc::Status status;
  std::vector<uint32_t> tokens;
  std::string text;
  v1::GenerateResponse last;
  int messages = 0;
};

// Streams one request; `on_message` (optional) runs after each message.
inline Result Generate(
    v1::Router::Stub* stub, const v1::GenerateRequest& req,
    std::function<void(const v1::GenerateResponse&)> on_message = nullptr,
    int timeout_ms = 120000) {
  Result r;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(timeout_ms));
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    ++r.messages;
    r.tokens.insert(r.tokens.end(), resp.token_ids().begin(),
                    resp.token_ids().end());
    r.text += resp.text();
    r.last = resp;
    if (on_message) on_message(resp);
  }
  r.status = reader->Finish();
  return r;
}

inline v1::GenerateRequest Request(const std::string& prompt,
                                   uint32_t max_tokens, float temperature = 0,
                                   uint64_t seed = 0,
                                   const std::string& salt = "") {
  v1::GenerateRequest req;
  req.set_prompt(prompt);
  req.mutable_sampling()->set_max_tokens(max_tokens);
  req.mutable_sampling()->set_temperature(temperature);
  req.mutable_sampling()->set_seed(seed);
  req.mutable_sampling()->set_ignore_eos(true);
  req.set_cache_salt(salt);
  return req;
}

// Runs `bin ARGS` through the shell (stderr dropped); returns its stdout.
std::string RunCli(const std::string& bin, const std::string& args);
// token_ids of `pdserve generate --json` output (empty if it is not that).
std::vector<uint32_t> IdsFromJson(const std::string& out);

// `pdserve ARGS` (PdserveBin()) through the shell; returns its stdout.
inline std::string RunPdserve(const std::string& args) {
  return RunCli(PdserveBin(), args);
}

// `pdserve generate --model` (the local reference path), ignoring EOS: the
// token ids.
inline std::vector<uint32_t> LocalTokens(const std::string& model,
                                         const std::string& prompt,
                                         uint32_t max_tokens,
                                         float temperature = 0,
                                         uint64_t seed = 0) {
  return IdsFromJson(RunPdserve(absl::StrCat(
      "generate --model ", model, " --json --ignore-eos --max-tokens ",
      max_tokens, " --temperature ", temperature, " --seed ", seed,
      " --prompt '", prompt, "'")));
}

// A long shared "system prompt" per family (about 500 bytes, 31 blocks of 16
// with the byte tokenizer), so prompts span many blocks.
inline std::string Family(int f) {
  std::string s = absl::StrCat("System prompt ", f, ": ");
  for (int i = 0; i < 12; ++i)
    absl::StrAppend(&s, "rule ", f * 100 + i, " is to be helpful and exact. ");
  return s;
}

// `series` summed over the live workers (not the router); absent counts 0.
inline double SumOverWorkers(Cluster& c, const std::string& series) {
  double total = 0;
  for (Proc* p : c.All()) {
    if (!p->alive() || p->role == "router") continue;
    const double v = MetricValue(Scrape(p->metrics_port), series);
    if (v > 0) total += v;
  }
  return total;
}

// Every live worker's pool drains to 0 active blocks within 10 s.
inline void ExpectNoActiveBlocks(Cluster& c) {
  for (Proc* p : c.All()) {
    if (!p->alive() || p->role == "router") continue;
    double active = -1;
    WaitUntil(
        [&] {
          active = MetricValue(Scrape(p->metrics_port),
                               "pdserve_kv_cache_blocks{state=\"active\"}");
          return active == 0;
        },
        std::chrono::seconds(10));
    EXPECT_EQ(active, 0) << p->role << " " << p->address;
  }
}

}  // namespace pdserve::testing
