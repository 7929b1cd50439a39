// pdserve_soak: a fault-injected soak of a disaggregated cluster (router +
// 2 prefill + 2 decode workers, real processes on loopback).
//
// While client threads send a random mix of every workload kind (shared
// system prompts, multi-turn conversations, long documents, short synthetic
// prompts, seeded sampling, stop strings, EOS, token-id input, cache salts,
// client cancellation, tight deadlines, malformed requests) and a hostile
// peer sends header garbage to the OpenAI HTTP front and forged streams and
// fd-socket requests to the decode workers' shm endpoints (--shm: decode
// workers and one prefill worker move KV over shm), a chaos thread
// SIGKILLs and SIGTERMs workers and restarts them, SIGSTOPs a prefill worker
// mid-transfer (a stalled KV transfer, sometimes past the 10 s stall
// timeout), and restarts the router (every KV event stream breaks and
// resyncs). At the end it checks that:
//  - every request either finished with exactly the tokens of the reference
//    path (`pdserve generate --model`, same sampling parameters and seed) or
//    ended with a clear gRPC status (not UNKNOWN/INTERNAL/DATA_LOSS, never a
//    success with wrong output);
//  - no process crashed on its own;
//  - no worker has an active KV block left (pdserve_kv_cache_blocks
//    {state="active"} on /metrics) once the load stops;
//  - no process grew its resident memory without bound (VmRSS samples);
//  - the router's prefix index agrees with each worker's cache, pool and KV
//    tier (ListWorkers' indexed_blocks/indexed_digest and indexed_tier_*
//    vs the pool's and the tier's part of the worker's KV event snapshot).
//
// With --kv_tier (the default) every worker has a disk KV tier
// (--kv-offload-dir, 4x its pool), and the chaos thread also corrupts,
// truncates and deletes tier files at random while the load runs: each
// must end in a recompute with the reference's tokens, never wrong output.
// and prints a summary (also as JSON with --json). Exit status 0 = pass.
//
// --slow runs the `small` preset with long prompts (1-3.5 K tokens): an
// engine step over 512 prompt tokens then takes more than a second, which is
// what exercises the slow paths (a prefill abandoned while its final step
// runs, decode reservations waiting for blocks). CI runs the tiny soak.
#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "pdserve/v1/internal.grpc.pb.h"
#include "pdserve/v1/router.grpc.pb.h"
#include "tests/soak/hostile_peer.h"

ABSL_FLAG(std::string, pdserve, "", "the pdserve binary (build/bin/pdserve)");
ABSL_FLAG(double, minutes, 2, "how long the load and the faults run");
ABSL_FLAG(std::string, work_dir, "",
          "model, process logs and summary (default /tmp/pdserve-soak-PID)");
ABSL_FLAG(std::string, preset, "tiny", "model preset: tiny or small");
ABSL_FLAG(int32_t, clients, 3, "concurrent client threads");
ABSL_FLAG(double, fault_interval, -1,
          "mean seconds between injected faults (0: no faults; default 5, or "
          "20 with --slow, where a request takes tens of seconds)");
ABSL_FLAG(uint64_t, seed, 1, "seed of the load and fault schedule");
ABSL_FLAG(std::string, json, "", "also write the summary as JSON here");
ABSL_FLAG(bool, long_prompts, false,
          "prompts of 1-3.5 KB (tokens) instead of 10-900 bytes, and KV pools "
          "sized for them");
ABSL_FLAG(bool, kv_tier, true,
          "workers with a disk KV tier (4x the pool) and tier-file faults "
          "(corrupt, truncate, delete) in the chaos mix");
ABSL_FLAG(int32_t, kv_tier_multiple, 4,
          "with --kv_tier: each worker's tier holds this many times its pool "
          "(larger: damaged files are likelier to be read back before the "
          "tier drops them)");
ABSL_FLAG(bool, shm, true,
          "decode workers and prefill-1 use --kv-transport=shm (prefill-0 "
          "keeps grpc, so both paths run), and the hostile peer also attacks "
          "the decode workers' shm endpoints");
ABSL_FLAG(double, hostile_interval, 1,
          "mean seconds between the hostile peer's attempts (0: none): header "
          "garbage on the HTTP front, forged shm control streams and pool fd "
          "socket requests");
ABSL_FLAG(bool, hostile_http_headers, true,
          "the hostile peer's mix includes header garbage on the HTTP front");
ABSL_FLAG(bool, slow, false,
          "the slow-model soak: --preset=small --long_prompts, so that an "
          "engine step (512 prompt tokens) takes over a second and the slow "
          "paths run (prefill abandoned mid-step, reservations waiting for "
          "blocks)");
ABSL_FLAG(double, reference_timeout_s, 120,
          "a reference `pdserve generate` still running after this is killed "
          "and its spec fails");
ABSL_FLAG(double, check_limit_s, 360,
          "the check phase (from the end of the load until the cluster is "
          "stopped) fails, naming where it waits, once it runs this long; "
          "the default stays under the ctest timeout");

namespace pdserve::soak {
namespace {

using Clock = std::chrono::steady_clock;

double Now() {
  static const Clock::time_point start = Clock::now();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void Log(const std::string& s) {
  std::fprintf(stderr, "[soak %7.1fs] %s\n", Now(), s.c_str());
}

// Whether 127.0.0.1:port can be bound now.
bool CanBind(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

// A port for a process the soak starts and restarts on the same port: never
// one handed out before in this run, and below the kernel's ephemeral range
// (ip_local_port_range), so no outgoing connection can hold it when a killed
// process comes back. (Asking bind for port 0 gave an ephemeral port, and the
// same one twice in a row at times.)
int FreePort() {
  static absl::Mutex mu;
  absl::MutexLock l(&mu);
  static std::set<int> given;
  static int low = [] {
    int lo = 32768;
    std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> lo;
    return lo;
  }();
  static int next = 20000 + static_cast<int>(::getpid() % 4000);
  for (int tries = 0; tries < 20000; ++tries) {
    const int port = next;
    next = next + 1 < low ? next + 1 : 10000;
    if (given.count(port) == 0 && CanBind(port)) {
      given.insert(port);
      return port;
    }
  }
  Log("no free port below the ephemeral range");
  std::abort();
}

// Raw bytes to a TCP port; returns false if it could not connect.
bool SendRaw(int port, const std::string& bytes, std::string* reply) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return false;
  }
  (void)!write(fd, bytes.data(), bytes.size());
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) {
    if (reply) reply->append(buf, n);
    if (reply && reply->size() > (1 << 20)) break;
  }
  close(fd);
  return true;
}

std::string Scrape(int port) {
  std::string reply;
  if (!SendRaw(port,
               "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: "
               "close\r\n\r\n",
               &reply))
    return "";
  return reply;
}

// Value of the exposition line starting with `series`, or -1.
double Metric(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::StartsWith(line, series)) continue;
    absl::string_view rest = line.substr(series.size());
    if (rest.empty() || rest[0] != ' ') continue;
    double v;
    if (absl::SimpleAtod(absl::StripAsciiWhitespace(rest), &v)) return v;
  }
  return -1;
}

// ---------------------------------------------------------------------------
// Processes

struct RssSample {
  double t;
  int64_t kb;
};

struct Proc {
  std::string name;  // router | prefill-0 | decode-1 ...
  std::string role;  // router | prefill | decode
  int port = 0, metrics_port = 0;
  std::vector<std::string> args;
  pid_t pid = -1;
  int incarnation = 0;
  double started = 0;
  bool expect_exit = false;  // set before the chaos thread signals it
  bool stopped = false;      // SIGSTOPped
  std::vector<std::vector<RssSample>> rss;  // per incarnation
  std::string address() const { return absl::StrCat("127.0.0.1:", port); }
};

struct Cluster {
  std::string bin, log_dir;
  absl::Mutex mu;
  std::vector<std::unique_ptr<Proc>> procs ABSL_GUARDED_BY(mu);
  std::map<std::string, int> crashes ABSL_GUARDED_BY(mu);  // unexpected exits

