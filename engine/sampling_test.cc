#include "engine/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "engine/backend.h"
#include "engine/engine.h"
#include "engine/test_util.h"

namespace pdserve::engine {
namespace {

class SamplingTest : public ::testing::Test {
 protected:
  int32_t Sample(const std::vector<float>& logits, const SamplingParams& p,
                 int64_t pos) {
    return SampleToken(logits.data(), static_cast<int64_t>(logits.size()), p,
                       pos, &scratch_);
  }
  std::vector<std::pair<float, int32_t>> scratch_;
};

TEST_F(SamplingTest, PhiloxMatchesPublishedKnownAnswers) {
  // Random123 kat_vectors for philox4x32_10.
  EXPECT_EQ(Philox4x32({0, 0, 0, 0}, {0, 0}),
            (std::array<uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c,
                                     0x9b00dbd8}));
  EXPECT_EQ(Philox4x32({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
                       {0xffffffff, 0xffffffff}),
            (std::array<uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6,
                                     0x6d5451fd}));
  EXPECT_EQ(Philox4x32({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
                       {0xa4093822, 0x299f31d0}),
            (std::array<uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420,
                                     0x24126ea1}));
}

TEST_F(SamplingTest, GreedyAndDegenerateFiltersTakeTheArgmax) {
  const std::vector<float> logits = {0.1f, 2.0f, 2.0f, -1.0f};
  SamplingParams p;
  EXPECT_EQ(Sample(logits, p, 0), 1);  // first maximum
  p.temperature = 1.0f;
  p.top_k = 1;
  EXPECT_EQ(Sample(logits, p, 5), 1);
  p.top_k = 0;
  p.top_p = 1e-6f;
  EXPECT_EQ(Sample(logits, p, 5), 1);
}

// Greedy picks what the plain scan picks (first maximum, NaN never wins, a
// NaN at 0 stays, +0 and -0 tie), at every vocabulary size around the
// 16-lane blocks and on adversarial rows.
TEST_F(SamplingTest, GreedyEqualsThePlainScanOnHardRows) {
  auto scan = [](const std::vector<float>& l) {
    for (float v : l)
      if (v != v) return kInvalidLogitsToken;
    int32_t best = 0;
    for (size_t i = 1; i < l.size(); ++i)
      if (l[i] > l[best]) best = static_cast<int32_t>(i);
    return best;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-5.0f, 5.0f);
  SamplingParams p;
  for (int n = 1; n <= 70; ++n) {
    for (int trial = 0; trial < 40; ++trial) {
      std::vector<float> l(n);
      for (float& v : l) v = trial % 4 == 0 ? std::round(u(rng)) : u(rng);
      if (trial % 5 == 1) l[rng() % n] = nan;
      if (trial % 7 == 2) l[0] = nan;
      if (trial % 6 == 3) l[rng() % n] = inf;
      if (trial % 8 == 4) {
        for (float& v : l) v = -inf;
      }
      if (trial % 9 == 5) {
        for (float& v : l) v = (rng() % 2) ? 0.0f : -0.0f;
      }
      ASSERT_EQ(Sample(l, p, 0), scan(l)) << "n=" << n << " trial=" << trial;
    }
  }
  std::vector<float> big(128256);
  for (float& v : big) v = u(rng);
  big[100000] = 9.0f;
  big[127000] = 9.0f;
  EXPECT_EQ(Sample(big, p, 0), 100000);
}

TEST_F(SamplingTest,
       SameSeedAndPositionGiveTheSameTokenAndFollowTheDistribution) {
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, 3.0f};
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 42;
  std::map<int32_t, int> counts;
  for (int64_t pos = 0; pos < 20000; ++pos) {
    const int32_t t = Sample(logits, p, pos);
    EXPECT_EQ(t, Sample(logits, p, pos));
    ++counts[t];
  }
  // softmax(0,1,2,3) = 0.032, 0.087, 0.237, 0.644
  EXPECT_NEAR(counts[3] / 20000.0, 0.644, 0.02);
  EXPECT_NEAR(counts[0] / 20000.0, 0.032, 0.01);
  p.top_k = 2;  // only ids 2 and 3 remain: 0.269 / 0.731
  counts.clear();
  for (int64_t pos = 0; pos < 20000; ++pos) ++counts[Sample(logits, p, pos)];
  EXPECT_EQ(counts[0] + counts[1], 0);
  EXPECT_NEAR(counts[2] / 20000.0, 0.269, 0.02);
  p.seed = 43;  // another seed changes the stream
  int differ = 0;
  SamplingParams q = p;
  q.seed = 42;
  for (int64_t pos = 0; pos < 200; ++pos)
    differ += Sample(logits, p, pos) != Sample(logits, q, pos);
  EXPECT_GT(differ, 20);
}

