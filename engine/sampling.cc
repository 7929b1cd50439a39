#include "engine/sampling.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace pdserve::engine {

absl::Status SamplingParams::Validate() const {
  if (max_tokens == 0)
    return absl::InvalidArgumentError("max_tokens must be at least 1");
  if (!(temperature >= 0.0f && temperature <= 100.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be in [0, 100], got ", temperature));
  }
  if (!(top_p >= 0.0f && top_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_p must be in (0, 1], got ", top_p));
  }
  for (const auto& s : stop) {
    if (s.empty())
      return absl::InvalidArgumentError("stop strings must not be empty");
  }
  if (top_logprobs > kMaxTopLogprobs)
    return absl::InvalidArgumentError(
        absl::StrCat("top_logprobs must be at most ", kMaxTopLogprobs, ", got ",
                     top_logprobs));
  return absl::OkStatus();
}

TokenLogprobs ComputeLogprobs(const float* logits, int64_t vocab, int32_t token,
                              uint32_t top_n) {
  float max = logits[0];
  for (int64_t i = 1; i < vocab; ++i) max = std::max(max, logits[i]);
  double sum = 0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(double{logits[i]} - max);
  const double log_z = double{max} + std::log(sum);
  TokenLogprobs out;
  out.token = token;
  out.logprob = static_cast<float>(double{logits[token]} - log_z);
  const int64_t n = std::min<int64_t>(top_n, vocab);
  std::vector<int32_t> ids(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) ids[i] = static_cast<int32_t>(i);
  auto higher = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), higher);
  for (int64_t i = 0; i < n; ++i) {
    out.top.emplace_back(ids[i],
                         static_cast<float>(double{logits[ids[i]]} - log_z));
  }
  return out;
}

std::array<uint32_t, 4> Philox4x32(std::array<uint32_t, 4> ctr,
                                   std::array<uint32_t, 2> key) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t{kM0} * ctr[0];
    const uint64_t p1 = uint64_t{kM1} * ctr[2];
    ctr = {static_cast<uint32_t>(p1 >> 32) ^ ctr[1] ^ key[0],
           static_cast<uint32_t>(p1),
           static_cast<uint32_t>(p0 >> 32) ^ ctr[3] ^ key[1],
           static_cast<uint32_t>(p0)};
    key[0] += kW0;
    key[1] += kW1;
  }
  return ctr;
}