  Proc* Add(const std::string& name, const std::string& role,
            std::vector<std::string> args) {
    auto p = std::make_unique<Proc>();
    p->name = name;
    p->role = role;
    p->port = FreePort();
    p->metrics_port = FreePort();
    p->args = std::move(args);
    p->args.push_back(absl::StrCat("--port=", p->port));
    p->args.push_back(absl::StrCat("--metrics-port=", p->metrics_port));
    absl::MutexLock l(&mu);
    procs.push_back(std::move(p));
    return procs.back().get();
  }

  // Starts (or restarts) `p` and waits until it prints its listening line.
  bool Start(Proc* p) {
    const std::string log = absl::StrCat(log_dir, "/", p->name, ".log");
    const pid_t pid = fork();
    if (pid == 0) {
      const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      std::vector<char*> argv;
      argv.push_back(const_cast<char*>(bin.c_str()));
      for (auto& a : p->args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(bin.c_str(), argv.data());
      _exit(127);
    }
    {
      absl::MutexLock l(&mu);
      p->pid = pid;
      p->expect_exit = false;
      p->stopped = false;
      p->started = Now();
      ++p->incarnation;
      p->rss.emplace_back();
    }
    // Ready when its gRPC port accepts connections and /metrics answers.
    for (int i = 0; i < 600; ++i) {
      if (!Scrape(p->metrics_port).empty() && SendRaw(p->port, "", nullptr))
        return true;
      {
        absl::MutexLock l(&mu);
        if (p->pid != pid) return false;  // reaped elsewhere
        int status = 0;
        if (waitpid(pid, &status, WNOHANG) == pid) {
          p->pid = -1;
          Log(absl::StrCat(p->name, " exited while starting; see ", log));
          ++crashes[absl::StrCat(p->name, " (exited while starting)")];
          return false;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    Log(absl::StrCat(p->name, " did not become ready; see ", log));
    return false;
  }

  // Reaps exited processes; unexpected exits are counted and restarted.
  void Reap() {
    std::vector<Proc*> restart;
    {
      absl::MutexLock l(&mu);
      for (auto& p : procs) {
        if (p->pid <= 0) continue;
        int status = 0;
        if (waitpid(p->pid, &status, WNOHANG) != p->pid) continue;
        p->pid = -1;
        if (!p->expect_exit) {
          const std::string why =
              WIFSIGNALED(status) ? absl::StrCat("signal ", WTERMSIG(status))
                                  : absl::StrCat("exit ", WEXITSTATUS(status));
          Log(absl::StrCat("UNEXPECTED EXIT of ", p->name, ": ", why));
          ++crashes[absl::StrCat(p->name, " (", why, ")")];
          restart.push_back(p.get());
        }
      }
    }
    for (Proc* p : restart) Start(p);
  }

  pid_t Pid(Proc* p) {
    absl::MutexLock l(&mu);
    return p->pid;
  }

  // Sends `sig`; with SIGKILL/SIGTERM the process is expected to exit and
  // this waits (up to `wait_s`) until the reaper saw it go.
  bool Signal(Proc* p, int sig, double wait_s = 30) {
    {
      absl::MutexLock l(&mu);
      if (p->pid <= 0) return false;
      if (sig == SIGKILL || sig == SIGTERM) p->expect_exit = true;
      if (sig == SIGSTOP) p->stopped = true;
      if (sig == SIGCONT) p->stopped = false;
      kill(p->pid, sig);
      if (sig == SIGTERM && p->stopped) kill(p->pid, SIGCONT);
    }
    if (sig != SIGKILL && sig != SIGTERM) return true;
    const double until = Now() + wait_s;
    while (Now() < until) {
      Reap();
      if (Pid(p) <= 0) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  void SampleRss() {
    absl::MutexLock l(&mu);
    for (auto& p : procs) {
      if (p->pid <= 0) continue;
      std::ifstream in(absl::StrCat("/proc/", p->pid, "/status"));
      std::string line;
      while (std::getline(in, line)) {
        if (absl::StartsWith(line, "VmRSS:")) {
          int64_t kb = 0;
          std::vector<std::string> parts =
              absl::StrSplit(line, ' ', absl::SkipEmpty());
          if (parts.size() >= 2 && absl::SimpleAtoi(parts[1], &kb))
            p->rss.back().push_back({Now(), kb});
        }
      }
    }
  }

  // SIGKILLs every process now, without waiting: the last resort of a
  // check phase that ran out of time. The lock is taken when it is free; a
  // thread stuck while holding it must not keep the processes alive.
  void KillAllNow() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    const bool locked = mu.TryLock();
    for (auto& p : procs) {
      if (p->pid <= 0) continue;
      if (p->stopped) kill(p->pid, SIGCONT);
      kill(p->pid, SIGKILL);
    }
    if (locked) mu.Unlock();
  }

  void StopAll() {
    std::vector<Proc*> all;
    {
      absl::MutexLock l(&mu);
      for (auto& p : procs) all.push_back(p.get());
    }
    for (Proc* p : all) {
      if (p->stopped) Signal(p, SIGCONT);
      Signal(p, SIGKILL, 5);
    }
  }
};

// ---------------------------------------------------------------------------
// Workload

struct Spec {
  int id = 0;
  std::string kind;
  std::string prompt;
  uint32_t max_tokens = 8;
  float temperature = 0, top_p = 1;
  uint32_t top_k = 0;
  uint64_t seed = 0;
  std::vector<std::string> stop;
  bool ignore_eos = true;
};

std::string Words(std::mt19937_64& rng, int bytes) {
  static const char* kWords[] = {
      "the ",   "cache ",    "block ",  "prefill ", "decode ", "router ",
      "token ", "stream ",   "worker ", "fault ",   "memory ", "index ",
      "event ", "transfer ", "layer ",  "quiet ",   "river ",  "north ",
      "stone ", "light ",    "Grüße ",  "naïve ",   "日本 ",   "🙂 "};
  std::string out;
  while (static_cast<int>(out.size()) < bytes) out += kWords[rng() % 24];
  return out;
}

// Prompt lengths in bytes (= tokens with the byte tokenizer) are multiplied
// by `scale` and capped at kMaxLongPromptBytes, which with max_tokens stays
// under the small preset's 4096-token context.
constexpr int kMaxLongPromptBytes = 3500;

std::vector<Spec> MakeSpecs(uint64_t seed, int scale) {
  std::mt19937_64 rng(seed);
  auto len = [scale](int bytes) {
    return scale == 1 ? bytes : std::min(bytes * scale, kMaxLongPromptBytes);
  };
  std::vector<Spec> specs;
  auto add = [&](Spec s) {
    s.id = static_cast<int>(specs.size());
    specs.push_back(std::move(s));
  };
  // chat: a few long shared system prompts, many users.
  std::vector<std::string> systems;
  for (int g = 0; g < 3; ++g) systems.push_back(Words(rng, len(160 + 40 * g)));
  for (int i = 0; i < 9; ++i) {
    Spec s;
    s.kind = "chat";
    s.prompt = systems[i % 3] + "User: " + Words(rng, len(20 + rng() % 40));
    s.max_tokens = 6 + rng() % 12;
    add(s);
  }
  // multiturn: each turn extends the previous prompt.
  for (int conv = 0; conv < 2; ++conv) {
    std::string p = Words(rng, len(60));
    for (int turn = 0; turn < 4; ++turn) {
      p += " Turn " + std::to_string(turn) + ": " + Words(rng, len(40));
      Spec s;
      s.kind = "multiturn";
      s.prompt = p;
      s.max_tokens = 8;
      add(s);
    }
  }
  // longdoc: long prompt, short answer.
  for (int i = 0; i < 3; ++i) {
    Spec s;
    s.kind = "longdoc";
    s.prompt = Words(rng, len(700 + 250 * i));
    s.max_tokens = 4;
    add(s);
  }
  // synthetic: short random prompts, below and above the local-prefill
  // threshold.
  for (int i = 0; i < 6; ++i) {
    Spec s;
    s.kind = "synthetic";
    s.prompt = Words(rng, len(8 + rng() % 120));
    s.max_tokens = 4 + rng() % 20;
    add(s);
  }
  // sampled: temperature/top-p/top-k with a seed.
  for (int i = 0; i < 5; ++i) {
    Spec s;
    s.kind = "sampled";
    s.prompt = systems[i % 3] + Words(rng, len(30));
    s.max_tokens = 12;
    s.temperature = 0.6f + 0.1f * i;
    s.top_p = i % 2 ? 0.9f : 1.0f;
    s.top_k = i % 3 == 0 ? 40 : 0;
    s.seed = 1000 + i;
    add(s);
  }
  // stop strings and EOS.
  for (int i = 0; i < 4; ++i) {
    Spec s;
    s.kind = "stop";
    s.prompt = Words(rng, len(50 + 30 * i));
    s.max_tokens = 24;
    s.stop = {std::string(1, "etao"[i]), "th"};
    s.temperature = i % 2 ? 0.8f : 0;
    s.seed = 7 + i;
    add(s);
  }
  for (int i = 0; i < 3; ++i) {
    Spec s;
    s.kind = "eos";
    s.prompt = Words(rng, len(40 + 20 * i));
    s.max_tokens = 48;
    s.ignore_eos = false;
    s.temperature = 1.0f;
    s.seed = 99 + i;
    add(s);
  }
  return specs;
}

struct Reference {
  bool ok = false;
  std::string error;
  std::vector<uint32_t> tokens;
  std::string finish_reason;
};

// The child of the `Run` in progress (0: none), for the check watchdog.
std::atomic<pid_t> g_run_child{0};

// Runs a command to completion; its stdout (and stderr when asked; otherwise
// stderr is appended to `stderr_path`, or dropped when that is empty). With
// `timeout_s` > 0 the command is killed once it runs that long, and
// `*timed_out` says so.
std::string Run(const std::vector<std::string>& args, int* status,
                bool with_stderr = false, double timeout_s = 0,
                const std::string& stderr_path = "",
                bool* timed_out = nullptr) {
  if (timed_out != nullptr) *timed_out = false;
  int fds[2];
  if (pipe(fds) != 0) return "";
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    close(fds[0]);
    if (with_stderr) {
      dup2(fds[1], 2);
    } else if (!stderr_path.empty()) {
      dup2(open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644), 2);
    } else {
      dup2(open("/dev/null", O_WRONLY), 2);
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);
  g_run_child = pid;
  std::string out;
  char buf[4096];
  const double until = Now() + timeout_s;
  while (true) {
    int wait_ms = -1;
    if (timeout_s > 0) {
      const double left = until - Now();
      if (left <= 0) {
        kill(pid, SIGKILL);
        if (timed_out != nullptr) *timed_out = true;
        break;
      }
      wait_ms = static_cast<int>(left * 1000) + 1;
    }
    pollfd pfd{fds[0], POLLIN, 0};
    const int r = poll(&pfd, 1, wait_ms);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      kill(pid, SIGKILL);
      break;
    }
    if (r == 0) continue;  // the deadline check above ends it
    const ssize_t n = read(fds[0], buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, n);
  }
  close(fds[0]);
  waitpid(pid, status, 0);
  g_run_child = 0;
  return out;
}

// `pdserve generate --model --json` with the spec's parameters.
// It is killed after `timeout_s`; its stderr is appended to `log_path`.
Reference ComputeReference(const std::string& bin, const std::string& model,
                           const Spec& s, double timeout_s,
                           const std::string& log_path) {
  std::vector<std::string> args = {
      bin,
      "generate",
      "--model=" + model,
      "--prompt=" + s.prompt,
      absl::StrCat("--max-tokens=", s.max_tokens),
      absl::StrCat("--temperature=", s.temperature),
      absl::StrCat("--top-p=", s.top_p),
      absl::StrCat("--top-k=", s.top_k),
      absl::StrCat("--seed=", s.seed),
      "--threads=1",
      "--json"};
  if (s.ignore_eos) args.push_back("--ignore-eos");
  for (const auto& st : s.stop) args.push_back("--stop=" + st);
  int status = 0;
  bool timed_out = false;
  const std::string out =
      Run(args, &status, false, timeout_s, log_path, &timed_out);
  Reference r;
  if (timed_out) {
    r.error = absl::StrFormat(
        "reference `pdserve generate` for spec %d ran past %g s and was "
        "killed; its stderr is in %s",
        s.id, timeout_s, log_path);
    return r;
  }
  const nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
  const bool shaped = !j.is_discarded() && j.is_object() &&
                      j.contains("token_ids") && j["token_ids"].is_array() &&
                      j.contains("finish_reason") &&
                      j["finish_reason"].is_string();
  if (status != 0 || !shaped) {
    r.error = absl::StrCat("reference failed (status ", status, "): ", out);
    return r;
  }
  for (const auto& id : j["token_ids"]) {
    if (!id.is_number_unsigned()) {
      r.error = "reference token_ids are not unsigned integers: " + out;
      r.tokens.clear();
      return r;
    }
    r.tokens.push_back(id.get<uint32_t>());
  }
  r.finish_reason = j["finish_reason"].get<std::string>();
  r.ok = true;
  return r;
}

// ---------------------------------------------------------------------------
// The soak

struct Outcome {
  int spec = -1;  // -1: a malformed request
  std::string variant;
  grpc::StatusCode code = grpc::StatusCode::OK;
  std::string message;
  std::vector<uint32_t> tokens;
  std::string finish_reason;
  double first_token_s = -1;  // send to the first message; -1: none came
};

const char* CodeName(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "?";
  }
}

bool UnclearStatus(grpc::StatusCode c) {
  return c == grpc::StatusCode::UNKNOWN || c == grpc::StatusCode::INTERNAL ||
         c == grpc::StatusCode::DATA_LOSS;
}

class Soak {
 public:
  Soak(std::string bin, std::string dir) : dir_(std::move(dir)) {
    cluster_.bin = std::move(bin);
    cluster_.log_dir = dir_;
  }

  int Main() {
    const uint64_t seed = absl::GetFlag(FLAGS_seed);
    const bool slow = absl::GetFlag(FLAGS_slow);
    const bool long_prompts = slow || absl::GetFlag(FLAGS_long_prompts);
    preset_ = slow ? "small" : absl::GetFlag(FLAGS_preset);
    const std::string& preset = preset_;
    model_ = dir_ + "/model";
    int status = 0;
    Run({cluster_.bin, "model", "init", "--preset=" + preset,
         "--out=" + model_},
        &status);
    if (status != 0) {
      Log("model init failed");
      return 2;
    }
    specs_ = MakeSpecs(seed, long_prompts ? 12 : 1);
    size_t longest = 0;
    for (const Spec& sp : specs_) longest = std::max(longest, sp.prompt.size());
    Log(absl::StrCat("model ", preset, ", ", specs_.size(),
                     " prompts, longest ", longest, " bytes"));
    refs_.resize(specs_.size());
    // A reference run takes seconds; the limit only keeps a stuck one from
    // holding the check phase.
    std::thread ref_thread([this] {
      const std::string log = dir_ + "/references.log";
      for (size_t i = 0; i < specs_.size() && !abort_; ++i) {
        Reference r =
            ComputeReference(cluster_.bin, model_, specs_[i],
                             absl::GetFlag(FLAGS_reference_timeout_s), log);
        absl::MutexLock l(&mu_);
        if (!r.error.empty() && ++refs_failed_ <= 5)
          Log("reference: " + r.error.substr(0, 300));
        refs_[i] = std::move(r);
        ++refs_done_;
      }
    });

    // Workers: small KV pools so admission, eviction and reuse happen (512
    // tokens; 6144 with long prompts: one or two of them per worker); a
    // short drain so SIGTERM finishes within the run. fp32 KV bytes per
    // token: 2 x layers x kv_heads x head_dim x 4 (tiny 512 B, small 8 KiB).
    const int64_t kv_bytes_per_token = preset == "small" ? 8192 : 512;
    const std::string kv_memory = absl::StrCat(
        kv_bytes_per_token * (long_prompts ? 6144 : 512) / 1024, "KiB");
    std::vector<std::string> worker_flags = {"--model=" + model_, "--threads=1",
                                             "--kv-cache-memory=" + kv_memory,
                                             "--drain-timeout-ms=5000"};
    if (absl::GetFlag(FLAGS_kv_tier)) {
      worker_flags.push_back(absl::StrCat(
          "--kv-offload-bytes=",
          int64_t{absl::GetFlag(FLAGS_kv_tier_multiple)} * kv_bytes_per_token *
              (long_prompts ? 6144 : 512) / 1024,
          "KiB"));
    }
    // Plaintext on loopback: binaries that demand TLS or an explicit choice
    // get --insecure.
    if (Run({cluster_.bin, "router", "--insecure", "--model=/nonexistent"},
            &status, true)
            .find("Unknown command line flag") == std::string::npos)
      security_.push_back("--insecure");
    worker_flags.insert(worker_flags.end(), security_.begin(), security_.end());
    // One tier directory per worker (a tier empties its own at start-up).
    auto tier_flag = [&](const std::string& name) {
      std::vector<std::string> a;
      if (!absl::GetFlag(FLAGS_kv_tier)) return a;
      tier_dirs_[name] = dir_ + "/tier/" + name;
      a.push_back("--kv-offload-dir=" + tier_dirs_[name]);
      return a;
    };
    const bool shm = absl::GetFlag(FLAGS_shm);
    for (int i = 0; i < 2; ++i) {
      const std::string name = absl::StrCat("prefill-", i);
      std::vector<std::string> a = {"worker", "--role=prefill"};
      a.insert(a.end(), worker_flags.begin(), worker_flags.end());
      if (shm && i == 1) a.push_back("--kv-transport=shm");
      for (std::string& f : tier_flag(name)) a.push_back(f);
      prefill_.push_back(cluster_.Add(name, "prefill", a));
    }
    for (int i = 0; i < 2; ++i) {
      const std::string name = absl::StrCat("decode-", i);
      std::vector<std::string> a = {"worker", "--role=decode"};
      a.insert(a.end(), worker_flags.begin(), worker_flags.end());
      // A shm decode worker still takes grpc pushes (from prefill-0).
      if (shm) a.push_back("--kv-transport=shm");
      for (std::string& f : tier_flag(name)) a.push_back(f);
      decode_.push_back(cluster_.Add(name, "decode", a));
    }
    std::vector<std::string> paddr, daddr;
    for (Proc* p : prefill_) paddr.push_back(p->address());
    for (Proc* p : decode_) daddr.push_back(p->address());
    http_port_ = FreePort();
    std::vector<std::string> router_flags = {
        "router", "--model=" + model_,
        "--http-port=" + std::to_string(http_port_),
        "--prefill-workers=" + absl::StrJoin(paddr, ","),
        "--decode-workers=" + absl::StrJoin(daddr, ",")};
    router_flags.insert(router_flags.end(), security_.begin(), security_.end());
    router_ = cluster_.Add("router", "router", router_flags);
    for (Proc* p : prefill_) cluster_.Start(p);
    for (Proc* p : decode_) cluster_.Start(p);
    cluster_.Start(router_);
    if (!WaitForWorkers(60)) {
      Log("the cluster did not come up");
      abort_ = true;
      ref_thread.join();
      cluster_.StopAll();
      return 2;
    }
    Log(absl::StrCat("cluster up: router ", router_->address(), "; load for ",
                     absl::GetFlag(FLAGS_minutes), " min, work dir ", dir_));

    const double end = Now() + absl::GetFlag(FLAGS_minutes) * 60;
    std::atomic<bool> stop{false};
    std::thread monitor([&] {
      while (!stop) {
        cluster_.Reap();
        cluster_.SampleRss();
        SampleShmMapping();
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
      }
    });
    std::vector<std::thread> clients;
    for (int i = 0; i < absl::GetFlag(FLAGS_clients); ++i)
      clients.emplace_back(
          [this, i, end, seed] { Client(seed * 31 + i, end); });
    std::thread chaos([this, end, seed] { Chaos(seed * 17 + 5, end); });
    std::thread hostile([this, end, seed] { Hostile(seed * 13 + 3, end); });
    for (auto& t : clients) t.join();
    chaos.join();
    hostile.join();
    Log("load and faults stopped; checking the cluster");

    // Every wait below is bounded; the watchdog turns a wait that is not
    // into a failure that names its phase, before the test's own limit.
    CheckWatchdog watchdog(this, absl::GetFlag(FLAGS_check_limit_s));
    SetPhase("checking the cluster (workers up, blocks drained, index)");
    const bool pass = Check();
    size_t refs_done = 0;
    {
      absl::MutexLock l(&mu_);
      refs_done = refs_done_;
    }
    SetPhase(absl::StrCat("waiting for the references (", refs_done, " of ",
                          specs_.size(), " done when the wait began)"));
    ref_thread.join();
    stop = true;
    SetPhase("stopping the monitor");
    monitor.join();
    SetPhase("comparing outputs with the references");
    const bool refs_pass = CheckOutputs();
    SetPhase("stopping the cluster");
    cluster_.StopAll();
    watchdog.Disarm();
    const bool all = Summarize(pass && refs_pass);
    return all ? 0 : 1;
  }

 private:
  void SetPhase(std::string phase) {
    absl::MutexLock l(&phase_mu_);
    phase_ = std::move(phase);
  }

  // Fails the soak, naming the phase, when the check phase is still running
  // after `limit_s`: the processes are killed and the soak exits 1.
  class CheckWatchdog {
   public:
    CheckWatchdog(Soak* soak, double limit_s)
        : thread_([this, soak, limit_s] {
            absl::MutexLock l(&mu_);
            if (mu_.AwaitWithTimeout(absl::Condition(&disarmed_),
                                     absl::Seconds(limit_s)))
              return;
            std::string phase;
            {
              absl::MutexLock pl(&soak->phase_mu_);
              phase = soak->phase_;
            }
            Log(absl::StrFormat(
                "FAIL: the check phase ran past %g s, while %s; killing "
                "the cluster",
                limit_s, phase));
            const pid_t child = g_run_child;
            if (child > 0) kill(child, SIGKILL);
            soak->cluster_.KillAllNow();
            std::fflush(stderr);
            std::_Exit(1);
          }) {}
    ~CheckWatchdog() { Disarm(); }

    void Disarm() {
      {
        absl::MutexLock l(&mu_);
        disarmed_ = true;
      }
      if (thread_.joinable()) thread_.join();
    }

   private:
    absl::Mutex mu_;
    bool disarmed_ = false;
    std::thread thread_;
  };

  std::unique_ptr<v1::Router::Stub> RouterStub() {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
    return v1::Router::NewStub(grpc::CreateCustomChannel(
        router_->address(), grpc::InsecureChannelCredentials(), args));
  }

  bool WaitForWorkers(double seconds) {
    auto stub = RouterStub();
    const double until = Now() + seconds;
    while (Now() < until) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(2));
      v1::ListWorkersResponse resp;
      if (stub->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp).ok()) {
        int up = 0;
        for (const auto& w : resp.workers()) up += w.state() == "up";
        if (up == 4) return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    return false;
  }

  void Record(Outcome o) {
    absl::MutexLock l(&mu_);
    outcomes_.push_back(std::move(o));
  }

  void Client(uint64_t seed, double end) {
    std::mt19937_64 rng(seed);
    auto stub = RouterStub();
    while (Now() < end && !abort_) {
      const int roll = static_cast<int>(rng() % 100);
      if (roll < 6) {
        Malformed(stub.get(), &rng);
        continue;
      }
      const Spec& s = specs_[rng() % specs_.size()];
      v1::GenerateRequest req;
      std::string variant = "prompt";
      if (roll < 16) {
        // The same prompt as token ids: BOS then the bytes (byte tokenizer).
        variant = "token_ids";
        req.mutable_token_ids()->add_ids(256);
        for (unsigned char c : s.prompt) req.mutable_token_ids()->add_ids(c);
      } else {
        req.set_prompt(s.prompt);
      }
      static const char* kSalts[] = {"", "", "tenant-a", "tenant-b"};
      req.set_cache_salt(kSalts[rng() % 4]);
      auto* sp = req.mutable_sampling();
      sp->set_max_tokens(s.max_tokens);
      sp->set_temperature(s.temperature);
      sp->set_top_p(s.top_p);
      sp->set_top_k(s.top_k);
      sp->set_seed(s.seed);
      sp->set_ignore_eos(s.ignore_eos);
      for (const auto& st : s.stop) sp->add_stop(st);
      const bool cancel = roll >= 16 && roll < 21;
      const bool tight_deadline = roll >= 21 && roll < 25;
      if (cancel) variant = "cancel";
      if (tight_deadline) variant = "deadline";

      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() +
                       (tight_deadline ? std::chrono::milliseconds(150)
                                       : std::chrono::milliseconds(120000)));
      Outcome o;
      o.spec = s.id;
      o.variant = variant;
      const double sent = Now();
      auto reader = stub->Generate(&ctx, req);
      v1::GenerateResponse resp;
      while (reader->Read(&resp)) {
        if (o.first_token_s < 0) o.first_token_s = Now() - sent;
        o.tokens.insert(o.tokens.end(), resp.token_ids().begin(),
                        resp.token_ids().end());
        if (!resp.finish_reason().empty())
          o.finish_reason = resp.finish_reason();
        if (cancel) ctx.TryCancel();
      }
      const grpc::Status st = reader->Finish();
      o.code = st.error_code();
      o.message = st.error_message();
      const bool unavailable = o.code == grpc::StatusCode::UNAVAILABLE;
      Record(std::move(o));
      // While the router restarts, do not spin.
      if (unavailable)
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }

  // Requests that must be refused with a clear status, and raw garbage.
  void Malformed(v1::Router::Stub* stub, std::mt19937_64* rng) {
    const int kind = static_cast<int>((*rng)() % 10);
    Outcome o;
    if (kind == 9) {
      MalformedHttp(rng);
      return;
    }
    if (kind == 7) {
      // Garbage bytes on the router's and a worker's gRPC ports; the
      // processes must just drop the connection.
      std::string junk(64 + (*rng)() % 512, '\0');
      for (char& c : junk) c = static_cast<char>((*rng)());
      if ((*rng)() % 2) junk = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + junk;
      SendRaw(router_->port, junk, nullptr);
      SendRaw(decode_[(*rng)() % 2]->port, junk, nullptr);
      SendRaw(router_->metrics_port, "GET /" + junk + " HTTP/1.1\r\n\r\n",
              nullptr);
      absl::MutexLock l(&mu_);
      ++faults_["malformed_raw_bytes"];
      return;
    }
    if (kind == 8) {
      // A KV transfer stream for a reservation that does not exist, and one
      // without a header, straight to a decode worker.
      Proc* d = decode_[(*rng)() % 2];
      auto kv = v1::KvTransfer::NewStub(grpc::CreateChannel(
          d->address(), grpc::InsecureChannelCredentials()));
      for (int bad = 0; bad < 2; ++bad) {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(5));
        v1::KvTransferAck ack;
        auto w = kv->Push(&ctx, &ack);
        v1::KvChunk chunk;
        if (bad == 0) {
          chunk.mutable_header()->set_request_id("soak-forged");
          chunk.mutable_header()->set_reservation_id(0xdeadbeef);
        }
        auto* span = chunk.add_spans();
        span->set_layer(0);
        span->set_block_index(0);
        span->set_data(std::string(4096, 'x'));
        w->Write(chunk);
        w->WritesDone();
        const grpc::Status st = w->Finish();
        Outcome k;
        k.variant = bad == 0 ? "kv_unknown_reservation" : "kv_no_header";
        k.code = st.error_code();
        k.message = st.error_message();
        Record(std::move(k));
      }
      absl::MutexLock l(&mu_);
      ++faults_["malformed_kv_stream"];
      return;
    }
    v1::GenerateRequest req;
    req.set_prompt("hello");
    req.mutable_sampling()->set_max_tokens(4);
    switch (kind) {
      case 0:
        o.variant = "max_tokens_0";
        req.mutable_sampling()->set_max_tokens(0);
        break;
      case 1:
        o.variant = "negative_temperature";
        req.mutable_sampling()->set_temperature(-1);
        break;
      case 2:
        o.variant = "no_input";
        req.clear_prompt();
        break;
      case 3:
        o.variant = "token_out_of_vocab";
        req.mutable_token_ids()->add_ids(1u << 30);
        break;
      case 4:
        o.variant = "max_tokens_huge";
        req.mutable_sampling()->set_max_tokens(4000000000u);
        break;
      case 5:
        o.variant = "top_p_2";
        req.mutable_sampling()->set_top_p(2);
        break;
      default:
        o.variant = "prompt_too_long";
        req.set_prompt(std::string(5000, 'z'));
        break;
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(30));
    auto reader = stub->Generate(&ctx, req);
    v1::GenerateResponse resp;
    while (reader->Read(&resp)) {
    }
    const grpc::Status st = reader->Finish();
    o.code = st.error_code();
    o.message = st.error_message();
    Record(std::move(o));
    absl::MutexLock l(&mu_);
    ++faults_["malformed_request"];
  }