// The sampler as a comparison sort over every non-NaN candidate, as it was
// written before the radix sort: the reference the fast path must equal.
int32_t ComparisonSortSample(const std::vector<float>& logits,
                             const SamplingParams& params, int64_t position) {
  std::vector<std::pair<float, int32_t>> cand;
  const float inv_t = 1.0f / params.temperature;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float v = logits[i] * inv_t;
    if (!std::isnan(v)) cand.emplace_back(v, static_cast<int32_t>(i));
  }
  auto order = [](const std::pair<float, int32_t>& a,
                  const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  if (params.top_k > 0 && params.top_k < cand.size()) {
    std::partial_sort(cand.begin(), cand.begin() + params.top_k, cand.end(),
                      order);
    cand.resize(params.top_k);
  } else {
    std::sort(cand.begin(), cand.end(), order);
  }
  const double mx = cand[0].first;
  std::vector<double> probs(cand.size());
  double total = 0;
  for (size_t i = 0; i < cand.size(); ++i)
    total += probs[i] = std::exp(cand[i].first - mx);
  const double top_p = params.top_p <= 0.0f ? 1.0 : params.top_p;
  if (top_p < 1.0) {
    double mass = 0;
    size_t n = 0;
    while (n < cand.size()) {
      mass += probs[n++] / total;
      if (mass >= top_p) break;
    }
    cand.resize(n);
    probs.resize(n);
    total = 0;
    for (double p : probs) total += p;
  }
  const double u =
      static_cast<double>(UniformForPosition(params.seed, position)) * total;
  double cdf = 0;
  for (size_t i = 0; i < cand.size(); ++i) {
    cdf += probs[i];
    if (u < cdf) return cand[i].second;
  }
  return cand.back().second;
}

