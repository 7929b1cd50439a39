#include "bench/kv_tier_sim.h"

#include <cmath>
#include <list>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/json.h"

namespace pdserve::bench {
namespace {

// An LRU set of block ids; capacity < 0 is unbounded.
class BlockLru {
 public:
  explicit BlockLru(int64_t capacity) : capacity_(capacity) {}
  bool Contains(int64_t id) const { return pos_.contains(id); }
  // Makes `id` the most recent (inserting it); returns the evicted id, or -1.
  int64_t Touch(int64_t id) {
    if (auto it = pos_.find(id); it != pos_.end()) {
      order_.splice(order_.end(), order_, it->second);
      return -1;
    }
    if (capacity_ == 0) return id;  // holds nothing: "evicts" at once
    pos_[id] = order_.insert(order_.end(), id);
    if (capacity_ > 0 && static_cast<int64_t>(order_.size()) > capacity_) {
      const int64_t victim = order_.front();
      order_.pop_front();
      pos_.erase(victim);
      return victim;
    }
    return -1;
  }
  // Inserts `id` as the most recent unless present (present ones stay where
  // they are, as KvTier::Offer does).
  void Offer(int64_t id) {
    if (!Contains(id)) Touch(id);
  }

 private:
  int64_t capacity_;
  std::list<int64_t> order_;
  absl::flat_hash_map<int64_t, std::list<int64_t>::iterator> pos_;
};

TierSimCase Replay(const std::vector<TraceRequest>& trace, int64_t n,
                   int64_t pool_blocks, int64_t tier_blocks,
                   const TierSimConfig& c) {
  TierSimCase out;
  out.pool_blocks = pool_blocks;
  out.tier_blocks = tier_blocks;
  BlockLru pool(pool_blocks);
  BlockLru tier(tier_blocks);
  int64_t missed = 0;
  for (int64_t r = 0; r < n; ++r) {
    const TraceRequest& req = trace[r];
    out.input_tokens += req.input_length;
    const size_t blocks = req.hash_ids.size();
    auto tokens_of = [&](size_t k) {
      return std::min<int64_t>(kTraceBlockTokens,
                               req.input_length - k * kTraceBlockTokens);
    };
    size_t k = 0;
    std::vector<int64_t> from_tier;
    for (; k < blocks; ++k) {
      const int64_t id = req.hash_ids[k];
      if (pool.Contains(id)) {
        out.pool_hit_tokens += tokens_of(k);
      } else if (tier_blocks != 0 && tier.Contains(id)) {
        out.tier_hit_tokens += tokens_of(k);
        from_tier.push_back(id);
      } else {
        break;
      }
    }
    // As the engine does: tier hits become the most recent with the chain's
    // head last (KvTier::Match), and the pool releases a sequence's blocks
    // tail first, so its LRU evicts a chain's tail before its head.
    for (size_t j = from_tier.size(); j-- > 0;) tier.Touch(from_tier[j]);
    for (size_t j = k; j < blocks; ++j) missed += tokens_of(j);
    for (size_t j = blocks; j-- > 0;) {
      const int64_t victim = pool.Touch(req.hash_ids[j]);
      if (victim >= 0 && tier_blocks != 0) tier.Offer(victim);
    }
  }
  const int64_t hits = out.pool_hit_tokens + out.tier_hit_tokens;
  out.hit_ratio =
      out.input_tokens ? static_cast<double>(hits) / out.input_tokens : 0;
  const double tier_us_per_token =
      static_cast<double>(c.kv_bytes_per_token) / (c.tier_read_gbps * 1e3);
  out.prefill_seconds = (missed * c.prefill_us_per_token +
                         out.tier_hit_tokens * tier_us_per_token) /
                        1e6;
  return out;
}

}  // namespace

absl::Status TierSimConfig::Validate() const {
  if (pool_fractions.empty())
    return absl::InvalidArgumentError("tier sim needs a pool fraction");
  for (double f : pool_fractions) {
    if (!(f > 0 && f <= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("pool fractions must be in (0, 1], got ", f));
    }
  }
  if (!(tier_multiple >= 0) || !(prefill_us_per_token > 0) ||
      kv_bytes_per_token <= 0 || !(tier_read_gbps > 0)) {
    return absl::InvalidArgumentError(
        "tier sim: tier_multiple >= 0 and positive rates and sizes needed");
  }
  return absl::OkStatus();
}

absl::StatusOr<TierSimReport> RunTierSim(
    const TierSimConfig& config, const std::vector<TraceRequest>& trace) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  TierSimReport report;
  report.config = config;
  const int64_t n = config.max_requests > 0
                        ? std::min<int64_t>(config.max_requests, trace.size())
                        : static_cast<int64_t>(trace.size());
  report.requests = n;
  absl::flat_hash_set<int64_t> distinct;
  for (int64_t r = 0; r < n; ++r)
    distinct.insert(trace[r].hash_ids.begin(), trace[r].hash_ids.end());
  report.working_set_blocks = static_cast<int64_t>(distinct.size());

