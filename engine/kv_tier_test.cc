#include "engine/kv_tier.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "absl/synchronization/notification.h"
#include "engine/engine.h"
#include "engine/test_util.h"

namespace pdserve::engine {
namespace {

namespace fs = std::filesystem;

struct RunResult {
  std::vector<int32_t> tokens;
  std::vector<TokenLogprobs> logprobs;
  int32_t cached_prompt_tokens = -1;
};

bool SameLogprobs(const std::vector<TokenLogprobs>& a,
                  const std::vector<TokenLogprobs>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].token != b[i].token || a[i].logprob != b[i].logprob ||
        a[i].top != b[i].top)
      return false;
  }
  return true;
}

class KvTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::TempDir(
        std::string("kvtier_") +
        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    const ModelConfig& mc = testing::TinyWeights()->config;
    block_bytes_ = int64_t{16} * mc.num_layers * 2 * mc.num_kv_heads *
                   mc.head_dim * 4;  // fp32, block_size 16
  }
  void TearDown() override { fs::remove_all(dir_); }

  // An engine whose pool holds 8 blocks, over a file tier in dir_.
  std::unique_ptr<Engine> MakeTiered(KvTierConfig tier = {}) {
    EngineConfig cfg;
    cfg.kv_cache_bytes = 8 * block_bytes_;
    if (tier.dir.empty()) tier.dir = dir_;
    if (tier.capacity_bytes == 0) tier.capacity_bytes = 64 << 20;
    cfg.kv_offload = tier;
    auto e = Engine::Create(testing::TinyWeights(), cfg);
    EXPECT_TRUE(e.ok()) << e.status();
    EXPECT_EQ((*e)->block_manager().num_blocks(), 8);
    return std::move(*e);
  }
  static EngineRequest Req(const std::string& id, int len, int salt) {
    EngineRequest r;
    r.id = id;
    for (int i = 0; i < len; ++i)
      r.prompt.push_back((i * 37 + salt * 11 + 5) % 256);
    r.sampling.max_tokens = 8;
    r.sampling.temperature = 0.8f;
    r.sampling.seed = 99 + salt;
    r.sampling.ignore_eos = true;
    r.sampling.logprobs = true;
    r.sampling.top_logprobs = 5;
    return r;
  }
  static RunResult Run(Engine* e, EngineRequest req) {
    RunResult r;
    EXPECT_TRUE(e->AddRequest(std::move(req)).ok());
    for (int steps = 0; e->HasWork() && steps < 1000; ++steps) {
      auto step = e->Step();
      EXPECT_TRUE(step.ok()) << step.status();
      if (!step.ok()) break;
      for (StepOutput& o : *step) {
        r.tokens.insert(r.tokens.end(), o.new_tokens.begin(),
                        o.new_tokens.end());
        r.logprobs.insert(r.logprobs.end(), o.logprobs.begin(),
                          o.logprobs.end());
        if (o.finish != FinishReason::kNone)
          r.cached_prompt_tokens = o.cached_prompt_tokens;
      }
    }
    EXPECT_FALSE(e->HasWork());
    return r;
  }
  // Prompt A: 64 tokens (3 usable full blocks); A's 5 blocks plus B's 8
  // exceed the pool, so B evicts every block of A to the tier.
  static EngineRequest A(const std::string& id = "a") { return Req(id, 64, 1); }
  static EngineRequest B() { return Req("b", 120, 2); }
  RunResult Cold() {
    auto e = Engine::Create(testing::TinyWeights(), EngineConfig{});
    EXPECT_TRUE(e.ok());
    return Run(e->get(), A("cold"));
  }
  // Runs A then B, and waits until A's evicted blocks are on disk.
  void OffloadA(Engine* e) {
    Run(e, A("a0"));
    Run(e, B());
    ASSERT_TRUE(e->kv_tier()->WaitForWrites(absl::Seconds(30)));
    ASSERT_GE(e->Stats().kv_tier.blocks_stored, 4);
  }
  std::vector<BlockHash> HashesOfA(Engine* e) {
    std::vector<BlockHash> h;
    ExtendBlockHashes(e->cache_fingerprint(), "", A().prompt, 16, &h);
    return h;
  }
  static void ExpectSame(const RunResult& got, const RunResult& want) {
    EXPECT_EQ(got.tokens, want.tokens);
    EXPECT_TRUE(SameLogprobs(got.logprobs, want.logprobs));
  }
  static int64_t Failures(Engine* e, KvTierFailure f) {
    return e->Stats().kv_tier.failures[static_cast<int>(f)];
  }

  std::string dir_;
  int64_t block_bytes_ = 0;
};

