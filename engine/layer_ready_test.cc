// LayerReadySequencer over a fake device whose progress the test drives: the
// ordering logic the CUDA backend runs with one cudaEvent per layer.
#include "engine/layer_ready.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace pdserve::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

// A device with one in-order queue. Layers finish only when the test says so
// (Complete) or when the host blocks on them (Wait), and never before their
// marker was recorded.
class FakeLayerEvents : public LayerReadyEvents {
 public:
  absl::Status Record(int32_t layer) override {
    ++records;
    if (fail_record_at == layer) return absl::InternalError("record failed");
    recorded = layer + 1;
    completed = std::min(completed, layer);  // a re-recorded marker is pending
    return absl::OkStatus();
  }
  absl::StatusOr<bool> Ready(int32_t layer) override {
    ++polls;
    if (fail_ready_at == layer) return absl::InternalError("device fault");
    return layer < completed;
  }
  absl::Status Wait(int32_t layer) override {
    ++waits;
    if (fail_wait_at == layer) return absl::InternalError("device fault");
    completed = std::max(completed, std::min(layer + 1, recorded));
    return absl::OkStatus();
  }
  // The device finishes the work up to and including `layer`'s marker.
  void Complete(int32_t layer) {
    completed = std::max(completed, std::min(layer + 1, recorded));
  }

  int32_t recorded = 0;   // markers in the queue: layers [0, recorded)
  int32_t completed = 0;  // finished: layers [0, completed)
  int records = 0, polls = 0, waits = 0;
  std::optional<int32_t> fail_record_at, fail_ready_at, fail_wait_at;
};

class LayerReadySequencerTest : public ::testing::Test {
 protected:
  LayerReadySequencerTest() {
    hook_ = [this](int32_t layer) {
      // A hook only ever sees a layer whose KV write has finished.
      EXPECT_LT(layer, events_.completed) << "hook before its layer finished";
      fired_.push_back(layer);
    };
  }
  FakeLayerEvents events_;
  std::vector<int32_t> fired_;
  LlamaModel::LayerWrittenFn hook_;
};

TEST_F(LayerReadySequencerTest, HooksRunInLayerOrderOnceEachAfterTheirLayer) {
  LayerReadySequencer seq(&events_, &hook_);
  ASSERT_TRUE(seq.LayerEnqueued(0).ok());
  EXPECT_THAT(fired_, IsEmpty());  // layer 0 still running
  ASSERT_TRUE(seq.LayerEnqueued(1).ok());
  EXPECT_THAT(fired_, IsEmpty());
  events_.Complete(1);  // layers 0 and 1 finish together
  ASSERT_TRUE(seq.LayerEnqueued(2).ok());
  EXPECT_THAT(fired_, ElementsAre(0, 1));
  ASSERT_TRUE(seq.LayerEnqueued(3).ok());
  ASSERT_TRUE(seq.Poll().ok());
  EXPECT_THAT(fired_, ElementsAre(0, 1));  // 2 and 3 not finished
  ASSERT_TRUE(seq.Drain().ok());
  EXPECT_THAT(fired_, ElementsAre(0, 1, 2, 3));
  EXPECT_EQ(events_.waits, 2);    // only the layers not seen finished by polls
  ASSERT_TRUE(seq.Drain().ok());  // a second drain runs nothing again
  EXPECT_THAT(fired_, ElementsAre(0, 1, 2, 3));
  EXPECT_EQ(seq.layers_reported(), 4);
}

TEST_F(LayerReadySequencerTest, HooksRunWhileLaterLayersAreStillEnqueued) {
  // A device that keeps up: every layer finishes right after its marker, so
  // each hook runs during the pass, before the last layer is even enqueued.
  LayerReadySequencer seq(&events_, &hook_);
  for (int32_t l = 0; l < 6; ++l) {
    ASSERT_TRUE(seq.LayerEnqueued(l).ok());
    events_.Complete(l);
    ASSERT_TRUE(seq.Poll().ok());
    EXPECT_EQ(static_cast<int32_t>(fired_.size()), l + 1);
  }
  ASSERT_TRUE(seq.Drain().ok());
  EXPECT_THAT(fired_, ElementsAre(0, 1, 2, 3, 4, 5));
  EXPECT_EQ(events_.waits, 0);
}