  // Malformed requests to the router's OpenAI HTTP front: each must get a
  // 4xx answer (never a 2xx, a 5xx or a crash). A refused connection (the
  // router restarting) only counts as a fault sent.
  void MalformedHttp(std::mt19937_64* rng) {
    static const char* const kBodies[] = {
        "{\"model\": \"x\", \"prompt\": ",                   // truncated JSON
        "[1, 2, 3]",                                         // not an object
        "{\"prompt\": \"hi\", \"max_tokens\": -5}",          // bad value
        "{\"prompt\": \"hi\", \"n\": 3}",                    // n != 1
        "{\"prompt\": {\"nested\": [[[[[[[[[[]]]]]]]]]]}}",  // wrong type
        "{\"messages\": \"not a list\"}",                    // chat, bad shape
    };
    const size_t which = (*rng)() % (std::size(kBodies) + 1);
    std::string request;
    std::string variant;
    if (which == std::size(kBodies)) {
      variant = "http_garbage_request_line";
      request = "POST\x01\x02 /v1/completions HTTP/9.9\r\n\r\n";
    } else {
      const std::string body = kBodies[which];
      const bool chat = body.find("messages") != std::string::npos;
      variant = absl::StrCat("http_bad_body_", which);
      request = absl::StrCat(
          "POST ", chat ? "/v1/chat/completions" : "/v1/completions",
          " HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
          "Connection: close\r\nContent-Length: ",
          body.size(), "\r\n\r\n", body);
    }
    std::string reply;
    const bool connected = SendRaw(http_port_, request, &reply);
    {
      absl::MutexLock l(&mu_);
      ++faults_["malformed_http"];
    }
    if (!connected || reply.empty()) return;  // restarting, or dropped
    Outcome o;
    o.variant = variant;
    o.message = reply.substr(0, reply.find("\r\n"));
    // "HTTP/1.1 400 Bad Request" -> the status class decides.
    const char cls = reply.size() > 9 ? reply[9] : '?';
    o.code = cls == '4'   ? grpc::StatusCode::INVALID_ARGUMENT
             : cls == '2' ? grpc::StatusCode::OK
                          : grpc::StatusCode::INTERNAL;
    Record(std::move(o));
  }

