#include "router/policy.h"

#include <algorithm>
#include <limits>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace pdserve::router {
namespace {

bool Excluded(const RouteRequest& r, const WorkerView& w) {
  return std::find(r.exclude.begin(), r.exclude.end(), w.index) != r.exclude.end();
}

bool CanDecode(const WorkerView& w) { return w.role == "decode" || w.role == "both"; }
bool CanPrefill(const WorkerView& w) { return w.role == "prefill"; }

double DecodeLoad(const WorkerView& w) {
  return static_cast<double>(w.status.num_running() + w.status.num_waiting() + w.routed_requests);
}

// Block hashes per cache fingerprint (workers with another KV dtype or block
// size hash differently), computed once per request.
class HashCache {
 public:
  explicit HashCache(const RouteRequest& r) : r_(r) {}
  const std::vector<engine::BlockHash>& For(const engine::ModelFingerprint& fp, int32_t block_size) {
    auto key = std::make_pair(fp[0], fp[1]);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    std::vector<engine::BlockHash> hashes;
    if (block_size > 0) engine::ExtendBlockHashes(fp, r_.cache_salt, *r_.tokens, block_size, &hashes);
    return cache_.emplace(key, std::move(hashes)).first->second;
  }

 private:
  const RouteRequest& r_;
  // The fingerprint covers the block size, so it is a sufficient key.
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, std::vector<engine::BlockHash>> cache_;
};

class CacheAwarePolicy : public Policy {
 public:
  CacheAwarePolicy(PolicyConfig config, PrefixIndex* index) : config_(config), index_(index) {}
  const char* name() const override { return "cache_aware"; }

  absl::StatusOr<RouteDecision> Choose(const RouteRequest& request,
                                       const std::vector<WorkerView>& workers) override {
    HashCache hashes(request);
    auto cached_tokens = [&](const WorkerView& w) -> int64_t {
      const int32_t bs = static_cast<int32_t>(w.status.layout().block_size());
      const auto& h = hashes.For(w.fingerprint, bs);
      const WorkerIndex idx = w.index;
      const int32_t blocks = index_->LeadingBlocks(h, {&idx, 1})[0];
      return std::min<int64_t>(request.num_tokens, int64_t{blocks} * bs);
    };
    RouteDecision d;
    double best_decode = std::numeric_limits<double>::infinity();
    for (const WorkerView& w : workers) {
      if (!CanDecode(w) || Excluded(request, w)) continue;
      const int64_t cached = cached_tokens(w);
      const double free = w.status.total_blocks() ? double(w.status.free_blocks()) / w.status.total_blocks() : 0;
      // Fewer running sequences, more free blocks, more of the prompt cached.
      const double cost = config_.w_decode * DecodeLoad(w) - config_.w_decode * free -
                          config_.w_prefill * static_cast<double>(cached);
      if (cost < best_decode) {
        best_decode = cost;
        d.decode = &w;
        d.decode_cached_tokens = cached;
      }
    }
    if (d.decode == nullptr) return absl::UnavailableError("no decode worker is up");
    const int64_t uncached_at_decode = request.num_tokens - d.decode_cached_tokens;
    double best_prefill = std::numeric_limits<double>::infinity();
    const WorkerView* prefill = nullptr;
    int64_t prefill_cached = 0;
    for (const WorkerView& w : workers) {
      if (!CanPrefill(w) || Excluded(request, w)) continue;
      const int64_t cached = cached_tokens(w);
      const double queued = static_cast<double>(w.status.queued_prefill_tokens() + w.routed_prefill_tokens);
      const double cost = config_.w_prefill * (static_cast<double>(request.num_tokens - cached) + queued) +
                          config_.w_decode * DecodeLoad(w);
      if (cost < best_prefill) {
        best_prefill = cost;
        prefill = &w;
        prefill_cached = cached;
      }
    }
    if (prefill == nullptr) {
      d.reason = d.decode->role == "both" ? "colocated" : "local:no_prefill";
      d.prefill_cached_tokens = d.decode_cached_tokens;
    } else if (uncached_at_decode <= config_.local_prefill_threshold) {
      d.reason = "local:short";
      d.prefill_cached_tokens = d.decode_cached_tokens;
    } else {
      d.reason = "remote";
      d.prefill = prefill;
      d.prefill_cached_tokens = prefill_cached;
    }
    return d;
  }

 private:
  PolicyConfig config_;
  PrefixIndex* index_;
};

class RoundRobinPolicy : public Policy {
 public:
  explicit RoundRobinPolicy(PolicyConfig config) : config_(config) {}
  const char* name() const override { return "round_robin"; }
  absl::StatusOr<RouteDecision> Choose(const RouteRequest& request,
                                       const std::vector<WorkerView>& workers) override {
    std::vector<const WorkerView*> decoders, prefillers;
    for (const WorkerView& w : workers) {
      if (Excluded(request, w)) continue;
      if (CanDecode(w)) decoders.push_back(&w);
      if (CanPrefill(w)) prefillers.push_back(&w);
    }
    if (decoders.empty()) return absl::UnavailableError("no decode worker is up");
    const uint64_t n = next_++;
    RouteDecision d;
    d.decode = decoders[n % decoders.size()];
    if (prefillers.empty()) {
      d.reason = d.decode->role == "both" ? "colocated" : "local:no_prefill";
    } else if (request.num_tokens <= config_.local_prefill_threshold) {
      d.reason = "local:short";
    } else {
      d.prefill = prefillers[n % prefillers.size()];
      d.reason = "remote";
    }
    return d;
  }

 private:
  PolicyConfig config_;
  std::atomic<uint64_t> next_{0};
};

}  // namespace

std::vector<engine::BlockHash> Policy::HashesFor(const WorkerView& w, const std::string& salt,
                                                 const std::vector<int32_t>& tokens) {
  std::vector<engine::BlockHash> hashes;
  const int32_t bs = static_cast<int32_t>(w.status.layout().block_size());
  if (bs > 0) engine::ExtendBlockHashes(w.fingerprint, salt, tokens, bs, &hashes);
  return hashes;
}

absl::StatusOr<std::unique_ptr<Policy>> Policy::Create(const std::string& name, PolicyConfig config,
                                                       PrefixIndex* index) {
  if (name == "cache_aware") return std::unique_ptr<Policy>(new CacheAwarePolicy(config, index));
  if (name == "round_robin") return std::unique_ptr<Policy>(new RoundRobinPolicy(config));
  return absl::InvalidArgumentError(
      absl::StrCat("unknown routing policy \"", name, "\" (cache_aware or round_robin)"));
}

}  // namespace pdserve::router