TEST_F(LayerReadySequencerTest, DeviceErrorMidPassRunsNoLaterHook) {
  LayerReadySequencer seq(&events_, &hook_);
  ASSERT_TRUE(seq.LayerEnqueued(0).ok());
  ASSERT_TRUE(seq.LayerEnqueued(1).ok());
  events_.Complete(1);
  ASSERT_TRUE(seq.LayerEnqueued(2).ok());  // polls 0, 1 (ready), 2 (not yet)
  EXPECT_THAT(fired_, ElementsAre(0, 1));
  events_.fail_ready_at = 2;  // the device faults while running layer 2
  events_.Complete(2);
  // Polling layer 2 now hits the fault: the pass fails and stays failed.
  EXPECT_FALSE(seq.LayerEnqueued(3).ok());
  EXPECT_FALSE(seq.Drain().ok());
  EXPECT_FALSE(seq.Poll().ok());
  EXPECT_THAT(fired_, ElementsAre(0, 1));
  const int records = events_.records, waits = events_.waits;
  EXPECT_FALSE(seq.LayerEnqueued(4).ok());
  EXPECT_EQ(events_.records, records);  // a failed pass touches no marker
  EXPECT_EQ(events_.waits, waits);
}

TEST_F(LayerReadySequencerTest, RecordFailureRunsOnlyTheLayersBefore) {
  events_.fail_record_at = 2;
  LayerReadySequencer seq(&events_, &hook_);
  ASSERT_TRUE(seq.LayerEnqueued(0).ok());
  ASSERT_TRUE(seq.LayerEnqueued(1).ok());
  EXPECT_FALSE(seq.LayerEnqueued(2).ok());
  EXPECT_FALSE(seq.Drain().ok());  // does not wait for 0 and 1 either
  EXPECT_THAT(fired_, IsEmpty());
  EXPECT_EQ(events_.waits, 0);
}

TEST_F(LayerReadySequencerTest, WaitFailureInDrainStopsThere) {
  events_.fail_wait_at = 1;
  LayerReadySequencer seq(&events_, &hook_);
  for (int32_t l = 0; l < 3; ++l) ASSERT_TRUE(seq.LayerEnqueued(l).ok());
  EXPECT_FALSE(seq.Drain().ok());
  EXPECT_THAT(fired_, ElementsAre(0));
  EXPECT_FALSE(seq.Drain().ok());
  EXPECT_THAT(fired_, ElementsAre(0));
}

TEST_F(LayerReadySequencerTest, AbandonedPassLeavesNothingForTheNext) {
  {
    // The backend returns an error mid-pass: the sequencer dies undrained.
    LayerReadySequencer seq(&events_, &hook_);
    ASSERT_TRUE(seq.LayerEnqueued(0).ok());
    ASSERT_TRUE(seq.LayerEnqueued(1).ok());
  }
  events_.Complete(1);  // the abandoned work finishes later on the device
  EXPECT_THAT(fired_, IsEmpty());
  // The next pass re-records the same markers and reports only its layers.
  LayerReadySequencer next(&events_, &hook_);
  ASSERT_TRUE(next.LayerEnqueued(0).ok());
  EXPECT_THAT(fired_, IsEmpty());  // re-recorded marker 0 is pending again
  ASSERT_TRUE(next.LayerEnqueued(1).ok());
  ASSERT_TRUE(next.Drain().ok());
  EXPECT_THAT(fired_, ElementsAre(0, 1));
}

TEST_F(LayerReadySequencerTest, OutOfOrderLayerIsAnError) {
  LayerReadySequencer seq(&events_, &hook_);
  ASSERT_TRUE(seq.LayerEnqueued(0).ok());
  const absl::Status s = seq.LayerEnqueued(2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_FALSE(seq.Drain().ok());
  EXPECT_THAT(fired_, IsEmpty());
}

TEST_F(LayerReadySequencerTest, WithoutAHookNothingIsRecorded) {
  const LlamaModel::LayerWrittenFn empty;
  const LlamaModel::LayerWrittenFn* const hooks[] = {&empty, nullptr};
  for (const LlamaModel::LayerWrittenFn* hook : hooks) {
    LayerReadySequencer seq(&events_, hook);
    for (int32_t l = 0; l < 4; ++l) ASSERT_TRUE(seq.LayerEnqueued(l).ok());
    ASSERT_TRUE(seq.Drain().ok());
  }
  EXPECT_EQ(events_.records, 0);
  EXPECT_EQ(events_.polls + events_.waits, 0);
}

}  // namespace
}  // namespace pdserve::engine
