// TokenTable parsing and TenantLimiter admission (no processes).
#include "router/auth.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "router/tenant_limiter.h"

namespace pdserve::router {
namespace {

using ::testing::HasSubstr;

TEST(TokenTableTest, ParsesTenantsOverridesAndComments) {
  TenantLimits defaults{4, 1000};
  auto t = TokenTable::Parse(
      "# comment\n\nk1 acme\nk2 acme tokens_per_minute=50  # inline\n"
      "k3 solo max_concurrent=1\n",
      defaults);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_NE(t->Find("k1"), nullptr);
  EXPECT_EQ(t->Find("k1")->name, "acme");
  // Overrides belong to the tenant, whichever line carries them.
  EXPECT_EQ(t->Find("k1")->limits.tokens_per_minute, 50);
  EXPECT_EQ(t->Find("k1")->limits.max_concurrent, 4);
  EXPECT_EQ(t->Find("k3")->limits.max_concurrent, 1);
  EXPECT_EQ(t->Find("k3")->limits.tokens_per_minute, 1000);
  EXPECT_EQ(t->Find("nope"), nullptr);
}

TEST(TokenTableTest, RejectsMalformedLinesWithTheirNumber) {
  for (const char* text :
       {"lonely", "a t\na u", "a t max_concurrent=-1", "a t colour=blue"}) {
    auto t = TokenTable::Parse(text, {});
    EXPECT_FALSE(t.ok()) << text;
    EXPECT_THAT(t.status().message(), HasSubstr("line")) << text;
  }
}

TEST(TenantLimiterTest, ConcurrencyIsReleased) {
  TenantLimiter l;
  Tenant t{"a", {1, 0}};
  const absl::Time now = absl::Now();
  EXPECT_FALSE(l.Admit(t, 10, now).has_value());
  auto no = l.Admit(t, 10, now);
  ASSERT_TRUE(no.has_value());
  EXPECT_EQ(no->limit, "concurrency");
  l.Release(t);
  EXPECT_FALSE(l.Admit(t, 10, now).has_value());
}

TEST(TenantLimiterTest, TokensPerMinuteRefillsAndHintsTheWait) {
  TenantLimiter l;
  Tenant t{"a", {0, 600}};  // 10 tokens per second
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  ASSERT_FALSE(l.Admit(t, 100, t0).has_value());
  l.Charge(t, 550, t0);  // balance 600 - 100 - 550 = -50
  l.Release(t);
  auto no = l.Admit(t, 20, t0);
  ASSERT_TRUE(no.has_value());
  EXPECT_EQ(no->limit, "tokens_per_minute");
  EXPECT_EQ(no->retry_after, absl::Seconds(7));  // (20 + 50) / 10 per s
  EXPECT_FALSE(l.Admit(t, 20, t0 + absl::Seconds(7)).has_value());
}

}  // namespace
}  // namespace pdserve::router
