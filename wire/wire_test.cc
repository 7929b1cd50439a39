#include <gtest/gtest.h>

#include "common/grpc_status.h"
#include "common/status_cause.h"
#include "wire/enums.h"

namespace pdserve::wire {
namespace {

TEST(WireEnumsTest, RoleNamesRoundTrip) {
  for (auto role : {v1::WORKER_ROLE_PREFILL, v1::WORKER_ROLE_DECODE,
                    v1::WORKER_ROLE_BOTH}) {
    auto parsed = ParseRole(RoleName(role));
    ASSERT_TRUE(parsed.has_value());
    EXPECT_EQ(*parsed, role);
    EXPECT_TRUE(IsKnownRole(role));
  }
  EXPECT_FALSE(ParseRole("Prefill").has_value());
  EXPECT_FALSE(ParseRole("").has_value());
  EXPECT_FALSE(IsKnownRole(v1::WORKER_ROLE_UNSPECIFIED));
  EXPECT_FALSE(IsKnownRole(static_cast<v1::WorkerRole>(77)));
  EXPECT_TRUE(ServesPrefill(v1::WORKER_ROLE_BOTH));
  EXPECT_FALSE(ServesPrefill(v1::WORKER_ROLE_DECODE));
  EXPECT_TRUE(ServesDecode(v1::WORKER_ROLE_DECODE));
  EXPECT_FALSE(ServesDecode(v1::WORKER_ROLE_PREFILL));
}

TEST(WireEnumsTest, FinishReasonsSpellThePublicStrings) {
  EXPECT_STREQ(FinishReasonName(v1::FINISH_REASON_NONE), "");
  EXPECT_STREQ(FinishReasonName(v1::FINISH_REASON_LENGTH), "length");
  EXPECT_STREQ(FinishReasonName(v1::FINISH_REASON_STOP), "stop");
  EXPECT_STREQ(FinishReasonName(v1::FINISH_REASON_EOS), "eos");
  EXPECT_STREQ(FinishReasonName(v1::FINISH_REASON_CANCELLED), "cancelled");
  EXPECT_STREQ(FinishReasonName(static_cast<v1::FinishReason>(99)), "");
}

TEST(WireEnumsTest, KvDtypesRoundTripAndUnknownMatchesNothing) {
  for (DType t :
       {DType::kF32, DType::kF16, DType::kBF16, DType::kI8, DType::kFp8E4M3}) {
    EXPECT_EQ(DTypeFromProto(DTypeToProto(t)), t);
  }
  EXPECT_FALSE(DTypeFromProto(v1::KV_DTYPE_UNSPECIFIED).has_value());
  EXPECT_FALSE(DTypeFromProto(static_cast<v1::KvDtype>(42)).has_value());
}

TEST(StatusCauseTest, CauseSurvivesTheGrpcBoundary) {
  absl::Status s = WithCause(absl::UnavailableError("prefill worker down"),
                             StatusCause::kPrefillFailed);
  EXPECT_EQ(CauseOf(s), StatusCause::kPrefillFailed);
  grpc::Status g = ToGrpc(s);
  EXPECT_EQ(g.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(g.error_message(), "prefill worker down");
  EXPECT_EQ(CauseOf(g), StatusCause::kPrefillFailed);
  absl::Status back = FromGrpc(g);
  EXPECT_EQ(back.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(CauseOf(back), StatusCause::kPrefillFailed);
}

TEST(StatusCauseTest, NoCauseMeansNoDetailsAndMessageTextIsNotACause) {
  // The old decision read the message; a message alone must carry no cause.
  grpc::Status g = ToGrpc(absl::UnavailableError("prefill worker failed at x"));
  EXPECT_TRUE(g.error_details().empty());
  EXPECT_EQ(CauseOf(g), StatusCause::kNone);
  EXPECT_EQ(CauseOf(FromGrpc(g)), StatusCause::kNone);
  // No payload at all when there is no cause.
  EXPECT_FALSE(FromGrpc(g).GetPayload(kCausePayloadUrl).has_value());
  EXPECT_EQ(CauseOf(absl::OkStatus()), StatusCause::kNone);
  EXPECT_TRUE(WithCause(absl::OkStatus(), StatusCause::kNeverFits).ok());
}

TEST(StatusCauseTest, MalformedDetailsFromAPeerReadAsNoCause) {
  grpc::Status garbage(grpc::StatusCode::INTERNAL, "x", "\xff\x01garbage");
  EXPECT_EQ(CauseOf(garbage), StatusCause::kNone);
  google::protobuf::Struct d;
  (*d.mutable_fields())["cause"].set_number_value(1e9);
  EXPECT_EQ(CauseOf(grpc::Status(grpc::StatusCode::INTERNAL, "x",
                                 d.SerializeAsString())),
            StatusCause::kNone);
  (*d.mutable_fields())["cause"].set_number_value(1.5);
  EXPECT_EQ(CauseOf(grpc::Status(grpc::StatusCode::INTERNAL, "x",
                                 d.SerializeAsString())),
            StatusCause::kNone);
}

}  // namespace
}  // namespace pdserve::wire
