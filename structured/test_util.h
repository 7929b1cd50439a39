// Test helpers for structured/: running bytes through a Dfa and drawing
// random strings from its language. Header-only; thread-compatible.
#pragma once

#include <random>
#include <string>
#include <vector>

#include "structured/dfa.h"

namespace pdserve::structured {

inline bool DfaMatches(const Dfa& dfa, const std::string& s) {
  int state = dfa.start();
  for (char c : s) {
    state = dfa.Next(state, static_cast<uint8_t>(c));
    if (state == Dfa::kDead) return false;
  }
  return dfa.accepting(state);
}

// A random string the DFA accepts: each step picks a live byte uniformly,
// stopping in an accepting state with probability `stop`.
inline std::string DfaSample(const Dfa& dfa, std::mt19937_64* rng,
                             double stop = 0.3) {
  int state = dfa.start();
  std::string out;
  std::vector<int> next;
  while (true) {
    next.clear();
    for (int b = 0; b < 256; ++b) {
      if (dfa.Next(state, static_cast<uint8_t>(b)) != Dfa::kDead)
        next.push_back(b);
    }
    if (dfa.accepting(state) &&
        (next.empty() || std::uniform_real_distribution<>(0, 1)(*rng) < stop)) {
      return out;
    }
    const int b =
        next[std::uniform_int_distribution<size_t>(0, next.size() - 1)(*rng)];
    out.push_back(static_cast<char>(b));
    state = dfa.Next(state, static_cast<uint8_t>(b));
  }
}

}  // namespace pdserve::structured
