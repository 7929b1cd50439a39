// Whole-file reads for small configuration files. Stateless; thread-safe.
#pragma once

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace pdserve {

// The file's bytes; an empty string when it does not exist (optional configs
// such as tokenizer_config.json); NOT_FOUND when it exists but cannot be read.
inline absl::StatusOr<std::string> ReadFileIfExists(const std::string& path) {
  if (!std::filesystem::exists(path)) return std::string();
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace pdserve
