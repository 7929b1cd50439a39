// Every preset's config.json names the dtype its weights are written in.
#include "model/model_init.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "common/json.h"
#include "model/safetensors.h"

namespace pdserve::engine {
namespace {

std::string TorchDtype(const std::string& config_json) {
  auto j = json::Parse(config_json, "config.json");
  EXPECT_TRUE(j.ok()) << j.status();
  if (!j.ok()) return "";
  const std::string* s = json::StringOrNull(json::Find(*j, "torch_dtype"));
  return s == nullptr ? "" : *s;
}

TEST(ModelInitTest, EveryPresetsConfigNamesItsDefaultDtype) {
  ASSERT_EQ(PresetNames().size(), 13u);
  for (const std::string& preset : PresetNames()) {
    const DType dtype = PresetDefaultDtype(preset);
    auto config = PresetConfigJson(preset, dtype);
    ASSERT_TRUE(config.ok()) << preset << ": " << config.status();
    EXPECT_EQ(TorchDtype(*config), TorchDtypeName(dtype)) << preset;
  }
  // The full-size preset is bf16, as the real checkpoint.
  EXPECT_EQ(PresetDefaultDtype("llama3.2-1b"), DType::kBF16);
  EXPECT_EQ(TorchDtype(*PresetConfigJson("llama3.2-1b", DType::kBF16)),
            "bfloat16");
}

// Written models: the safetensors file's tensors carry the dtype config.json
// names, for every preset at test size and every dtype --dtype takes. (The
// full-size llama3.2-1b is 2.5 GB: its config comes from the same
// PresetConfigJson, checked above.)
TEST(ModelInitTest, WrittenConfigMatchesTheWeightsForEveryPreset) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      ("pdserve_model_init_" + std::to_string(getpid()));
  for (const std::string& preset : PresetNames()) {
    if (preset == "llama3.2-1b") continue;
    for (const char* name : {"fp32", "fp16", "bf16"}) {
      auto dtype = ParseModelFileDtype(name);
      ASSERT_TRUE(dtype.ok());
      ModelInitOptions o;
      o.preset = preset;
      o.out_dir = (dir / (preset + "-" + name)).string();
      o.weight_dtype = *dtype;
      ASSERT_TRUE(WriteRandomModel(o).ok()) << preset;
      std::ifstream in(o.out_dir + "/config.json");
      const std::string config(std::istreambuf_iterator<char>(in), {});
      EXPECT_EQ(TorchDtype(config), TorchDtypeName(*dtype))
          << preset << " " << name;
      auto file = SafetensorsFile::Open(o.out_dir + "/model.safetensors");
      ASSERT_TRUE(file.ok()) << file.status();
      ASSERT_FALSE((*file)->tensors().empty());
      for (const auto& [tensor, view] : (*file)->tensors())
        EXPECT_EQ(view.dtype, *dtype) << preset << " " << tensor;
      std::filesystem::remove_all(o.out_dir);
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(ModelInitTest, FileDtypesAreFp32Fp16AndBf16Only) {
  EXPECT_TRUE(ParseModelFileDtype("bf16").ok());
  EXPECT_EQ(ParseModelFileDtype("int8").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(ParseModelFileDtype("fp8").ok());
}

}  // namespace
}  // namespace pdserve::engine
