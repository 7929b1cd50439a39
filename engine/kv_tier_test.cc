#include "kv_cache/kv_tier.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/status_cause.h"
#include "engine/engine.h"
#include "engine/engine_loop.h"
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

  // An engine whose pool holds 8 blocks, over a file tier in dir_ (or the
  // memory tier `tier` asks for).
  std::unique_ptr<Engine> MakeTiered(KvTierConfig tier = {},
                                     KvEventSink events = nullptr) {
    EngineConfig cfg;
    cfg.kv_cache_bytes = 8 * block_bytes_;
    if (tier.dir.empty() && tier.memory_bytes == 0) tier.dir = dir_;
    if (!tier.dir.empty() && tier.capacity_bytes == 0)
      tier.capacity_bytes = 64 << 20;
    cfg.kv_offload = tier;
    auto e = Engine::Create(testing::TinyWeights(), cfg, std::move(events));
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
      // Nothing scheduled: the request waits for the tier's reader thread.
      if (step->empty() && e->kv_tier() != nullptr)
        EXPECT_TRUE(e->kv_tier()->WaitForReads(absl::Seconds(30)));
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
  // One block's record (header + every layer) in this fixture's tiers.
  int64_t RecordBytes() {
    KvTierConfig probe;
    probe.memory_bytes = 1 << 20;
    return MakeTiered(probe)->kv_tier()->record_bytes();
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
  EXPECT_EQ(s.kv_tier.bytes_read, 3 * e->kv_tier()->record_bytes());
  for (int f = 0; f < kNumKvTierFailures; ++f)
    EXPECT_EQ(s.kv_tier.failures[f], 0) << KvTierFailureName(KvTierFailure(f));
  // A loaded block is a pool hit for the next identical prompt.
  const RunResult third = Run(e.get(), A("a2"));
  ExpectSame(third, cold);
  EXPECT_EQ(third.cached_prompt_tokens, 48);
  EXPECT_EQ(e->Stats().kv_tier.blocks_loaded, 3);
}

// A tier hit costs no extra forward passes: the files are read while the
// request is queued (on the tier's reader thread), and the step that admits
// it copies every matched block in and prefills the rest, so the first token
// comes from that one step (a load spread over steps, or a chunk split by the
// load, would show up in TTFT as whole forward passes).
TEST_F(KvTierTest, TierHitLoadsAndPrefillsTheRestInOneStep) {
  const RunResult cold = Cold();
  auto e = MakeTiered();
  OffloadA(e.get());
  const int64_t steps = e->Stats().steps;
  ASSERT_TRUE(e->AddRequest(A("hit")).ok());
  ASSERT_TRUE(e->kv_tier()->WaitForReads(absl::Seconds(30)));
  auto first = e->Step();
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->size(), 1u);
  ASSERT_EQ((*first)[0].new_tokens.size(), 1u);
  EXPECT_EQ((*first)[0].new_tokens[0], cold.tokens[0]);
  EXPECT_EQ((*first)[0].cached_prompt_tokens, 48);
  EXPECT_EQ(e->Stats().steps, steps + 1);
  EXPECT_EQ(e->Stats().kv_tier.blocks_loaded, 3);
  e->Abort("hit");
  while (e->HasWork()) ASSERT_TRUE(e->Step().ok());
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
  if (!r.ok()) {
    // The reads it queued are still in flight: it waits as for busy blocks.
    EXPECT_EQ(CauseOf(r.status()), StatusCause::kPoolBusy) << r.status();
    ASSERT_TRUE(e->kv_tier()->WaitForReads(absl::Seconds(30)));
    r = e->Reserve(A("r"));
  }
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

// The thread ids that read tier files (KvTierConfig::before_read).
struct ReaderThreads {
  absl::Mutex mu;
  std::vector<std::thread::id> ids ABSL_GUARDED_BY(mu);
  std::function<void()> Hook() {
    return [this] {
      absl::MutexLock l(&mu);
      ids.push_back(std::this_thread::get_id());
    };
  }
  // How many reads ran on `thread`, and how many in all.
  std::pair<int, int> On(std::thread::id thread) {
    absl::MutexLock l(&mu);
    return {static_cast<int>(std::count(ids.begin(), ids.end(), thread)),
            static_cast<int>(ids.size())};
  }
};

// The engine thread (here: this test's thread, which steps the engine) never
// reads a tier file: admission and reservation only copy reads the tier's
// reader thread finished, and the output is the same as a cold run.
TEST_F(KvTierTest, EngineThreadReadsNoTierFileAtAdmission) {
  const RunResult cold = Cold();
  ReaderThreads readers;
  KvTierConfig tier;
  tier.before_read = readers.Hook();
  auto e = MakeTiered(tier);
  OffloadA(e.get());
  const RunResult again = Run(e.get(), A());
  ExpectSame(again, cold);
  EXPECT_EQ(again.cached_prompt_tokens, 48);
  auto [mine, all] = readers.On(std::this_thread::get_id());
  EXPECT_EQ(mine, 0);
  EXPECT_GE(all, 3);
  // A decode reservation: evict A again, then reserve it.
  Run(e.get(), B());
  ASSERT_TRUE(e->kv_tier()->WaitForWrites(absl::Seconds(30)));
  auto r = e->Reserve(A("r"));
  if (!r.ok()) {
    ASSERT_EQ(CauseOf(r.status()), StatusCause::kPoolBusy) << r.status();
    ASSERT_TRUE(e->kv_tier()->WaitForReads(absl::Seconds(30)));
    r = e->Reserve(A("r"));
  }
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cached_blocks, 4);
  std::tie(mine, all) = readers.On(std::this_thread::get_id());
  EXPECT_EQ(mine, 0);
  EXPECT_GE(all, 7);
  e->Abort("r");
  ASSERT_TRUE(e->Step().ok());
}

