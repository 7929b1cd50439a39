// Structured output through the engine: masked sampling on every path
// (colocated, prefill + decode, a resumed stream), unconstrained rows
// untouched, and the finish reasons of a completed or unfinished match.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine/test_util.h"
#include "structured/test_util.h"
#include "structured/token_guide.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::engine {
namespace {

using structured::ConstraintSpec;

constexpr char kSchema[] = R"({"type":"object","properties":{
  "name":{"type":"string","maxLength":6},
  "n":{"type":"integer","minimum":-3,"maximum":40},
  "tags":{"type":"array","items":{"enum":["x","y"]},"maxItems":2}},
  "required":["name","n","tags"],"additionalProperties":false})";

class StructuredOutputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto t = Tokenizer::Load(ModelDir());
    ASSERT_TRUE(t.ok()) << t.status();
    tokenizer_ = t->release();
    guides_ = new std::shared_ptr<structured::GuideCache>(
        std::make_shared<structured::GuideCache>(
            structured::GuideCacheConfig{},
            structured::TokenTrie::Build(*tokenizer_)));
  }
  static std::string ModelDir() {
    static const std::string dir = [] {
      const std::string d = testing::TempDir("structured_model");
      ModelInitOptions opts;
      opts.preset = "tiny";
      opts.out_dir = d;
      opts.seed = 1;
      EXPECT_TRUE(WriteRandomModel(opts).ok());
      return d;
    }();
    return dir;
  }
  std::unique_ptr<Engine> Make(bool with_guides = true) {
    auto e = Engine::Create(testing::TinyWeights(), {});
    EXPECT_TRUE(e.ok()) << e.status();
    if (with_guides) (*e)->set_guide_cache(*guides_);
    return std::move(*e);
  }
  static EngineRequest Req(const std::string& id, ConstraintSpec spec,
                           float temperature, uint32_t max_tokens = 120) {
    EngineRequest r;
    r.id = id;
    r.prompt = tokenizer_->Encode("Describe it as JSON: ");
    r.sampling.max_tokens = max_tokens;
    r.sampling.temperature = temperature;
    r.sampling.seed = 7;
    r.constraint = std::move(spec);
    return r;
  }
  static std::string Text(const std::vector<int32_t>& ids) {
    return tokenizer_->Decode(ids, true);
  }
  static inline Tokenizer* tokenizer_ = nullptr;
  static inline std::shared_ptr<structured::GuideCache>* guides_ = nullptr;
};

TEST_F(StructuredOutputTest, GreedyAndSeededOutputsMatchTheSchema) {
  auto dfa =
      structured::CompileConstraint(ConstraintSpec::JsonSchema(kSchema), {});
  ASSERT_TRUE(dfa.ok());
  for (float temperature : {0.0f, 0.9f}) {
    auto e = Make();
    ASSERT_TRUE(e->AddRequest(
                     Req("a", ConstraintSpec::JsonSchema(kSchema), temperature))
                    .ok());
    std::map<std::string, StepOutput> last;
    const auto out = testing::DrainEngine(e.get(), &last);
    const std::string text = Text(out.at("a"));
    EXPECT_TRUE(structured::DfaMatches(**dfa, text)) << text;
    EXPECT_TRUE(last.at("a").finish == FinishReason::kStop ||
                last.at("a").finish == FinishReason::kEos)
        << FinishReasonName(last.at("a").finish);
    auto doc = nlohmann::json::parse(text, nullptr, false);
    ASSERT_TRUE(doc.is_object()) << text;
    EXPECT_TRUE(doc["name"].is_string());
    EXPECT_TRUE(doc["n"].is_number_integer());
    EXPECT_LE(doc["n"].get<int>(), 40);
  }
}

TEST_F(StructuredOutputTest, UnconstrainedRowsAreBitIdentical) {
  EngineRequest plain = Req("plain", ConstraintSpec(), 0.8f, 24);
  plain.sampling.ignore_eos = true;
  auto alone = Make();
  ASSERT_TRUE(alone->AddRequest(plain).ok());
  const auto expected = testing::DrainEngine(alone.get()).at("plain");
  // The same request batched beside constrained ones.
  auto mixed = Make();
  ASSERT_TRUE(
      mixed->AddRequest(Req("c1", ConstraintSpec::JsonSchema(kSchema), 0.0f))
          .ok());
  ASSERT_TRUE(mixed->AddRequest(plain).ok());
  ASSERT_TRUE(
      mixed->AddRequest(Req("c2", ConstraintSpec::Regex("[a-z]{3,9}"), 0.8f))
          .ok());
  const auto got = testing::DrainEngine(mixed.get());
  EXPECT_EQ(got.at("plain"), expected);
  // Every constrained token was masked (the prefill's first token
  // included); the unconstrained one never.
  const EngineStats stats = mixed->Stats();
  EXPECT_EQ(stats.constrained_rows,
            static_cast<int64_t>(got.at("c1").size() + got.at("c2").size()));
  EXPECT_GT(stats.constraint_seconds, 0.0);
  EXPECT_EQ(alone->Stats().constrained_rows, 0);
  // And without a guide cache at all.
  auto bare = Make(/*with_guides=*/false);
  ASSERT_TRUE(bare->AddRequest(plain).ok());
  EXPECT_EQ(testing::DrainEngine(bare.get()).at("plain"), expected);
}

