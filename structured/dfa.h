// A deterministic automaton over bytes, built from a ByteRegex by Thompson's
// construction and the subset construction, with every state that cannot
// reach an accepting state removed. So any byte string the DFA accepts as a
// prefix can still be completed to a match: a constrained generation never
// walks into a dead end.
//
// Building is bounded: NFA states, DFA states and wall time all have caps
// (DfaLimits), and exceeding one is RESOURCE_EXHAUSTED naming the cap, never
// an unbounded compile. Immutable after Build; thread-safe.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "structured/byte_regex.h"

namespace pdserve::structured {

struct DfaLimits {
  int max_nfa_states = 400000;
  int max_dfa_states = 50000;
  absl::Duration max_build_time = absl::Seconds(2);
  absl::Status Validate() const;
};

class Dfa {
 public:
  static constexpr int kDead = -1;

  // The automaton of `root` in `re`. INVALID_ARGUMENT when it matches no
  // string; RESOURCE_EXHAUSTED when a limit is exceeded.
  static absl::StatusOr<Dfa> Build(const ByteRegex& re, int root,
                                   const DfaLimits& limits);

  // The same language with the fewest states (equivalent states merged);
  // RESOURCE_EXHAUSTED past `deadline`.
  absl::StatusOr<Dfa> Minimized(absl::Time deadline) const;

  int start() const { return 0; }
  // The state after `byte`, or kDead.
  int Next(int state, uint8_t byte) const {
    return next_[static_cast<size_t>(state) * num_classes_ + byte_class_[byte]];
  }
  bool accepting(int state) const { return accepting_[state]; }
  // Whether any byte leads on from `state`.
  bool has_next(int state) const { return has_next_[state]; }
  // Whether every byte of `bytes` (a 256-bit set) leads from `state` back
  // to `state`: then any string of those bytes keeps the DFA there.
  bool LoopsOn(int state, const uint64_t bytes[4]) const {
    const uint64_t* loop = &self_loops_[static_cast<size_t>(state) * 4];
    return (bytes[0] & ~loop[0]) == 0 && (bytes[1] & ~loop[1]) == 0 &&
           (bytes[2] & ~loop[2]) == 0 && (bytes[3] & ~loop[3]) == 0;
  }
  int num_states() const { return static_cast<int>(accepting_.size()); }
  int num_classes() const { return num_classes_; }

 private:
  void ComputeSelfLoops();

  int num_classes_ = 0;
  uint8_t byte_class_[256] = {};
  std::vector<int32_t> next_;  // [state][class]
  std::vector<bool> accepting_;
  std::vector<bool> has_next_;
  std::vector<uint64_t> self_loops_;  // [state][4]: bytes leading back
};

}  // namespace pdserve::structured