// The radix-sorted sampler picks the comparison sort's token on rows built to
// stress the order: many exact ties, +0 and -0, denormals, +-inf, wide and
// narrow ranges, masked (-inf) rows, with and without top_k / top_p, at
// vocabularies around the radix passes' sizes.
TEST_F(SamplingTest, SeededSamplingEqualsTheComparisonSortOnHardRows) {
  std::mt19937 rng(7);
  const float inf = std::numeric_limits<float>::infinity();
  const float denorm = std::numeric_limits<float>::denorm_min();
  int checked = 0;
  for (int64_t vocab : {1, 2, 3, 17, 258, 2047, 2049, 4096, 32000, 128256}) {
    for (int kind = 0; kind < 7; ++kind) {
      std::vector<float> l(static_cast<size_t>(vocab));
      std::uniform_real_distribution<float> wide(-30.0f, 30.0f);
      std::uniform_int_distribution<int> few(-3, 3);
      for (float& v : l) {
        switch (kind) {
          case 0:
            v = wide(rng);
            break;
          case 1:
            v = static_cast<float>(few(rng));
            break;  // ties
          case 2:
            v = (few(rng) & 1) ? 0.0f : -0.0f;
            break;
          case 3:
            v = few(rng) * denorm;
            break;
          case 4:
            v = few(rng) > 1 ? wide(rng) : -inf;
            break;  // a mask
          case 5:
            v = wide(rng) * 1e-3f;
            break;  // nearly flat
          default:
            v = few(rng) == 3 ? inf : wide(rng);
            break;
        }
      }
      if (kind == 4) l[static_cast<size_t>(vocab - 1)] = 1.0f;  // one allowed
      for (const auto& [t, k, p] :
           std::vector<std::tuple<float, uint32_t, float>>{{1.0f, 0, 1.0f},
                                                           {0.7f, 0, 0.9f},
                                                           {1.3f, 40, 1.0f},
                                                           {0.5f, 3, 0.5f},
                                                           {2.0f, 0, 0.3f}}) {
        SamplingParams params;
        params.temperature = t;
        params.top_k = k;
        params.top_p = p;
        for (int64_t pos = 0; pos < 6; ++pos) {
          params.seed = rng();
          const int32_t got = Sample(l, params, pos);
          ASSERT_GE(got, 0);
          // A masked token is never chosen; the reference may fall back on
          // one only when u rounds up to the total, which these rows avoid.
          EXPECT_NE(l[static_cast<size_t>(got)], -inf)
              << "vocab " << vocab << " kind " << kind;
          if (kind == 6) continue;  // +inf rows: the softmax is NaN in both
          EXPECT_EQ(got, ComparisonSortSample(l, params, pos))
              << "vocab " << vocab << " kind " << kind << " t " << t
              << " top_k " << k << " top_p " << p << " pos " << pos;
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 1500);
}

TEST_F(SamplingTest, ValidateRejectsOutOfRangeParameters) {
  SamplingParams p;
  EXPECT_TRUE(p.Validate().ok());
  p.max_tokens = 0;
  EXPECT_EQ(p.Validate().code(), absl::StatusCode::kInvalidArgument);
  p = {};
  p.temperature = -1;
  EXPECT_FALSE(p.Validate().ok());
  p.temperature = 101;
  EXPECT_FALSE(p.Validate().ok());
  p = {};
  p.top_p = 1.5f;
  EXPECT_FALSE(p.Validate().ok());
  p = {};
  p.stop = {""};
  EXPECT_FALSE(p.Validate().ok());
}

TEST_F(SamplingTest, LogprobsAreLogSoftmaxOfRawLogitsWithTopByValueThenId) {
  const std::vector<float> logits = {1.0f, 2.0f, 3.0f, 3.0f};
  const TokenLogprobs lp = ComputeLogprobs(logits.data(), 4, 1, 3);
  const double z = std::exp(1.0) + std::exp(2.0) + 2 * std::exp(3.0);
  EXPECT_EQ(lp.token, 1);
  EXPECT_NEAR(lp.logprob, 2.0 - std::log(z), 1e-6);
  ASSERT_EQ(lp.top.size(), 3u);
  EXPECT_EQ(lp.top[0].first, 2);  // tie at 3.0: lower id first
  EXPECT_EQ(lp.top[1].first, 3);
  EXPECT_EQ(lp.top[2].first, 1);
  EXPECT_EQ(lp.top[0].second, lp.top[1].second);
  EXPECT_EQ(lp.top[2].second, lp.logprob);
  EXPECT_TRUE(ComputeLogprobs(logits.data(), 4, 0, 0).top.empty());
  SamplingParams p;
  p.top_logprobs = kMaxTopLogprobs + 1;
  EXPECT_FALSE(p.Validate().ok());
}

TEST_F(SamplingTest, ANanLogitMakesTheRowInvalidGreedyOrRandom) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  SamplingParams greedy;
  SamplingParams random;
  random.temperature = 0.8f;
  random.top_k = 5;
  random.top_p = 0.9f;
  random.seed = 3;
  for (size_t at : {size_t{0}, size_t{17}, size_t{999}}) {
    std::vector<float> l(1000, 0.5f);
    l[10] = 4.0f;
    l[at] = nan;
    EXPECT_EQ(Sample(l, greedy, 0), kInvalidLogitsToken) << at;
    EXPECT_EQ(Sample(l, random, 0), kInvalidLogitsToken) << at;
  }
  std::vector<float> clean(1000, 0.5f);
  clean[10] = 4.0f;
  EXPECT_EQ(Sample(clean, greedy, 0), 10);
}

// The CPU backend behind a test factory registered for Device::kCuda, whose
// logits turn to NaN for every sequence whose length after this step is
// kPoisonLength: the engine's handling of a NaN row, on CPU.
constexpr int32_t kPoisonLength = 22;

class NanAtLengthBackend final : public Backend {
 public:
  explicit NanAtLengthBackend(std::unique_ptr<Backend> inner)
      : inner_(std::move(inner)) {}
  Device device() const override { return Device::kCuda; }
  const KvCacheSpec& kv_spec() const override { return inner_->kv_spec(); }
  int64_t num_blocks() const override { return inner_->num_blocks(); }
  KvStorage* kv_storage() override { return inner_->kv_storage(); }
  absl::Status Forward(
      std::span<const LlamaModel::SeqInput> seqs, std::vector<float>* logits,
      const LlamaModel::LayerWrittenFn& on_layer_written) override {
    if (absl::Status s = inner_->Forward(seqs, logits, on_layer_written);
        !s.ok())
      return s;
    size_t rows = 0;
    for (const auto& s : seqs) rows += s.logits == LlamaModel::Logits::kLast;
    if (rows == 0) return absl::OkStatus();
    const size_t vocab = logits->size() / rows;
    size_t row = 0;
    for (const auto& s : seqs) {
      if (s.logits != LlamaModel::Logits::kLast) continue;
      if (s.start_pos + static_cast<int32_t>(s.tokens.size()) == kPoisonLength)
        (*logits)[row * vocab + vocab / 3] =
            std::numeric_limits<float>::quiet_NaN();
      ++row;
    }
    return absl::OkStatus();
  }

 private:
  std::unique_ptr<Backend> inner_;
};

absl::StatusOr<std::unique_ptr<Backend>> NanAtLengthFactory(
    std::shared_ptr<const ModelWeights> weights, const BackendConfig& config) {
  BackendConfig cpu = config;
  cpu.device = Device::kCpu;
  auto inner = CreateBackend(std::move(weights), cpu);
  if (!inner.ok()) return inner.status();
  return std::unique_ptr<Backend>(new NanAtLengthBackend(*std::move(inner)));
}

TEST(SamplingNanTest, NanLogitsEndThatRequestWithInternalAndFreeItsBlocks) {
  SetBackendFactory(Device::kCuda, NanAtLengthFactory);
  EngineConfig config;
  config.device = Device::kCuda;
  auto make = [&] {
    auto e = Engine::Create(testing::TinyWeights(), config);
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(*e);
  };
  // "poisoned": a 20-token prompt reaches length 22 at its third token;
  // "clean" (24 tokens) and "short" (8 tokens, 6 new) never pass through 22.
  auto poisoned = testing::SyntheticRequest("poisoned", 20, 1, 8, 0.0f, 5);
  auto clean = testing::SyntheticRequest("clean", 24, 2, 8, 0.7f, 5);
  auto shorter = testing::SyntheticRequest("short", 8, 3, 6, 0.0f, 5);
  auto alone = make();
  ASSERT_TRUE(alone->AddRequest(clean).ok());
  ASSERT_TRUE(alone->AddRequest(shorter).ok());
  const auto want = testing::DrainEngine(alone.get());

  auto engine = make();
  ASSERT_TRUE(engine->AddRequest(poisoned).ok());
  ASSERT_TRUE(engine->AddRequest(clean).ok());
  ASSERT_TRUE(engine->AddRequest(shorter).ok());
  std::map<std::string, std::vector<int32_t>> got;
  absl::Status error;
  int errors = 0;
  for (int steps = 0; engine->HasWork() && steps < 1000; ++steps) {
    auto step = engine->Step();
    ASSERT_TRUE(step.ok()) << step.status();
    for (const StepOutput& o : *step) {
      if (!o.error.ok()) {
        EXPECT_EQ(o.id, "poisoned");
        EXPECT_TRUE(o.new_tokens.empty());
        error = o.error;
        ++errors;
        // Its blocks are free at once; the others still run.
        EXPECT_EQ(engine->Stats().num_running, 2);
      }
      auto& v = got[o.id];
      v.insert(v.end(), o.new_tokens.begin(), o.new_tokens.end());
    }
  }
  EXPECT_FALSE(engine->HasWork());
  ASSERT_EQ(errors, 1);
  EXPECT_EQ(error.code(), absl::StatusCode::kInternal);
  EXPECT_NE(error.message().find("position 22"), std::string::npos) << error;
  EXPECT_NE(error.message().find("NaN"), std::string::npos) << error;
  // Two tokens came before the NaN row, none after.
  EXPECT_EQ(got["poisoned"].size(), 2u);
  // The other rows of the same batches are untouched.
  EXPECT_EQ(got["clean"], want.at("clean"));
  EXPECT_EQ(got["short"], want.at("short"));
  EXPECT_EQ(engine->Stats().blocks_active, 0) << "a block was left held";
  // Aborting the ended request later is harmless.
  engine->Abort("poisoned");
  SetBackendFactory(Device::kCuda, nullptr);
}

}  // namespace
}  // namespace pdserve::engine
