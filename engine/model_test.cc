#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "engine/test_util.h"
#include "model/llama_model.h"

namespace pdserve::engine {
namespace {

using Logits = LlamaModel::Logits;

// The tiny preset (fp32 checkpoint, seed 1, as testing::TinyWeights) written
// once, so that tests can load it with other weight dtypes and modes.
const std::string& TinyDir(DType checkpoint = DType::kF32) {
  static std::map<DType, std::string> dirs;
  auto it = dirs.find(checkpoint);
  if (it != dirs.end()) return it->second;
  const std::string dir =
      testing::TempDir(absl::StrCat("model_dtype_", DTypeName(checkpoint)));
  ModelInitOptions opts;
  opts.preset = "tiny";
  opts.out_dir = dir;
  opts.seed = 1;
  opts.weight_dtype = checkpoint;
  EXPECT_TRUE(WriteRandomModel(opts).ok());
  return dirs[checkpoint] = dir;
}

std::shared_ptr<const ModelWeights> LoadTiny(
    WeightDtype dtype, DType checkpoint = DType::kF32,
    kernels::MatMulMode mode = kernels::MatMulMode::kDeterministic) {
  auto w = ModelWeights::Load(TinyDir(checkpoint), dtype, mode);
  EXPECT_TRUE(w.ok()) << w.status();
  return std::make_shared<const ModelWeights>(std::move(*w));
}

// Runs `a` in chunks of 13 and `b` one token at a time (the decode shape),
// batched together, with all-position logits; appends each one's logits to
// got_a / got_b.
void ForwardChunkedBesideDecode(LlamaModel& model, KvPool* pool,
                                const std::vector<int32_t>& a,
                                const std::vector<int32_t>& b,
                                const std::vector<int32_t>& ta,
                                const std::vector<int32_t>& tb, int64_t vocab,
                                std::vector<float>* got_a,
                                std::vector<float>* got_b) {
  const int len_a = static_cast<int>(a.size());
  const int len_b = static_cast<int>(b.size());
  int pa = 0, pb = 0;
  while (pa < len_a || pb < len_b) {
    std::vector<LlamaModel::SeqInput> batch;
    const int na = std::min(13, len_a - pa);
    if (na > 0)
      batch.push_back(
          {std::span<const int32_t>(a).subspan(pa, na), pa, ta, Logits::kAll});
    if (pb < len_b)
      batch.push_back(
          {std::span<const int32_t>(b).subspan(pb, 1), pb, tb, Logits::kAll});
    std::vector<float> out;
    ASSERT_TRUE(model.Forward(batch, pool, &out).ok());
    got_a->insert(got_a->end(), out.begin(), out.begin() + na * vocab);
    if (pb < len_b)
      got_b->insert(got_b->end(), out.begin() + na * vocab, out.end());
    pa += na;
    pb += pb < len_b;
  }
}

class ModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    weights_ = testing::TinyWeights();
    const auto& c = weights_->config;
    spec_ = {static_cast<int32_t>(c.num_layers),
             static_cast<int32_t>(c.num_kv_heads),
             static_cast<int32_t>(c.head_dim), 16, DType::kF32};
    pool_ = std::move(*KvPool::Create(spec_, 64));
  }
  std::vector<int32_t> Prompt(int n, int salt = 0) {
    std::vector<int32_t> t(n);
    for (int i = 0; i < n; ++i) t[i] = (i * 37 + salt * 11 + 5) % 256;
    return t;
  }
  std::vector<int32_t> Table(int first, int n) {
    std::vector<int32_t> t(n);
    std::iota(t.begin(), t.end(), first);
    return t;
  }
  std::shared_ptr<const ModelWeights> weights_;
  KvCacheSpec spec_;
  std::unique_ptr<KvPool> pool_;
};

// The invariance tests run once per weight dtype (the fixture's weights_),
// and for bf16 also with --matmul bf16dot (bf16 activations).
using DtypeAndMode = std::tuple<WeightDtype, kernels::MatMulMode>;
class ModelDtypeTest : public ModelTest,
                       public ::testing::WithParamInterface<DtypeAndMode> {
 protected:
  void SetUp() override {
    ModelTest::SetUp();
    weights_ = LoadTiny(Dtype(), DType::kF32, Mode());
  }
  static WeightDtype Dtype() { return std::get<0>(GetParam()); }
  static kernels::MatMulMode Mode() { return std::get<1>(GetParam()); }
};