  TierSimCase unbounded = Replay(trace, n, -1, 0, config);
  unbounded.name = "unbounded";
  unbounded.pool_fraction = 1;
  unbounded.vs_unbounded = 1;
  report.cases.push_back(unbounded);
  for (double f : config.pool_fractions) {
    const int64_t pool =
        std::max<int64_t>(1, std::llround(f * report.working_set_blocks));
    const int64_t tier = std::llround(config.tier_multiple * pool);
    for (bool with_tier : {false, true}) {
      TierSimCase c = Replay(trace, n, pool, with_tier ? tier : 0, config);
      c.name = with_tier ? "pool+tier" : "pool";
      c.pool_fraction = f;
      c.vs_unbounded =
          unbounded.hit_ratio > 0 ? c.hit_ratio / unbounded.hit_ratio : 0;
      report.cases.push_back(c);
    }
  }
  return report;
}

std::string TierSimReport::ToTable() const {
  std::string out = absl::StrFormat(
      "KV tier model: %d requests, working set %d blocks of %d tokens; tier = "
      "%.3gx pool, read %.3g GB/s at %d B/token, recompute %.3g us/token\n",
      requests, working_set_blocks, kTraceBlockTokens, config.tier_multiple,
      config.tier_read_gbps, config.kv_bytes_per_token,
      config.prefill_us_per_token);
  absl::StrAppendFormat(&out, "%-10s %8s %10s %10s %9s %9s %9s %8s %11s\n",
                        "case", "pool/ws", "pool_blk", "tier_blk", "hit",
                        "pool_hit", "tier_hit", "vs_unb", "prefill_s");
  for (const TierSimCase& c : cases) {
    const double in = c.input_tokens ? static_cast<double>(c.input_tokens) : 1;
    absl::StrAppendFormat(
        &out, "%-10s %8.4f %10s %10s %9.4f %9.4f %9.4f %8.3f %11.1f\n", c.name,
        c.pool_fraction,
        c.pool_blocks < 0 ? std::string("inf") : absl::StrCat(c.pool_blocks),
        absl::StrCat(c.tier_blocks), c.hit_ratio, c.pool_hit_tokens / in,
        c.tier_hit_tokens / in, c.vs_unbounded, c.prefill_seconds);
  }
  return out;
}

std::string TierSimReport::ToJson() const {
  json::OrderedValue j;
  j["requests"] = requests;
  j["working_set_blocks"] = working_set_blocks;
  j["block_tokens"] = kTraceBlockTokens;
  j["tier_multiple"] = config.tier_multiple;
  j["tier_read_gbps"] = config.tier_read_gbps;
  j["kv_bytes_per_token"] = config.kv_bytes_per_token;
  j["prefill_us_per_token"] = config.prefill_us_per_token;
  j["cases"] = json::OrderedValue::array();
  for (const TierSimCase& c : cases) {
    json::OrderedValue o;
    o["case"] = c.name;
    o["pool_fraction"] = c.pool_fraction;
    o["pool_blocks"] = c.pool_blocks;
    o["tier_blocks"] = c.tier_blocks;
    o["input_tokens"] = c.input_tokens;
    o["pool_hit_tokens"] = c.pool_hit_tokens;
    o["tier_hit_tokens"] = c.tier_hit_tokens;
    o["hit_ratio"] = c.hit_ratio;
    o["vs_unbounded"] = c.vs_unbounded;
    o["prefill_seconds"] = c.prefill_seconds;
    j["cases"].push_back(std::move(o));
  }
  return j.dump();
}

}  // namespace pdserve::bench