  // With --shm: whether prefill-1 (a shm sender) has a decode worker's pool
  // memfd mapped, i.e. KV really moved over shm while the hostile peer ran.
  void SampleShmMapping() {
    if (!absl::GetFlag(FLAGS_shm) || prefill_.size() < 2) return;
    const pid_t pid = cluster_.Pid(prefill_[1]);
    if (pid <= 0) return;
    std::ifstream in(absl::StrCat("/proc/", pid, "/maps"));
    std::string line;
    while (std::getline(in, line)) {
      if (line.find("memfd:pdserve-kv-pool-") != std::string::npos) {
        absl::MutexLock l(&mu_);
        shm_mapped_ = true;
        return;
      }
    }
  }

  void Fault(const std::string& kind) {
    absl::MutexLock l(&mu_);
    ++faults_[kind];
  }

  // The hostile peer (tests/soak/hostile_peer.h): header garbage on the
  // HTTP front (any answer is fine; the router must stay up and lose
  // nothing), forged streams to the decode workers' shm control endpoint
  // and forged requests to their pool fd sockets (each must be refused with
  // a clear status, and no fd it attached may stay in the worker).
  void Hostile(uint64_t seed, double end) {
    const double interval = absl::GetFlag(FLAGS_hostile_interval);
    if (interval <= 0) return;
    std::mt19937_64 rng(seed);
    std::exponential_distribution<double> gap(1.0 / interval);
    enum Kind { kHeaders, kShmStream, kShmSocket };
    std::vector<Kind> kinds;
    if (absl::GetFlag(FLAGS_hostile_http_headers)) kinds.push_back(kHeaders);
    if (absl::GetFlag(FLAGS_shm)) {
      kinds.push_back(kShmStream);
      kinds.push_back(kShmSocket);
    }
    if (kinds.empty()) return;
    while (Now() < end - 2 && !abort_) {
      Sleep(std::min(gap(rng), 4 * interval));
      const Kind kind = kinds[rng() % kinds.size()];
      Proc* d = decode_[rng() % decode_.size()];
      HostileResult r;
      if (kind == kHeaders) {
        r = HttpHeaderGarbage(http_port_,
                              std::filesystem::path(model_).filename().string(),
                              &rng);
        Fault(r.answered ? "hostile_http_header_garbage_answered"
                         : "hostile_http_header_garbage_unanswered");
        continue;  // any HTTP answer counts as handled
      }
      if (kind == kShmStream) {
        r = HostileShmStream(d->address(), &rng);
        Fault("hostile_shm_control_stream");
      } else {
        const pid_t pid = cluster_.Pid(d);
        if (pid <= 0) continue;
        int leaked = 0;
        r = HostileShmSocket(pid, &rng, &leaked);
        Fault("hostile_shm_pool_socket");
        if (leaked > 0) {
          Log(absl::StrCat("FAIL: ", d->name, " holds ", leaked,
                           " fds a hostile peer attached (", r.variant, ")"));
          absl::MutexLock l(&mu_);
          hostile_fds_leaked_ += leaked;
        }
      }
      if (!r.answered) continue;  // restarting
      Outcome o;
      o.variant = r.variant;
      o.code = r.code;
      o.message = r.message;
      Record(std::move(o));
    }
  }

