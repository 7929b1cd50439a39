// Runs the real `pdserve` binary the way users do and checks what they see.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "tests/matrix/up_cluster.h"

namespace {

using ::testing::HasSubstr;
using ::testing::Not;

struct Result {
  int exit_code = -1;
  std::string out;  // stdout only
};

class CliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(std::filesystem::temp_directory_path() /
                           ("pdserve_cli_" + std::to_string(::getpid())));
    std::filesystem::create_directories(*dir_);
    ASSERT_EQ(Run("model init --preset tiny --out " + Model() + " --seed 5")
                  .exit_code,
              0);
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(*dir_, ec);
    delete dir_;
    dir_ = nullptr;
  }
  static std::string Model() { return *dir_ + "/tiny"; }
  static Result Run(const std::string& args) {
    Result r;
    const std::string cmd =
        std::string(PDSERVE_BIN) + " " + args + " 2>" + *dir_ + "/stderr";
    FILE* p = popen(cmd.c_str(), "r");
    std::array<char, 4096> buf;
    size_t n;
    while ((n = fread(buf.data(), 1, buf.size(), p)) > 0)
      r.out.append(buf.data(), n);
    const int status = pclose(p);
    r.exit_code =
        WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return r;
  }
  static std::string Stderr() {
    std::ifstream in(*dir_ + "/stderr");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  static std::string* dir_;
};
std::string* CliTest::dir_ = nullptr;

TEST_F(CliTest, KvBudgetReproducesTheReferenceFigures) {
  auto r = Run("kv-budget --layers 2 --kv-heads 4 --head-dim 8 --dtype fp16");
  ASSERT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out, HasSubstr("\"bytes_per_token\": 256"));
  r =
      Run("kv-budget --layers 32 --kv-heads 8 --head-dim 128 --dtype fp16 "
          "--tokens 8192 --memory 1GiB");
  ASSERT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out, HasSubstr("\"bytes_per_token\": 131072"));
  EXPECT_THAT(r.out, HasSubstr("\"bytes\": 1073741824"));
  EXPECT_THAT(r.out, HasSubstr("\"tokens_fit\": 8192"));
  r = Run("kv-budget --layers 0 --kv-heads 4 --head-dim 8");
  EXPECT_EQ(r.exit_code, 2);
}

// MLA (DeepSeek-V2's full config: 60 layers, kv_lora_rank 512, rope key 64,
// bf16): (512 + 64) x 60 x 2 = 69,120 B per token, beside the MHA cache of
// its 128 heads of 128 dims: 2 x 60 x 128 x 128 x 2 = 3,932,160 B.
TEST_F(CliTest, KvBudgetReportsMlaLatentBytesBesideMha) {
  auto r =
      Run("kv-budget --layers 60 --kv-lora-rank 512 --qk-rope-head-dim 64 "
          "--dtype bf16 --kv-heads 128 --head-dim 128 --tokens 1000");
  ASSERT_EQ(r.exit_code, 0) << Stderr();
  EXPECT_THAT(r.out, HasSubstr("\"bytes_per_token\": 69120"));
  EXPECT_THAT(r.out, HasSubstr("\"bytes\": 69120000"));
  EXPECT_THAT(r.out, HasSubstr("\"mha_bytes_per_token\": 3932160"));
  // Without heads there is no MHA figure, and the latent needs both flags.
  r =
      Run("kv-budget --layers 60 --kv-lora-rank 512 --qk-rope-head-dim 64 "
          "--dtype bf16");
  ASSERT_EQ(r.exit_code, 0) << Stderr();
  EXPECT_THAT(r.out, HasSubstr("\"bytes_per_token\": 69120"));
  EXPECT_THAT(r.out, Not(HasSubstr("mha_bytes_per_token")));
  r = Run("kv-budget --layers 60 --kv-lora-rank 512 --dtype bf16");
  EXPECT_EQ(r.exit_code, 2);
}