TEST_P(ModelDtypeTest, PrefixCacheHitGivesTheSameLogitsAsAColdPrefill) {
  LlamaModel model(weights_, Mode());
  const auto prompt = Prompt(45);
  auto table = Table(0, 3);
  std::vector<float> cold, warm;
  LlamaModel::SeqInput all{prompt, 0, table, Logits::kLast};
  ASSERT_TRUE(model.Forward({&all, 1}, pool_.get(), &cold).ok());
  // A second sequence shares the first two blocks (32 tokens) and computes
  // only the suffix into its own third block.
  std::vector<int32_t> table2 = {0, 1, 10};
  LlamaModel::SeqInput suffix{std::span<const int32_t>(prompt).subspan(32), 32,
                              table2, Logits::kLast};
  ASSERT_TRUE(model.Forward({&suffix, 1}, pool_.get(), &warm).ok());
  EXPECT_EQ(cold, warm);  // bit-identical, not just close
}

TEST_P(ModelDtypeTest, ChunkedPrefillAndBatchedDecodeEqualOneAtATime) {
  LlamaModel model(weights_, Mode());
  const auto a = Prompt(40, 1), b = Prompt(7, 2);
  auto ta = Table(0, 4), tb = Table(20, 4);
  // Reference: each prompt alone with all-position logits.
  std::vector<float> ref_a, ref_b;
  LlamaModel::SeqInput ia{a, 0, ta, Logits::kAll}, ib{b, 0, tb, Logits::kAll};
  ASSERT_TRUE(model.Forward({&ia, 1}, pool_.get(), &ref_a).ok());
  ASSERT_TRUE(model.Forward({&ib, 1}, pool_.get(), &ref_b).ok());
  // Now: a in chunks of 13, b one token at a time, batched together.
  std::vector<float> got_a, got_b;
  ASSERT_NO_FATAL_FAILURE(
      ForwardChunkedBesideDecode(model, pool_.get(), a, b, ta, tb,
                                 weights_->config.vocab_size, &got_a, &got_b));
  EXPECT_EQ(got_a, ref_a);
  EXPECT_EQ(got_b, ref_b);
}

// Compact weights stay close to the fp32 model: max |Δlogit| relative to the
// largest logit over every position of a prompt.
TEST_P(ModelDtypeTest, LogitsStayCloseToTheFp32Model) {
  auto fp32 = LoadTiny(WeightDtype::kF32);
  EXPECT_EQ(weights_->dtype, Dtype() == WeightDtype::kAuto   ? DType::kF32
                             : Dtype() == WeightDtype::kBF16 ? DType::kBF16
                             : Dtype() == WeightDtype::kF16  ? DType::kF16
                             : Dtype() == WeightDtype::kI8   ? DType::kI8
                                                             : DType::kF32);
  const auto prompt = Prompt(50);
  auto table = Table(0, 4);
  LlamaModel::SeqInput in{prompt, 0, table, Logits::kAll};
  std::vector<float> ref, got;
  LlamaModel a(fp32, kernels::MatMulMode::kDeterministic);
  LlamaModel b(weights_, Mode());
  ASSERT_TRUE(a.Forward({&in, 1}, pool_.get(), &ref).ok());
  ASSERT_TRUE(b.Forward({&in, 1}, pool_.get(), &got).ok());
  double err = 0, mag = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    err = std::max(err, std::fabs(double(ref[i]) - got[i]));
    mag = std::max(mag, std::fabs(double(ref[i])));
  }
  const bool bf16dot = Mode() == kernels::MatMulMode::kBf16Dot;
  const double tol = bf16dot                         ? 5e-2
                     : Dtype() == WeightDtype::kBF16 ? 3e-2
                     : Dtype() == WeightDtype::kF16  ? 5e-3
                     : Dtype() == WeightDtype::kI8   ? 6e-2
                                                     : 0.0;
  EXPECT_LE(err / mag, tol) << WeightDtypeName(Dtype());
  if (bf16dot) {  // other arithmetic than the same weights' fp32 chain
    auto chain = LoadTiny(WeightDtype::kBF16);
    EXPECT_NE(weights_->fingerprint, chain->fingerprint);
  }
  // A different storage is a different model for the prefix cache.
  if (weights_->dtype != DType::kF32) {
    EXPECT_NE(weights_->fingerprint, fp32->fingerprint);
  }
}

