// The one definition of which command reads which flag, what values a flag
// takes, and how `pdserve up` passes a flag on to its child processes. Every
// command's --help, the check that rejects a flag a command does not read,
// `up`'s child command lines and the config-info metrics are generated from
// this table, so adding a flag is one ABSL_FLAG plus one kFlags entry.
// Read-only after static initialisation; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace pdserve::metrics {
class Registry;
}

namespace pdserve::cli {

// One bit per subcommand (Command::id).
enum CommandBit : uint32_t {
  kModelInit = 1u << 0,
  kModelLogits = 1u << 1,
  kUp = 1u << 2,
  kRouter = 1u << 3,
  kPrefill = 1u << 4,
  kDecode = 1u << 5,
  kWorker = 1u << 6,
  kGenerate = 1u << 7,
  kKvBudget = 1u << 8,
  kBenchEngine = 1u << 9,
  kTokenize = 1u << 10,
  kDetokenize = 1u << 11,
  kSimRoute = 1u << 12,
  kBenchServe = 1u << 13,
  kBenchTransfer = 1u << 14,
};
inline constexpr uint32_t kWorkerCommands = kPrefill | kDecode | kWorker;
// Commands that build an engine from the engine flags (EngineConfigFromFlags).
inline constexpr uint32_t kEngineCommands =
    kWorkerCommands | kGenerate | kBenchEngine;

// Where `pdserve up` sends a flag (it accepts every flag it sends on).
enum class UpForward {
  kNone,     // up does not accept it (or reads it itself: kUp in commands)
  kWorkers,  // to every worker
  kRouter,   // to the router
  kAll,      // to every worker and the router
};

// What `up` knows when it builds a child's command line.
struct UpChild {
  bool is_router = false;
  std::string role;  // worker role: prefill, decode or both
  int index = 0;     // worker index (prefill workers first)
  int num_workers = 1;
  std::string model;               // the model directory (resolved default)
  int num_prefill = 0;             // prefill workers among num_workers
  std::string core_share = "off";  // workers' --core-share
};

// The kernel threads `up` gives a worker of `role` (prefill, decode, both)
// on a host of `cores` when --threads is not given. Colocated workers split
// the cores. With prefill and decode workers the split follows what each
// does: a decode step reads every weight once per token and is
// bandwidth-bound, and a quarter of the cores saturate DRAM bandwidth on
// common x86 hosts (on the 2-core development VM one thread read as fast as
// two), so each decode worker gets cores / 4 over the decode workers (at
// least 1); prefill is compute-bound and gets every core left (over the
// prefill workers, at least 1). No core runs two workers' threads at once:
// measured on 2 cores with the 1B shape, a third thread (prefill on both
// cores) doubled decode's ITL p99, and running prefill at a lower priority
// instead quadrupled its TTFT on a host shared with other work. A core
// passes from one worker to another only while its owner's engine is idle
// (--core-share, kernels/cpu/core_share.h).
int UpWorkerThreads(const std::string& role, int cores, int num_prefill,
                    int num_workers);

struct FlagSpec {
  const char* name;   // Abseil name (underscores); --help shows dashes
  uint32_t commands;  // CommandBits of the commands that read it
  UpForward up = UpForward::kNone;
  // The values it takes, where a parser restricts them; empty: free-form.
  std::vector<const char*> choices = {};
  // The parser the command itself uses: accepts exactly the valid values.
  absl::Status (*check)(const std::string& value) = nullptr;
  // The value `up` passes on for this child (default: its own current
  // value); nullopt leaves the flag out of that child's command line.
  std::optional<std::string> (*up_value)(const UpChild& child) = nullptr;
};

// The table. A flag name may appear in more than one entry when commands
// read it with different choices (e.g. --dtype); their command sets are
// disjoint.
const std::vector<FlagSpec>& AllFlags();

// The entry of `name` that `command` reads, or nullptr.
const FlagSpec* FindFlag(absl::string_view name, uint32_t command);

// Whether `command` accepts the flag (directly or because up forwards it).
bool CommandAccepts(const FlagSpec& spec, uint32_t command);

// The flag list of `pdserve COMMAND --help`: every flag it accepts with its
// value placeholder or choices, its help text and its default. For `up`,
// grouped by where the flag goes.
std::string FlagHelp(uint32_t command);

// Checks the command line (Abseil names, "--name[=value]") before parsing:
// every flag must be one `command` accepts (the error names the command and
// points at --help). Remembers the flags it saw: `up` keeps a value given on
// its command line where it would otherwise choose its own.
absl::Status CheckCommandLineFlags(const std::string& command_name,
                                   uint32_t command,
                                   const std::vector<std::string>& args);

// After parsing: every flag with a check holds a value its parser accepts.
absl::Status CheckFlagValues(uint32_t command);

// `up`'s arguments for one child: "--name=value" for every flag forwarded to
// it.
std::vector<std::string> UpChildArgs(const UpChild& child);

// Registers `<prefix>_config_info{flag,value} 1`, one series per flag
// `command` reads, with the value this process runs with (after `up`'s
// forwarding, what the child actually got).
void RegisterConfigInfo(metrics::Registry& registry, absl::string_view prefix,
                        uint32_t command);

}  // namespace pdserve::cli