TEST_F(CliTest, GenerateStreamsOnlyTheTextAndIsDeterministic) {
  auto a = Run("generate --model " + Model() +
               " --prompt hello --max-tokens 12 --temperature 0.9 --seed 7");
  auto b = Run("generate --model " + Model() +
               " --prompt hello --max-tokens 12 --temperature 0.9 --seed 7");
  ASSERT_EQ(a.exit_code, 0) << Stderr();
  EXPECT_FALSE(a.out.empty());
  EXPECT_EQ(a.out, b.out);
  auto j =
      Run("generate --model " + Model() +
          " --prompt hello --max-tokens 12 --temperature 0.9 --seed 7 --json");
  ASSERT_EQ(j.exit_code, 0);
  EXPECT_THAT(j.out, HasSubstr("\"finish_reason\": \"length\""));
  EXPECT_THAT(j.out, HasSubstr("\"completion_tokens\": 12"));
  EXPECT_THAT(j.out, HasSubstr("\"prompt_tokens\": 6"));
  // Batch-invariant kernels: a bf16 KV cache or tiny step budget must not
  // matter for the fp32 path, so chunked prefill gives the same text.
  auto c = Run("generate --model " + Model() +
               " --prompt hello --max-tokens 12 --temperature 0.9 --seed 7 "
               "--max-num-batched-tokens 2");
  EXPECT_EQ(c.out, a.out);
}

TEST_F(CliTest, StopStringsEndTheTextBeforeTheMatch) {
  auto full = Run("generate --model " + Model() +
                  " --prompt abc --max-tokens 40 --ignore-eos --json");
  ASSERT_EQ(full.exit_code, 0);
  auto plain = Run("generate --model " + Model() +
                   " --prompt abc --max-tokens 40 --ignore-eos");
  ASSERT_GE(plain.out.size(), 6u);
  // Use a stop string taken from the middle of the real output.
  const std::string stop = plain.out.substr(3, 2);
  if (stop.find('\'') != std::string::npos) GTEST_SKIP() << "quote in sample";
  auto s = Run("generate --model " + Model() +
               " --prompt abc --max-tokens 40 --ignore-eos --stop '" + stop +
               "' --stop 'zzzz' --json");
  ASSERT_EQ(s.exit_code, 0) << Stderr();
  EXPECT_THAT(s.out, HasSubstr("\"finish_reason\": \"stop\""));
  auto t =
      Run("generate --model " + Model() +
          " --prompt abc --max-tokens 40 --ignore-eos --stop '" + stop + "'");
  EXPECT_EQ(t.out, plain.out.substr(0, plain.out.find(stop)));
}