constexpr auto kChain = kernels::MatMulMode::kDeterministic;
INSTANTIATE_TEST_SUITE_P(
    EveryWeightDtype, ModelDtypeTest,
    ::testing::Values(DtypeAndMode{WeightDtype::kAuto, kChain},
                      DtypeAndMode{WeightDtype::kF32, kChain},
                      DtypeAndMode{WeightDtype::kBF16, kChain},
                      DtypeAndMode{WeightDtype::kF16, kChain},
                      DtypeAndMode{WeightDtype::kI8, kChain},
                      DtypeAndMode{WeightDtype::kBF16,
                                   kernels::MatMulMode::kBf16Dot}),
    [](const ::testing::TestParamInfo<DtypeAndMode>& info) {
      return std::string(WeightDtypeName(std::get<0>(info.param))) +
             (std::get<1>(info.param) == kernels::MatMulMode::kBf16Dot
                  ? "_bf16dot"
                  : "");
    });

// A bf16 checkpoint widened to fp32 or kept in bf16 computes the same chain
// on the same values: identical logits, only half the bytes.
TEST_F(ModelTest, Bf16CheckpointKeptAsBf16EqualsItWidenedToFp32) {
  auto as_bf16 = LoadTiny(WeightDtype::kAuto, DType::kBF16);
  auto as_fp32 = LoadTiny(WeightDtype::kF32, DType::kBF16);
  EXPECT_EQ(as_bf16->dtype, DType::kBF16);
  EXPECT_LT(as_bf16->ParameterBytes(), as_fp32->ParameterBytes() * 6 / 10);
  const auto prompt = Prompt(30);
  auto table = Table(0, 2);
  LlamaModel::SeqInput in{prompt, 0, table, Logits::kAll};
  std::vector<float> a, b;
  LlamaModel ma(as_bf16, kernels::MatMulMode::kDeterministic);
  LlamaModel mb(as_fp32, kernels::MatMulMode::kDeterministic);
  ASSERT_TRUE(ma.Forward({&in, 1}, pool_.get(), &a).ok());
  ASSERT_TRUE(mb.Forward({&in, 1}, pool_.get(), &b).ok());
  EXPECT_EQ(a, b);
}

TEST_F(ModelTest, BlasModeNeedsFp32WeightsAndBf16DotNeedsBf16) {
  EXPECT_EQ(ModelWeights::Load(TinyDir(), WeightDtype::kBF16,
                               kernels::MatMulMode::kBlas)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ModelWeights::Load(TinyDir(), WeightDtype::kAuto,
                               kernels::MatMulMode::kBf16Dot)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);  // the checkpoint is fp32
}

TEST_F(ModelTest, BlasModeAgreesWithinRoundingAndQuantisedKvWithinTolerance) {
  LlamaModel det(weights_, kernels::MatMulMode::kDeterministic);
  LlamaModel blas(
      LoadTiny(WeightDtype::kAuto, DType::kF32, kernels::MatMulMode::kBlas),
      kernels::MatMulMode::kBlas);
  const auto prompt = Prompt(50);
  auto table = Table(0, 4);
  std::vector<float> a, b;
  LlamaModel::SeqInput in{prompt, 0, table, Logits::kAll};
  ASSERT_TRUE(det.Forward({&in, 1}, pool_.get(), &a).ok());
  ASSERT_TRUE(blas.Forward({&in, 1}, pool_.get(), &b).ok());
  double max_abs = 0, max_ref = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    max_abs = std::max(max_abs, std::fabs(double(a[i]) - b[i]));
    max_ref = std::max(max_ref, std::fabs(double(a[i])));
  }
  EXPECT_LT(max_abs / max_ref, 1e-4);
  // Quantised KV caches: relative error of the logits stays bounded.
  for (auto [dtype, tol] : {std::pair{DType::kF16, 5e-3},
                            {DType::kBF16, 3e-2},
                            {DType::kI8, 6e-2}}) {
    KvCacheSpec spec = spec_;
    spec.dtype = dtype;
    auto pool = std::move(*KvPool::Create(spec, 8));
    std::vector<float> q;
    ASSERT_TRUE(det.Forward({&in, 1}, pool.get(), &q).ok());
    double err = 0;
    for (size_t i = 0; i < a.size(); ++i)
      err = std::max(err, std::fabs(double(a[i]) - q[i]));
    EXPECT_LT(err / max_ref, tol) << DTypeName(dtype);
  }
}