  void Sleep(double s) {
    std::this_thread::sleep_for(
        std::chrono::milliseconds(static_cast<int64_t>(s * 1000)));
  }

  void Chaos(uint64_t seed, double end) {
    double interval = absl::GetFlag(FLAGS_fault_interval);
    if (interval < 0) interval = absl::GetFlag(FLAGS_slow) ? 20 : 5;
    if (interval <= 0) return;
    std::mt19937_64 rng(seed);
    std::exponential_distribution<double> gap(1.0 / interval);
    Sleep(std::min(3.0, interval));
    const int kinds = tier_dirs_.empty() ? 6 : 8;
    while (Now() < end - 5) {
      const int kind = static_cast<int>(rng() % kinds);
      std::vector<Proc*> workers = prefill_;
      workers.insert(workers.end(), decode_.begin(), decode_.end());
      Proc* w = workers[rng() % workers.size()];
      switch (kind) {
        case 0:
        case 1: {  // SIGKILL a worker, restart it on the same ports
          Log("fault: SIGKILL " + w->name);
          Fault("sigkill_" + w->role);
          AddTierCounters(w);
          cluster_.Signal(w, SIGKILL);
          Sleep(0.5 + (rng() % 1500) / 1000.0);
          cluster_.Start(w);
          break;
        }
        case 2: {  // SIGTERM: graceful drain, then restart
          Log("fault: SIGTERM " + w->name);
          Fault("sigterm_" + w->role);
          AddTierCounters(w);
          if (!cluster_.Signal(w, SIGTERM, 20)) {
            Log(w->name + " did not exit within 20 s of SIGTERM");
            Fault("sigterm_hang");
            cluster_.Signal(w, SIGKILL);
          }
          cluster_.Start(w);
          break;
        }
        case 3:
        case 4: {  // stall a prefill worker mid-transfer
          Proc* p = prefill_[rng() % prefill_.size()];
          const double s = 2 + (rng() % 11000) / 1000.0;  // 2..13 s
          Log(absl::StrFormat("fault: SIGSTOP %s for %.1f s", p->name, s));
          Fault(s > 10 ? "stall_kv_transfer_past_timeout"
                       : "stall_kv_transfer");
          cluster_.Signal(p, SIGSTOP);
          Sleep(s);
          cluster_.Signal(p, SIGCONT);
          break;
        }
        case 5: {  // restart the router: every KV event stream drops
          Log("fault: restart the router (KV event streams drop and resync)");
          Fault("router_restart_event_streams_drop");
          cluster_.Signal(router_, SIGKILL);
          cluster_.Start(router_);
          break;
        }
        case 6:
        case 7:  // damage tier files of a running worker
          TierFault(w, rng);
          break;
      }
      Sleep(std::min(gap(rng), 4 * interval));
    }
  }