TEST_F(KvTierTest, EvictedPrefixComesBackFromTheTierBitIdentical) {
  const RunResult cold = Cold();
  auto e = MakeTiered();
  OffloadA(e.get());
  const int64_t written = e->Stats().kv_tier.bytes_written;
  EXPECT_GE(written, 4 * block_bytes_);
  const RunResult again = Run(e.get(), A());
  ExpectSame(again, cold);
  EXPECT_EQ(again.cached_prompt_tokens, 48);  // 3 usable blocks, all loaded
  const EngineStats s = e->Stats();
  EXPECT_TRUE(s.has_kv_tier);
  EXPECT_EQ(s.kv_tier.hit_tokens, 48);
  EXPECT_EQ(s.kv_tier.blocks_loaded, 3);
  EXPECT_EQ(s.kv_tier.bytes_read, 3 * e->kv_tier()->file_bytes());
  for (int f = 0; f < kNumKvTierFailures; ++f)
    EXPECT_EQ(s.kv_tier.failures[f], 0) << KvTierFailureName(KvTierFailure(f));
  // A loaded block is a pool hit for the next identical prompt.
  const RunResult third = Run(e.get(), A("a2"));
  ExpectSame(third, cold);
  EXPECT_EQ(third.cached_prompt_tokens, 48);
  EXPECT_EQ(e->Stats().kv_tier.blocks_loaded, 3);
}

// All layers of pool block `block`, as bytes.
std::vector<unsigned char> BlockBytes(Engine* e, int32_t block) {
  const KvCacheSpec& spec = e->kv_spec();
  std::vector<unsigned char> out(spec.LayerBlockBytes() * spec.num_layers);
  for (int32_t l = 0; l < spec.num_layers; ++l) {
    EXPECT_TRUE(e->kv_storage()
                    .CopyToHost(l, block,
                                out.data() + l * spec.LayerBlockBytes(),
                                nullptr)
                    .ok());
  }
  return out;
}

TEST_F(KvTierTest, DecodeReservationTakesTierBlocksAsItsOwn) {
  auto cold = Engine::Create(testing::TinyWeights(), EngineConfig{});
  ASSERT_TRUE(cold.ok());
  Run(cold->get(), A("cold"));
  auto e = MakeTiered();
  OffloadA(e.get());
  const std::vector<BlockHash> hashes = HashesOfA(e.get());
  const std::vector<int32_t> cold_blocks =
      (*cold)->block_manager().Lookup(hashes);
  ASSERT_EQ(cold_blocks.size(), 4u);
  auto r = e->Reserve(A("r"));
  ASSERT_TRUE(r.ok()) << r.status();
  // Every full prompt block came from the tier: the prefill worker sends none.
  EXPECT_EQ(r->cached_blocks, 4);
  EXPECT_EQ(e->Stats().kv_tier.blocks_loaded, 4);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(BlockBytes(e.get(), r->blocks[i]),
              BlockBytes(cold->get(), cold_blocks[i]))
        << "block " << i;
  }
  // They are in the pool's prefix cache at once.
  EXPECT_EQ(e->block_manager().Lookup(hashes).size(), 4u);
  e->Abort("r");
  ASSERT_TRUE(e->Step().ok());
  EXPECT_EQ(e->Stats().blocks_active, 0);
}

enum class Fault { kCorrupt, kTruncated, kMissing };

class KvTierFaultTest : public KvTierTest,
                        public ::testing::WithParamInterface<Fault> {};

TEST_P(KvTierFaultTest, BadBlockFileMeansRecomputeWithEqualOutput) {
  const RunResult cold = Cold();
  auto e = MakeTiered();
  OffloadA(e.get());
  // Damage A's second block: the first loads, the rest is recomputed.
  const std::string path = e->kv_tier()->PathFor(HashesOfA(e.get())[1]);
  ASSERT_TRUE(fs::exists(path));
  KvTierFailure expected = KvTierFailure::kCorrupt;
  switch (GetParam()) {
    case Fault::kCorrupt: {
      std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(200);
      char c = 0;
      f.read(&c, 1);
      c ^= 0x10;
      f.seekp(200);
      f.write(&c, 1);
      break;
    }
    case Fault::kTruncated:
      fs::resize_file(path, fs::file_size(path) / 2);
      expected = KvTierFailure::kShort;
      break;
    case Fault::kMissing:
      fs::remove(path);
      expected = KvTierFailure::kMissing;
      break;
  }
  const RunResult again = Run(e.get(), A());
  ExpectSame(again, cold);
  EXPECT_EQ(again.cached_prompt_tokens, 16);
  EXPECT_EQ(Failures(e.get(), expected), 1);
  EXPECT_EQ(e->Stats().kv_tier.blocks_loaded, 1);
}

