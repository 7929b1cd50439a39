#include "engine/engine.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "engine/test_util.h"
#include "kernels/cpu/matmul.h"

namespace pdserve::engine {
namespace {

class EngineTest : public ::testing::Test {
 protected:
  std::unique_ptr<Engine> Make(EngineConfig config = {},
                               KvEventSink sink = nullptr) {
    auto e = Engine::Create(testing::TinyWeights(), config, std::move(sink));
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(*e);
  }
  static EngineRequest Req(const std::string& id, int len, int salt,
                           uint32_t max_tokens, float temperature = 0.0f) {
    EngineRequest r;
    r.id = id;
    for (int i = 0; i < len; ++i)
      r.prompt.push_back((i * 31 + salt * 17 + 3) % 256);
    r.sampling.max_tokens = max_tokens;
    r.sampling.temperature = temperature;
    r.sampling.seed = 1234 + salt;
    r.sampling.ignore_eos = true;
    return r;
  }
  static std::map<std::string, std::vector<int32_t>> Drain(
      Engine* e, std::map<std::string, StepOutput>* last = nullptr) {
    return testing::DrainEngine(e, last);
  }
  static void ExpectNoLeaks(Engine* e) {
    const EngineStats s = e->Stats();
    EXPECT_EQ(s.blocks_active, 0);
    EXPECT_EQ(s.blocks_free + s.blocks_cached, e->block_manager().num_blocks());
  }
};

TEST_F(EngineTest, GenerationIsIdenticalAcrossBatchCompositions) {
  // Each request alone...
  std::map<std::string, std::vector<int32_t>> alone;
  for (int i = 0; i < 4; ++i) {
    auto e = Make();
    ASSERT_TRUE(e->AddRequest(Req("r" + std::to_string(i), 10 + 13 * i, i, 12,
                                  i % 2 ? 0.8f : 0.0f))
                    .ok());
    auto out = Drain(e.get());
    alone.insert(out.begin(), out.end());
  }
  // ...equals all of them together, with a tiny token budget forcing chunking.
  EngineConfig cfg;
  cfg.max_num_batched_tokens = 7;
  auto e = Make(cfg);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(e->AddRequest(Req("r" + std::to_string(i), 10 + 13 * i, i, 12,
                                  i % 2 ? 0.8f : 0.0f))
                    .ok());
  }
  EXPECT_EQ(Drain(e.get()), alone);
  ExpectNoLeaks(e.get());
}

TEST_F(EngineTest, SampledTokensDoNotDependOnTheKernelThreadCount) {
  // Rows without a constraint are sampled over the kernel threads; greedy
  // and seeded rows, top-k and top-p among them, must come out the same
  // whichever thread samples them.
  auto run = [&](int threads) {
    const int saved = kernels::KernelThreads();
    kernels::SetKernelThreads(threads);
    auto e = Make();
    for (int i = 0; i < 6; ++i) {
      EngineRequest r =
          Req("s" + std::to_string(i), 9 + 5 * i, i, 10, i == 0 ? 0.0f : 0.9f);
      if (i % 3 == 1) r.sampling.top_k = 20;
      if (i % 3 == 2) r.sampling.top_p = 0.8f;
      EXPECT_TRUE(e->AddRequest(r).ok());
    }
    auto out = Drain(e.get());
    ExpectNoLeaks(e.get());
    kernels::SetKernelThreads(saved);
    return out;
  };
  const auto one = run(1);
  ASSERT_EQ(one.size(), 6u);
  for (const auto& [id, tokens] : one) EXPECT_EQ(tokens.size(), 10u) << id;
  EXPECT_EQ(run(2), one);
  EXPECT_EQ(run(3), one);
}

TEST_F(EngineTest, LongPrefillChunkLetsAShortPromptFinishFirst) {
  // A 100-token prompt, then a 5-token one. Without a chunk limit the long
  // prompt takes the whole first step and the short one waits; with a limit
  // of 16 the short one is admitted beside the long one's first chunk and
  // produces its first token in step 1, while the long one needs 7 steps.
  // Tokens do not change.
  auto long_then_short = [&](int32_t budget, int32_t chunk) {
    EngineConfig cfg;
    cfg.max_num_batched_tokens = budget;
    cfg.long_prefill_chunk = chunk;
    auto e = Make(cfg);
    EXPECT_TRUE(e->AddRequest(Req("long", 100, 1, 4)).ok());
    EXPECT_TRUE(e->AddRequest(Req("short", 5, 2, 4)).ok());
    return e;
  };
  auto run = [&](int32_t chunk, std::map<std::string, int>* first_step) {
    auto e = long_then_short(128, chunk);
    std::map<std::string, std::vector<int32_t>> out;
    for (int step = 1; e->HasWork() && step < 1000; ++step) {
      auto outputs = e->Step();
      EXPECT_TRUE(outputs.ok()) << outputs.status();
      if (!outputs.ok()) break;
      for (const StepOutput& o : *outputs) {
        if (!o.new_tokens.empty() && !first_step->count(o.id))
          (*first_step)[o.id] = step;
        out[o.id].insert(out[o.id].end(), o.new_tokens.begin(),
                         o.new_tokens.end());
      }
    }
    ExpectNoLeaks(e.get());
    // Chunked or not, the prompts' 105 tokens go through prompt passes and
    // each request's 3 tokens after its first through one-token steps.
    EXPECT_EQ(e->Stats().prefill_tokens, 105);
    EXPECT_EQ(e->Stats().decode_tokens, 6);
    return out;
  };
  std::map<std::string, int> whole, chunked;
  const auto expected = run(0, &whole);
  EXPECT_EQ(whole["long"], 1);
  EXPECT_EQ(whole["short"], 1);  // same step: 105 tokens fit the budget
  EXPECT_EQ(run(16, &chunked), expected);
  EXPECT_EQ(chunked["short"], 1);
  EXPECT_EQ(chunked["long"], 7);  // ceil(100 / 16) steps of prefill

  // With a budget the long prompt fills, the short one waits a whole step
  // without a limit and none with one.
  auto tight = [&](int32_t chunk) {
    auto e = long_then_short(100, chunk);
    auto first = e->Step();
    EXPECT_TRUE(first.ok());
    bool short_started = false;
    for (const StepOutput& o : *first)
      short_started |= o.id == "short" && !o.new_tokens.empty();
    testing::DrainEngine(e.get());
    ExpectNoLeaks(e.get());
    return short_started;
  };
  EXPECT_FALSE(tight(0));
  EXPECT_TRUE(tight(32));

  EngineConfig bad;
  bad.long_prefill_chunk = -1;
  EXPECT_EQ(bad.Validate().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(EngineTest, PreemptionUnderMemoryPressureKeepsOutputsAndLeaksNothing) {
  auto reference = Make();
  for (int i = 0; i < 6; ++i)
    ASSERT_TRUE(
        reference->AddRequest(Req("p" + std::to_string(i), 30, i, 40)).ok());
  const auto expected = Drain(reference.get());
  // 12 blocks of 16 tokens: 6 requests of 70 tokens need 30 blocks together.
  EngineConfig cfg;
  cfg.kv_cache_bytes = 12 * 16 * testing::TinyWeights()->config.num_layers * 2 *
                       testing::TinyWeights()->config.num_kv_heads *
                       testing::TinyWeights()->config.head_dim * 4;
  auto e = Make(cfg);
  ASSERT_EQ(e->block_manager().num_blocks(), 12);
  for (int i = 0; i < 6; ++i)
    ASSERT_TRUE(e->AddRequest(Req("p" + std::to_string(i), 30, i, 40)).ok());
  EXPECT_EQ(Drain(e.get()), expected);
  EXPECT_GT(e->Stats().preemptions, 0);
  ExpectNoLeaks(e.get());
}

TEST_F(EngineTest, PrefixCacheHitsAreCountedAndDoNotChangeTokens) {
  std::vector<KvEvent> events;
  auto e = Make({}, [&](const KvEvent& ev) { events.push_back(ev); });
  ASSERT_TRUE(e->AddRequest(Req("a", 50, 7, 5)).ok());
  const auto first = Drain(e.get());
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events[0].type, KvEvent::Type::kStored);
  EXPECT_EQ(events[0].seq, 1u);
  ASSERT_TRUE(e->AddRequest(Req("b", 50, 7, 5)).ok());  // same prompt
  std::map<std::string, StepOutput> last;
  const auto second = Drain(e.get(), &last);
  EXPECT_EQ(second.at("b"), first.at("a"));
  EXPECT_EQ(last.at("b").cached_prompt_tokens, 48);  // 3 full blocks of 16
  EXPECT_EQ(last.at("b").finish, FinishReason::kLength);
  // A different cache salt never shares blocks.
  auto salted = Req("c", 50, 7, 5);
  salted.cache_salt = "tenant-x";
  ASSERT_TRUE(e->AddRequest(salted).ok());
  const auto third = Drain(e.get(), &last);
  EXPECT_EQ(last.at("c").cached_prompt_tokens, 0);
  EXPECT_EQ(third.at("c"), first.at("a"));
  EXPECT_EQ(e->Stats().prefix_hit_tokens, 48);
  EXPECT_EQ(e->Stats().prefix_queried_tokens, 150);
  ExpectNoLeaks(e.get());
}

TEST_F(EngineTest, RejectsBadRequestsWithTheRightCodes) {
  EngineConfig cfg;
  cfg.kv_cache_bytes = 4 * 16 * 2 * 2 * 2 * 16 * 4;  // 4 blocks
  auto e = Make(cfg);
  EXPECT_EQ(e->AddRequest(Req("x", 0, 0, 4)).code(),
            absl::StatusCode::kInvalidArgument);
  auto bad_tok = Req("x", 3, 0, 4);
  bad_tok.prompt[1] = 5000;
  EXPECT_EQ(e->AddRequest(bad_tok).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e->AddRequest(Req("x", 3, 0, 0)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e->AddRequest(Req("x", 2000, 0, 100)).code(),
            absl::StatusCode::kInvalidArgument);
  auto never = e->AddRequest(Req("x", 60, 0, 10));  // 70 tokens > 64 slots
  EXPECT_EQ(never.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(never.message()), ::testing::HasSubstr("can never"));
  ASSERT_TRUE(e->AddRequest(Req("x", 3, 0, 4)).ok());
  EXPECT_EQ(e->AddRequest(Req("x", 3, 0, 4)).code(),
            absl::StatusCode::kAlreadyExists);
}

TEST_F(EngineTest, AbortEndsTheRequestAndReleasesItsBlocks) {
  auto e = Make();
  ASSERT_TRUE(e->AddRequest(Req("a", 40, 1, 100)).ok());
  ASSERT_TRUE(e->AddRequest(Req("b", 40, 2, 3)).ok());
  ASSERT_TRUE(e->Step().ok());
  e->Abort("a");
  e->Abort("unknown");
  std::map<std::string, StepOutput> last;
  Drain(e.get(), &last);
  EXPECT_EQ(last.at("a").finish, FinishReason::kCancelled);
  EXPECT_EQ(last.at("b").finish, FinishReason::kLength);
  ExpectNoLeaks(e.get());
}

TEST_F(EngineTest, StopsAtEosUnlessIgnored) {
  auto weights = testing::TinyWeights();
  // Find a prompt whose greedy continuation hits EOS within 200 tokens.
  for (int salt = 0; salt < 50; ++salt) {
    auto e = Make();
    auto r = Req("e", 5, salt, 200);
    r.sampling.ignore_eos = false;
    r.sampling.temperature = 1.5f;
    ASSERT_TRUE(e->AddRequest(r).ok());
    std::map<std::string, StepOutput> last;
    auto out = Drain(e.get(), &last);
    if (last.at("e").finish == FinishReason::kEos) {
      EXPECT_EQ(out.at("e").back(), weights->config.eos_token_id);
      return;
    }
  }
  GTEST_FAIL() << "no sampled continuation reached EOS";
}

}  // namespace
}  // namespace pdserve::engine

namespace pdserve::engine {
namespace {

TEST_F(EngineTest, DisaggregatedPrefillThenDecodeEqualsColocated) {
  auto colocated = Make();
  auto req = Req("d", 45, 3, 10, 0.7f);
  ASSERT_TRUE(colocated->AddRequest(req).ok());
  const auto expected = Drain(colocated.get()).at("d");

  auto prefill = Make();
  auto decode = Make();
  // Decode reserves first; prefill computes, holds its blocks, and we copy
  // the KV spans (what a transport does) before completing the reservation.
  auto reservation = decode->Reserve(req);
  ASSERT_TRUE(reservation.ok()) << reservation.status();
  EXPECT_EQ(reservation->blocks.size(), 3u);
  EXPECT_EQ(reservation->cached_blocks, 0);
  auto p_req = req;
  p_req.sampling.max_tokens = 1;
  p_req.hold_blocks_on_finish = true;
  ASSERT_TRUE(prefill->AddRequest(p_req).ok());
  std::map<std::string, StepOutput> last;
  auto first = Drain(prefill.get(), &last);
  const auto& held = last.at("d").held_blocks;
  ASSERT_EQ(held.size(), 3u);
  EXPECT_EQ(prefill->Stats().blocks_active, 3);
  for (int l = 0; l < testing::TinyWeights()->config.num_layers; ++l) {
    for (size_t b = 0; b < held.size(); ++b) {
      std::memcpy(decode->kv_storage().Span(l, reservation->blocks[b]).data,
                  prefill->kv_storage().Span(l, held[b]).data,
                  prefill->kv_spec().LayerBlockBytes());
    }
  }
  prefill->ReleaseBlocks(held);
  ExpectNoLeaks(prefill.get());
  auto finish = decode->CompleteReservation("d", first.at("d")[0]);
  ASSERT_TRUE(finish.ok());
  EXPECT_EQ(*finish, FinishReason::kNone);
  auto rest = Drain(decode.get());
  std::vector<int32_t> got = first.at("d");
  got.insert(got.end(), rest["d"].begin(), rest["d"].end());
  EXPECT_EQ(got, expected);
  ExpectNoLeaks(decode.get());
  // A second reservation of the same prompt reuses the decode worker's cache.
  auto again = decode->Reserve(req);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->cached_blocks, 2);  // the two full prompt blocks
  decode->Abort("d");
  ASSERT_TRUE(decode->Step().ok());
  ExpectNoLeaks(decode.get());
}

}  // namespace
}  // namespace pdserve::engine
