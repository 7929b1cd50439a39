// Layer-wise KV streaming: which (layer, block) spans a prefill sends when,
// first from synthetic layer reports, then from a real engine running a
// chunked prefill.
#include "prefill_service/layer_streamer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <set>
#include <tuple>

#include "engine/engine_loop.h"
#include "model/model_init.h"
#include "model/weights.h"

namespace pdserve::prefill {
namespace {

// Records every span sent, with its bytes as they were at send time.
class RecordingSession : public kv_transfer::KvSendSession {
 public:
  explicit RecordingSession(engine::KvStorage* pool) : pool_(pool) {}
  absl::Status SendLayers(int32_t, int32_t) override {
    return absl::UnimplementedError("streaming uses SendBlocks");
  }
  absl::Status SendBlocks(
      int32_t first, int32_t last,
      std::span<const kv_transfer::BlockRef> blocks) override {
    for (int32_t l = first; l < last; ++l) {
      for (const auto& [index, physical] : blocks) {
        std::string bytes;
        if (pool_ != nullptr) {
          const engine::KvSpan span = pool_->Span(l, physical);
          bytes.assign(static_cast<const char*>(span.data), span.data_bytes);
        }
        const bool fresh = sent.emplace(std::pair{l, index}, bytes).second;
        EXPECT_TRUE(fresh) << "layer " << l << " block " << index << " twice";
        ++num_sent;
      }
    }
    return absl::OkStatus();
  }
  absl::StatusOr<kv_transfer::SendStats> Finish() override {
    return kv_transfer::SendStats{};
  }
  void Cancel() override {}

  std::map<std::pair<int32_t, int32_t>, std::string> sent;
  std::atomic<int> num_sent{0};