INSTANTIATE_TEST_SUITE_P(Faults, KvTierFaultTest,
                         ::testing::Values(Fault::kCorrupt, Fault::kTruncated,
                                           Fault::kMissing));

TEST_F(KvTierTest, FullTierMeansNoOffloadAndEqualOutput) {
  const RunResult cold = Cold();
  KvTierConfig tier;
  tier.capacity_bytes = block_bytes_;  // below one file (header + payload)
  auto e = MakeTiered(tier);
  Run(e.get(), A("a0"));
  Run(e.get(), B());
  ASSERT_TRUE(e->kv_tier()->WaitForWrites(absl::Seconds(30)));
  EXPECT_GE(Failures(e.get(), KvTierFailure::kFull), 4);
  EXPECT_EQ(e->Stats().kv_tier.blocks_stored, 0);
  const RunResult again = Run(e.get(), A());
  ExpectSame(again, cold);
  EXPECT_EQ(again.cached_prompt_tokens, 0);
}

TEST_F(KvTierTest, TierCapEvictsStoredBlocksInLruOrderButNotWrites) {
  KvTierConfig tier;
  auto e = MakeTiered(tier);
  const int64_t file = e->kv_tier()->file_bytes();
  e.reset();
  tier.capacity_bytes = 2 * file;
  absl::Notification release;
  tier.before_write = [&release] {
    release.WaitForNotificationWithTimeout(absl::Seconds(60));
  };
  e = MakeTiered(tier);
  Run(e.get(), A("a0"));
  Run(e.get(), B());
  // B evicted A's blocks tail first (3, 2, 1, 0). Blocks 3 and 2 took the
  // cap while being written, so 1 and 0 found the tier full.
  KvTierStats s = e->Stats().kv_tier;
  EXPECT_EQ(s.blocks_writing, 2);
  release.Notify();
  ASSERT_TRUE(e->kv_tier()->WaitForWrites(absl::Seconds(30)));
  s = e->Stats().kv_tier;
  EXPECT_EQ(s.blocks_stored, 2);
  EXPECT_EQ(s.bytes_used, 2 * file);
  EXPECT_EQ(s.failures[static_cast<int>(KvTierFailure::kFull)], 2);
  const std::vector<BlockHash> a = HashesOfA(e.get());
  EXPECT_EQ(e->kv_tier()->Match(std::span<const BlockHash>(a).subspan(2)), 2);
  // A again evicts B's blocks: the stored blocks of A make room (LRU).
  Run(e.get(), A("a1"));
  ASSERT_TRUE(e->kv_tier()->WaitForWrites(absl::Seconds(30)));
  s = e->Stats().kv_tier;
  EXPECT_EQ(s.blocks_stored, 2);
  EXPECT_EQ(e->kv_tier()->Match(std::span<const BlockHash>(a).subspan(2)), 0);
  size_t files = 0;
  for (const auto& d : fs::recursive_directory_iterator(dir_))
    files += d.path().extension() == ".kvb";
  EXPECT_EQ(files, 2u);
}

TEST_F(KvTierTest, FailedWriteMeansNoOffloadAndEqualOutput) {
  const RunResult cold = Cold();
  KvTierConfig tier;
  // Every write finds its directory gone, as on a disk that refuses writes.
  const std::string dir = dir_;
  tier.before_write = [dir] {
    std::error_code ec;
    for (const auto& d : fs::directory_iterator(dir, ec))
      fs::remove_all(d.path(), ec);
  };
  auto e = MakeTiered(tier);
  Run(e.get(), A("a0"));
  Run(e.get(), B());
  ASSERT_TRUE(e->kv_tier()->WaitForWrites(absl::Seconds(30)));
  EXPECT_GE(Failures(e.get(), KvTierFailure::kWriteError), 4);
  EXPECT_EQ(e->Stats().kv_tier.blocks_stored, 0);
  const RunResult again = Run(e.get(), A());
  ExpectSame(again, cold);
  EXPECT_EQ(again.cached_prompt_tokens, 0);
}

