// GPU sampling (kernels/cuda/sampling.cuh) against the CPU sampler
// (engine/sampling.h): the Philox
// stream is bit-identical, and greedy, temperature, top-k and top-p sampling
// pick the same token for the same logits, seed and position. Exact
// equality is expected; the only allowed difference (a uniform within
// ~1e-15 of a CDF boundary) does not occur on these inputs. Rows with a NaN
// logit are invalid on both.
#include <gtest/gtest.h>

#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/sampling.h"
#include "kernels/cuda/sampling.cuh"
#include "kernels/cuda/test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::DeviceArray;

TEST(CudaPhiloxTest, HostPortMatchesTheEngine) {
  for (uint64_t seed : {0ull, 1ull, 42ull, 0xdeadbeefcafef00dull}) {
    for (int64_t pos : {0ll, 1ll, 7ll, 1000ll, (1ll << 40) + 3}) {
      const std::array<uint32_t, 4> ctr = {
          static_cast<uint32_t>(pos), static_cast<uint32_t>(pos >> 32), 0, 0};
      const std::array<uint32_t, 2> key = {static_cast<uint32_t>(seed),
                                           static_cast<uint32_t>(seed >> 32)};
      EXPECT_EQ(PhiloxHost(ctr, key), engine::Philox4x32(ctr, key));
      EXPECT_EQ(UniformForPositionHost(seed, pos),
                engine::UniformForPosition(seed, pos));
    }
  }
}

class CudaSamplingTest : public testing::GpuTest {};

TEST_F(CudaSamplingTest, SameTokensAsTheCpuSampler) {
  struct Case {
    float temperature, top_p;
    uint32_t top_k;
  };
  const Case cases[] = {{0.0f, 1.0f, 0},  {1.0f, 1.0f, 0},   {0.7f, 1.0f, 0},
                        {1.3f, 0.9f, 0},  {1.0f, 0.5f, 0},   {0.8f, 1.0f, 1},
                        {1.0f, 1.0f, 5},  {1.0f, 0.95f, 50}, {2.0f, 0.0f, 0},
                        {0.5f, 0.3f, 40}, {1.0f, 0.999f, 0}};
  for (int64_t vocab : {7, 1000, 32000, 128256}) {
    const int32_t rows = 24;
    std::vector<float> logits =
        testing::RandomFloats(&rng_, static_cast<size_t>(rows) * vocab, 3.0f);
    // Ties, to check the lower-id rule.
    for (int32_t r = 0; r < rows; r += 3) logits[r * vocab + vocab - 1] = 40.0f;
    for (int32_t r = 0; r < rows; r += 3) logits[r * vocab + 2] = 40.0f;
    std::vector<SampleParams> params(rows);
    for (int32_t r = 0; r < rows; ++r) {
      const Case& c = cases[r % std::size(cases)];
      params[r].temperature = c.temperature;
      params[r].top_p = c.top_p;
      params[r].top_k = c.top_k;
      params[r].seed = 1234 + r * 7919;
      params[r].position = 17 + r * 3;
    }
    DeviceArray<float> dlogits(logits);
    DeviceArray<int32_t> tokens(rows);
    const int64_t ws_bytes = SamplingWorkspaceBytes(rows, vocab);
    DeviceArray<uint8_t> ws(static_cast<size_t>(ws_bytes));
    ASSERT_TRUE(InvokeSample(dlogits.get(), rows, vocab, params.data(),
                             tokens.get(), ws.get(), ws_bytes, stream_)
                    .ok());
    Sync();
    const std::vector<int32_t> got = tokens.Download();
    std::vector<std::pair<float, int32_t>> scratch;
    for (int32_t r = 0; r < rows; ++r) {
      engine::SamplingParams p;
      p.temperature = params[r].temperature;
      p.top_p = params[r].top_p;
      p.top_k = params[r].top_k;
      p.seed = params[r].seed;
      const int32_t want = engine::SampleToken(logits.data() + r * vocab, vocab,
                                               p, params[r].position, &scratch);
      EXPECT_EQ(got[r], want)
          << "vocab " << vocab << " row " << r << " temperature "
          << p.temperature << " top_p " << p.top_p << " top_k " << p.top_k;
    }
  }
}

// A NaN anywhere in a row (first, middle, last element; greedy, random,
// top-k, top-p) makes both samplers report the row invalid with the same
// sentinel, and leaves the rows beside it alone: a GPU that kept sampling
// (treating NaN as -inf) would serve tokens from corrupt logits.
TEST_F(CudaSamplingTest, ARowWithANanIsInvalidOnBothSamplersAndOthersAreNot) {
  static_assert(kInvalidToken == engine::kInvalidLogitsToken);
  const int64_t vocab = 32000;
  const int32_t rows = 12;
  std::vector<float> logits =
      testing::RandomFloats(&rng_, static_cast<size_t>(rows) * vocab, 3.0f);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Rows 0, 3, 6, 9 carry a NaN at the start, middle, end, and next to the
  // row's maximum.
  logits[0 * vocab + 0] = nan;
  logits[3 * vocab + vocab / 2] = nan;
  logits[6 * vocab + vocab - 1] = nan;
  logits[9 * vocab + 5] = 50.0f;
  logits[9 * vocab + 6] = nan;
  std::vector<SampleParams> params(rows);
  for (int32_t r = 0; r < rows; ++r) {
    params[r].temperature = r % 2 == 0 ? 0.0f : 0.9f;
    params[r].top_k = r % 4 == 1 ? 40 : 0;
    params[r].top_p = r % 4 == 3 ? 0.9f : 1.0f;
    params[r].seed = 77 + r;
    params[r].position = 5 + r;
  }
  DeviceArray<float> dlogits(logits);
  DeviceArray<int32_t> tokens(rows);
  const int64_t ws_bytes = SamplingWorkspaceBytes(rows, vocab);
  DeviceArray<uint8_t> ws(static_cast<size_t>(ws_bytes));
  ASSERT_TRUE(InvokeSample(dlogits.get(), rows, vocab, params.data(),
                           tokens.get(), ws.get(), ws_bytes, stream_)
                  .ok());
  Sync();
  const std::vector<int32_t> got = tokens.Download();
  std::vector<std::pair<float, int32_t>> scratch;
  for (int32_t r = 0; r < rows; ++r) {
    engine::SamplingParams p;
    p.temperature = params[r].temperature;
    p.top_p = params[r].top_p;
    p.top_k = params[r].top_k;
    p.seed = params[r].seed;
    const int32_t want = engine::SampleToken(logits.data() + r * vocab, vocab,
                                             p, params[r].position, &scratch);
    const bool poisoned = r % 3 == 0;
    EXPECT_EQ(want == engine::kInvalidLogitsToken, poisoned) << "row " << r;
    EXPECT_EQ(got[r], want) << "row " << r << " temperature " << p.temperature;
  }
}

// Checked before any CUDA call, so this runs without a device.
TEST(CudaSamplingArgumentsTest, RejectsTooSmallWorkspace) {
  SampleParams p;
  EXPECT_EQ(
      InvokeSample(nullptr, 1, 100, &p, nullptr, nullptr, 0, nullptr).code(),
      absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve::kernels::cuda
