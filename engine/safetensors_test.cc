#include "model/safetensors.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "engine/test_util.h"
#include "model/weights.h"

namespace pdserve::engine {
namespace {

class SafetensorsTest : public ::testing::Test {
 protected:
  std::string Path(const std::string& name) { return dir_ + "/" + name; }
  std::string ReadAll(const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  void WriteAll(const std::string& p, const std::string& s) {
    std::ofstream(p, std::ios::binary | std::ios::trunc) << s;
  }
  std::string dir_ = testing::TempDir("safetensors");
};

TEST_F(SafetensorsTest, RoundTripsEveryStorageDtype) {
  const std::vector<float> v = {1.0f, -2.5f, 0.333333f, 65504.0f, 1e-3f, 0.0f};
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    ASSERT_TRUE(
        WriteSafetensors(Path("a.safetensors"), {{"w", t, {2, 3}, v.data()}})
            .ok());
    auto f = SafetensorsFile::Open(Path("a.safetensors"));
    ASSERT_TRUE(f.ok()) << f.status();
    auto tv = (*f)->Find("w");
    ASSERT_TRUE(tv.ok());
    EXPECT_EQ((*tv)->shape, (std::vector<int64_t>{2, 3}));
    std::vector<float> back;
    TensorToFloat(**tv, &back);
    const float tol = t == DType::kF32 ? 0 : t == DType::kF16 ? 1e-3f : 1e-2f;
    for (size_t i = 0; i < v.size(); ++i)
      EXPECT_NEAR(back[i], v[i], tol * std::fabs(v[i]) + 1e-6);
  }
}

// Found by tests/fuzz/safetensors_fuzz (UBSan): converting an empty tensor
// passed a null pointer to memcpy.
TEST_F(SafetensorsTest, EmptyTensorConvertsToNoValues) {
  const std::string header =
      R"({"e": {"dtype": "F32", "shape": [0, 4], "data_offsets": [0, 0]}})";
  std::string image(8, '\0');
  image[0] = static_cast<char>(header.size());
  image += header;
  auto f = SafetensorsFile::FromBuffer(
      reinterpret_cast<const uint8_t*>(image.data()), image.size(), "e");
  ASSERT_TRUE(f.ok()) << f.status();
  auto tv = (*f)->Find("e");
  ASSERT_TRUE(tv.ok());
  std::vector<float> back = {1.0f};
  TensorToFloat(**tv, &back);
  EXPECT_TRUE(back.empty());
}

TEST_F(SafetensorsTest, TruncatedAndCorruptFilesAreErrorsNamingTheFile) {
  const std::vector<float> v(64, 1.0f);
  ASSERT_TRUE(WriteSafetensors(Path("good.safetensors"),
                               {{"w", DType::kF32, {64}, v.data()}})
                  .ok());
  const std::string good = ReadAll(Path("good.safetensors"));
  struct Case {
    std::string name, bytes, expect;
  };
  std::string huge_len = good;
  huge_len[7] = 0x7f;
  std::string bad_json = good;
  bad_json[8] = '[';
  std::string wrong_size = good;
  wrong_size.replace(wrong_size.find("[64]"), 4, "[65]");
  std::string bad_dtype = good;
  bad_dtype.replace(bad_dtype.find("F32"), 3, "I64");
  const Case cases[] = {
      {"empty", "", "shorter than"},
      {"truncated_data", good.substr(0, good.size() - 10), "outside"},
      {"truncated_header", good.substr(0, 20), "exceeds the file"},
      {"huge_header_len", huge_len, "exceeds the file"},
      {"bad_json", bad_json, "invalid JSON"},
      {"wrong_size", wrong_size, "bytes but shape needs"},
      {"bad_dtype", bad_dtype, "not supported"},
  };
  for (const Case& c : cases) {
    WriteAll(Path(c.name), c.bytes);
    auto f = SafetensorsFile::Open(Path(c.name));
    ASSERT_FALSE(f.ok()) << c.name;
    EXPECT_NE(f.status().message().find(Path(c.name)), std::string::npos)
        << f.status();
    EXPECT_NE(f.status().message().find(c.expect), std::string::npos)
        << f.status();
  }
  EXPECT_EQ(SafetensorsFile::Open(Path("nope")).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(SafetensorsTest, ModelLoadNamesMissingTensorsAndWrongShapes) {
  const std::string dir = testing::TempDir("badmodel");
  ModelInitOptions opts;
  opts.preset = "tiny";
  opts.out_dir = dir;
  ASSERT_TRUE(WriteRandomModel(opts).ok());
  // Drop lm_head: rewrite the file with one tensor fewer.
  auto f = SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_TRUE(f.ok());
  std::vector<std::vector<float>> keep;
  std::vector<TensorToWrite> tensors;
  for (const auto& [name, t] : (*f)->tensors()) {
    if (name == "lm_head.weight") continue;
    keep.emplace_back();
    TensorToFloat(t, &keep.back());
  }
  size_t i = 0;
  for (const auto& [name, t] : (*f)->tensors()) {
    if (name == "lm_head.weight") continue;
    std::vector<int64_t> shape = t.shape;
    if (name == "model.norm.weight") shape = {shape[0] / 2, 2};
    tensors.push_back({name, DType::kF32, shape, keep[i++].data()});
  }
  f->reset();
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", tensors).ok());
  auto w = ModelWeights::Load(dir);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("model.norm.weight"), std::string::npos)
      << w.status();
  EXPECT_NE(w.status().message().find("expected [64]"), std::string::npos)
      << w.status();
  EXPECT_EQ(ModelWeights::Load(dir + "/missing").status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(SafetensorsTest, ShardedCheckpointsLoadThroughTheIndex) {
  const std::string dir = testing::TempDir("sharded");
  ModelInitOptions opts;
  opts.preset = "tiny";
  opts.out_dir = dir;
  opts.weight_dtype = DType::kBF16;
  ASSERT_TRUE(WriteRandomModel(opts).ok());
  auto whole = ModelWeights::Load(dir);
  ASSERT_TRUE(whole.ok());
  // Split into two shards with an index.
  auto f = SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_TRUE(f.ok());
  std::vector<std::vector<float>> vals;
  std::vector<TensorToWrite> shard[2];
  std::string index = "{\"metadata\": {}, \"weight_map\": {";
  int n = 0;
  for (const auto& [name, t] : (*f)->tensors()) {
    vals.emplace_back();
    TensorToFloat(t, &vals.back());
  }
  for (const auto& [name, t] : (*f)->tensors()) {
    const int s = n % 2;
    shard[s].push_back({name, DType::kBF16, t.shape, vals[n].data()});
    index += (n ? ", \"" : "\"") + name + "\": \"model-0000" +
             std::to_string(s + 1) + "-of-00002.safetensors\"";
    ++n;
  }
  index += "}}";
  ASSERT_TRUE(
      WriteSafetensors(dir + "/model-00001-of-00002.safetensors", shard[0])
          .ok());
  ASSERT_TRUE(
      WriteSafetensors(dir + "/model-00002-of-00002.safetensors", shard[1])
          .ok());
  f->reset();
  std::filesystem::remove(dir + "/model.safetensors");
  std::ofstream(dir + "/model.safetensors.index.json") << index;
  auto sharded = ModelWeights::Load(dir);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  EXPECT_EQ(sharded->layers[1].gate_up, whole->layers[1].gate_up);
  EXPECT_EQ(sharded->lm_head, whole->lm_head);
}

}  // namespace
}  // namespace pdserve::engine