TEST_F(KvTierTest, SlowWriterDoesNotBlockTheEngine) {
  const RunResult cold = Cold();
  absl::Notification release;
  KvTierConfig tier;
  tier.before_write = [&release] {
    release.WaitForNotificationWithTimeout(absl::Seconds(60));
  };
  auto e = MakeTiered(tier);
  // Every step completes while the tier thread is stuck in its first write.
  Run(e.get(), A("a0"));
  Run(e.get(), B());
  const RunResult again = Run(e.get(), A());
  ExpectSame(again, cold);
  EXPECT_EQ(again.cached_prompt_tokens, 0);  // nothing was on disk yet
  KvTierStats s = e->Stats().kv_tier;
  EXPECT_EQ(s.blocks_stored, 0);
  EXPECT_GE(s.blocks_writing, 4);
  EXPECT_EQ(s.bytes_written, 0);
  release.Notify();
  ASSERT_TRUE(e->kv_tier()->WaitForWrites(absl::Seconds(30)));
  s = e->Stats().kv_tier;
  EXPECT_EQ(s.blocks_writing, 0);
  EXPECT_GE(s.blocks_stored, 4);
}

TEST_F(KvTierTest, ABlockBeingWrittenIsNotOfferedTwice) {
  absl::Notification release;
  KvTierConfig tier;
  tier.dir = dir_;
  tier.capacity_bytes = 1 << 20;
  tier.before_write = [&release] {
    release.WaitForNotificationWithTimeout(absl::Seconds(60));
  };
  const KvCacheSpec spec{2, 2, 16, 16, DType::kF32};
  auto pool = KvPool::Create(spec, 4);
  ASSERT_TRUE(pool.ok());
  auto t = KvFileTier::Create(tier, {1, 2}, spec);
  ASSERT_TRUE(t.ok()) << t.status();
  const BlockHash h{7, 8};
  (*t)->Offer(h, **pool, 0);
  (*t)->Offer(h, **pool, 1);
  EXPECT_EQ((*t)->Stats().blocks_writing, 1);
  EXPECT_EQ((*t)->Match(std::span<const BlockHash>(&h, 1)), 0);
  release.Notify();
  ASSERT_TRUE((*t)->WaitForWrites(absl::Seconds(30)));
  EXPECT_EQ((*t)->Stats().bytes_written, (*t)->file_bytes());
  EXPECT_EQ((*t)->Match(std::span<const BlockHash>(&h, 1)), 1);
}

TEST_F(KvTierTest, ClearedCacheEmptiesTheTier) {
  auto e = MakeTiered();
  OffloadA(e.get());
  e->block_manager().ClearCache();
  EXPECT_EQ(e->Stats().kv_tier.blocks_stored, 0);
  EXPECT_EQ(e->kv_tier()->Match(HashesOfA(e.get())), 0);
  ASSERT_TRUE(e->kv_tier()->WaitForWrites(absl::Seconds(30)));
  size_t files = 0;
  for (const auto& d : fs::recursive_directory_iterator(dir_))
    files += d.is_regular_file();
  EXPECT_EQ(files, 0u);
}

TEST_F(KvTierTest, StartUpRemovesBlocksOfEarlierModels) {
  const std::string old_dir = dir_ + "/0123456789abcdef0123456789abcdef";
  fs::create_directories(old_dir);
  std::ofstream(old_dir + "/x.kvb") << "old";
  std::ofstream(dir_ + "/keep.txt") << "not ours";
  auto e = MakeTiered();
  EXPECT_FALSE(fs::exists(old_dir));
  EXPECT_TRUE(fs::exists(dir_ + "/keep.txt"));
}

TEST_F(KvTierTest, ConfigIsValidated) {
  EngineConfig cfg;
  cfg.kv_offload.dir = dir_;
  EXPECT_FALSE(cfg.Validate().ok());  // no capacity
  cfg.kv_offload.capacity_bytes = 1 << 20;
  EXPECT_TRUE(cfg.Validate().ok());
  cfg.device = Device::kCuda;
  EXPECT_FALSE(cfg.Validate().ok());
}

}  // namespace
}  // namespace pdserve::engine