  // Adds a worker's KV tier counters (they restart from 0 with the worker):
  // called before the chaos thread stops it, and at the end.
  void AddTierCounters(Proc* p) {
    if (tier_dirs_.empty()) return;
    const std::string m = Scrape(p->metrics_port);
    absl::MutexLock l(&mu_);
    tier_hit_tokens_ +=
        std::max(0.0, Metric(m, "pdserve_kv_tier_hit_tokens_total"));
    for (const char* r :
         {"missing", "short", "corrupt", "write_error", "full", "queue_full"}) {
      tier_failures_[r] += std::max(
          0.0,
          Metric(m, absl::StrCat("pdserve_kv_tier_failures_total{reason=\"", r,
                                 "\"}")));
    }
  }

  // Corrupts (flips a byte), truncates or deletes up to 3 of `w`'s tier
  // block files. The worker finds out only when it loads one: it must then
  // recompute (same tokens) and drop the block (a `removed` event).
  void TierFault(Proc* w, std::mt19937_64& rng) {
    namespace fs = std::filesystem;
    std::vector<fs::path> files;
    std::error_code ec;
    for (fs::recursive_directory_iterator it(tier_dirs_[w->name], ec), end;
         !ec && it != end; it.increment(ec)) {
      if (it->path().extension() == ".kvb") files.push_back(it->path());
    }
    if (files.empty()) {
      Fault("tier_no_files_yet");
      return;
    }
    // The newest files: the blocks the pool evicted last, the likeliest to
    // be read back soon (an old file may be dropped unread). Each time is
    // read once: files vanish meanwhile, and a comparator that reads them
    // would not be a consistent order for std::sort.
    std::vector<std::pair<fs::file_time_type, fs::path>> by_time;
    for (const fs::path& f : files) {
      std::error_code e;
      by_time.push_back({fs::last_write_time(f, e), f});
    }
    std::sort(by_time.begin(), by_time.end(),
              [](const auto& a, const auto& b) { return a.first > b.first; });
    files.clear();
    for (const auto& [t, f] : by_time) files.push_back(f);
    if (files.size() > 8) files.resize(8);
    const int how = static_cast<int>(rng() % 3);
    const char* names[] = {"tier_file_corrupt", "tier_file_truncate",
                           "tier_file_delete"};
    const int n = 1 + static_cast<int>(rng() % 3);
    int done = 0;
    for (int i = 0; i < n; ++i) {
      const fs::path& f = files[rng() % files.size()];
      const auto size = fs::file_size(f, ec);
      if (ec || size == 0) continue;
      if (how == 0) {
        std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
        const std::streamoff at = static_cast<std::streamoff>(rng() % size);
        char c = 0;
        io.seekg(at);
        io.read(&c, 1);
        c = static_cast<char>(c ^ 0x5a);
        io.seekp(at);
        io.write(&c, 1);
        done += static_cast<bool>(io);
      } else if (how == 1) {
        fs::resize_file(f, rng() % size, ec);
        done += !ec;
      } else {
        done += fs::remove(f, ec);
      }
    }
    Log(absl::StrCat("fault: ", names[how], " x", done, " on ", w->name));
    absl::MutexLock l(&mu_);
    faults_[names[how]] += done;
  }