float UniformForPosition(uint64_t seed, int64_t position) {
  const uint64_t pos = static_cast<uint64_t>(position);
  const auto r = Philox4x32(
      {static_cast<uint32_t>(pos), static_cast<uint32_t>(pos >> 32), 0, 0},
      {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
  return static_cast<float>(r[0] >> 8) * (1.0f / 16777216.0f);
}

namespace {

// The first index of the largest logit, as the plain scan
//   best = 0; for i: if (logits[i] > logits[best]) best = i;
// gives it (+0 and -0 tie), or kInvalidLogitsToken when any logit is NaN,
// in two passes the compiler vectorizes: 16 running maxima and NaN flags,
// then the first index equal to their maximum. At batch 32 the scan over a
// 128k vocabulary was ~12% of a 1B decode step; the NaN flag rides along in
// the same pass.
int32_t Argmax(const float* logits, int64_t vocab) {
  if (vocab <= 0) return 0;
  if (!(logits[0] == logits[0])) return kInvalidLogitsToken;
  constexpr int kLanes = 16;
  float lane[kLanes];
  int nan[kLanes] = {};
  for (float& l : lane) l = logits[0];
  int64_t i = 0;
  for (; i + kLanes <= vocab; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float v = logits[i + j];
      lane[j] = v > lane[j] ? v : lane[j];
      nan[j] |= v != v;
    }
  }
  float mx = lane[0];
  int any_nan = 0;
  for (int j = 0; j < kLanes; ++j) {
    mx = lane[j] > mx ? lane[j] : mx;
    any_nan |= nan[j];
  }
  for (; i < vocab; ++i) {
    mx = logits[i] > mx ? logits[i] : mx;
    any_nan |= logits[i] != logits[i];
  }
  if (any_nan) return kInvalidLogitsToken;
  for (int64_t p = 0; p < vocab; ++p) {
    if (logits[p] == mx) return static_cast<int32_t>(p);
  }
  return 0;  // not reached: mx is one of the logits
}

// Sort keys of the candidates: the (logit desc, id asc) order is the
// ascending order of (DescendingKey(v) << 32 | id).
uint32_t DescendingKey(float v) {
  if (v == 0.0f) v = 0.0f;  // -0 ties with +0, as the comparison has it
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const uint32_t ascending = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ~ascending;
}

// Stable LSD radix sort of `keys` by their high 32 bits, 11 bits a pass;
// entries come in ascending id order, so ties stay by id. A pass whose digit
// is the same for every key is skipped.
void SortByHighWord(std::vector<uint64_t>& keys, std::vector<uint64_t>& tmp) {
  constexpr int kBits = 11;
  constexpr size_t kBuckets = size_t{1} << kBits;
  tmp.resize(keys.size());
  for (int shift = 32; shift < 64; shift += kBits) {
    std::array<uint32_t, kBuckets> count{};
    for (uint64_t k : keys) ++count[(k >> shift) & (kBuckets - 1)];
    if (count[(keys[0] >> shift) & (kBuckets - 1)] == keys.size()) continue;
    uint32_t pos = 0;
    for (uint32_t& c : count) {
      const uint32_t n = c;
      c = pos;
      pos += n;
    }
    for (uint64_t k : keys) tmp[count[(k >> shift) & (kBuckets - 1)]++] = k;
    keys.swap(tmp);
  }
}

}  // namespace

int32_t SampleToken(const float* logits, int64_t vocab,
                    const SamplingParams& params, int64_t position,
                    std::vector<std::pair<float, int32_t>>* scratch) {
  const int32_t best = Argmax(logits, vocab);
  if (params.temperature <= 0.0f || best == kInvalidLogitsToken) return best;

  // The candidates in (logit desc, id asc) order. -inf logits (masked by a
  // structured-output constraint) have probability 0 and are left out. The
  // order comes from a radix sort of integer keys, which gives exactly the
  // comparison sort's order (ties by id) at a fraction of its cost over a
  // 128k vocabulary.
  thread_local std::vector<uint64_t> keys, tmp;
  keys.clear();
  const float inv_t = 1.0f / params.temperature;
  for (int64_t i = 0; i < vocab; ++i) {
    const float v = logits[i] * inv_t;
    if (v == -std::numeric_limits<float>::infinity()) continue;
    keys.push_back(uint64_t{DescendingKey(v)} << 32 | static_cast<uint32_t>(i));
  }
  if (keys.empty()) return best;
  if (params.top_k > 0 && params.top_k < keys.size()) {
    std::partial_sort(keys.begin(), keys.begin() + params.top_k, keys.end());
    keys.resize(params.top_k);
  } else {
    SortByHighWord(keys, tmp);
  }
  auto& cand = *scratch;
  cand.clear();
  for (uint64_t k : keys) {
    const auto id = static_cast<int32_t>(k & 0xffffffffu);
    cand.emplace_back(logits[id] * inv_t, id);
  }
  // Softmax in double over the kept candidates, already sorted.
  const double mx = cand[0].first;
  thread_local std::vector<double> probs;
  probs.resize(cand.size());
  double total = 0;
  for (size_t i = 0; i < cand.size(); ++i)
    total += probs[i] = std::exp(cand[i].first - mx);
  const double top_p = params.top_p <= 0.0f ? 1.0 : params.top_p;
  if (top_p < 1.0) {
    double mass = 0;
    size_t n = 0;
    while (n < cand.size()) {
      mass += probs[n++] / total;
      if (mass >= top_p) break;
    }
    cand.resize(n);
    probs.resize(n);
    total = 0;
    for (double p : probs) total += p;
  }
  const double u =
      static_cast<double>(UniformForPosition(params.seed, position)) * total;
  double cdf = 0;
  for (size_t i = 0; i < cand.size(); ++i) {
    cdf += probs[i];
    if (u < cdf) return cand[i].second;
  }
  return cand.back().second;
}

}  // namespace pdserve::engine
