// The flag table (cli/flag_table.h) against the flags the commands define,
// the parsers behind each flag's choices, the generated help and `up`'s
// child command lines.
#include "cli/flag_table.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <thread>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "cli/command.h"
#include "cli/flags.h"
#include "model/model_init.h"

namespace pdserve::cli {
namespace {

using ::testing::HasSubstr;

std::string Dashed(const std::string& name) {
  return absl::StrReplaceAll(name, {{"_", "-"}});
}

uint32_t AllCommandBits() {
  uint32_t bits = 0;
  for (const Command& c : AllCommands()) bits |= c.id;
  return bits;
}

TEST(FlagTableTest, EveryEntryIsADefinedFlagReadBySomeCommand) {
  const uint32_t known = AllCommandBits();
  for (const FlagSpec& s : AllFlags()) {
    EXPECT_NE(absl::FindCommandLineFlag(s.name), nullptr) << s.name;
    EXPECT_NE(s.commands | (s.up != UpForward::kNone ? kUp : 0u), 0u) << s.name;
    EXPECT_EQ(s.commands & ~known, 0u) << s.name;
  }
}

TEST(FlagTableTest, EveryFlagDefinedInCliIsInTheTable) {
  std::set<std::string> in_table;
  for (const FlagSpec& s : AllFlags()) in_table.insert(s.name);
  int cli_flags = 0;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (flag->Filename().find("cli/") == std::string::npos) continue;
    ++cli_flags;
    EXPECT_TRUE(in_table.count(std::string(name)))
        << "--" << Dashed(std::string(name)) << " (" << flag->Filename()
        << ") has no entry in cli/flag_table.cc";
  }
  EXPECT_GT(cli_flags, 50);
}

TEST(FlagTableTest, RepeatedNamesBelongToDisjointCommands) {
  std::map<std::string, uint32_t> seen;
  for (const FlagSpec& s : AllFlags()) {
    EXPECT_EQ(seen[s.name] & s.commands, 0u) << s.name;
    seen[s.name] |= s.commands;
  }
}

// A listed choice the parser refuses (or a parser that takes anything) would
// make the help lie.
TEST(FlagTableTest, EveryChoiceIsAcceptedByTheCommandsParser) {
  for (const FlagSpec& s : AllFlags()) {
    if (s.choices.empty()) continue;
    ASSERT_NE(s.check, nullptr) << s.name << " lists choices but no parser";
    for (const char* choice : s.choices)
      EXPECT_TRUE(s.check(choice).ok()) << "--" << s.name << " " << choice;
    EXPECT_FALSE(s.check("no-such-value").ok()) << s.name;
  }
}

TEST(FlagTableTest, HelpListsEveryFlagWithItsChoicesAndDefault) {
  for (const Command& c : AllCommands()) {
    const std::string help = CommandUsage(c);
    EXPECT_THAT(help, HasSubstr(absl::StrCat("usage: pdserve ", c.name)));
    for (const FlagSpec& s : AllFlags()) {
      if (!CommandAccepts(s, c.id)) continue;
      // Entries of another command with the same name are not this one's.
      if (FindFlag(s.name, c.id) != &s) continue;
      const std::string line = absl::StrCat("  --", Dashed(s.name));
      ASSERT_THAT(help, HasSubstr(line)) << c.name;
      const std::string rest = help.substr(
          help.find(line + " ") != std::string::npos ? help.find(line + " ")
                                                     : help.find(line + "\n"));
      const std::string entry = rest.substr(0, rest.find("\n  --", 1));
      if (!s.choices.empty()) {
        EXPECT_THAT(entry, HasSubstr(absl::StrJoin(s.choices, "|")))
            << c.name << " --" << s.name;
      }
      const absl::CommandLineFlag* f = absl::FindCommandLineFlag(s.name);
      const std::string def =
          f->DefaultValue().empty() ? "\"\"" : f->DefaultValue();
      EXPECT_THAT(entry, HasSubstr("(default: " + def + ")"))
          << c.name << " --" << s.name;
    }
  }
}

TEST(FlagTableTest, ModelInitHelpListsEveryPreset) {
  const std::string help = FlagHelp(kModelInit);
  EXPECT_EQ(engine::PresetNames().size(), 13u);
  EXPECT_THAT(help, HasSubstr(absl::StrJoin(engine::PresetNames(), "|")));
}

TEST(FlagTableTest, WorkerHelpListsKvTransportChoices) {
  for (uint32_t c : {kWorker, kPrefill, kDecode, kUp}) {
    EXPECT_THAT(FlagHelp(c), HasSubstr("--kv-transport "
                                       "grpc|shm|cuda_ipc|nccl|auto"));
  }
}

TEST(FlagTableTest, UnknownFlagsAreRefusedWithTheCommandsName) {
  EXPECT_TRUE(CheckCommandLineFlags("worker", kWorker,
                                    {"--kv_dtype=int8", "--noinsecure"})
                  .ok());
  const absl::Status s = CheckCommandLineFlags("up", kUp, {"--host=0.0.0.0"});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("pdserve up does not take --host"));
  // up takes every flag it forwards.
  EXPECT_TRUE(
      CheckCommandLineFlags(
          "up", kUp, {"--weight_dtype=int8", "--peer_pull", "--max_retries=2"})
          .ok());
}