// A logits vector kept between passes (as the engine keeps one) ends up
// holding exactly the new pass's rows, whatever it held before: longer,
// shorter, or filled with values the pass must overwrite.
TEST_F(ModelTest, ReusedLogitsVectorHoldsOnlyThisPassRows) {
  LlamaModel model(weights_, kernels::MatMulMode::kDeterministic);
  const int64_t vocab = weights_->config.vocab_size;
  const auto prompt = Prompt(20);
  auto table = Table(0, 2);
  LlamaModel::SeqInput all{prompt, 0, table, Logits::kAll};
  LlamaModel::SeqInput last{prompt, 0, table, Logits::kLast};
  std::vector<float> want_all, want_last;
  ASSERT_TRUE(model.Forward({&all, 1}, pool_.get(), &want_all).ok());
  ASSERT_TRUE(model.Forward({&last, 1}, pool_.get(), &want_last).ok());
  ASSERT_EQ(want_all.size(), static_cast<size_t>(20 * vocab));
  ASSERT_EQ(want_last.size(), static_cast<size_t>(vocab));

  std::vector<float> kept(7 * vocab, 12345.0f);  // longer than one row
  ASSERT_TRUE(model.Forward({&last, 1}, pool_.get(), &kept).ok());
  EXPECT_EQ(kept, want_last);
  std::fill(kept.begin(), kept.end(), -7.0f);  // shorter than 20 rows
  ASSERT_TRUE(model.Forward({&all, 1}, pool_.get(), &kept).ok());
  EXPECT_EQ(kept, want_all);
  // A pass that needs no logits leaves none.
  LlamaModel::SeqInput none{prompt, 0, table, Logits::kNone};
  ASSERT_TRUE(model.Forward({&none, 1}, pool_.get(), &kept).ok());
  EXPECT_TRUE(kept.empty());
}

TEST_F(ModelTest, RejectsOutOfVocabularyTokensAndMissingBlocks) {
  LlamaModel model(weights_, kernels::MatMulMode::kDeterministic);
  std::vector<int32_t> bad = {1, 100000};
  auto table = Table(0, 1);
  std::vector<float> out;
  LlamaModel::SeqInput in{bad, 0, table, Logits::kLast};
  EXPECT_EQ(model.Forward({&in, 1}, pool_.get(), &out).code(),
            absl::StatusCode::kInvalidArgument);
  const auto long_prompt = Prompt(40);
  LlamaModel::SeqInput in2{long_prompt, 0, table, Logits::kLast};
  EXPECT_EQ(model.Forward({&in2, 1}, pool_.get(), &out).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve::engine

namespace pdserve::engine {
namespace {

TEST(ModelPresetTest, Llama32OneBHasTheRealShapeAndBf16Weights) {
  auto c = PresetConfig("llama3.2-1b");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->hidden_size, 2048);
  EXPECT_EQ(c->num_layers, 16);
  EXPECT_EQ(c->num_heads, 32);
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->intermediate_size, 8192);
  EXPECT_EQ(c->vocab_size, 128256);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->rope_theta, 5e5);
  EXPECT_EQ(PresetDefaultDtype("llama3.2-1b"), DType::kBF16);
  EXPECT_EQ(PresetDefaultDtype("small"), DType::kF32);
}

}  // namespace
}  // namespace pdserve::engine

