// `pdserve sim route`'s event loop and the simulated workers: a prefill
// worker's queue and prefix cache, a decode worker's admission and continuous
// batch, the KV tiers below their pools, the holder's side of a peer pull,
// and each worker's KV event stream into the router's index
// (SimEventStream). The router's side is router_sim_policies.cc.
#include "bench/router_sim.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "bench/router_sim_internal.h"
#include "common/json.h"
#include "common/status_macros.h"

namespace pdserve::bench {
namespace router_sim_internal {

absl::StatusOr<SimRun> Simulation::Run() {
  ASSIGN_OR_RETURN(
      policy_, router::Policy::Create(oracle_ ? "least_loaded" : base_policy_,
                                      c_.policy, &index_));
  pull_config_.enabled = pull_;
  pull_config_.overhead_seconds = c_.pull_overhead_ms / 1000;
  pull_config_.default_prefill_tokens_per_second =
      c_.prefill_us_per_token > 0 ? 1e6 / c_.prefill_us_per_token : 1e12;
  // The sim counts KV in tokens: one "byte" per token.
  pull_config_.default_transfer_bytes_per_second =
      c_.transfer_us_per_token > 0 ? 1e6 / c_.transfer_us_per_token : 1e12;
  Build();
  Schedule(0, Ev::kHeartbeat, 0);
  size_t next_arrival = 0;
  while (next_arrival < requests_.size() || !heap_.empty()) {
    const bool arrival =
        next_arrival < requests_.size() &&
        (heap_.empty() || requests_[next_arrival].arrival < heap_.top().t);
    if (arrival) {
      now_ = requests_[next_arrival].arrival;
      RETURN_IF_ERROR(Arrive(static_cast<int32_t>(next_arrival++)));
      continue;
    }
    const Event e = heap_.top();
    heap_.pop();
    now_ = e.t;
    switch (e.type) {
      case Ev::kHeartbeat:
        Heartbeat();
        if (next_arrival < requests_.size() || !heap_.empty())
          Schedule(now_ + heartbeat_, Ev::kHeartbeat, 0);
        break;
      case Ev::kPrefillDone:
        PrefillDone(e.id);
        break;
      case Ev::kLocalPrefillDone:
        FirstToken(e.id);
        DecodeJoin(e.id);
        break;
      case Ev::kDecodeJoin:
        DecodeJoin(e.id);
        break;
      case Ev::kStepDone:
        StepDone(e.id);
        break;
      case Ev::kResync:
        Resync(e.id);
        break;
    }
  }
  DeliverEvents(std::numeric_limits<Micros>::max());
  return Report();
}

void Simulation::Build() {
  int64_t p_blocks = c_.prefill_cache_tokens / bs_;
  int64_t d_blocks = c_.decode_kv_tokens / bs_;
  const int32_t n = num_prefill_ + num_decode_;
  if (c_.pool_fraction > 0) {
    p_blocks = std::max<int64_t>(
        1, static_cast<int64_t>(c_.pool_fraction *
                                static_cast<double>(working_set_blocks_) / n));
    d_blocks = std::max(p_blocks, max_request_blocks_);
  }
  prefill_pool_tokens_ = p_blocks * bs_;
  decode_pool_tokens_ = d_blocks * bs_;
  auto sink = [this](int32_t w) {
    return [this, w](const engine::KvEvent& e) { Emit(w, e); };
  };
  if (oracle_) {
    // One cache for the whole tier; nothing routes on it, so no events.
    // Unbounded: the working set plus every prefill worker's prompt in
    // flight, so nothing is ever evicted.
    caches_.push_back(std::make_unique<engine::BlockManager>(
        unbounded_
            ? working_set_blocks_ + (num_prefill_ + 1) * max_request_blocks_
            : p_blocks * num_prefill_));
  } else {
    for (int32_t w = 0; w < num_prefill_; ++w) {
      caches_.push_back(
          std::make_unique<engine::BlockManager>(p_blocks, sink(w)));
      feeds_.push_back(
          std::make_unique<SimEventStream>(&index_, w, caches_.back().get()));
      if (tier_) AddTier(w, caches_.back().get(), p_blocks);
    }
  }
  prefill_.resize(num_prefill_);
  for (int32_t w = 0; w < num_prefill_; ++w)
    prefill_[w].cache = caches_[oracle_ ? 0 : w].get();
  decode_.resize(num_decode_);
  for (int32_t j = 0; j < num_decode_; ++j) {
    decode_[j].kv = std::make_unique<engine::BlockManager>(
        d_blocks, sink(num_prefill_ + j));
    feeds_.push_back(std::make_unique<SimEventStream>(&index_, num_prefill_ + j,
                                                      decode_[j].kv.get()));
    if (decode_tier_) AddTier(num_prefill_ + j, decode_[j].kv.get(), d_blocks);
  }
  for (auto& f : feeds_) f->Resync();  // subscribed before the first request
  views_.resize(n);
  for (int32_t w = 0; w < n; ++w) {
    router::WorkerView& v = views_[w];
    v.index = w;
    v.role =
        w < num_prefill_ ? v1::WORKER_ROLE_PREFILL : v1::WORKER_ROLE_DECODE;
    v.id = absl::StrCat(w < num_prefill_ ? "prefill" : "decode", "-", w);
    v.address = v.id;
    v.up = true;
    v.fingerprint = fingerprint_;
    v.status.set_role(v.role);
    v.status.mutable_layout()->set_block_size(bs_);
    v.block_size = bs_;
    // The rates a worker measures and exports (the cost model's), for the
    // policy's tier pricing and the pull decision.
    if (c_.prefill_us_per_token > 0)
      v.status.set_prefill_tokens_per_second(1e6 / c_.prefill_us_per_token);
    if (TierOf(w) != nullptr) {
      v.status.set_kv_tier(v1::KV_TIER_DISK);
      if (c_.tier_read_us_per_token > 0)
        v.status.set_kv_tier_load_tokens_per_second(1e6 /
                                                    c_.tier_read_us_per_token);
    }
  }
  heartbeat_ = std::max<Micros>(1, FromMs(c_.heartbeat_ms));
}

void Simulation::AddTier(int32_t w, engine::BlockManager* cache,
                         int64_t pool_blocks) {
  if (static_cast<int32_t>(tiers_.size()) <= w) tiers_.resize(w + 1);
  tiers_[w] = std::make_unique<SimTier>(
      static_cast<int64_t>(c_.tier_multiple * static_cast<double>(pool_blocks)),
      c_.tier_refresh_on_hit);
  SimTier* t = tiers_[w].get();
  cache->set_tier_hooks(engine::BlockManager::TierHooks(
      engine::KvTierKind::kDisk,
      [t, cache](int32_t, const BlockHash& h) {
        if (const std::optional<BlockHash> dropped = t->Offer(h)) {
          engine::KvEvent e;
          e.type = engine::KvEvent::Type::kRemoved;
          e.tier = engine::KvTierKind::kDisk;
          e.hashes = {*dropped};
          cache->PublishTierEvent(std::move(e));
        }
        return t->Contains(h);
      },
      std::function<void()>()));
  Feed(w).SetTier(engine::KvTierKind::kDisk, [t] { return t->Hashes(); });
}

int32_t Simulation::HeldRun(int32_t w, std::span<const BlockHash> hashes) {
  size_t n = PoolOf(w)->Lookup(hashes).size();
  if (const SimTier* t = TierOf(w); t != nullptr) {
    while (n < hashes.size() && t->Contains(hashes[n])) ++n;
  }
  return static_cast<int32_t>(n);
}

void Simulation::Emit(int32_t w, const engine::KvEvent& e) {
  const bool lost = c_.event_loss > 0 && Uniform() < c_.event_loss;
  events_lost_ += lost;
  Feed(w).Publish(e, now_, FromMs(c_.event_delay_ms), lost);
}

void Simulation::DeliverEvents(Micros until) {
  for (size_t i = 0; i < feeds_.size(); ++i) {
    const std::optional<int64_t> gap = feeds_[i]->Deliver(until);
    if (gap && until != std::numeric_limits<Micros>::max()) {
      // Resubscribe after the service's back-off.
      const int32_t w = static_cast<int32_t>(i) + (oracle_ ? num_prefill_ : 0);
      Schedule(std::max(now_, *gap + FromMs(c_.resync_delay_ms)), Ev::kResync,
               w);
    }
  }
}

void Simulation::Resync(int32_t w) {
  Feed(w).Resync();
  ++resyncs_;
}

int32_t Simulation::Pull(int32_t r, int32_t have, int32_t* from_tier) {
  Req& q = reqs_[r];
  *from_tier = 0;
  q.pull_partial = false;
  if (q.pull_holder < 0 || q.pull_blocks <= have) return 0;
  engine::BlockManager* holder = PoolOf(q.pull_holder);
  const std::span<const BlockHash> want =
      std::span<const BlockHash>(P(r).hashes)
          .subspan(have, q.pull_blocks - have);
  std::vector<int32_t> blocks = holder->Lookup(want);
  const int32_t pool = static_cast<int32_t>(blocks.size());
  holder->Acquire(blocks);
  int32_t tier = 0;
  if (SimTier* t = c_.pull_from_tiers ? TierOf(q.pull_holder) : nullptr;
      t != nullptr && static_cast<size_t>(pool) < want.size()) {
    tier = t->Match(want.subspan(pool));
    tier = static_cast<int32_t>(std::min<int64_t>(tier, holder->num_free()));
    if (tier > 0) holder->Allocate(tier, &blocks);
  }
  std::reverse(blocks.begin(), blocks.end());
  holder->Release(blocks);
  const int32_t got = pool + tier;
  if (got == 0) {
    ++peer_pulls_failed_;
    return 0;
  }
  ++peer_pulls_;
  if (static_cast<size_t>(got) < want.size()) {
    ++peer_pulls_partial_;
    q.pull_partial = true;
  }
  *from_tier = tier;
  return got;
}

void Simulation::TryAdmit(int32_t j) {
  DecodeWorker& d = decode_[j];
  while (!d.admit.empty()) {
    const int32_t r = d.admit.front();
    Req& q = reqs_[r];
    const int64_t total =
        (Input(r) + P(r).trace->output_length + bs_ - 1) / bs_;
    if (total > d.kv->num_blocks()) {
      d.admit.pop_front();
      q.rejected = true;
      ++rejected_;
      views_[q.prefill >= 0 ? q.prefill : q.decode].routed_prefill_tokens -=
          q.routed_uncached;
      views_[q.decode].routed_requests -= 1;
      continue;
    }
    std::vector<int32_t> hits = d.kv->Lookup(P(r).hashes);
    int64_t idle = 0;
    for (int32_t b : hits) idle += d.kv->RefCount(b) == 0;
    const int64_t need = total - static_cast<int64_t>(hits.size());
    if (need + idle > d.kv->num_free()) return;
    d.admit.pop_front();
    d.kv->Acquire(hits);
    const int32_t pool_hits = static_cast<int32_t>(hits.size());
    q.d_blocks = std::move(hits);
    d.kv->Allocate(need, &q.d_blocks);
    q.d_hit_blocks = pool_hits;
    // "+dtier": the prompt continues in the decode worker's own tier, read
    // back into the blocks just reserved and committed at once (as
    // Engine::Reserve does): its own, not sent by the prefill worker.
    if (SimTier* t = TierOf(q.decode); t != nullptr) {
      const int32_t from_tier =
          t->Match(std::span<const BlockHash>(P(r).hashes).subspan(pool_hits));
      if (from_tier > 0) {
        q.d_hit_blocks += from_tier;
        Commit(d.kv.get(), P(r).hashes, pool_hits,
               std::vector<int32_t>(q.d_blocks.begin(),
                                    q.d_blocks.begin() + q.d_hit_blocks));
      }
    }
    q.admitted = now_;
    StartPrefill(r);
  }
}

void Simulation::StartPrefill(int32_t r) {
  Req& q = reqs_[r];
  if (q.prefill < 0) {
    // Local: the engine always computes at least the last token.
    const int64_t usable =
        std::min<int64_t>(q.d_hit_blocks, (Input(r) - 1) / bs_);
    q.hit_tokens = usable * bs_;
    q.prefill_start = now_;
    ++local_prefills_;
    Schedule(now_ + FromMs(c_.prefill_overhead_ms) +
                 static_cast<Micros>(
                     std::llround(static_cast<double>(Input(r) - q.hit_tokens) *
                                  c_.prefill_us_per_token)),
             Ev::kLocalPrefillDone, r);
    return;
  }
  PrefillWorker& p = prefill_[q.prefill];
  p.queue.push_back(r);
  p.queued_tokens += Input(r);
  if (p.running < 0) BeginPrefill(q.prefill);
}

void Simulation::BeginPrefill(int32_t w) {
  PrefillWorker& p = prefill_[w];
  const int32_t r = p.queue.front();
  p.queue.pop_front();
  p.queued_tokens -= Input(r);
  Req& q = reqs_[r];
  const std::vector<BlockHash>& hashes = P(r).hashes;
  const size_t usable = std::min<size_t>(
      hashes.size(), static_cast<size_t>((Input(r) - 1) / bs_));
  std::vector<int32_t> hits =
      p.cache->Lookup(std::span<const BlockHash>(hashes).first(usable));
  const int64_t blocks = (Input(r) + bs_ - 1) / bs_;
  const int64_t need = blocks - static_cast<int64_t>(hits.size());
  int64_t idle = 0;
  for (int32_t b : hits) idle += p.cache->RefCount(b) == 0;
  // Diagnosis: the longest run of this prompt's leading blocks one worker
  // holds (pool, then its tier) as the prompt starts, this one or another.
  int32_t held_anywhere = 0;
  if (!oracle_) {
    const std::span<const BlockHash> head =
        std::span<const BlockHash>(hashes).first(usable);
    for (int32_t v = 0; v < num_prefill_ + num_decode_; ++v)
      held_anywhere = std::max(held_anywhere, HeldRun(v, head));
  }
  if (need + idle <= p.cache->num_free()) {
    p.cache->Acquire(hits);
    q.p_hit_blocks = static_cast<int32_t>(hits.size());
    q.p_blocks = std::move(hits);
    p.cache->Allocate(need, &q.p_blocks);
    q.p_cached = true;
    // Tier hits continue the pool's, then pulled blocks; both fill the
    // fresh blocks after the hits and are committed with the computed
    // ones when the prompt ends.
    if (SimTier* t = TierOf(w); t != nullptr) {
      q.tier_blocks = t->Match(std::span<const BlockHash>(hashes).subspan(
          q.p_hit_blocks, usable - q.p_hit_blocks));
    }
    q.pulled_blocks =
        Pull(r, q.p_hit_blocks + q.tier_blocks, &q.pulled_tier_blocks);
  } else {
    // The prompt does not fit the cache: computed, not kept.
    q.p_hit_blocks = 0;
    q.p_cached = false;
  }
  const int64_t pulled_tokens = int64_t{q.pulled_blocks} * bs_;
  const int64_t tier_tokens = int64_t{q.tier_blocks} * bs_;
  pulled_tokens_ += pulled_tokens;
  tier_hit_tokens_ += tier_tokens;
  q.hit_tokens = int64_t{q.p_hit_blocks} * bs_ + tier_tokens + pulled_tokens;
  held_missed_tokens_ +=
      std::max<int64_t>(0, int64_t{held_anywhere} * bs_ - q.hit_tokens);
  const int64_t computed = Input(r) - q.hit_tokens;
  q.prefill_start = now_;
  p.running = r;
  p.run_start = now_;
  // A pull: its fixed cost (twice for a partial one: the holder says how
  // many it has, then sends them), the holder's tier reads, the transfer.
  const Micros pull_time =
      q.pulled_blocks == 0
          ? 0
          : FromMs(c_.pull_overhead_ms) * (q.pull_partial ? 2 : 1) +
                static_cast<Micros>(std::llround(
                    static_cast<double>(pulled_tokens) *
                        c_.transfer_us_per_token +
                    static_cast<double>(int64_t{q.pulled_tier_blocks} * bs_) *
                        c_.tier_read_us_per_token));
  pulled_tier_tokens_ += int64_t{q.pulled_tier_blocks} * bs_;
  const Micros tier_time = static_cast<Micros>(std::llround(
      static_cast<double>(tier_tokens) * c_.tier_read_us_per_token));
  p.run_end = now_ + FromMs(c_.prefill_overhead_ms) + pull_time + tier_time +
              static_cast<Micros>(std::llround(static_cast<double>(computed) *
                                               c_.prefill_us_per_token));
  p.run_computed = computed;
  p.computed_total += computed;
  Schedule(p.run_end, Ev::kPrefillDone, w);
}

void Simulation::PrefillDone(int32_t w) {
  PrefillWorker& p = prefill_[w];
  const int32_t r = p.running;
  p.running = -1;
  Req& q = reqs_[r];
  if (q.p_cached) {
    Commit(p.cache, P(r).hashes, q.p_hit_blocks, q.p_blocks);
    // Tail first, so the prompt's prefix is the last to be evicted.
    std::reverse(q.p_blocks.begin(), q.p_blocks.end());
    p.cache->Release(q.p_blocks);
    q.p_blocks = {};
  }
  FirstToken(r);
  const int64_t moved = Input(r) - int64_t{q.d_hit_blocks} * bs_;
  Schedule(now_ + static_cast<Micros>(std::llround(static_cast<double>(moved) *
                                                   c_.transfer_us_per_token)),
           Ev::kDecodeJoin, r);
  if (!p.queue.empty()) BeginPrefill(w);
}

void Simulation::Commit(engine::BlockManager* cache,
                        const std::vector<BlockHash>& hashes,
                        int32_t hit_blocks,
                        const std::vector<int32_t>& blocks) {
  const size_t full = std::min(hashes.size(), blocks.size());
  if (static_cast<size_t>(hit_blocks) >= full) return;
  const BlockHash parent =
      hit_blocks == 0 ? BlockHash{} : hashes[hit_blocks - 1];
  cache->Commit(
      parent,
      std::span<const int32_t>(blocks).subspan(hit_blocks, full - hit_blocks),
      std::span<const BlockHash>(hashes).subspan(hit_blocks,
                                                 full - hit_blocks));
}

void Simulation::FirstToken(int32_t r) {
  Req& q = reqs_[r];
  q.first_token = now_;
  views_[q.prefill >= 0 ? q.prefill : q.decode].routed_prefill_tokens -=
      q.routed_uncached;
  ttft_ms_.push_back(static_cast<double>(now_ - P(r).arrival) / 1000.0);
  prefill_queue_ms_.push_back(
      static_cast<double>(q.prefill_start - q.admitted) / 1000.0);
  decode_admit_ms_.push_back(static_cast<double>(q.admitted - P(r).arrival) /
                             1000.0);
  hit_tokens_ += q.hit_tokens;
  input_tokens_ += Input(r);
}

void Simulation::DecodeJoin(int32_t r) {
  Req& q = reqs_[r];
  const int32_t j = q.decode - num_prefill_;
  DecodeWorker& d = decode_[j];
  Commit(d.kv.get(), P(r).hashes, q.d_hit_blocks, q.d_blocks);
  q.join = now_;
  q.remaining =
      P(r).trace->output_length - 1;  // the first token came from prefill
  q.context = Input(r) + 1;
  if (q.remaining <= 0) {
    Finish(r);
    TryAdmit(j);
    return;
  }
  d.joining.push_back(r);
  if (!d.stepping) StartStep(j);
}

void Simulation::StartStep(int32_t j) {
  DecodeWorker& d = decode_[j];
  for (int32_t r : d.joining) {
    reqs_[r].in_batch = true;
    d.context += reqs_[r].context;
    d.running.push_back(r);
  }
  d.joining.clear();
  if (d.running.empty()) {
    d.stepping = false;
    return;
  }
  const double ms =
      c_.decode_step_ms +
      c_.decode_step_per_seq_ms * static_cast<double>(d.running.size()) +
      c_.decode_step_per_kctx_ms * static_cast<double>(d.context) / 1000.0;
  d.stepping = true;
  Schedule(now_ + std::max<Micros>(1, FromMs(ms)), Ev::kStepDone, j);
}

void Simulation::StepDone(int32_t j) {
  DecodeWorker& d = decode_[j];
  std::vector<int32_t> still;
  still.reserve(d.running.size());
  bool freed = false;
  for (int32_t r : d.running) {
    Req& q = reqs_[r];
    --q.remaining;
    ++q.context;
    ++d.context;
    if (q.remaining > 0) {
      still.push_back(r);
    } else {
      Finish(r);
      freed = true;
    }
  }
  d.running = std::move(still);
  if (freed) TryAdmit(j);
  StartStep(j);
}

void Simulation::Finish(int32_t r) {
  Req& q = reqs_[r];
  DecodeWorker& d = decode_[q.decode - num_prefill_];
  if (q.in_batch) d.context -= q.context;
  std::reverse(q.d_blocks.begin(), q.d_blocks.end());
  d.kv->Release(q.d_blocks);
  q.d_blocks = {};
  views_[q.decode].routed_requests -= 1;
  ++d.decoded;
  ++served_;
  makespan_ = std::max(makespan_, now_);
  const int64_t out = P(r).trace->output_length;
  if (out > 1)
    tpot_ms_.push_back(static_cast<double>(now_ - q.join) / 1000.0 /
                       static_cast<double>(out - 1));
}

}  // namespace router_sim_internal

void SimEventStream::Resync() {
  // Everything published so far is in the snapshot; later events follow it.
  in_flight_.clear();
  if (tier_hashes_) {
    router::KvEventApplier::TierHashes by_tier;
    by_tier[static_cast<size_t>(engine::KvTierKind::kPool)] =
        cache_->CachedHashes();
    by_tier[static_cast<size_t>(tier_kind_)] = tier_hashes_();
    applier_.SnapshotTiers(cache_->last_event_seq(), by_tier);
  } else {
    applier_.Snapshot(cache_->last_event_seq(), cache_->CachedHashes());
  }
  broken_ = false;
}

void SimEventStream::Publish(const engine::KvEvent& event, int64_t now_us,
                             int64_t delay_us, bool lost) {
  if (!lost) in_flight_.emplace_back(now_us + delay_us, event);
}

std::optional<int64_t> SimEventStream::Deliver(int64_t until_us) {
  std::optional<int64_t> gap;
  while (!in_flight_.empty() && in_flight_.front().first <= until_us) {
    const int64_t at = in_flight_.front().first;
    const engine::KvEvent event = std::move(in_flight_.front().second);
    in_flight_.pop_front();
    // The stream was dropped; the next snapshot covers these.
    if (broken_) continue;
    if (!applier_.Apply(event)) {
      broken_ = true;
      gap = at;
    }
  }
  return gap;
}

absl::Status ApplyEngineCalibration(absl::string_view bench_engine_json,
                                    SimConfig* config) {
  constexpr absl::string_view kWhat = "bench engine JSON";
  ASSIGN_OR_RETURN(const json::Value v, json::Parse(bench_engine_json, kWhat));
  ASSIGN_OR_RETURN(const double tps,
                   json::GetDouble(v, "prefill_tokens_per_s", kWhat));
  if (!(tps > 0))
    return absl::InvalidArgumentError(
        "bench engine JSON: prefill_tokens_per_s must be positive");
  // Least squares step_ms = a + b x batch over the decode figures.
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  if (const json::Value* decode = json::Find(v, "decode"); decode != nullptr) {
    if (!decode->is_array()) {
      return absl::InvalidArgumentError(
          "bench engine JSON: \"decode\" must be an array");
    }
    for (const json::Value& f : *decode) {
      ASSIGN_OR_RETURN(const double x, json::GetDouble(f, "batch", kWhat));
      ASSIGN_OR_RETURN(const double y, json::GetDouble(f, "step_ms", kWhat));
      n += 1;
      sx += x;
      sy += y;
      sxx += x * x;
      sxy += x * y;
    }
  }
  config->prefill_us_per_token = 1e6 / tps;
  if (n >= 1) {
    const double den = n * sxx - sx * sx;
    const double b =
        n >= 2 && den > 0 ? std::max(0.0, (n * sxy - sx * sy) / den) : 0.0;
    config->decode_step_per_seq_ms = b;
    config->decode_step_ms = std::max(0.0, (sy - b * sx) / n);
  }
  return absl::OkStatus();
}

}  // namespace pdserve::bench