// Every flag up forwards reaches the child it is meant for, exactly once.
TEST(FlagTableTest, UpForwardsEveryWorkerAndRouterFlag) {
  UpChild worker{false, "prefill", 0, 2, "/m"};
  UpChild router{true, "", 0, 2, "/m"};
  const std::string wargs = absl::StrJoin(UpChildArgs(worker), " ") + " ";
  const std::string rargs = absl::StrJoin(UpChildArgs(router), " ") + " ";
  for (const FlagSpec& s : AllFlags()) {
    const std::string arg = absl::StrCat("--", Dashed(s.name), "=");
    if (s.name == std::string("kv_offload_dir")) continue;  // only when set
    // Another command's entry of a forwarded name (sim route's --policy).
    if (s.up == UpForward::kNone && FindFlag(s.name, kUp) != nullptr) continue;
    const bool w = s.up == UpForward::kWorkers || s.up == UpForward::kAll;
    const bool r = s.up == UpForward::kRouter || s.up == UpForward::kAll;
    EXPECT_EQ(wargs.find(arg) != std::string::npos, w) << s.name;
    EXPECT_EQ(rargs.find(arg) != std::string::npos, r) << s.name;
    // Each forwarded flag is one a worker (router) command reads.
    if (w) EXPECT_NE(s.commands & kWorker, 0u) << s.name;
    if (r) EXPECT_NE(s.commands & kRouter, 0u) << s.name;
  }
  EXPECT_THAT(wargs, HasSubstr("--model=/m "));
  EXPECT_THAT(wargs, HasSubstr("--weight-dtype=auto "));
  EXPECT_THAT(rargs, HasSubstr("--port=50051 "));
  EXPECT_THAT(rargs, HasSubstr("--http-port=8000 "));
}

// up's thread split: colocated workers share the cores equally; with prefill
// and decode workers, decode gets a quarter of the cores (bandwidth-bound)
// and prefill the rest (compute-bound); no core is given twice.
TEST(FlagTableTest, UpSplitsThreadsByWhatEachWorkerDoes) {
  EXPECT_EQ(UpWorkerThreads("both", 2, 0, 1), 2);
  EXPECT_EQ(UpWorkerThreads("both", 8, 0, 2), 4);
  EXPECT_EQ(UpWorkerThreads("prefill", 2, 1, 2), 1);
  EXPECT_EQ(UpWorkerThreads("decode", 2, 1, 2), 1);
  EXPECT_EQ(UpWorkerThreads("prefill", 16, 1, 2), 12);
  EXPECT_EQ(UpWorkerThreads("decode", 16, 1, 2), 4);
  EXPECT_EQ(UpWorkerThreads("prefill", 16, 2, 4), 6);
  EXPECT_EQ(UpWorkerThreads("decode", 16, 2, 4), 2);
  EXPECT_EQ(UpWorkerThreads("decode", 2, 1, 4), 1);
  EXPECT_EQ(UpWorkerThreads("prefill", 1, 1, 2), 1);
  UpChild prefill{false, "prefill", 0, 2, "/m", 1};
  UpChild decode{false, "decode", 1, 2, "/m", 1};
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  EXPECT_THAT(absl::StrJoin(UpChildArgs(prefill), " ") + " ",
              HasSubstr(absl::StrCat(
                  "--threads=", UpWorkerThreads("prefill", cores, 1, 2), " ")));
  EXPECT_THAT(absl::StrJoin(UpChildArgs(decode), " ") + " ",
              HasSubstr(absl::StrCat(
                  "--threads=", UpWorkerThreads("decode", cores, 1, 2), " ")));
}

// up's CPU workers share the host's cores: unless given, they send the KV
// after the forward pass instead of layer by layer; given, it is kept.
TEST(FlagTableTest, UpTurnsLayerwiseSendingOffOnCpuUnlessGiven) {
  absl::FlagSaver saver;
  UpChild prefill{false, "prefill", 0, 2, "/m", 1};
  EXPECT_THAT(absl::StrJoin(UpChildArgs(prefill), " ") + " ",
              HasSubstr("--kv-layerwise=false "));
  absl::SetFlag(&FLAGS_device, std::string("cuda"));
  EXPECT_THAT(absl::StrJoin(UpChildArgs(prefill), " ") + " ",
              HasSubstr("--kv-layerwise=true "));
  absl::SetFlag(&FLAGS_device, std::string("cpu"));
  ASSERT_TRUE(CheckCommandLineFlags("up", kUp, {"--kv_layerwise=true"}).ok());
  EXPECT_THAT(absl::StrJoin(UpChildArgs(prefill), " ") + " ",
              HasSubstr("--kv-layerwise=true "));
}

TEST(EngineFlagsTest, LongPrefillChunkAutoIsSetOnPrefillWorkersOnly) {
  absl::FlagSaver saver;
  auto worker = EngineConfigFromFlags(/*prefill_worker=*/true);
  ASSERT_TRUE(worker.ok()) << worker.status();
  EXPECT_EQ(worker->long_prefill_chunk, kPrefillWorkerChunk);
  auto other = EngineConfigFromFlags();
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->long_prefill_chunk, 0);
  absl::SetFlag(&FLAGS_long_prefill_chunk, 0);
  EXPECT_EQ(EngineConfigFromFlags(true)->long_prefill_chunk, 0);
  absl::SetFlag(&FLAGS_long_prefill_chunk, 48);
  EXPECT_EQ(EngineConfigFromFlags()->long_prefill_chunk, 48);
  absl::SetFlag(&FLAGS_long_prefill_chunk, -2);
  EXPECT_EQ(EngineConfigFromFlags().status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve::cli
