#include "router/openai/errors.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace pdserve::router::openai {
namespace {

TEST(OpenAiErrorsTest, GrpcCodesMapToTheHttpStatusThatFits) {
  auto status = [](grpc::StatusCode c) {
    return FromGrpc(grpc::Status(c, "m"), 0).status;
  };
  EXPECT_EQ(status(grpc::StatusCode::INVALID_ARGUMENT), 400);
  EXPECT_EQ(status(grpc::StatusCode::UNAUTHENTICATED), 401);
  EXPECT_EQ(status(grpc::StatusCode::NOT_FOUND), 404);
  EXPECT_EQ(status(grpc::StatusCode::RESOURCE_EXHAUSTED), 429);
  EXPECT_EQ(status(grpc::StatusCode::UNAVAILABLE), 503);
  EXPECT_EQ(status(grpc::StatusCode::DEADLINE_EXCEEDED), 504);
  EXPECT_EQ(status(grpc::StatusCode::INTERNAL), 500);
}

TEST(OpenAiErrorsTest, RetryAfterRoundsUpToWholeSeconds) {
  const grpc::Status limited(grpc::StatusCode::RESOURCE_EXHAUSTED, "slow");
  EXPECT_EQ(FromGrpc(limited, 0).retry_after_s, 1);
  EXPECT_EQ(FromGrpc(limited, 1).retry_after_s, 1);
  EXPECT_EQ(FromGrpc(limited, 1001).retry_after_s, 2);
  EXPECT_EQ(FromGrpc(grpc::Status(grpc::StatusCode::UNAVAILABLE, ""), 5000)
                .retry_after_s,
            0);
}

TEST(OpenAiErrorsTest, BodyHasOpenAisShape) {
  const auto body =
      nlohmann::json::parse(ErrorJson(BadRequest("bad \"n\"", "n")));
  ASSERT_TRUE(body.contains("error"));
  const auto& e = body["error"];
  EXPECT_EQ(e["message"], "bad \"n\"");
  EXPECT_EQ(e["type"], "invalid_request_error");
  EXPECT_EQ(e["param"], "n");
  EXPECT_TRUE(e["code"].is_null());
  EXPECT_EQ(nlohmann::json::parse(ErrorJson(
                NotFound("no such model", "model_not_found")))["error"]["code"],
            "model_not_found");
}

}  // namespace
}  // namespace pdserve::router::openai