TEST_F(StructuredOutputTest, PrefillThenDecodeAndResumeEqualColocated) {
  const EngineRequest req = Req("d", ConstraintSpec::JsonSchema(kSchema), 0.9f);
  auto colocated = Make();
  ASSERT_TRUE(colocated->AddRequest(req).ok());
  const auto expected = testing::DrainEngine(colocated.get()).at("d");
  ASSERT_GT(expected.size(), 4u);

  // Disaggregated: the prefill engine samples the first token under the
  // mask; the decode engine resumes the match after it.
  auto prefill = Make();
  auto decode = Make();
  auto reservation = decode->Reserve(req);
  ASSERT_TRUE(reservation.ok()) << reservation.status();
  EngineRequest p_req = req;
  p_req.sampling.max_tokens = 1;
  p_req.hold_blocks_on_finish = true;
  ASSERT_TRUE(prefill->AddRequest(p_req).ok());
  std::map<std::string, StepOutput> last;
  auto first = testing::DrainEngine(prefill.get(), &last);
  const auto& held = last.at("d").held_blocks;
  for (int l = 0; l < testing::TinyWeights()->config.num_layers; ++l) {
    for (size_t b = 0; b < held.size(); ++b) {
      std::memcpy(decode->kv_storage().Span(l, reservation->blocks[b]).data,
                  prefill->kv_storage().Span(l, held[b]).data,
                  prefill->kv_spec().LayerBlockBytes());
    }
  }
  prefill->ReleaseBlocks(held);
  ASSERT_EQ(first.at("d")[0], expected[0]);
  auto finish = decode->CompleteReservation("d", first.at("d")[0]);
  ASSERT_TRUE(finish.ok()) << finish.status();
  std::vector<int32_t> got = first.at("d");
  const auto rest = testing::DrainEngine(decode.get());
  got.insert(got.end(), rest.at("d").begin(), rest.at("d").end());
  EXPECT_EQ(got, expected);

  // A migrated stream: prompt plus the first 3 tokens, resumed after them.
  EngineRequest migrated = req;
  migrated.prompt.insert(migrated.prompt.end(), expected.begin(),
                         expected.begin() + 3);
  migrated.constraint_resume_tokens = 3;
  migrated.sampling.max_tokens -= 3;
  auto resumed = Make();
  ASSERT_TRUE(resumed->AddRequest(migrated).ok());
  const auto tail = testing::DrainEngine(resumed.get()).at("d");
  EXPECT_EQ(tail, std::vector<int32_t>(expected.begin() + 3, expected.end()));
  // Resumed tokens that break the constraint are refused.
  migrated.prompt.back() = tokenizer_->Encode("~", false)[0];
  migrated.prompt[migrated.prompt.size() - 3] =
      tokenizer_->Encode("~", false)[0];
  EXPECT_EQ(Make()->AddRequest(migrated).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(StructuredOutputTest, ChoiceEndsWithStopAndUnfinishedWithLength) {
  auto e = Make();
  ASSERT_TRUE(
      e->AddRequest(Req("c", ConstraintSpec::Choice({"alpha", "beta"}), 0.0f))
          .ok());
  // The regex needs 40 bytes; 5 tokens cannot finish it.
  ASSERT_TRUE(
      e->AddRequest(Req("r", ConstraintSpec::Regex("q{40}"), 0.0f, 5)).ok());
  std::map<std::string, StepOutput> last;
  const auto out = testing::DrainEngine(e.get(), &last);
  const std::string choice = Text(out.at("c"));
  EXPECT_TRUE(choice == "alpha" || choice == "beta") << choice;
  EXPECT_EQ(last.at("c").finish, FinishReason::kStop);
  EXPECT_EQ(Text(out.at("r")), "qqqqq");
  EXPECT_EQ(last.at("r").finish, FinishReason::kLength);
}

TEST_F(StructuredOutputTest, BadConstraintsAreRefused) {
  auto e = Make();
  absl::Status s = e->AddRequest(Req("x", ConstraintSpec::Regex("(a"), 0.0f));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("missing ')'"), std::string::npos) << s;
  s = e->AddRequest(
      Req("y", ConstraintSpec::JsonSchema(R"({"type":"object","oneOf":[]})"),
          0.0f));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("oneOf"), std::string::npos) << s;
  EXPECT_EQ(Make(/*with_guides=*/false)
                ->AddRequest(Req("z", ConstraintSpec::Regex("a"), 0.0f))
                .code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(e->HasWork());
}

}  // namespace
}  // namespace pdserve::engine