 private:
  engine::KvStorage* pool_;
};

engine::LayerWritten Report(int32_t layer, int32_t computed, int32_t prompt,
                            const std::vector<int32_t>& table) {
  return {layer, computed, prompt, table};
}

std::set<std::pair<int32_t, int32_t>> AllSpans(int layers, int from, int to) {
  std::set<std::pair<int32_t, int32_t>> out;
  for (int l = 0; l < layers; ++l)
    for (int i = from; i < to; ++i) out.emplace(l, i);
  return out;
}

std::set<std::pair<int32_t, int32_t>> Keys(const RecordingSession& s) {
  std::set<std::pair<int32_t, int32_t>> out;
  for (const auto& [key, bytes] : s.sent) out.insert(key);
  return out;
}

TEST(LayerStreamerTest, ChunkedPrefillSendsCompletedBlocksOncePerLayer) {
  // 3 layers, blocks of 4 tokens, a 14-token prompt (4 blocks, the last one
  // partial) in chunks of 6, 6 and 2 tokens; the receiver holds block 0.
  engine::BlockManager blocks(16);
  std::vector<int32_t> table;
  ASSERT_TRUE(blocks.Allocate(4, &table));
  LayerStreamer streamer(3, 4, /*skip_blocks=*/1, /*span_bytes=*/10,
                         /*max_queued_bytes=*/1000);
  RecordingSession session(nullptr);
  for (int l = 0; l < 3; ++l)
    streamer.OnLayerWritten(Report(l, 6, 14, table), blocks);
  ASSERT_TRUE(streamer.SendQueued(&session, absl::ZeroDuration()).ok());
  EXPECT_TRUE(session.sent.empty());  // block 0 is skipped, block 1 partial

  streamer.OnLayerWritten(Report(0, 12, 14, table), blocks);
  ASSERT_TRUE(streamer.SendQueued(&session, absl::ZeroDuration()).ok());
  // Layer 0 of blocks 1 and 2 leave before layers 1 and 2 were computed.
  EXPECT_EQ(Keys(session),
            (std::set<std::pair<int32_t, int32_t>>{{0, 1}, {0, 2}}));
  for (int l = 1; l < 3; ++l)
    streamer.OnLayerWritten(Report(l, 12, 14, table), blocks);
  EXPECT_FALSE(streamer.forward_done());
  for (int l = 0; l < 3; ++l)
    streamer.OnLayerWritten(Report(l, 14, 14, table), blocks);
  EXPECT_TRUE(streamer.forward_done());
  ASSERT_TRUE(streamer.SendRest(&session, table).ok());
  EXPECT_EQ(Keys(session), AllSpans(3, 1, 4));
  const LayerStreamer::Stats stats = streamer.stats();
  EXPECT_EQ(stats.spans_before_forward_end, 2u);
  EXPECT_EQ(stats.spans_streamed, 9u);
  EXPECT_EQ(stats.spans_at_end, 0u);

  // Blocks 1..3 were pinned once each; Close hands the pins back.
  for (int i = 1; i < 4; ++i) EXPECT_EQ(blocks.RefCount(table[i]), 2);
  EXPECT_EQ(blocks.RefCount(table[0]), 1);
  std::vector<int32_t> pins = streamer.Close();
  std::sort(pins.begin(), pins.end());
  std::vector<int32_t> want(table.begin() + 1, table.end());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(pins, want);
  // Reports after Close are ignored.
  streamer.OnLayerWritten(Report(0, 14, 14, table), blocks);
  EXPECT_TRUE(streamer.Close().empty());
}

TEST(LayerStreamerTest, FullQueueDefersSpansWithoutLosingOrRepeatingAny) {
  engine::BlockManager blocks(16);
  std::vector<int32_t> table;
  ASSERT_TRUE(blocks.Allocate(5, &table));
  // Room for one span: reports completing two blocks are skipped.
  LayerStreamer streamer(2, 4, 0, 10, 15);
  RecordingSession session(nullptr);
  streamer.OnLayerWritten(Report(0, 4, 20, table), blocks);  // queued
  streamer.OnLayerWritten(Report(1, 4, 20, table), blocks);  // queue full
  ASSERT_TRUE(streamer.SendQueued(&session, absl::ZeroDuration()).ok());
  streamer.OnLayerWritten(Report(0, 12, 20, table), blocks);  // 2 blocks: skip
  streamer.OnLayerWritten(Report(1, 12, 20, table), blocks);  // 3 blocks: skip
  EXPECT_EQ(streamer.stats().reports_skipped, 3u);
  ASSERT_TRUE(streamer.SendRest(&session, table).ok());
  EXPECT_EQ(Keys(session), AllSpans(2, 0, 5));
  EXPECT_EQ(streamer.stats().spans_at_end, 9u);
  streamer.Close();
}

TEST(LayerStreamerTest, NothingToSendWhenTheReceiverHoldsEveryBlock) {
  engine::BlockManager blocks(4);
  std::vector<int32_t> table;
  ASSERT_TRUE(blocks.Allocate(2, &table));
  LayerStreamer streamer(2, 4, 2, 10, 100);
  RecordingSession session(nullptr);
  for (int l = 0; l < 2; ++l)
    streamer.OnLayerWritten(Report(l, 8, 8, table), blocks);
  ASSERT_TRUE(streamer.SendRest(&session, table).ok());
  EXPECT_TRUE(session.sent.empty());
  EXPECT_TRUE(streamer.Close().empty());
}

class LayerStreamerEngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(std::filesystem::temp_directory_path() /
                           ("pdserve_streamer_" + std::to_string(::getpid())));
    engine::ModelInitOptions options;
    options.preset = "tiny";
    options.out_dir = *dir_;
    options.seed = 5;
    ASSERT_TRUE(engine::WriteRandomModel(options).ok());
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }
  static std::string* dir_;
};
std::string* LayerStreamerEngineTest::dir_ = nullptr;

