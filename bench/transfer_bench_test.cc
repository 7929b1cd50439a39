#include "bench/transfer_bench.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace pdserve::bench {
namespace {

using ::testing::HasSubstr;

TransferBenchConfig SmallConfig() {
  TransferBenchConfig c;
  c.layouts = {{"tiny-fp32", {2, 2, 16, 16, DType::kF32}},
               {"tiny-int8", {3, 2, 16, 8, DType::kI8}}};
  c.tokens = {64, 200};  // 200 is not a whole number of blocks
  c.repetitions = 2;
  return c;
}

TEST(TransferBenchTest, MovesVerifiedBytesAndReportsPositiveFigures) {
  absl::StatusOr<TransferBenchResult> r = RunTransferBench(SmallConfig());
  ASSERT_TRUE(r.ok()) << r.status();  // includes byte-for-byte verification
  ASSERT_EQ(r->figures.size(), 4u);
  const TransferFigure& f = r->figures[1];
  EXPECT_EQ(f.layout, "tiny-fp32");
  EXPECT_EQ(f.tokens, 208);
  EXPECT_EQ(f.blocks, 13);
  EXPECT_EQ(f.bytes, 13 * 2 * (2 * 2 * 16 * 16 * 4));
  EXPECT_EQ(r->figures[2].bytes,
            8 * 3 * (2 * 2 * 8 * 16 + 2 * 2 * 4));  // int8 spans carry scales
  for (const TransferFigure& g : r->figures) {
    EXPECT_GT(g.grpc_gb_per_s, 0);
    EXPECT_GE(g.grpc_gb_per_s, g.grpc_median_gb_per_s);
    EXPECT_GT(g.tcp_gb_per_s, 0);
    EXPECT_GT(g.ratio, 0);
    EXPECT_GT(g.shm_gb_per_s, 0);  // shm moved (and verified) the same bytes
    EXPECT_GE(g.shm_gb_per_s, g.shm_median_gb_per_s);
  }
  EXPECT_THAT(r->ToJson(),
              HasSubstr("\"layout\": \"tiny-int8\", \"tokens\": 64"));
  EXPECT_THAT(r->ToTable(), HasSubstr("tiny-int8"));
}

TEST(TransferBenchTest, DefaultLayoutsAreSmallPresetAnd8bShaped) {
  const std::vector<TransferLayout> l = DefaultTransferLayouts();
  ASSERT_EQ(l.size(), 2u);
  EXPECT_EQ(l[0].name, "small-fp32");
  EXPECT_EQ(l[0].spec.BytesPerToken(), 2 * 8 * 2 * 64 * 4);
  EXPECT_EQ(l[1].name, "8b-bf16");
  EXPECT_EQ(l[1].spec.BytesPerToken() * 16384,
            int64_t{2} << 30);  // 2 GiB per pool at 16k tokens
  EXPECT_EQ(DefaultTransferLayouts(DType::kBF16)[0].name, "small-bf16");
}

TEST(TransferBenchTest, RejectsEmptyOrNonPositiveSizes) {
  TransferBenchConfig c = SmallConfig();
  c.repetitions = 0;
  EXPECT_EQ(RunTransferBench(c).status().code(),
            absl::StatusCode::kInvalidArgument);
  c = SmallConfig();
  c.tokens = {0};
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
  c = SmallConfig();
  c.layouts.clear();
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TransferBenchTest, RefusesPoolsLargerThanMemoryBeforeMeasuring) {
  TransferBenchConfig c;
  c.tokens = {1024, 1 << 30};  // 8 TiB per small-fp32 pool
  const absl::Status s = RunTransferBench(c).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("small-fp32 at 1073741824 tokens"));
}

}  // namespace
}  // namespace pdserve::bench