// A tier read that does not finish stalls only the request that waits for
// it: the engine keeps stepping the running one, and admits the waiting one
// (with every block from the tier) once the read ends.
TEST_F(KvTierTest, HeldTierReadDoesNotStallTheEngine) {
  const RunResult cold = Cold();
  std::atomic<bool> hold{false};
  absl::Notification reading, release;
  KvTierConfig tier;
  tier.before_read = [&] {
    if (!hold.load()) return;
    if (!reading.HasBeenNotified()) reading.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(60));
  };
  auto e = MakeTiered(tier);
  OffloadA(e.get());
  EngineRequest other = Req("other", 20, 5);
  other.sampling.max_tokens = 16;
  ASSERT_TRUE(e->AddRequest(std::move(other)).ok());
  auto first = e->Step();
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(first->size(), 1u);  // "other" runs
  hold = true;
  ASSERT_TRUE(e->AddRequest(A("hit")).ok());
  reading.WaitForNotification();
  for (int i = 0; i < 4; ++i) {
    auto step = e->Step();
    ASSERT_TRUE(step.ok()) << step.status();
    ASSERT_EQ(step->size(), 1u) << "step " << i;
    EXPECT_EQ((*step)[0].id, "other");
  }
  EXPECT_EQ(e->Stats().num_waiting, 1);
  release.Notify();
  ASSERT_TRUE(e->kv_tier()->WaitForReads(absl::Seconds(30)));
  std::map<std::string, StepOutput> last;
  const auto tokens = testing::DrainEngine(e.get(), &last);
  EXPECT_EQ(tokens.at("hit"), cold.tokens);
  EXPECT_EQ(last.at("hit").cached_prompt_tokens, 48);
}

// Through the engine loop, a reservation whose tier reads are in flight is
// retried when they end (the tier's read listener wakes the engine thread),
// not when its deadline passes.
TEST_F(KvTierTest, LoopReservationIsServedWhenItsTierReadsEnd) {
  absl::Notification release;
  std::atomic<bool> hold{false};
  KvTierConfig tier;
  tier.before_read = [&] {
    if (hold.load()) release.WaitForNotificationWithTimeout(absl::Seconds(60));
  };
  auto e = MakeTiered(tier);
  OffloadA(e.get());
  hold = true;
  EngineLoop loop(std::move(e));
  absl::Notification served;
  absl::StatusOr<Reservation> r;
  std::thread caller([&] {
    r = loop.Reserve(A("r"), absl::Now() + absl::Seconds(60));
    served.Notify();
  });
  // Held reads: the reservation waits.
  EXPECT_FALSE(served.WaitForNotificationWithTimeout(absl::Milliseconds(50)));
  release.Notify();
  caller.join();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cached_blocks, 4);
  loop.Abort("r");
}

