// The `pdserve` command-line front end: one binary, many subcommands.
// Each subcommand is a function taking its own argv (flags already parsed
// into ABSL_FLAGs, which live only in cli/) and returning an exit code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace pdserve::cli {

struct Command {
  const char* name;     // "model init", "generate", ...
  const char* summary;  // one line for `pdserve --help`
  uint32_t id;          // its CommandBit (cli/flag_table.h)
  // What it does, for `pdserve NAME --help`; the flag list below it is
  // generated from the flag table.
  const char* description;
  int (*run)(const std::vector<std::string>& positional);
};

const std::vector<Command>& AllCommands();

// The full text of `pdserve NAME --help`.
std::string CommandUsage(const Command& command);

// Prints "pdserve: error: <message>" to stderr and returns the exit code for
// the status (2 for invalid arguments, 1 otherwise).
int ReportError(const absl::Status& status);

int RunModelInit(const std::vector<std::string>& args);
int RunModelLogits(const std::vector<std::string>& args);
int RunGenerate(const std::vector<std::string>& args);
int RunKvBudget(const std::vector<std::string>& args);
int RunBenchEngine(const std::vector<std::string>& args);
int RunRouter(const std::vector<std::string>& args);
int RunPrefillWorker(const std::vector<std::string>& args);
int RunDecodeWorker(const std::vector<std::string>& args);
int RunWorker(const std::vector<std::string>& args);
int RunUp(const std::vector<std::string>& args);
int RunGenerateRemote();
int RunTokenize(const std::vector<std::string>& args);
int RunDetokenize(const std::vector<std::string>& args);

}  // namespace pdserve::cli
