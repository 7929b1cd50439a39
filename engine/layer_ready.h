// Backend::Forward's per-layer hooks (on_layer_written) for a device that
// computes asynchronously. The engine thread enqueues a whole forward pass on
// the device; after each layer's KV write it records a marker (on CUDA a
// cudaEvent on the compute stream). LayerReadySequencer then runs layer l's
// hook on the calling thread as soon as that thread sees marker l complete:
// between later layers' launches (non-blocking polls) and, once everything
// is enqueued, by waiting for each remaining marker in order. So a layer-wise
// KV sender (prefill_service/layer_streamer.h) starts on layer l while the
// device still computes layers l+1.. of the same pass.
//
// No hook runs inside a device callback, and none on another thread: the
// hooks touch the engine's BlockManager, which only the engine thread may.
//
// Invariants: hooks run in layer order, each at most once, only after their
// layer's marker completed. After an error (recording, polling or waiting, or
// the caller abandoning the pass by destroying the sequencer) no further hook
// runs. Not thread-safe: one engine thread.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/llama_model.h"

namespace pdserve::engine {

// One marker per layer in a device's ordered work queue. The CUDA backend's
// implementation is a cudaEvent per layer (engine/cuda_backend.cc); CPU tests
// use a fake whose device progress the test drives.
class LayerReadyEvents {
 public:
  virtual ~LayerReadyEvents() = default;
  // Marks the point right after layer `layer`'s KV write in the device's
  // queue. Re-recording a layer (the next pass) replaces its marker.
  virtual absl::Status Record(int32_t layer) = 0;
  // True once all work before layer's marker has finished; never blocks.
  virtual absl::StatusOr<bool> Ready(int32_t layer) = 0;
  // Blocks until all work before layer's marker has finished.
  virtual absl::Status Wait(int32_t layer) = 0;
};

class LayerReadySequencer {
 public:
  // `hook` may be null (or empty): then nothing is recorded or run. Both
  // pointers must outlive the sequencer.
  LayerReadySequencer(LayerReadyEvents* events,
                      const LlamaModel::LayerWrittenFn* hook);
  LayerReadySequencer(const LayerReadySequencer&) = delete;
  LayerReadySequencer& operator=(const LayerReadySequencer&) = delete;

  // After enqueueing layer `layer`'s KV write; layers come in order from 0.
  // Records its marker, then runs the hooks of layers already complete.
  absl::Status LayerEnqueued(int32_t layer);
  // Runs the hooks of layers whose markers completed, without blocking.
  absl::Status Poll();
  // After the last layer was enqueued: waits for every layer not yet
  // reported, in order, and runs its hook.
  absl::Status Drain();

  int32_t layers_enqueued() const { return enqueued_; }
  int32_t layers_reported() const { return reported_; }

 private:
  absl::Status Fail(absl::Status s);

  LayerReadyEvents* const events_;
  const LlamaModel::LayerWrittenFn* const hook_;
  int32_t enqueued_ = 0;  // markers recorded: layers [0, enqueued_)
  int32_t reported_ = 0;  // hooks run: layers [0, reported_)
  absl::Status error_;    // first error; once set, no hook runs again
};

}  // namespace pdserve::engine
