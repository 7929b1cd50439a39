// pdserve: one binary with subcommands (ARCHITECTURE.md, command line).
#include <dlfcn.h>
#include <malloc.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "cli/command.h"
#include "cli/flag_table.h"

// Thread stacks of at least 1 MiB, for civetweb's sake (the metrics port,
// common/metrics_http.h). glibc carves every loaded library's static TLS out
// of each thread's stack, and OpenBLAS, NCCL and cudart take ~77 KiB of it
// (readelf -l: PT_TLS 60 + 12 + 4 KiB). Debian's civetweb 1.15 starts its
// threads with a fixed 100 KiB stack (the size is compiled in; it has no
// option for it, nor does prometheus-cpp's Exposer, which passes options to
// it), so a scrape overflowed into the neighbouring mapping (SIGSEGV), and
// with a little more TLS pthread_create fails ("Cannot create threads").
// Defining pthread_attr_setstacksize in the executable overrides libc's for
// every shared library (the executable comes first in symbol lookup, and the
// definition is exported because libcivetweb references it): requests below
// 1 MiB are raised to 1 MiB, then passed on to libc's. Only the `pdserve`
// binary does this; libraries and tests link without it.
extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) {
  using Fn = int (*)(pthread_attr_t*, size_t);
  static const Fn libc_setstacksize =
      reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  return libc_setstacksize(attr, std::max<size_t>(size, size_t{1} << 20));
}

namespace pdserve::cli {
namespace {

void PrintTopUsage(FILE* out) {
  std::fprintf(out, "usage: pdserve COMMAND [FLAGS]\n\ncommands:\n");
  for (const Command& c : AllCommands())
    std::fprintf(out, "  %-16s %s\n", c.name, c.summary);
  std::fprintf(out,
               "\n`pdserve COMMAND --help` describes a command's flags.\n");
}

}  // namespace

int Main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" ||
      args[0] == "help") {
    PrintTopUsage(args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  // Longest match: "model init" before "model".
  const Command* cmd = nullptr;
  size_t words = 0;
  for (const Command& c : AllCommands()) {
    std::vector<std::string> parts = absl::StrSplit(c.name, ' ');
    if (parts.size() > args.size() || parts.size() <= words) continue;
    if (std::equal(parts.begin(), parts.end(), args.begin())) {
      cmd = &c;
      words = parts.size();
    }
  }
  if (cmd == nullptr) {
    std::fprintf(stderr, "pdserve: unknown command \"%s\"\n\n",
                 absl::StrJoin(args, " ").c_str());
    PrintTopUsage(stderr);
    return 2;
  }
  std::vector<std::string> rest(args.begin() + words, args.end());
  for (const std::string& a : rest) {
    if (a == "--help" || a == "-h" || a == "--helpfull") {
      std::printf("%s", CommandUsage(*cmd).c_str());
      return 0;
    }
  }
  // Contract flags use dashes (--max-tokens); Abseil flag names use
  // underscores.
  // --stop may repeat: the occurrences are joined with \x1f into one value.
  std::vector<std::string> stops, others;
  for (size_t i = 0; i < rest.size(); ++i) {
    if (rest[i] == "--stop" && i + 1 < rest.size()) {
      stops.push_back(rest[++i]);
    } else if (rest[i].rfind("--stop=", 0) == 0) {
      stops.push_back(rest[i].substr(7));
    } else {
      others.push_back(rest[i]);
    }
  }
  if (!stops.empty())
    others.push_back("--stop=" + absl::StrJoin(stops, "\x1f"));
  std::vector<std::string> translated = {std::string("pdserve ") + cmd->name};
  for (const std::string& a : others) {
    if (a.rfind("--", 0) == 0) {
      const size_t eq = a.find('=');
      std::string name =
          a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      std::replace(name.begin(), name.end(), '-', '_');
      translated.push_back("--" + name +
                           (eq == std::string::npos ? "" : a.substr(eq)));
    } else {
      translated.push_back(a);
    }
  }
  // Only the flags the command reads (its --help lists them): a flag another
  // command reads would be silently ignored here.
  if (absl::Status s = CheckCommandLineFlags(
          cmd->name, cmd->id,
          std::vector<std::string>(translated.begin() + 1, translated.end()));
      !s.ok())
    return ReportError(s);
  std::vector<char*> cargv;
  for (auto& s : translated) cargv.push_back(s.data());
  absl::SetProgramUsageMessage(CommandUsage(*cmd));
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(cargv.size()), cargv.data());
  if (absl::Status s = CheckFlagValues(cmd->id); !s.ok()) return ReportError(s);
  std::vector<std::string> pos;
  for (size_t i = 1; i < positional.size(); ++i)
    pos.emplace_back(positional[i]);
  return cmd->run(pos);
}

}  // namespace pdserve::cli

int main(int argc, char** argv) {
  // Debian builds Abseil without NDEBUG, which leaves absl::Mutex's deadlock
  // detector on and aborting: every lock then also updates a process-wide
  // lock-order graph under one global lock (about 30 ns more per uncontended
  // lock in a microbenchmark), and gRPC's own locking has been reported to
  // trip it without a real deadlock under connection churn. The server turns
  // it off; the test binaries keep it, as a check on pdserve's lock order.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Kernel threads wait passively between parallel regions unless the user
  // chose otherwise. Spinning (libgomp's default) collapses when cores are
  // shared — several workers per node, or a busy CI machine: a descheduled
  // team member stalls every barrier for a whole time slice (measured: decode
  // step 12 ms -> 180 ms on 2 shared cores). libgomp reads the variable when
  // it loads, so it is set here and the binary re-executes itself once.
  if (std::getenv("OMP_WAIT_POLICY") == nullptr) {
    setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    execv("/proc/self/exe", argv);  // on failure, carry on with the default
  }
  // Keep freed memory mapped: KV transfer allocates and frees large receive
  // buffers for every request, and glibc's defaults hand them back to the
  // kernel each time, so every transfer pays page faults on fresh pages
  // (measured: grpc transfer CPU per GB 1.5 -> 1.0 s; bench/transfer_bench).
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  return pdserve::cli::Main(argc, argv);
}