TEST_F(LayerStreamerEngineTest, LayersLeaveWhileTheChunkedPrefillStillRuns) {
  auto weights = engine::ModelWeights::Load(*dir_);
  ASSERT_TRUE(weights.ok()) << weights.status();
  engine::EngineConfig config;
  config.block_size = 4;
  config.max_num_batched_tokens = 16;  // a 70-token prompt takes 5 steps
  config.kv_cache_bytes = 8 << 20;
  auto eng = engine::Engine::Create(
      std::make_shared<const engine::ModelWeights>(*std::move(weights)),
      config);
  ASSERT_TRUE(eng.ok()) << eng.status();
  engine::EngineLoop loop(*std::move(eng));
  const engine::KvCacheSpec& spec = loop.kv_spec();
  const int32_t prompt_len = 70, skip = 2;
  const int32_t num_blocks = (prompt_len + 3) / 4;

  auto streamer =
      std::make_shared<LayerStreamer>(spec.num_layers, spec.block_size, skip,
                                      spec.LayerBlockBytes(), int64_t{1} << 30);
  RecordingSession session(&loop.kv_storage_for_transfer());
  // Hook order, recorded on the engine thread.
  std::vector<std::pair<int32_t, int32_t>> reports;  // (layer, num_computed)
  engine::EngineRequest req;
  req.id = "p";
  for (int i = 0; i < prompt_len; ++i) req.prompt.push_back(1 + (i * 7) % 200);
  req.sampling.max_tokens = 1;
  req.hold_blocks_on_finish = true;
  req.on_layer_written = [&](const engine::LayerWritten& w,
                             engine::BlockManager& b) {
    streamer->OnLayerWritten(w, b);
    reports.emplace_back(w.layer, w.num_computed);
    // Hold the last chunk's forward pass at its first layer until earlier
    // layers went out: they must leave while the prefill still runs.
    if (w.num_computed == prompt_len && w.layer == 0) {
      const absl::Time until = absl::Now() + absl::Seconds(20);
      while (session.num_sent.load() == 0 && absl::Now() < until)
        absl::SleepFor(absl::Milliseconds(1));
    }
  };
  auto stream = loop.Submit(req);
  ASSERT_TRUE(stream.ok()) << stream.status();
  engine::StepOutput done;
  while (done.finish == engine::FinishReason::kNone) {
    absl::Duration wait = absl::Milliseconds(50);
    if (!streamer->forward_done()) {
      ASSERT_TRUE(streamer->SendQueued(&session, wait).ok());
      wait = absl::ZeroDuration();
    }
    for (auto& out : (*stream)->Pop(wait))
      if (out.finish != engine::FinishReason::kNone) done = std::move(out);
  }
  ASSERT_EQ(static_cast<int32_t>(done.held_blocks.size()), num_blocks);
  ASSERT_TRUE(streamer->SendRest(&session, done.held_blocks).ok());

  // The hook ran layer by layer, chunk by chunk.
  std::vector<std::pair<int32_t, int32_t>> want;
  for (int32_t computed : {16, 32, 48, 64, 70})
    for (int32_t l = 0; l < spec.num_layers; ++l)
      want.emplace_back(l, computed);
  EXPECT_EQ(reports, want);
  // Every (layer, block) the receiver lacks left exactly once, with the
  // bytes the prefill finally holds.
  EXPECT_EQ(Keys(session), AllSpans(spec.num_layers, skip, num_blocks));
  for (const auto& [key, bytes] : session.sent) {
    const auto [layer, index] = key;
    EXPECT_EQ(bytes, std::string(static_cast<const char*>(
                                     loop.kv_storage_for_transfer()
                                         .Span(layer, done.held_blocks[index])
                                         .data),
                                 spec.LayerBlockBytes()))
        << "layer " << layer << " block " << index;
  }
  const LayerStreamer::Stats stats = streamer->stats();
  EXPECT_GT(stats.spans_before_forward_end, 0u);
  EXPECT_EQ(stats.spans_streamed + stats.spans_at_end,
            static_cast<uint64_t>(spec.num_layers) * (num_blocks - skip));

  // Release pins and held blocks: nothing stays referenced.
  ASSERT_TRUE(loop.Call([&](engine::Engine& e) {
                    e.ReleaseBlocks(streamer->Close());
                    e.ReleaseBlocks(done.held_blocks);
                  })
                  .ok());
  const absl::StatusOr<engine::EngineStats> after =
      loop.Call([](engine::Engine& e) { return e.Stats(); });
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->blocks_active, 0);
}

}  // namespace
}  // namespace pdserve::prefill