// Through the engine loop, a submitted request whose tier reads are held
// gets nothing until they end, then its whole prefix from the tier.
TEST_F(KvTierTest, LoopAdmitsATierHitWhenItsReadsEnd) {
  const RunResult cold = Cold();
  absl::Notification reading, release;
  std::atomic<bool> hold{false};
  KvTierConfig tier;
  tier.before_read = [&] {
    if (!hold.load()) return;
    if (!reading.HasBeenNotified()) reading.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(60));
  };
  auto e = MakeTiered(tier);
  OffloadA(e.get());
  hold = true;
  EngineLoop loop(std::move(e));
  auto stream = loop.Submit(A("hit"));
  ASSERT_TRUE(stream.ok()) << stream.status();
  reading.WaitForNotification();
  EXPECT_TRUE((*stream)->Pop(absl::Milliseconds(50)).empty());
  release.Notify();
  std::vector<int32_t> tokens;
  int32_t cached = -1;
  bool done = false;
  for (int polls = 0; !done && polls < 1000; ++polls) {
    for (StepOutput& o : (*stream)->Pop(absl::Seconds(30))) {
      tokens.insert(tokens.end(), o.new_tokens.begin(), o.new_tokens.end());
      if (o.finish != FinishReason::kNone) {
        cached = o.cached_prompt_tokens;
        done = true;
      }
    }
    ASSERT_TRUE((*stream)->error().ok()) << (*stream)->error();
  }
  ASSERT_TRUE(done);
  EXPECT_EQ(tokens, cold.tokens);
  EXPECT_EQ(cached, 48);
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
  const int64_t file = e->kv_tier()->record_bytes();
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
  auto t = KvTier::Create(tier, {1, 2}, **pool);
  ASSERT_TRUE(t.ok()) << t.status();
  const BlockHash h{7, 8};
  (*t)->Offer(h, **pool, 0);
  (*t)->Offer(h, **pool, 1);
  EXPECT_EQ((*t)->Stats().blocks_writing, 1);
  EXPECT_EQ((*t)->Match(std::span<const BlockHash>(&h, 1)), 0);
  release.Notify();
  ASSERT_TRUE((*t)->WaitForWrites(absl::Seconds(30)));
  EXPECT_EQ((*t)->Stats().bytes_written, (*t)->record_bytes());
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
  EXPECT_FALSE(cfg.Validate().ok());  // no disk tier on a GPU worker
  cfg.kv_offload.dir.clear();
  cfg.kv_offload.memory_bytes = 1 << 20;
  EXPECT_TRUE(cfg.Validate().ok());  // a host-memory tier on any device
  cfg.kv_offload.dir = dir_;
  EXPECT_FALSE(cfg.Validate().ok());  // one tier per worker
  cfg.kv_offload.dir.clear();
  cfg.kv_offload.memory_bytes = -1;
  EXPECT_FALSE(cfg.Validate().ok());
}

// --- The host-memory tier (--kv-offload-memory): the same tier logic over
// slots in one arena; on CPU plain host memory, on CUDA pinned.

class KvMemoryTierTest : public KvTierTest {
 protected:
  std::unique_ptr<Engine> MakeMemoryTiered(int64_t records,
                                           KvEventSink events = nullptr) {
    KvTierConfig tier;
    tier.memory_bytes = records * RecordBytes();
    return MakeTiered(tier, std::move(events));
  }
};