// DeepSeek MLA over the latent KV cache (model/mla.h).
namespace pdserve::engine {
namespace {

using Logits = LlamaModel::Logits;

std::shared_ptr<const ModelWeights> DeepseekWeights(const std::string& preset) {
  static std::map<std::string, std::shared_ptr<const ModelWeights>> cache;
  auto& slot = cache[preset];
  if (!slot) {
    const std::string dir = testing::TempDir("mla_" + preset);
    ModelInitOptions opts;
    opts.preset = preset;
    opts.out_dir = dir;
    opts.seed = 3;
    auto s = WriteRandomModel(opts);
    EXPECT_TRUE(s.ok()) << s;
    auto w = ModelWeights::Load(dir);
    EXPECT_TRUE(w.ok()) << w.status();
    slot = std::make_shared<const ModelWeights>(std::move(*w));
  }
  return slot;
}

using PresetAndKv = std::tuple<std::string, DType>;
class MlaModelTest : public ::testing::TestWithParam<PresetAndKv> {
 protected:
  void SetUp() override {
    weights_ = DeepseekWeights(std::get<0>(GetParam()));
    spec_ = weights_->config.KvSpec(16, std::get<1>(GetParam()));
    pool_ = std::move(*KvPool::Create(spec_, 64));
  }
  static std::vector<int32_t> Prompt(int n, int salt = 0) {
    std::vector<int32_t> t(n);
    for (int i = 0; i < n; ++i) t[i] = (i * 41 + salt * 7 + 3) % 256;
    return t;
  }
  static std::vector<int32_t> Table(int first, int n) {
    std::vector<int32_t> t(n);
    std::iota(t.begin(), t.end(), first);
    return t;
  }
  // The raw bytes of blocks `table` in every layer.
  std::string Bytes(const std::vector<int32_t>& table) {
    std::string out;
    for (int l = 0; l < spec_.num_layers; ++l) {
      for (int32_t b : table) {
        const KvSpan s = pool_->Span(l, b);
        out.append(static_cast<const char*>(s.data), s.data_bytes);
        if (s.scales != nullptr)
          out.append(reinterpret_cast<const char*>(s.scales), s.scale_bytes);
      }
    }
    return out;
  }
  std::shared_ptr<const ModelWeights> weights_;
  KvCacheSpec spec_;
  std::unique_ptr<KvPool> pool_;
};

TEST_P(MlaModelTest, ABlockHoldsOnlyTheLatentAndTheRopeKey) {
  const ModelConfig& c = weights_->config;
  ASSERT_TRUE(spec_.mla());
  const int64_t width = c.kv_lora_rank + c.qk_rope_head_dim;
  EXPECT_EQ(pool_->Span(0, 0).data_bytes,
            static_cast<size_t>(16 * width * DTypeBytes(spec_.dtype)));
  EXPECT_EQ(
      spec_.BytesPerToken(),
      c.num_layers * width * static_cast<int64_t>(DTypeBytes(spec_.dtype)));
  // int8: one scale for the latent part, one for the rope part.
  EXPECT_EQ(pool_->Span(0, 0).scale_bytes,
            spec_.dtype == DType::kI8 ? 2 * sizeof(float) : 0u);
  // An MHA cache of the same model would hold K and V of every head.
  const int64_t mha = 2 * c.num_layers * c.num_heads *
                      (c.qk_nope_head_dim + c.qk_rope_head_dim);
  EXPECT_LT(spec_.BytesPerToken(),
            mha * static_cast<int64_t>(DTypeBytes(spec_.dtype)));
}

TEST_P(MlaModelTest, PrefixCacheHitGivesTheSameLogitsAsAColdPrefill) {
  LlamaModel model(weights_, kernels::MatMulMode::kDeterministic);
  const auto prompt = Prompt(45);
  auto table = Table(0, 3);
  std::vector<float> cold, warm;
  LlamaModel::SeqInput all{prompt, 0, table, Logits::kLast};
  ASSERT_TRUE(model.Forward({&all, 1}, pool_.get(), &cold).ok());
  std::vector<int32_t> table2 = {0, 1, 10};
  LlamaModel::SeqInput suffix{std::span<const int32_t>(prompt).subspan(32), 32,
                              table2, Logits::kLast};
  ASSERT_TRUE(model.Forward({&suffix, 1}, pool_.get(), &warm).ok());
  EXPECT_EQ(cold, warm);
  // The suffix block's latents are byte-identical to the cold run's.
  EXPECT_EQ(Bytes({2}), Bytes({10}));
}

// int8 is excluded here as for GQA: a prefill chunk's queries read their
// block with the scale its later tokens grew it to, a decode step with the
// scale so far (the kernel-level property, same values -> same block bytes
// however chunked, is MlaKernelTest below).
class MlaInvarianceTest : public MlaModelTest {};
TEST_P(MlaInvarianceTest, ChunkedPrefillAndBatchedDecodeEqualOneAtATime) {
  LlamaModel model(weights_, kernels::MatMulMode::kDeterministic);
  const auto a = Prompt(40, 1), b = Prompt(7, 2);
  auto ta = Table(0, 4), tb = Table(20, 4);
  std::vector<float> ref_a, ref_b;
  LlamaModel::SeqInput ia{a, 0, ta, Logits::kAll}, ib{b, 0, tb, Logits::kAll};
  ASSERT_TRUE(model.Forward({&ia, 1}, pool_.get(), &ref_a).ok());
  ASSERT_TRUE(model.Forward({&ib, 1}, pool_.get(), &ref_b).ok());
  const std::string blocks_a = Bytes({0, 1, 2}), blocks_b = Bytes({20});
  // a in chunks of 13, b one token at a time (the decode shape), batched,
  // into fresh blocks.
  auto ta2 = Table(30, 4), tb2 = Table(40, 4);
  std::vector<float> got_a, got_b;
  ASSERT_NO_FATAL_FAILURE(
      ForwardChunkedBesideDecode(model, pool_.get(), a, b, ta2, tb2,
                                 weights_->config.vocab_size, &got_a, &got_b));
  EXPECT_EQ(got_a, ref_a);
  EXPECT_EQ(got_b, ref_b);
  // Block bytes do not depend on the chunking either (int8 requantises).
  EXPECT_EQ(Bytes({30, 31, 32}), blocks_a);
  EXPECT_EQ(Bytes({40}), blocks_b);
}

class MlaCompactKvTest : public MlaModelTest {};
TEST_P(MlaCompactKvTest, CompactKvStaysCloseToFp32Kv) {
  KvCacheSpec fp32 = spec_;
  fp32.dtype = DType::kF32;
  auto ref_pool = std::move(*KvPool::Create(fp32, 64));
  LlamaModel model(weights_, kernels::MatMulMode::kDeterministic);
  const auto prompt = Prompt(50, 4);
  auto table = Table(0, 4);
  LlamaModel::SeqInput in{prompt, 0, table, Logits::kAll};
  std::vector<float> ref, got;
  ASSERT_TRUE(model.Forward({&in, 1}, ref_pool.get(), &ref).ok());
  ASSERT_TRUE(model.Forward({&in, 1}, pool_.get(), &got).ok());
  // Per position, max |dlogit| relative to the largest fp32 logit. A rare
  // position may switch an expert choice (a discrete step the rounding can
  // tip), so the bound holds for 90% of positions, not all.
  const int64_t vocab = weights_->config.vocab_size;
  const int64_t positions = static_cast<int64_t>(ref.size()) / vocab;
  double mag = 0, total_err = 0;
  for (float x : ref) mag = std::max(mag, std::fabs(double(x)));
  int close = 0;
  const double tol = spec_.dtype == DType::kI8 ? 3e-2 : 1e-2;
  for (int64_t p = 0; p < positions; ++p) {
    double e = 0;
    for (int64_t i = 0; i < vocab; ++i)
      e = std::max(e,
                   std::fabs(double(ref[p * vocab + i]) - got[p * vocab + i]));
    total_err += e;
    close += e / mag <= tol;
  }
  EXPECT_GT(total_err, 0.0);  // it did quantise
  EXPECT_GE(close, positions * 9 / 10) << close << " of " << positions;
}

TEST_P(MlaModelTest, RejectsAGqaPoolForAnMlaModel) {
  const ModelConfig& c = weights_->config;
  KvCacheSpec gqa{static_cast<int32_t>(c.num_layers),
                  static_cast<int32_t>(c.num_kv_heads),
                  static_cast<int32_t>(c.head_dim), 16, DType::kF32};
  auto pool = std::move(*KvPool::Create(gqa, 8));
  LlamaModel model(weights_, kernels::MatMulMode::kDeterministic);
  const auto prompt = Prompt(5);
  auto table = Table(0, 1);
  LlamaModel::SeqInput in{prompt, 0, table, Logits::kLast};
  std::vector<float> out;
  EXPECT_EQ(model.Forward({&in, 1}, pool.get(), &out).code(),
            absl::StatusCode::kFailedPrecondition);
}

// Latent rows written token by token give the same block bytes and scales
// as one chunk write (int8 requantises a part when its scale grows).
TEST(MlaKernelTest, Int8LatentWritesTokenByTokenEqualOneChunk) {
  KvCacheSpec spec{2, 1, 12, 16, DType::kI8, 8, 4};
  ASSERT_TRUE(spec.Validate().ok());
  std::vector<float> rows(16 * 12);
  for (size_t i = 0; i < rows.size(); ++i)
    rows[i] =
        std::sin(0.7f * i) * (1.0f + (i / 12) * 0.4f) * (i % 12 < 8 ? 1 : 9);
  std::vector<int64_t> slots(16);
  std::iota(slots.begin(), slots.end(), 16);  // block 1
  auto a = std::move(*KvPool::Create(spec, 3));
  auto b = std::move(*KvPool::Create(spec, 3));
  WriteLatentRows(rows.data(), 16, slots.data(), spec, a->Layer(0).data,
                  a->Layer(0).scales);
  for (int t = 0; t < 16; ++t) {
    WriteLatentRows(&rows[t * 12], 1, &slots[t], spec, b->Layer(0).data,
                    b->Layer(0).scales);
  }
  const KvSpan sa = a->Span(0, 1), sb = b->Span(0, 1);
  ASSERT_EQ(sa.data_bytes, 16u * 12u);
  EXPECT_EQ(0, std::memcmp(sa.data, sb.data, sa.data_bytes));
  EXPECT_EQ(sa.scales[0], sb.scales[0]);
  EXPECT_EQ(sa.scales[1], sb.scales[1]);
  // The rope part (9x larger) has its own scale, so the latent keeps its
  // resolution; reading back stays within a few steps of each part (each
  // requantisation as the scale grew rounded once more).
  EXPECT_GT(sa.scales[1], 5 * sa.scales[0]);
  std::vector<float> back(16 * 12);
  ReadLatentBlock(spec, a->Layer(0).data, a->Layer(0).scales, 1, 16,
                  back.data());
  for (size_t i = 0; i < back.size(); ++i) {
    const float step = sa.scales[i % 12 < 8 ? 0 : 1];
    EXPECT_NEAR(back[i], rows[i], 2.0f * step) << i;
  }
}

std::string MlaParamName(const ::testing::TestParamInfo<PresetAndKv>& info) {
  std::string name = std::get<0>(info.param) == "deepseek-v2" ? "V2" : "V3";
  return name + "_" + DTypeName(std::get<1>(info.param));
}
const auto kDeepseekPresets = ::testing::Values("deepseek-v2", "deepseek-v3");
INSTANTIATE_TEST_SUITE_P(DeepseekPresets, MlaModelTest,
                         ::testing::Combine(kDeepseekPresets,
                                            ::testing::Values(DType::kF32,
                                                              DType::kBF16,
                                                              DType::kI8)),
                         MlaParamName);
INSTANTIATE_TEST_SUITE_P(DeepseekPresets, MlaInvarianceTest,
                         ::testing::Combine(kDeepseekPresets,
                                            ::testing::Values(DType::kF32,
                                                              DType::kBF16)),
                         MlaParamName);
INSTANTIATE_TEST_SUITE_P(DeepseekPresets, MlaCompactKvTest,
                         ::testing::Combine(kDeepseekPresets,
                                            ::testing::Values(DType::kBF16,
                                                              DType::kI8)),
                         MlaParamName);

}  // namespace
}  // namespace pdserve::engine