  // After the load: everything up, no active blocks, index == caches.
  bool Check() {
    bool ok = true;
    for (Proc* p : prefill_)
      if (p->stopped) cluster_.Signal(p, SIGCONT);
    cluster_.Reap();
    for (Proc* p : {prefill_[0], prefill_[1], decode_[0], decode_[1], router_})
      if (cluster_.Pid(p) <= 0) cluster_.Start(p);
    if (!WaitForWorkers(60)) {
      Log("FAIL: not every worker is up again after the run");
      ok = false;
    }
    // Active blocks drain once in-flight requests end (KV stall timeout and
    // admission timeout are 10 s each).
    // Slow steps: abandoned prefills and cancelled decodes end later.
    const double until = Now() + (absl::GetFlag(FLAGS_slow) ? 180 : 60);
    std::map<std::string, double> active;
    while (true) {
      active.clear();
      double total = 0;
      for (Proc* p : {prefill_[0], prefill_[1], decode_[0], decode_[1]}) {
        const std::string m = Scrape(p->metrics_port);
        const double a = Metric(m, "pdserve_kv_cache_blocks{state=\"active\"}");
        active[p->name] = a;
        total += a < 0 ? 1 : a;
      }
      if (total == 0 || Now() > until) break;
      Sleep(1);
    }
    // The tiers' counters of the last incarnations (the earlier ones were
    // added when the chaos thread stopped them).
    for (Proc* p : {prefill_[0], prefill_[1], decode_[0], decode_[1]})
      AddTierCounters(p);
    blocks_leaked_ = 0;
    for (const auto& [name, a] : active) {
      if (a != 0) {
        Log(absl::StrCat("FAIL: ", name, " has ", a, " active KV blocks"));
        ok = false;
      }
      blocks_leaked_ += std::max(0.0, a);
    }
    // The router's index vs each worker's cache, after the streams resynced.
    index_agrees_ = false;
    const double index_until = Now() + 30;
    while (!index_agrees_ && Now() < index_until) {
      index_agrees_ = true;
      index_report_.clear();
      tier_blocks_at_end_ = 0;
      std::map<std::string, v1::WorkerInfo> routed;
      {
        auto stub = RouterStub();
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(5));
        v1::ListWorkersResponse resp;
        if (!stub->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp).ok()) {
          index_agrees_ = false;
          Sleep(1);
          continue;
        }
        for (const auto& w : resp.workers()) routed[w.address()] = w;
      }
      for (Proc* p : {prefill_[0], prefill_[1], decode_[0], decode_[1]}) {
        auto worker = v1::Worker::NewStub(grpc::CreateChannel(
            p->address(), grpc::InsecureChannelCredentials()));
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(5));
        auto reader =
            worker->SubscribeKvEvents(&ctx, v1::SubscribeKvEventsRequest());
        v1::KvEventBatch snapshot;
        const bool got = reader->Read(&snapshot);
        ctx.TryCancel();
        reader->Finish();
        // The snapshot's events per tier (pool, then the tier below it).
        struct Digest {
          uint64_t hi = 0, lo = 0, n = 0;
          std::set<std::string> seen;
          std::string Hex() const {
            return absl::StrFormat("%016x%016x", hi, lo);
          }
        } pool, tier;
        for (const auto& e : snapshot.events()) {
          Digest& d = e.tier() == v1::KV_TIER_POOL ? pool : tier;
          for (const std::string& h : e.hashes()) {
            if (h.size() != 16 || !d.seen.insert(h).second) continue;
            uint64_t a = 0, b = 0;
            for (int i = 0; i < 8; ++i) {
              a = (a << 8) | static_cast<uint8_t>(h[i]);
              b = (b << 8) | static_cast<uint8_t>(h[8 + i]);
            }
            d.hi ^= a;
            d.lo ^= b;
            ++d.n;
          }
        }
        const v1::WorkerInfo& r = routed[p->address()];
        const bool same_pool = got && r.indexed_blocks() == pool.n &&
                               r.indexed_digest() == pool.Hex();
        // A worker without a tier sends no tier event; the router then
        // indexes none (indexed_tier_blocks 0, digest empty).
        const bool same_tier =
            got && r.indexed_tier_blocks() == tier.n &&
            (tier.n == 0 || r.indexed_tier_digest() == tier.Hex());
        index_agrees_ = index_agrees_ && same_pool && same_tier;
        index_report_[p->name] = absl::StrCat(
            "pool: worker ", pool.n, " blocks ", pool.Hex().substr(0, 8),
            "…, router ", r.indexed_blocks(), " blocks ",
            r.indexed_digest().substr(0, 8), "…", same_pool ? "" : " MISMATCH",
            "; tier: worker ", tier.n, ", router ", r.indexed_tier_blocks(),
            same_tier ? "" : " MISMATCH");
        tier_blocks_at_end_ += tier.n;
      }
      if (!index_agrees_) Sleep(1);
    }
    if (!index_agrees_) {
      Log("FAIL: the router's prefix index disagrees with a worker's cache");
      ok = false;
    }
    return ok;
  }

  bool CheckOutputs() {
    absl::MutexLock l(&mu_);
    bool ok = true;
    for (const Outcome& o : outcomes_) {
      const std::string code = CodeName(o.code);
      ++errors_[code];
      if (o.code != grpc::StatusCode::OK) {
        // Digits (ports, counts, ids) dropped so that one cause is one line.
        std::string cause = absl::StrCat(code, ": ", o.message.substr(0, 90));
        cause.erase(
            std::remove_if(cause.begin(), cause.end(),
                           [](char ch) { return absl::ascii_isdigit(ch); }),
            cause.end());
        ++causes_[cause];
      }
      if (UnclearStatus(o.code)) {
        ++unclear_;
        if (unclear_ <= 10)
          Log(absl::StrCat("unclear status ", code, " (", o.variant,
                           "): ", o.message));
      }
      if (o.spec < 0) {
        ++malformed_;
        if (o.code == grpc::StatusCode::OK) {
          ++malformed_accepted_;
          Log("FAIL: malformed request accepted: " + o.variant);
        }
        continue;
      }
      ++requests_;
      if (o.code != grpc::StatusCode::OK) continue;
      if (o.first_token_s >= 0) first_token_s_.push_back(o.first_token_s);
      if (o.variant == "cancel" || o.variant == "deadline") {
        ++completed_;  // finished before the cancel/deadline hit
      } else {
        ++completed_;
      }
      const Reference& r = refs_[o.spec];
      if (!r.ok) {
        ++unchecked_;
        continue;
      }
      if (o.tokens != r.tokens || o.finish_reason != r.finish_reason) {
        ++mismatches_;
        if (mismatches_ <= 10)
          Log(absl::StrCat("MISMATCH spec ", o.spec, " (", specs_[o.spec].kind,
                           ", ", o.variant, "): got ",
                           absl::StrJoin(o.tokens, ","), " [", o.finish_reason,
                           "], reference ", absl::StrJoin(r.tokens, ","), " [",
                           r.finish_reason, "]"));
      } else {
        ++matched_;
      }
    }
    // Outputs without a reference went unchecked: that fails the soak.
    int missing = 0;
    for (const Reference& r : refs_) {
      if (r.ok) continue;
      if (++missing <= 5) Log("FAIL: reference missing: " + r.error);
      ok = false;
    }
    if (missing > 5)
      Log(absl::StrCat("FAIL: ", missing, " references missing"));
    if (mismatches_ > 0 || unclear_ > 0 || malformed_accepted_ > 0 ||
        hostile_fds_leaked_ > 0)
      ok = false;
    if (absl::GetFlag(FLAGS_shm) && !shm_mapped_) {
      Log("FAIL: prefill-1 never mapped a decode worker's pool (no KV moved "
          "over shm)");
      ok = false;
    }
    if (!cluster_.crashes.empty()) ok = false;
    return ok;
  }

  bool Summarize(bool pass) {
    absl::MutexLock l(&mu_);
    absl::MutexLock c(&cluster_.mu);
    std::map<std::string, int64_t> peak_rss;  // role -> kB
    std::vector<std::string> growth;
    bool bounded = true;
    for (auto& p : cluster_.procs) {
      for (size_t inc = 0; inc < p->rss.size(); ++inc) {
        const auto& s = p->rss[inc];
        for (const RssSample& x : s)
          peak_rss[p->role] = std::max(peak_rss[p->role], x.kb);
        if (s.size() < 40) continue;  // under ~20 s alive: no trend
        // Warm (after the first third of its life) vs the last tenth.
        int64_t warm = 0, last = 0;
        for (size_t i = s.size() / 3; i < s.size() / 2; ++i)
          warm = std::max(warm, s[i].kb);
        for (size_t i = s.size() * 9 / 10; i < s.size(); ++i)
          last = std::max(last, s[i].kb);
        const int64_t grew = last - warm;
        if (grew > std::max<int64_t>(64 * 1024, warm / 2)) {
          bounded = false;
          growth.push_back(absl::StrCat(p->name, "#", inc + 1, " grew ",
                                        grew / 1024, " MiB"));
        }
      }
    }
    const bool all = pass && bounded;
    std::string s;
    absl::StrAppend(&s, "\n===== pdserve soak summary =====\n");
    absl::StrAppendFormat(&s,
                          "duration            %.1f min load, %.1f s total\n",
                          absl::GetFlag(FLAGS_minutes), Now());
    absl::StrAppend(
        &s, "model               ", preset_,
        absl::GetFlag(FLAGS_slow) || absl::GetFlag(FLAGS_long_prompts)
            ? " (long prompts)\n"
            : "\n");
    absl::StrAppend(&s, "requests            ", requests_, " (", completed_,
                    " completed OK, ", matched_, " equal to the reference, ",
                    mismatches_, " mismatched, ", unchecked_,
                    " without reference)\n");
    std::sort(first_token_s_.begin(), first_token_s_.end());
    auto quantile = [&](double q) {
      return first_token_s_.empty() ? -1.0
                                    : first_token_s_[static_cast<size_t>(
                                          q * (first_token_s_.size() - 1))];
    };
    absl::StrAppendFormat(&s,
                          "first token (s)      p50 %.2f, p90 %.2f, max %.2f "
                          "over %d OK requests\n",
                          quantile(0.5), quantile(0.9), quantile(1.0),
                          static_cast<int>(first_token_s_.size()));
    absl::StrAppend(&s, "malformed           ", malformed_, " refused (",
                    malformed_accepted_, " wrongly accepted)\n");
    absl::StrAppend(&s, "hostile fds leaked  ", hostile_fds_leaked_,
                    absl::GetFlag(FLAGS_shm)
                        ? (shm_mapped_ ? " (KV moved over shm)"
                                       : " (KV never moved over shm)")
                        : "",
                    "\n");
    absl::StrAppend(&s, "faults injected    ");
    int total_faults = 0;
    for (const auto& [k, v] : faults_) {
      absl::StrAppend(&s, " ", k, "=", v);
      total_faults += v;
    }
    absl::StrAppend(&s, " (total ", total_faults, ")\n");
    absl::StrAppend(&s, "statuses           ");
    for (const auto& [k, v] : errors_) absl::StrAppend(&s, " ", k, "=", v);
    absl::StrAppend(&s, "  (unclear: ", unclear_, ")\n");
    std::vector<std::pair<int, std::string>> top;
    for (const auto& [k, v] : causes_) top.push_back({v, k});
    std::sort(top.rbegin(), top.rend());
    if (top.size() > 6) top.resize(6);
    absl::StrAppend(&s, "top error causes\n");
    for (const auto& [v, k] : top) absl::StrAppend(&s, "  ", v, "x ", k, "\n");
    absl::StrAppend(&s, "crashes             ",
                    cluster_.crashes.empty() ? "none" : "");
    for (const auto& [k, v] : cluster_.crashes)
      absl::StrAppend(&s, k, " x", v, "  ");
    absl::StrAppend(&s, "\nblocks leaked       ", blocks_leaked_, "\n");
    if (!tier_dirs_.empty()) {
      absl::StrAppend(&s, "kv tier (disk)      ", tier_blocks_at_end_,
                      " blocks at the end, ", tier_hit_tokens_,
                      " tokens read back; not loaded or not offloaded:");
      for (const auto& [k, v] : tier_failures_)
        absl::StrAppend(&s, " ", k, "=", v);
      absl::StrAppend(&s, " (all incarnations but a hung SIGTERM's)\n");
    }
    absl::StrAppend(&s, "peak RSS (MiB)     ");
    for (const auto& [k, v] : peak_rss)
      absl::StrAppendFormat(&s, " %s=%.1f", k, v / 1024.0);
    absl::StrAppend(
        &s, bounded ? "  (no unbounded growth)\n" : "  UNBOUNDED GROWTH: ");
    if (!bounded) absl::StrAppend(&s, absl::StrJoin(growth, ", "), "\n");
    absl::StrAppend(&s, "index vs caches     ",
                    index_agrees_ ? "agree" : "DISAGREE", "\n");
    for (const auto& [k, v] : index_report_)
      absl::StrAppend(&s, "  ", k, ": ", v, "\n");
    absl::StrAppend(&s, "result              ", all ? "PASS" : "FAIL", "\n");
    std::fputs(s.c_str(), stdout);
    std::fflush(stdout);
    const std::string json_path = absl::GetFlag(FLAGS_json);
    if (!json_path.empty()) {
      nlohmann::ordered_json out = {
          {"pass", all},
          {"minutes", absl::GetFlag(FLAGS_minutes)},
          {"model", preset_},
          {"requests", requests_},
          {"completed", completed_},
          {"matched", matched_},
          {"mismatched", mismatches_},
          {"unchecked", unchecked_},
          {"malformed", malformed_},
          {"hostile_fds_leaked", hostile_fds_leaked_},
          {"blocks_leaked", blocks_leaked_},
          {"first_token_s",
           {{"p50", quantile(0.5)},
            {"p90", quantile(0.9)},
            {"max", quantile(1.0)}}},
          {"index_agrees", index_agrees_},
          {"kv_tier",
           {{"blocks_at_end", tier_blocks_at_end_},
            {"hit_tokens", tier_hit_tokens_},
            {"failures", tier_failures_}}},
          {"crashes", cluster_.crashes.size()},
          {"faults", faults_},
          {"statuses", errors_},
          {"error_causes", causes_},
          {"peak_rss_mib", nlohmann::ordered_json::object()}};
      for (const auto& [k, v] : peak_rss) out["peak_rss_mib"][k] = v / 1024.0;
      std::ofstream(json_path) << out.dump() << "\n";
    }
    return all;
  }

  const std::string dir_;
  std::string model_, preset_;
  Cluster cluster_;
  std::vector<Proc*> prefill_, decode_;
  Proc* router_ = nullptr;
  int http_port_ = 0;  // the router's OpenAI HTTP front
  std::vector<Spec> specs_;
  std::vector<std::string> security_;  // --insecure where the binary has it
  std::atomic<bool> abort_{false};

  absl::Mutex mu_;
  std::vector<Reference> refs_ ABSL_GUARDED_BY(mu_);
  size_t refs_done_ ABSL_GUARDED_BY(mu_) = 0;
  int refs_failed_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Mutex phase_mu_;
  std::string phase_ ABSL_GUARDED_BY(phase_mu_);
  std::vector<Outcome> outcomes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> faults_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> errors_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> causes_ ABSL_GUARDED_BY(mu_);  // code: message
  int requests_ = 0, completed_ = 0, matched_ = 0, mismatches_ = 0,
      unchecked_ = 0, malformed_ = 0, malformed_accepted_ = 0, unclear_ = 0;
  std::vector<double> first_token_s_ ABSL_GUARDED_BY(mu_);  // OK requests
  double blocks_leaked_ = 0;
  int hostile_fds_leaked_ ABSL_GUARDED_BY(mu_) = 0;
  bool shm_mapped_ ABSL_GUARDED_BY(mu_) = false;
  bool index_agrees_ = false;
  std::map<std::string, std::string> index_report_;
  std::map<std::string, std::string> tier_dirs_;  // by worker name
  uint64_t tier_blocks_at_end_ = 0;
  double tier_hit_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, double> tier_failures_ ABSL_GUARDED_BY(mu_);
};

}  // namespace
}  // namespace pdserve::soak

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  signal(SIGPIPE, SIG_IGN);
  std::string bin = absl::GetFlag(FLAGS_pdserve);
  if (bin.empty() || access(bin.c_str(), X_OK) != 0) {
    std::fprintf(stderr,
                 "pdserve_soak: --pdserve=PATH to the pdserve binary\n");
    return 2;
  }
  bin = std::filesystem::absolute(bin).string();
  std::string dir = absl::GetFlag(FLAGS_work_dir);
  if (dir.empty()) dir = absl::StrCat("/tmp/pdserve-soak-", getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  pdserve::soak::Soak soak(bin, dir);
  return soak.Main();
}
