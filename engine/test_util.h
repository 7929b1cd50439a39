// Helpers for engine tests: a tiny random model written to a temporary
// directory and loaded once per test binary.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "model/model_init.h"
#include "model/weights.h"

namespace pdserve::engine::testing {

// Removes, when the test binary exits, the directories TempDir made. Only in
// the process that made them: a forked child (death tests, a worker started
// by fork) that runs exit handlers must not delete its parent's files.
class TempDirCleaner {
 public:
  static TempDirCleaner& Get() {
    static TempDirCleaner cleaner;
    return cleaner;
  }
  void Add(const std::filesystem::path& dir) { dirs_.push_back(dir); }
  ~TempDirCleaner() {
    if (::getpid() != owner_) return;
    for (const auto& d : dirs_) {
      std::error_code ec;
      std::filesystem::remove_all(d, ec);
    }
  }

 private:
  TempDirCleaner() : owner_(::getpid()) {}
  const pid_t owner_;
  std::vector<std::filesystem::path> dirs_;
};

// A directory under the system's temp dir, named for the test and the
// process; removed when the test binary exits.
inline std::string TempDir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("pdserve_test_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  TempDirCleaner::Get().Add(dir);
  return dir.string();
}

inline std::shared_ptr<const ModelWeights> TinyWeights(
    const std::string& preset = "tiny") {
  static std::shared_ptr<const ModelWeights> tiny, small;
  auto& slot = preset == "tiny" ? tiny : small;
  if (!slot) {
    const std::string dir = TempDir("model_" + preset);
    ModelInitOptions opts;
    opts.preset = preset;
    opts.out_dir = dir;
    opts.seed = 1;
    auto s = WriteRandomModel(opts);
    EXPECT_TRUE(s.ok()) << s;
    auto w = ModelWeights::Load(dir);
    EXPECT_TRUE(w.ok()) << w.status();
    slot = std::make_shared<const ModelWeights>(std::move(*w));
  }
  return slot;
}

// A request of `len` synthetic prompt tokens that differ by `salt` (and by
// `offset`, which tells one test's prompts from another's), seeded by salt,
// ignoring EOS so it runs its full `max_tokens`.
inline EngineRequest SyntheticRequest(const std::string& id, int len, int salt,
                                      uint32_t max_tokens, float temperature,
                                      int offset) {
  EngineRequest r;
  r.id = id;
  for (int i = 0; i < len; ++i)
    r.prompt.push_back((i * 29 + salt * 13 + offset) % 256);
  r.sampling.max_tokens = max_tokens;
  r.sampling.temperature = temperature;
  r.sampling.seed = 99 + salt;
  r.sampling.ignore_eos = true;
  return r;
}

// Steps `e` until it has no work (at most 10,000 steps); returns the tokens
// generated per request id, and each request's final StepOutput in `last`.
inline std::map<std::string, std::vector<int32_t>> DrainEngine(
    Engine* e, std::map<std::string, StepOutput>* last = nullptr) {
  std::map<std::string, std::vector<int32_t>> out;
  for (int steps = 0; e->HasWork() && steps < 10000; ++steps) {
    auto step = e->Step();
    EXPECT_TRUE(step.ok()) << step.status();
    if (!step.ok()) break;
    for (auto& o : *step) {
      auto& v = out[o.id];
      v.insert(v.end(), o.new_tokens.begin(), o.new_tokens.end());
      if (last && o.finish != FinishReason::kNone) (*last)[o.id] = o;
    }
  }
  EXPECT_FALSE(e->HasWork());
  return out;
}

}  // namespace pdserve::engine::testing