TEST_F(KvMemoryTierTest, EvictedPrefixComesBackBitIdentical) {
  const RunResult cold = Cold();
  auto e = MakeMemoryTiered(64);
  ASSERT_EQ(e->kv_tier()->kind(), KvTierKind::kHostMemory);
  OffloadA(e.get());
  const RunResult again = Run(e.get(), A());
  ExpectSame(again, cold);
  EXPECT_EQ(again.cached_prompt_tokens, 48);
  const EngineStats s = e->Stats();
  EXPECT_EQ(s.kv_tier.kind, KvTierKind::kHostMemory);
  EXPECT_EQ(s.kv_tier.hit_tokens, 48);
  EXPECT_EQ(s.kv_tier.blocks_loaded, 3);
  EXPECT_GT(s.kv_tier.LoadTokensPerSecond(), 0);
  for (int f = 0; f < kNumKvTierFailures; ++f)
    EXPECT_EQ(s.kv_tier.failures[f], 0) << KvTierFailureName(KvTierFailure(f));
  // The decode path reads it as well.
  auto cold_engine = Engine::Create(testing::TinyWeights(), EngineConfig{});
  ASSERT_TRUE(cold_engine.ok());
  Run(cold_engine->get(), A("cold"));
  Run(e.get(), B());  // evicts A again (still in the tier: no copy)
  auto r = e->Reserve(A("r"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cached_blocks, 4);
  const std::vector<int32_t> cold_blocks =
      (*cold_engine)->block_manager().Lookup(HashesOfA(e.get()));
  ASSERT_EQ(cold_blocks.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(BlockBytes(e.get(), r->blocks[i]),
              BlockBytes(cold_engine->get(), cold_blocks[i]))
        << "block " << i;
  }
  e->Abort("r");
  ASSERT_TRUE(e->Step().ok());
}

TEST_F(KvMemoryTierTest, CapKeepsTheHeadsOfChainsInLruOrder) {
  const RunResult cold = Cold();
  auto e = MakeMemoryTiered(2);
  Run(e.get(), A("a0"));
  Run(e.get(), B());
  // B evicted A's blocks tail first (3, 2, 1, 0) into two slots: 1 and 0
  // pushed 3 and 2 out, so the tier keeps the chain's head.
  KvTierStats s = e->Stats().kv_tier;
  EXPECT_EQ(s.blocks_stored, 2);
  EXPECT_EQ(s.blocks_writing, 0);
  EXPECT_EQ(s.bytes_used, 2 * e->kv_tier()->record_bytes());
  const std::vector<BlockHash> a = HashesOfA(e.get());
  EXPECT_EQ(e->kv_tier()->Match(a), 2);
  const RunResult again = Run(e.get(), A());
  ExpectSame(again, cold);
  EXPECT_EQ(again.cached_prompt_tokens, 32);
  // While A's blocks were pinned for loading, B's evicted blocks found the
  // tier full rather than pushing them out.
  EXPECT_GT(Failures(e.get(), KvTierFailure::kFull), 0);
}

TEST_F(KvMemoryTierTest, CorruptRecordMeansRecomputeWithEqualOutput) {
  const RunResult cold = Cold();
  auto e = MakeMemoryTiered(64);
  OffloadA(e.get());
  std::span<unsigned char> rec =
      e->kv_tier()->RecordForTest(HashesOfA(e.get())[1]);
  ASSERT_FALSE(rec.empty());
  rec[200] ^= 0x10;
  const RunResult again = Run(e.get(), A());
  ExpectSame(again, cold);
  EXPECT_EQ(again.cached_prompt_tokens, 16);
  EXPECT_EQ(Failures(e.get(), KvTierFailure::kCorrupt), 1);
}

TEST_F(KvMemoryTierTest, ClearedCacheEmptiesTheTierAndFreesItsSlots) {
  auto e = MakeMemoryTiered(4);
  OffloadA(e.get());
  EXPECT_EQ(e->Stats().kv_tier.blocks_stored, 4);
  e->block_manager().ClearCache();
  EXPECT_EQ(e->Stats().kv_tier.blocks_stored, 0);
  EXPECT_EQ(e->kv_tier()->Match(HashesOfA(e.get())), 0);
  // Every slot is free again: A's blocks all fit once more.
  OffloadA(e.get());
  EXPECT_EQ(e->Stats().kv_tier.blocks_stored, 4);
  EXPECT_EQ(Failures(e.get(), KvTierFailure::kFull), 0);
}

TEST_F(KvMemoryTierTest, RecordsOfAnotherModelAreNotLoaded) {
  const KvCacheSpec spec{2, 2, 16, 16, DType::kF32};
  auto pool = KvPool::Create(spec, 4);
  ASSERT_TRUE(pool.ok());
  KvTierConfig cfg;
  cfg.memory_bytes = 1 << 20;
  auto mine = KvTier::Create(cfg, {1, 2}, **pool);
  auto other = KvTier::Create(cfg, {3, 4}, **pool);
  ASSERT_TRUE(mine.ok() && other.ok());
  const BlockHash h{7, 8};
  EXPECT_TRUE((*mine)->Offer(h, **pool, 0));
  EXPECT_TRUE((*other)->Offer(h, **pool, 0));
  EXPECT_TRUE((*mine)->Load(h, **pool, 1).ok());
  // The other model's record under the same hash: its fingerprint differs.
  std::span<unsigned char> a = (*mine)->RecordForTest(h);
  std::span<unsigned char> b = (*other)->RecordForTest(h);
  ASSERT_EQ(a.size(), b.size());
  std::copy(b.begin(), b.end(), a.begin());
  absl::Status s = (*mine)->Load(h, **pool, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(
      (*mine)->Stats().failures[static_cast<int>(KvTierFailure::kCorrupt)], 1);
  EXPECT_EQ((*mine)->Match(std::span<const BlockHash>(&h, 1)), 0);
}

// A pool whose CopyFromHost (the copy of a tier Load) announces itself and
// then waits for the test: the Load is then caught mid-copy.
class CopyLatchStorage final : public KvStorage {
 public:
  explicit CopyLatchStorage(KvStorage& pool) : pool_(pool) {}
  const KvCacheSpec& spec() const override { return pool_.spec(); }
  int64_t num_blocks() const override { return pool_.num_blocks(); }
  KvMemory memory() const override { return pool_.memory(); }
  KvSpan Span(int32_t layer, int64_t block) override {
    return pool_.Span(layer, block);
  }
  absl::Status CopyToHost(int32_t layer, int64_t block, void* data,
                          void* scales) override {
    return pool_.CopyToHost(layer, block, data, scales);
  }
  absl::Status CopyFromHost(int32_t layer, int64_t block, const void* data,
                            const void* scales) override {
    if (!copying.HasBeenNotified()) copying.Notify();
    release.WaitForNotification();
    return pool_.CopyFromHost(layer, block, data, scales);
  }
  absl::Notification copying, release;

 private:
  KvStorage& pool_;
};

// A Load (e.g. a peer pull's RPC thread) copying a memory record holds no
// tier lock: an offer from the engine's eviction path meanwhile returns at
// once. The record being read keeps its slot (the one-slot tier cannot take
// the offer) until the Load ends, and the Load's bytes are the record's.
TEST_F(KvMemoryTierTest, LoadCopiesWithoutTheTierLock) {
  const KvCacheSpec spec{2, 2, 16, 16, DType::kF32};
  auto pool = KvPool::Create(spec, 4);
  ASSERT_TRUE(pool.ok());
  for (int32_t l = 0; l < spec.num_layers; ++l) {
    KvSpan span = (*pool)->Span(l, 0);
    auto* p = static_cast<unsigned char*>(span.data);
    for (size_t i = 0; i < span.data_bytes; ++i) p[i] = (i * 7 + l) & 0xff;
  }
  KvTierConfig probe;
  probe.memory_bytes = 1 << 20;
  auto sized = KvTier::Create(probe, {1, 2}, **pool);
  ASSERT_TRUE(sized.ok());
  KvTierConfig cfg;
  cfg.memory_bytes = (*sized)->record_bytes();  // one slot
  auto t = KvTier::Create(cfg, {1, 2}, **pool);
  ASSERT_TRUE(t.ok()) << t.status();
  const BlockHash h1{1, 1}, h2{2, 2};
  ASSERT_TRUE((*t)->Offer(h1, **pool, 0));
  CopyLatchStorage latch(**pool);
  absl::Status loaded = absl::UnknownError("not run");
  std::thread loader([&] { loaded = (*t)->Load(h1, latch, 1); });
  latch.copying.WaitForNotification();
  // The engine's eviction path, while the Load is mid-copy.
  absl::Notification offered;
  bool kept = true;
  std::thread evictor([&] {
    kept = (*t)->Offer(h2, **pool, 2);
    offered.Notify();
  });
  const bool without_waiting =
      offered.WaitForNotificationWithTimeout(absl::Seconds(20));
  EXPECT_TRUE(without_waiting) << "Offer waited for a Load's copy";
  latch.release.Notify();
  evictor.join();
  loader.join();
  // h1 was dropped to make room, but its slot stayed with its reader.
  EXPECT_FALSE(kept);
  EXPECT_EQ((*t)->Stats().failures[static_cast<int>(KvTierFailure::kFull)], 1);
  ASSERT_TRUE(loaded.ok()) << loaded;
  for (int32_t l = 0; l < spec.num_layers; ++l) {
    KvSpan a = (*pool)->Span(l, 0), b = (*pool)->Span(l, 1);
    EXPECT_EQ(std::memcmp(a.data, b.data, a.data_bytes), 0) << "layer " << l;
  }
  // The last reader freed the slot: the next offer gets it.
  EXPECT_TRUE((*t)->Offer(h2, **pool, 2));
  EXPECT_EQ((*t)->Match(std::span<const BlockHash>(&h2, 1)), 1);
}

TEST_F(KvMemoryTierTest, TooSmallForOneBlockIsRefused) {
  EngineConfig cfg;
  cfg.kv_cache_bytes = 8 * block_bytes_;
  cfg.kv_offload.memory_bytes = 100;
  auto e = Engine::Create(testing::TinyWeights(), cfg);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition);
}

// --- KV events per tier: what the router's index is fed.

// The sets a subscriber rebuilds from one worker's event stream.
struct TierSets {
  std::array<std::set<std::pair<uint64_t, uint64_t>>, kNumKvTierKinds> sets;
  uint64_t last_seq = 0;
  bool in_order = true;
  static std::pair<uint64_t, uint64_t> Key(const BlockHash& h) {
    return {h.hi, h.lo};
  }
  void Apply(const KvEvent& e) {
    in_order = in_order && e.seq == last_seq + 1;
    last_seq = e.seq;
    auto& to = sets[static_cast<int>(e.tier)];
    switch (e.type) {
      case KvEvent::Type::kStored:
        for (const BlockHash& h : e.hashes) to.insert(Key(h));
        break;
      case KvEvent::Type::kRemoved:
        for (const BlockHash& h : e.hashes) to.erase(Key(h));
        break;
      case KvEvent::Type::kMoved:
        for (const BlockHash& h : e.hashes) {
          sets[static_cast<int>(e.from_tier)].erase(Key(h));
          to.insert(Key(h));
        }
        break;
      case KvEvent::Type::kCleared:
        for (auto& s : sets) s.clear();
        break;
    }
  }
  static std::set<std::pair<uint64_t, uint64_t>> Of(
      const std::vector<BlockHash>& hashes) {
    std::set<std::pair<uint64_t, uint64_t>> out;
    for (const BlockHash& h : hashes) out.insert(Key(h));
    return out;
  }
  // Equal to what the engine holds now, pool and tier.
  void ExpectEqual(Engine* e) {
    const Engine::KvSnapshot snap = e->TakeKvSnapshot();
    EXPECT_EQ(snap.seq, last_seq);
    EXPECT_EQ(sets[0], Of(snap.pool));
    ASSERT_TRUE(snap.has_tier);
    EXPECT_EQ(sets[static_cast<int>(snap.tier_kind)], Of(snap.tier));
    EXPECT_TRUE(in_order);
  }
};

// Counts `hashes` among events of one type and tier.
int CountIn(const std::vector<KvEvent>& events, KvEvent::Type type,
            KvTierKind tier, const std::vector<BlockHash>& hashes) {
  int n = 0;
  for (const KvEvent& e : events) {
    if (e.type != type || e.tier != tier) continue;
    for (const BlockHash& h : e.hashes)
      n += std::find(hashes.begin(), hashes.end(), h) != hashes.end();
  }
  return n;
}

class KvTierEventTest : public KvTierTest,
                        public ::testing::WithParamInterface<KvTierKind> {
 protected:
  std::unique_ptr<Engine> Make(std::vector<KvEvent>* log) {
    KvTierConfig tier;
    if (GetParam() == KvTierKind::kHostMemory) tier.memory_bytes = 64 << 20;
    return MakeTiered(tier, [log](const KvEvent& e) { log->push_back(e); });
  }
};

TEST_P(KvTierEventTest, EventsFollowBlocksAcrossTiers) {
  const KvTierKind kind = GetParam();
  std::vector<KvEvent> log;
  auto e = Make(&log);
  OffloadA(e.get());
  e->PublishTierEvents();
  const std::vector<BlockHash> a = HashesOfA(e.get());
  if (kind == KvTierKind::kDisk) {
    // Evicted (removed from the pool), then stored in the tier once written.
    EXPECT_EQ(CountIn(log, KvEvent::Type::kRemoved, KvTierKind::kPool, a), 4);
    EXPECT_EQ(CountIn(log, KvEvent::Type::kStored, kind, a), 4);
  } else {
    // Stored at once: one move per block, pool -> host memory.
    EXPECT_EQ(CountIn(log, KvEvent::Type::kMoved, kind, a), 4);
    EXPECT_EQ(CountIn(log, KvEvent::Type::kStored, kind, a), 0);
  }
  TierSets sets;
  for (const KvEvent& ev : log) sets.Apply(ev);
  sets.ExpectEqual(e.get());
  EXPECT_EQ(sets.sets[static_cast<int>(kind)], TierSets::Of(a));
  // Loaded back: stored in the pool again, still in the (inclusive) tier.
  log.clear();
  Run(e.get(), A("a1"));
  e->PublishTierEvents();
  EXPECT_EQ(CountIn(log, KvEvent::Type::kStored, KvTierKind::kPool, a), 4);
  // Evicted again: the tier has them, so the pool reports a move.
  Run(e.get(), B());
  ASSERT_TRUE(e->kv_tier()->WaitForWrites(absl::Seconds(30)));
  e->PublishTierEvents();
  EXPECT_GE(CountIn(log, KvEvent::Type::kMoved, kind, a), 3);
  for (const KvEvent& ev : log) sets.Apply(ev);
  sets.ExpectEqual(e.get());
  // cleared covers the tier: nothing is left in either set.
  log.clear();
  e->block_manager().ClearCache();
  e->PublishTierEvents();
  ASSERT_EQ(log.size(), 1u);
  EXPECT_EQ(log[0].type, KvEvent::Type::kCleared);
  sets.Apply(log[0]);
  sets.ExpectEqual(e.get());
  EXPECT_TRUE(sets.sets[static_cast<int>(kind)].empty());
}

TEST_P(KvTierEventTest, SnapshotPlusLaterEventsEqualsTheTier) {
  std::vector<KvEvent> log;
  absl::Notification release;
  KvTierConfig tier;
  if (GetParam() == KvTierKind::kHostMemory) {
    tier.memory_bytes = 3 * RecordBytes();
  } else {
    tier.capacity_bytes = 3 * RecordBytes();
    tier.before_write = [&release] {
      release.WaitForNotificationWithTimeout(absl::Seconds(60));
    };
  }
  auto e = MakeTiered(tier, [&log](const KvEvent& ev) { log.push_back(ev); });
  Run(e.get(), A("a0"));
  Run(e.get(), B());
  // Disk: the writes are still held back; the snapshot has none of them.
  const Engine::KvSnapshot snap = e->TakeKvSnapshot();
  TierSets sets;
  sets.last_seq = snap.seq;
  for (const BlockHash& h : snap.pool) sets.sets[0].insert(TierSets::Key(h));
  for (const BlockHash& h : snap.tier)
    sets.sets[static_cast<int>(snap.tier_kind)].insert(TierSets::Key(h));
  release.Notify();
  ASSERT_TRUE(e->kv_tier()->WaitForWrites(absl::Seconds(30)));
  // More traffic: A comes back from the tier, B is evicted (the cap of 3
  // drops blocks: removed events), then everything is published.
  Run(e.get(), A("a1"));
  Run(e.get(), B());
  ASSERT_TRUE(e->kv_tier()->WaitForWrites(absl::Seconds(30)));
  e->PublishTierEvents();
  EXPECT_GT(
      CountIn(log, KvEvent::Type::kRemoved, GetParam(), HashesOfA(e.get())) +
          e->Stats().kv_tier.failures[static_cast<int>(KvTierFailure::kFull)],
      0);
  for (const KvEvent& ev : log)
    if (ev.seq > snap.seq) sets.Apply(ev);
  sets.ExpectEqual(e.get());
}

INSTANTIATE_TEST_SUITE_P(Tiers, KvTierEventTest,
                         ::testing::Values(KvTierKind::kDisk,
                                           KvTierKind::kHostMemory),
                         [](const auto& info) {
                           return std::string(KvTierKindName(info.param));
                         });

}  // namespace
}  // namespace pdserve::engine