TEST_F(CliTest, BadInputGivesClearErrorsNotCrashes) {
  auto r = Run("generate --model " + Model() + " --prompt x --max-tokens 0");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(Stderr(), HasSubstr("max_tokens"));
  r = Run("generate --model " + Model() + " --prompt x --temperature -1");
  EXPECT_EQ(r.exit_code, 2);
  r = Run("generate --model /nonexistent --prompt x");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(Stderr(), HasSubstr("/nonexistent"));
  r = Run("model logits --model " + Model() + " --tokens 1,x");
  EXPECT_EQ(r.exit_code, 2);
  r = Run("model logits --model " + Model() + " --tokens 1,99999");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(Stderr(), HasSubstr("vocabulary"));
  // A truncated checkpoint.
  const std::string broken = *dir_ + "/broken";
  std::filesystem::create_directories(broken);
  std::filesystem::copy_file(Model() + "/config.json", broken + "/config.json",
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::copy_file(Model() + "/model.safetensors",
                             broken + "/model.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::resize_file(
      broken + "/model.safetensors",
      std::filesystem::file_size(broken + "/model.safetensors") / 2);
  r = Run("model logits --model " + broken + " --tokens 1,2");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(Stderr(), HasSubstr("model.safetensors"));
  EXPECT_THAT(Stderr(), HasSubstr("truncated"));
  r = Run("no-such-command");
  EXPECT_EQ(r.exit_code, 2);
}

TEST_F(CliTest, RouterRegistryFlagsAreValidated) {
  const std::string router = "router --model " + Model() +
                             " --insecure --decode-workers 127.0.0.1:1"
                             " --port 0 --metrics-port 0";
  auto r = Run(router + " --worker-max-missed-polls 0");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(Stderr(), HasSubstr("--worker-max-missed-polls"));
  r = Run(router + " --worker-heartbeat-ms -5");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(Stderr(), HasSubstr("--worker-heartbeat-ms"));
  r = Run("router --help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out + Stderr(), HasSubstr("--worker-status-timeout-ms"));
}

TEST_F(CliTest, EveryCommandHasHelp) {
  for (const char* cmd : {"model init", "model logits", "generate", "kv-budget",
                          "bench engine"}) {
    auto r = Run(std::string(cmd) + " --help");
    EXPECT_EQ(r.exit_code, 0) << cmd;
    EXPECT_THAT(r.out, HasSubstr(std::string("usage: pdserve ") + cmd));
  }
  auto top = Run("--help");
  EXPECT_EQ(top.exit_code, 0);
  EXPECT_THAT(top.out, HasSubstr("kv-budget"));
}

// Which flags each command reads, from the cli/ sources: the FLAGS_ names in
// each top-level function, closed over the calls between cli/ functions,
// from the command's Run function in the AllCommands table. (Flags live only
// in cli/, so these are all the reads.)
std::map<std::string, std::set<std::string>> FlagsReadByCommand() {
  std::map<std::string, std::set<std::string>> reads, calls;
  std::set<std::string> functions;
  std::string commands_cc;
  for (const auto& entry : std::filesystem::directory_iterator(
           std::string(PDSERVE_SOURCE_DIR) + "/cli")) {
    const std::string path = entry.path().string();
    if (path.size() < 3 || path.substr(path.size() - 3) != ".cc" ||
        path.find("_test.cc") != std::string::npos)
      continue;
    std::ifstream in(path);
    const std::string text(std::istreambuf_iterator<char>(in), {});
    if (path.find("/commands.cc") != std::string::npos) commands_cc = text;
    // A top-level function starts at column 0 with a header that has a "("
    // and ends in "{"; its body ends at a "}" in column 0.
    std::istringstream lines(text);
    std::string line, header, name, body;
    bool in_body = false;
    const std::regex name_re(R"((\w+)\s*\()");
    const std::regex flag_re(R"(FLAGS_(\w+))");
    auto finish = [&] {
      std::smatch m;
      for (std::sregex_iterator it(body.begin(), body.end(), flag_re), end;
           it != end; ++it)
        reads[name].insert((*it)[1].str());
      for (std::sregex_iterator it(body.begin(), body.end(), name_re), end;
           it != end; ++it)
        calls[name].insert((*it)[1].str());
    };
    while (std::getline(lines, line)) {
      if (in_body) {
        if (!line.empty() && line[0] == '}') {
          finish();
          in_body = false;
        } else {
          body += line + "\n";
        }
        continue;
      }
      if (header.empty() &&
          (line.empty() || line[0] == ' ' || line[0] == '#' || line[0] == '/' ||
           line[0] == '}' || line.rfind("ABSL_", 0) == 0 ||
           line.rfind("namespace", 0) == 0 || line.rfind("using", 0) == 0))
        continue;
      header += line + " ";
      const std::string trimmed =
          line.substr(0, line.find_last_not_of(' ') + 1);
      if (trimmed.empty()) continue;
      if (trimmed.back() == ';') {
        header.clear();
        continue;
      }
      if (trimmed.back() != '{') continue;
      std::smatch m;
      if (header.find('(') != std::string::npos &&
          std::regex_search(header, m, name_re)) {
        name = m[1].str();
        functions.insert(name);
        body.clear();
        in_body = true;
      }
      header.clear();
    }
  }
  // Table entries: {"name", "summary", kBit, "description"..., RunFn},
  std::map<std::string, std::set<std::string>> out;
  const std::regex entry(R"re(\n      \{"([a-z -]+)",[\s\S]*?(Run\w+)\})re");
  for (std::sregex_iterator it(commands_cc.begin(), commands_cc.end(), entry),
       end;
       it != end; ++it) {
    const std::string command = (*it)[1].str();
    std::set<std::string> seen;
    std::vector<std::string> todo = {(*it)[2].str()};
    while (!todo.empty()) {
      const std::string f = todo.back();
      todo.pop_back();
      if (!functions.count(f) || !seen.insert(f).second) continue;
      out[command].insert(reads[f].begin(), reads[f].end());
      for (const std::string& c : calls[f]) todo.push_back(c);
    }
  }
  return out;
}

// A flag a command reads but does not list in --help would be undocumented
// (and refused by the command-line check): every read flag is listed.
TEST_F(CliTest, HelpListsEveryFlagTheCommandReads) {
  const auto reads = FlagsReadByCommand();
  ASSERT_GE(reads.size(), 15u) << "commands not found in cli/commands.cc";
  EXPECT_TRUE(reads.at("worker").count("kv_transport"));
  EXPECT_TRUE(reads.at("generate").count("kv_dtype"));
  for (const auto& [command, flags] : reads) {
    auto r = Run(command + " --help");
    ASSERT_EQ(r.exit_code, 0) << command;
    for (std::string f : flags) {
      std::replace(f.begin(), f.end(), '_', '-');
      EXPECT_THAT(r.out, HasSubstr("\n  --" + f)) << command << " --help";
    }
  }
}

TEST_F(CliTest, HelpListsChoicesAndEveryPreset) {
  for (const char* cmd : {"worker", "prefill", "decode", "up"}) {
    EXPECT_THAT(Run(std::string(cmd) + " --help").out,
                HasSubstr("--kv-transport grpc|shm|cuda_ipc|nccl|auto"))
        << cmd;
  }
  const std::string init = Run("model init --help").out;
  std::smatch presets;
  ASSERT_TRUE(
      std::regex_search(init, presets, std::regex(R"(--preset (\S+))")));
  std::set<std::string> listed;
  std::stringstream names(presets[1].str());
  for (std::string n; std::getline(names, n, '|');) listed.insert(n);
  EXPECT_EQ(listed, (std::set<std::string>{
                        "tiny", "small", "llama2", "llama3", "llama3.1",
                        "mistral", "qwen2", "qwen3", "llama3.2-1b", "mixtral",
                        "qwen3-moe", "deepseek-v2", "deepseek-v3"}));
  // Every listed choice of --matmul passes the parser of `generate`.
  const std::string help = Run("generate --help").out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(help, m, std::regex(R"(--matmul (\S+))")));
  std::stringstream choices(m[1].str());
  for (std::string c; std::getline(choices, c, '|');) {
    Run("generate --model " + Model() + " --prompt x --max-tokens 1 --matmul " +
        c);
    EXPECT_THAT(Stderr(), Not(HasSubstr("must be"))) << c;
  }
  // A value no parser takes is refused, naming the choices.
  auto r = Run("worker --kv-transport carrier-pigeon --insecure");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(Stderr(), HasSubstr("grpc"));
}

TEST_F(CliTest, FlagsACommandDoesNotReadAreRefused) {
  auto r = Run("up --host 0.0.0.0");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(Stderr(), HasSubstr("pdserve up does not take --host"));
  r = Run("kv-budget --layers 2 --kv-heads 2 --head-dim 8 --kv-dtype int8");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(Stderr(), HasSubstr("--kv-dtype"));
}

TEST_F(CliTest, ModelInitWritesTheWeightsDtypeInConfig) {
  for (const char* dtype : {"bf16", "fp16", "fp32"}) {
    const std::string out = *dir_ + "/dtype-" + dtype;
    ASSERT_EQ(
        Run("model init --preset llama3 --out " + out + " --dtype " + dtype)
            .exit_code,
        0);
    std::ifstream in(out + "/config.json");
    const std::string config(std::istreambuf_iterator<char>(in), {});
    const std::string want = std::string(dtype) == "bf16"   ? "bfloat16"
                             : std::string(dtype) == "fp16" ? "float16"
                                                            : "float32";
    EXPECT_THAT(config, HasSubstr("\"torch_dtype\": \"" + want + "\""));
  }
}

// On CPU, `up` gives its workers one core share (a memfd they inherit), so
// an idle worker's cores go to a busy one; --core-share off gives none.
TEST_F(CliTest, UpGivesItsCpuWorkersOneCoreShareUnlessTurnedOff) {
  for (const bool off : {false, true}) {
    std::vector<std::string> args = {"--model=" + Model(), "--prefill=1",
                                     "--decode=1",         "--port=0",
                                     "--metrics-port=0",   "--http-port=0"};
    if (off) args.push_back("--core-share=off");
    pdserve::testing::UpCluster up = pdserve::testing::UpCluster::Start(args);
    ASSERT_TRUE(up.ok()) << up.output();
    const std::regex joined(R"(core share (/proc/self/fd/\d+): slot (\d))");
    std::set<std::string> paths, slots;
    const std::string out = up.output();
    for (std::sregex_iterator it(out.begin(), out.end(), joined), end;
         it != end; ++it) {
      paths.insert((*it)[1].str());
      slots.insert((*it)[2].str());
    }
    if (off) {
      EXPECT_TRUE(paths.empty()) << out;
    } else {
      EXPECT_EQ(paths.size(), 1u) << out;
      EXPECT_EQ(slots, (std::set<std::string>{"0", "1"})) << out;
    }
    int decode_port = 0;
    for (const auto& w : up.workers()) {
      EXPECT_EQ(
          pdserve::testing::ConfigInfo(pdserve::testing::Scrape(w.metrics_port),
                                       "pdserve_worker")["core_share"],
          off || paths.empty() ? "off" : *paths.begin())
          << w.name;
      if (w.name.rfind("decode", 0) == 0) decode_port = w.metrics_port;
    }
    ASSERT_NE(decode_port, 0) << out;
    // While the decode worker generates and the prefill worker idles, the
    // decode worker's kernels may use every core (up splits them between
    // the two).
    const int cores =
        std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    const int own = std::max(1, cores / 4);
    auto kernel_threads = [&] {
      return static_cast<int>(pdserve::testing::MetricValue(
          pdserve::testing::Scrape(decode_port), "pdserve_kernel_threads"));
    };
    EXPECT_EQ(kernel_threads(), own);
    std::atomic<bool> stop{false};
    std::thread load([&] {
      while (!stop) {
        Run("generate --router " + up.router().address +
            " --prompt x --max-tokens 2000 --ignore-eos");
      }
    });
    int most = 0;
    pdserve::testing::WaitUntil(
        [&] {
          most = std::max(most, kernel_threads());
          return most == cores;
        },
        std::chrono::milliseconds(off ? 2000 : 20000));
    stop = true;
    load.join();
    EXPECT_EQ(most, off ? own : cores);
    up.Stop();
  }
}

// `pdserve up` passes every worker and router flag it takes on: each one set
// to a value other than its default, each worker and the router report what
// they got (pdserve_{worker,router}_config_info).
TEST_F(CliTest, UpForwardsEveryFlagToEveryWorkerAndTheRouter) {
  // The forwarded flags and their defaults, from up's own --help.
  const std::string help = Run("up --help").out;
  struct Forwarded {
    std::string value_kind, def;
    bool to_workers = false, to_router = false;
  };
  std::map<std::string, Forwarded> flags;
  bool workers = false, router = false;
  std::istringstream lines(help);
  const std::regex flag_line(R"(^  --([a-z0-9-]+) ?(\S*)$)");
  std::string line, current;
  while (std::getline(lines, line)) {
    if (line.rfind("flags", 0) == 0) {
      workers = line.find("every worker") != std::string::npos;
      router = line.find("router") != std::string::npos;
      continue;
    }
    std::smatch m;
    if (std::regex_match(line, m, flag_line)) {
      current = m[1].str();
      if (workers || router) flags[current] = {m[2].str(), "", workers, router};
      continue;
    }
    const size_t at = line.rfind("(default: ");
    if (!current.empty() && flags.count(current) && at != std::string::npos) {
      std::string def = line.substr(at + 10);
      def.pop_back();
      flags[current].def = def == "\"\"" ? "" : def;
    }
  }
  ASSERT_GT(flags.size(), 40u) << help;
  const std::string tokens = *dir_ + "/tokens";
  std::ofstream(tokens) << "secret-token tenant-a\n";
  // Values other than the default that a CPU cluster starts with.
  const std::map<std::string, std::string> chosen = {
      {"model", Model()},
      {"kv-dtype", "int8"},
      {"block-size", "32"},
      {"kv-cache-memory", "96MiB"},
      {"max-model-len", "1024"},
      {"kv-offload-dir", *dir_ + "/tier"},
      {"kv-offload-bytes", "64MiB"},
      {"matmul", "int8dot"},
      {"weight-dtype", "int8"},
      {"threads", "1"},
      {"gpu-memory-utilization", "0.5"},
      {"kv-transport", "grpc"},
      {"core-share", *dir_ + "/cores"},
      {"insecure", "true"},
      {"port", "0"},
      {"metrics-port", "0"},
      {"http-port", std::to_string(pdserve::testing::FreePort())},
      {"served-model-name", "forwarded"},
      {"policy", "round_robin"},
      {"auth-tokens", tokens},
  };
  // Not set here, and why: --device cuda needs a GPU; --kv-offload-memory
  // excludes --kv-offload-dir and the certificate files exclude --insecure
  // (both are checked in clusters of their own below).
  const std::set<std::string> unset = {"device", "kv-offload-memory",
                                       "tls-cert", "tls-key", "tls-ca"};
  std::vector<std::string> args = {"--prefill=1", "--decode=1"};
  std::map<std::string, std::string> want;
  for (const auto& [name, f] : flags) {
    if (unset.count(name)) continue;
    std::string v;
    if (auto it = chosen.find(name); it != chosen.end()) {
      v = it->second;
    } else if (f.value_kind.empty()) {  // a boolean: the other one
      v = f.def == "true" ? "false" : "true";
    } else if (f.value_kind == "N") {
      v = std::to_string(std::stoll(f.def) + 1);
    } else if (f.value_kind == "X") {
      std::ostringstream o;
      o << std::stod(f.def) + 0.5;
      v = o.str();
    } else {
      ADD_FAILURE() << "--" << name << " (" << f.value_kind
                    << "): choose a non-default value for it here";
      continue;
    }
    EXPECT_NE(v, f.def) << name;
    args.push_back("--" + name + "=" + v);
    want[name] = v;
  }
  pdserve::testing::UpCluster up = pdserve::testing::UpCluster::Start(args);
  ASSERT_TRUE(up.ok()) << up.output();
  ASSERT_EQ(up.workers().size(), 2u);
  auto underscored = [](std::string n) {
    std::replace(n.begin(), n.end(), '-', '_');
    return n;
  };
  for (const auto& w : up.workers()) {
    const std::string role = w.name.substr(0, w.name.find('-'));
    auto info = pdserve::testing::ConfigInfo(
        pdserve::testing::Scrape(w.metrics_port), "pdserve_worker");
    ASSERT_FALSE(info.empty()) << w.name;
    for (const auto& [name, f] : flags) {
      if (!f.to_workers || !want.count(name)) continue;
      std::string expect = want[name];
      // up's per-worker rewrites: a directory per worker, an equal share of
      // the GPU memory fraction.
      if (name == "kv-offload-dir")
        expect += "/" + role + "-" + w.name.substr(w.name.find('-') + 1);
      if (name == "gpu-memory-utilization") expect = "0.25";
      EXPECT_EQ(info[underscored(name)], expect) << w.name << " --" << name;
    }
  }
  // Both workers joined the one core share, each in a slot of its own.
  for (const char* slot : {": slot 0,", ": slot 1,"}) {
    EXPECT_THAT(up.output(),
                HasSubstr("core share " + *dir_ + "/cores" + slot));
  }
  auto rinfo = pdserve::testing::ConfigInfo(
      pdserve::testing::Scrape(up.router().metrics_port), "pdserve_router");
  for (const auto& [name, f] : flags) {
    if (!f.to_router || !want.count(name)) continue;
    EXPECT_EQ(rinfo[underscored(name)], want[name]) << "router --" << name;
  }
  up.Stop();
  // --kv-offload-memory, which the first cluster could not take.
  pdserve::testing::UpCluster mem = pdserve::testing::UpCluster::Start(
      {"--model=" + Model(), "--prefill=0", "--decode=1", "--port=0",
       "--metrics-port=0", "--http-port=0", "--threads=1",
       "--kv-offload-memory=16MiB"});
  ASSERT_TRUE(mem.ok()) << mem.output();
  // One worker has nobody to lend cores to.
  EXPECT_THAT(mem.output(), Not(HasSubstr("core share")));
  // Not given, --local-prefill-threshold is up's own: one prefill chunk.
  EXPECT_EQ(pdserve::testing::ConfigInfo(
                pdserve::testing::Scrape(mem.router().metrics_port),
                "pdserve_router")["local_prefill_threshold"],
            "128");
  EXPECT_EQ(pdserve::testing::ConfigInfo(
                pdserve::testing::Scrape(mem.workers().at(0).metrics_port),
                "pdserve_worker")["kv_offload_memory"],
            "16MiB");
  // Not given, --kv-layerwise is off on up's CPU workers.
  EXPECT_EQ(pdserve::testing::ConfigInfo(
                pdserve::testing::Scrape(mem.workers().at(0).metrics_port),
                "pdserve_worker")["kv_layerwise"],
            "false");
  mem.Stop();
  // The certificate files: mTLS between up's children, with a throwaway CA
  // and one certificate for 127.0.0.1 (the identity of every process).
  const std::string
      ca = *dir_ + "/ca",
      ec = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 ";
  ASSERT_EQ(
      std::system(("openssl req -x509" + ec + "-subj /CN=test-ca -keyout " +
                   ca + ".key -out " + ca + ".crt >/dev/null 2>&1")
                      .c_str()),
      0);
  ASSERT_EQ(
      std::system(("openssl req -new" + ec +
                   "-subj /CN=pdserve -addext "
                   "subjectAltName=IP:127.0.0.1,DNS:localhost -keyout " +
                   *dir_ + "/id.key -out " + *dir_ + "/id.csr >/dev/null 2>&1")
                      .c_str()),
      0);
  ASSERT_EQ(std::system(("openssl x509 -req -days 2 -in " + *dir_ +
                         "/id.csr -CA " + ca + ".crt -CAkey " + ca +
                         ".key -CAcreateserial -copy_extensions copy -out " +
                         *dir_ + "/id.crt >/dev/null 2>&1")
                            .c_str()),
            0);
  const std::map<std::string, std::string> files = {
      {"tls_cert", *dir_ + "/id.crt"},
      {"tls_key", *dir_ + "/id.key"},
      {"tls_ca", ca + ".crt"}};
  pdserve::testing::UpCluster tls = pdserve::testing::UpCluster::Start(
      {"--model=" + Model(), "--prefill=1", "--decode=1", "--port=0",
       "--metrics-port=0", "--http-port=0", "--threads=1",
       "--tls-cert=" + files.at("tls_cert"), "--tls-key=" + files.at("tls_key"),
       "--tls-ca=" + files.at("tls_ca")});
  ASSERT_TRUE(tls.ok()) << tls.output();
  EXPECT_THAT(tls.output(), HasSubstr("mutual TLS"));
  for (const auto& c : tls.children()) {
    auto info = pdserve::testing::ConfigInfo(
        pdserve::testing::Scrape(c.metrics_port),
        c.name == "router" ? "pdserve_router" : "pdserve_worker");
    EXPECT_EQ(info["insecure"], "false") << c.name;
    for (const auto& [flag, file] : files)
      EXPECT_EQ(info[flag], file) << c.name << " --" << flag;
  }
}

// A standalone worker reports the flags of the command it was started as:
// `pdserve prefill` takes no --role, so it reports none.
TEST_F(CliTest, WorkersReportTheFlagsTheirCommandReads) {
  pdserve::testing::Proc p = pdserve::testing::StartProcess(
      "prefill", {"prefill", "--model=" + Model(), "--insecure", "--port=0",
                  "--metrics-port=0", "--threads=1", "--kv-dtype=bf16"});
  ASSERT_TRUE(p.alive());
  auto info = pdserve::testing::ConfigInfo(
      pdserve::testing::Scrape(p.metrics_port), "pdserve_worker");
  pdserve::testing::Kill(&p, SIGTERM);
  EXPECT_EQ(info["kv_dtype"], "bf16");
  EXPECT_EQ(info["threads"], "1");
  EXPECT_EQ(info.count("role"), 0u);
  EXPECT_EQ(info.count("prompt"), 0u);  // generate's, not a worker's
}

}  // namespace
