#include "engine/layer_ready.h"

#include "absl/strings/str_cat.h"

namespace pdserve::engine {

LayerReadySequencer::LayerReadySequencer(LayerReadyEvents* events,
                                         const LlamaModel::LayerWrittenFn* hook)
    : events_(events), hook_(hook != nullptr && *hook ? hook : nullptr) {}

absl::Status LayerReadySequencer::Fail(absl::Status s) {
  if (error_.ok()) error_ = std::move(s);
  return error_;
}

absl::Status LayerReadySequencer::LayerEnqueued(int32_t layer) {
  if (hook_ == nullptr) return absl::OkStatus();
  if (!error_.ok()) return error_;
  if (layer != enqueued_) {
    return Fail(absl::InternalError(absl::StrCat(
        "layer ", layer, " enqueued out of order (expected ", enqueued_, ")")));
  }
  if (absl::Status s = events_->Record(layer); !s.ok()) return Fail(s);
  ++enqueued_;
  return Poll();
}

absl::Status LayerReadySequencer::Poll() {
  if (hook_ == nullptr) return absl::OkStatus();
  if (!error_.ok()) return error_;
  while (reported_ < enqueued_) {
    absl::StatusOr<bool> ready = events_->Ready(reported_);
    if (!ready.ok()) return Fail(ready.status());
    if (!*ready) break;  // later markers cannot be complete before this one
    (*hook_)(reported_++);
  }
  return absl::OkStatus();
}

absl::Status LayerReadySequencer::Drain() {
  if (hook_ == nullptr) return absl::OkStatus();
  if (!error_.ok()) return error_;
  while (reported_ < enqueued_) {
    if (absl::Status s = events_->Wait(reported_); !s.ok()) return Fail(s);
    (*hook_)(reported_++);
  }
  return absl::OkStatus();
}

}  // namespace pdserve::engine
