#include "router/tenant_limiter.h"

#include <gtest/gtest.h>

namespace pdserve::router {
namespace {

Tenant Named(const std::string& name, int32_t max_concurrent,
             int64_t tokens_per_minute) {
  Tenant t;
  t.name = name;
  t.limits.max_concurrent = max_concurrent;
  t.limits.tokens_per_minute = tokens_per_minute;
  return t;
}

// Time is passed in, so these tests run on a fake clock.
class TenantLimiterTest : public ::testing::Test {
 protected:
  absl::Time now_ = absl::FromUnixSeconds(1'700'000'000);
  TenantLimiter limiter_;
};

TEST_F(TenantLimiterTest, ConcurrencyLimitHoldsUntilARelease) {
  const Tenant t = Named("a", 2, 0);
  EXPECT_FALSE(limiter_.Admit(t, 10, now_));
  EXPECT_FALSE(limiter_.Admit(t, 10, now_));
  auto no = limiter_.Admit(t, 10, now_);
  ASSERT_TRUE(no);
  EXPECT_EQ(no->limit, "concurrency");
  EXPECT_GT(no->retry_after, absl::ZeroDuration());
  limiter_.Release(t);
  EXPECT_FALSE(limiter_.Admit(t, 10, now_));
  EXPECT_TRUE(limiter_.Admit(t, 10, now_));
}

TEST_F(TenantLimiterTest, ExtraReleasesDoNotRaiseTheLimit) {
  const Tenant t = Named("a", 1, 0);
  limiter_.Release(t);  // nothing in flight
  limiter_.Release(t);
  EXPECT_FALSE(limiter_.Admit(t, 1, now_));
  EXPECT_TRUE(limiter_.Admit(t, 1, now_));
}

TEST_F(TenantLimiterTest, TokensPerMinuteRefillsOverTime) {
  const Tenant t = Named("a", 0, 600);         // 10 tokens a second
  EXPECT_FALSE(limiter_.Admit(t, 500, now_));  // bucket 600 -> 100
  auto no = limiter_.Admit(t, 200, now_);
  ASSERT_TRUE(no);
  EXPECT_EQ(no->limit, "tokens_per_minute");
  EXPECT_EQ(no->retry_after, absl::Seconds(10));  // 100 more at 10/s
  EXPECT_TRUE(limiter_.Admit(t, 200, now_ + absl::Seconds(9)));
  EXPECT_FALSE(limiter_.Admit(t, 200, now_ + absl::Seconds(10)));
}

TEST_F(TenantLimiterTest, GeneratedTokensAreChargedToo) {
  const Tenant t = Named("a", 0, 600);
  EXPECT_FALSE(limiter_.Admit(t, 100, now_));  // 500 left
  limiter_.Charge(t, 699, now_);               // -199
  auto no = limiter_.Admit(t, 1, now_);
  ASSERT_TRUE(no);
  EXPECT_EQ(no->retry_after, absl::Seconds(20));  // 200 more at 10/s
  EXPECT_TRUE(limiter_.Admit(t, 1, now_ + absl::Seconds(19)));
  EXPECT_FALSE(limiter_.Admit(t, 1, now_ + absl::Seconds(20)));
}

TEST_F(TenantLimiterTest, APromptLargerThanTheBucketRunsWhenItIsFull) {
  const Tenant t = Named("a", 0, 60);
  EXPECT_FALSE(limiter_.Admit(t, 1000, now_));
  // Now deep in debt: 60 - 1000 = -940; full again (60) after 1000 s.
  EXPECT_TRUE(limiter_.Admit(t, 1000, now_ + absl::Seconds(900)));
  EXPECT_FALSE(limiter_.Admit(t, 1000, now_ + absl::Seconds(1000)));
}

TEST_F(TenantLimiterTest, TenantsAreLimitedSeparately) {
  const Tenant a = Named("a", 1, 100), b = Named("b", 1, 100);
  EXPECT_FALSE(limiter_.Admit(a, 100, now_));
  EXPECT_TRUE(limiter_.Admit(a, 1, now_));
  EXPECT_FALSE(limiter_.Admit(b, 100, now_));
}

TEST_F(TenantLimiterTest, ZeroMeansUnlimited) {
  const Tenant t = Named("", 0, 0);
  for (int i = 0; i < 1000; ++i) {
    ASSERT_FALSE(limiter_.Admit(t, 1'000'000, now_));
    limiter_.Charge(t, 1'000'000, now_);
  }
}

}  // namespace
}  // namespace pdserve::router
