// Helpers for engine tests: a tiny random model written to a temporary
// directory and loaded once per test binary.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>

#include "engine/model_init.h"
#include "engine/weights.h"

namespace pdserve::engine::testing {

inline std::string TempDir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("pdserve_test_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
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

}  // namespace pdserve::engine::testing
