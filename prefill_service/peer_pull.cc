#include "prefill_service/peer_pull.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/tls.h"
#include "kv_transfer/grpc/grpc_transport.h"
#include "wire/channel_args.h"

namespace pdserve::prefill {

void RateMeter::Add(double units, double seconds) {
  if (!(units > 0) || !(seconds > 0)) return;
  const double sample = units / seconds;
  absl::MutexLock l(&mu_);
  rate_ = rate_ == 0 ? sample : (1 - weight_) * rate_ + weight_ * sample;
}

double RateMeter::rate() const {
  absl::MutexLock l(&mu_);
  return rate_;
}

const char* PeerPullMetrics::OutcomeName(Outcome o) {
  switch (o) {
    case kPulled:
      return "pulled";
    case kEvicted:
      return "evicted";
    case kFailed:
      return "failed";
    case kNoBlocks:
      return "no_blocks";
    case kLocal:
      return "local";
    case kPartial:
      return "partial";
    default:
      return "unknown";
  }
}

PeerPullMetrics::PeerPullMetrics(metrics::Registry& r)
    : blocks_pulled(metrics::CounterChild(
          r, "pdserve_kv_peer_pull_blocks_total",
          "KV blocks pulled from a peer worker instead of recomputed")),
      bytes_pulled(metrics::CounterChild(
          r, "pdserve_kv_peer_pull_bytes_total",
          "KV bytes pulled from a peer worker instead of recomputed")),
      served_sent(metrics::CounterChild(
          r, "pdserve_kv_peer_pull_served_total",
          "Peer pulls this worker served as the holder, by outcome",
          {"outcome"}, {"sent"})),
      served_not_found(metrics::CounterChild(
          r, "pdserve_kv_peer_pull_served_total",
          "Peer pulls this worker served as the holder, by outcome",
          {"outcome"}, {"not_found"})),
      served_failed(metrics::CounterChild(
          r, "pdserve_kv_peer_pull_served_total",
          "Peer pulls this worker served as the holder, by outcome",
          {"outcome"}, {"failed"})),
      served_partial(metrics::CounterChild(
          r, "pdserve_kv_peer_pull_served_total",
          "Peer pulls this worker served as the holder, by outcome",
          {"outcome"}, {"partial"})),
      served_refused(metrics::CounterChild(
          r, "pdserve_kv_peer_pull_served_total",
          "Peer pulls this worker served as the holder, by outcome",
          {"outcome"}, {"refused"})),
      served_busy(metrics::CounterChild(
          r, "pdserve_kv_peer_pull_served_total",
          "Peer pulls this worker served as the holder, by outcome",
          {"outcome"}, {"busy"})),
      served_pool_blocks(metrics::CounterChild(
          r, "pdserve_kv_peer_pull_served_blocks_total",
          "KV blocks this worker sent to peers as the holder, by where they "
          "were: its pool, or its KV tier (read back for the pull)",
          {"source"}, {"pool"})),
      served_tier_blocks(metrics::CounterChild(
          r, "pdserve_kv_peer_pull_served_blocks_total",
          "KV blocks this worker sent to peers as the holder, by where they "
          "were: its pool, or its KV tier (read back for the pull)",
          {"source"}, {"tier"})) {
  for (int o = 0; o < kNumOutcomes; ++o) {
    outcomes_[o] = metrics::CounterChild(
        r, "pdserve_kv_peer_pull_total",
        "Peer pulls asked of this prefill worker, by outcome (anything but "
        "pulled means the prefix was recomputed)",
        {"outcome"}, {OutcomeName(static_cast<Outcome>(o))});
  }
}

std::string BlockHashToBytes(const engine::BlockHash& h) {
  std::string out(16, '\0');
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<char>(h.hi >> (56 - 8 * i));
    out[8 + i] = static_cast<char>(h.lo >> (56 - 8 * i));
  }
  return out;
}

bool BlockHashFromBytes(const std::string& bytes, engine::BlockHash* h) {
  if (bytes.size() != 16) return false;
  h->hi = h->lo = 0;
  for (int i = 0; i < 8; ++i) {
    h->hi = (h->hi << 8) | static_cast<uint8_t>(bytes[i]);
    h->lo = (h->lo << 8) | static_cast<uint8_t>(bytes[8 + i]);
  }
  return true;
}

// ---------------------------------------------------------------- holder

absl::Status PeerBlockHolderConfig::Validate() const {
  if (address.empty() || keys == nullptr) {
    return absl::InvalidArgumentError(
        "a peer-pull holder needs its address and a key set");
  }
  if (max_concurrent_pulls < 1 || max_blocks_per_pull < 1) {
    return absl::InvalidArgumentError(
        "peer-pull caps (concurrent pulls, blocks per pull) must be >= 1");
  }
  return absl::OkStatus();
}

grpc::Status PeerBlockHolder::Admit(const v1::PullBlocksRequest& request) {
  auto refused = [&](grpc::Status s) {
    if (metrics_) metrics_->served_refused->Increment();
    return s;
  };
  const v1::PeerPull& grant = request.grant();
  const uint64_t end_block =
      uint64_t{request.first_block()} + request.hashes_size();
  if (absl::Status s = config_.keys->Verify(
          grant, config_.address, request.request_id(), end_block, absl::Now());
      !s.ok()) {
    return refused(ToGrpc(s));
  }
  // The destination is the grant's (the puller's registered address); the
  // caller may repeat it, never name another.
  if (!request.kv_destination().empty() &&
      request.kv_destination() != grant.puller_kv_address()) {
    return refused(grpc::Status(
        grpc::StatusCode::PERMISSION_DENIED,
        absl::StrCat("PullBlocks: kv_destination ", request.kv_destination(),
                     " is not the puller's registered address ",
                     grant.puller_kv_address(), " named by the grant")));
  }
  if (request.hashes_size() > config_.max_blocks_per_pull) {
    if (metrics_) metrics_->served_busy->Increment();
    return grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat("PullBlocks: ", request.hashes_size(),
                     " blocks asked for; this holder serves at most ",
                     config_.max_blocks_per_pull, " per pull"));
  }
  return grpc::Status::OK;
}

grpc::Status PeerBlockHolder::PullBlocks(grpc::ServerContext* context,
                                         const v1::PullBlocksRequest& request,
                                         v1::PullBlocksResponse* response) {
  // The grant first, so that callers without one cannot take the slots of
  // pulls served at once; then that cap, before anything is pinned.
  if (grpc::Status st = Admit(request); !st.ok()) return st;
  const int32_t now_active = ++active_;
  struct Leave {
    std::atomic<int32_t>* n;
    ~Leave() { --*n; }
  } leave{&active_};
  if (now_active > config_.max_concurrent_pulls) {
    if (metrics_) metrics_->served_busy->Increment();
    return grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat("PullBlocks: this holder is serving ", now_active - 1,
                     " pulls (at most ", config_.max_concurrent_pulls, ")"));
  }
  return Serve(context, request, response);
}

grpc::Status PeerBlockHolder::Serve(grpc::ServerContext* context,
                                    const v1::PullBlocksRequest& request,
                                    v1::PullBlocksResponse* response) {
  auto failed = [&](grpc::Status s) {
    if (metrics_) metrics_->served_failed->Increment();
    return s;
  };
  if (absl::Status s = kv_transfer::CheckLayouts(
          layout_, kv_transfer::FromProto(request.layout()));
      !s.ok()) {
    return failed(ToGrpc(s));
  }
  if (absl::Status s = engine::CheckRequestFieldCaps(request.request_id(), "");
      !s.ok()) {
    return failed(ToGrpc(s));
  }
  // Untrusted input: a hash list no longer than the pool, of 16-byte hashes,
  // whose logical indices stay within int32.
  if (request.hashes().empty() ||
      static_cast<int64_t>(request.hashes_size()) > loop_->num_blocks() ||
      request.first_block() > static_cast<uint32_t>(INT32_MAX / 2)) {
    return failed(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                               "PullBlocks: hashes must be 1..pool size"));
  }
  std::vector<engine::BlockHash> hashes(request.hashes_size());
  for (int i = 0; i < request.hashes_size(); ++i) {
    if (!BlockHashFromBytes(request.hashes(i), &hashes[i])) {
      return failed(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                 "PullBlocks: a hash is not 16 bytes"));
    }
  }
  // On the engine thread: pin the leading blocks still in the pool; for the
  // rest, pin the run the tier holds and take free pool blocks to read it
  // into (reading happens below, on this thread, not the engine's).
  struct Held {
    std::vector<int32_t> blocks;  // pool hits, then blocks for tier reads
    int32_t pool = 0;
    int32_t tier = 0;  // of blocks, to read from `kv_tier` (pinned there)
    engine::KvTier* kv_tier = nullptr;
  };
  absl::StatusOr<Held> held = loop_->Call([&](engine::Engine& e) {
    Held h;
    engine::BlockManager& bm = e.block_manager();
    h.blocks = bm.Lookup(hashes);
    h.pool = static_cast<int32_t>(h.blocks.size());
    bm.Acquire(h.blocks);
    h.kv_tier = e.kv_tier();
    if (h.kv_tier != nullptr && h.blocks.size() < hashes.size()) {
      const std::span<const engine::BlockHash> rest =
          std::span<const engine::BlockHash>(hashes).subspan(h.pool);
      h.tier = static_cast<int32_t>(h.kv_tier->MatchAndPin(rest));
      // As many as the pool has room for (the rest is a shorter run).
      const int32_t room =
          static_cast<int32_t>(std::min<int64_t>(h.tier, bm.num_free()));
      if (room < h.tier) {
        h.kv_tier->Unpin(rest.subspan(room, h.tier - room));
        h.tier = room;
      }
      if (h.tier > 0 && !bm.Allocate(h.tier, &h.blocks)) {
        h.kv_tier->Unpin(rest.first(h.tier));  // not reached: room was there
        h.tier = 0;
      }
    }
    return h;
  });
  if (!held.ok()) return failed(ToGrpc(held.status()));
  // Unpins on every path, after the session stopped reading (Finish or
  // Cancel returned); Engine::ReleaseBlocks goes tail first. Blocks read
  // from the tier were never committed: they go back to the free list.
  auto unpin = [&] {
    loop_->Call([&](engine::Engine& e) { e.ReleaseBlocks(held->blocks); })
        .IgnoreError();
  };
  // The tier part: read in chain order; a missing, short or corrupt record
  // (counted by the tier, which drops it) ends the run there.
  const int32_t from_tier = held->tier;
  const bool whole = held->pool + from_tier == request.hashes_size();
  int32_t loaded = 0, tried = 0;
  if (from_tier > 0 && whole) {
    engine::KvStorage& storage = loop_->kv_storage_for_transfer();
    while (loaded < from_tier) {
      ++tried;
      if (!held->kv_tier
               ->Load(hashes[held->pool + loaded], storage,
                      held->blocks[held->pool + loaded])
               .ok()) {
        break;
      }
      ++loaded;
    }
  }
  // Load unpinned each hash it tried; the others are unpinned here.
  if (from_tier > tried) {
    held->kv_tier->Unpin(std::span<const engine::BlockHash>(hashes).subspan(
        held->pool + tried, from_tier - tried));
  }
  // Not read yet when the run is short anyway: the puller asks again for
  // what is there, and the reads happen then.
  const int32_t available = held->pool + (whole ? loaded : from_tier);
  if (available < request.hashes_size()) {
    unpin();
    if (available > 0 && request.partial_ok()) {
      if (metrics_) metrics_->served_partial->Increment();
      response->set_blocks_available(static_cast<uint32_t>(available));
      response->set_worker_id(worker_id_);
      return grpc::Status::OK;
    }
    if (metrics_) metrics_->served_not_found->Increment();
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        "the pulled blocks are no longer cached here");
  }
  if (config_.before_send_for_test) config_.before_send_for_test();
  const std::vector<int32_t>* pinned = &held->blocks;
  kv_transfer::SendPlan plan;
  // Never the caller's choice: the puller's registered address, as the
  // router's grant names it (checked in Admit).
  plan.destination = request.grant().puller_kv_address();
  plan.request_id = request.request_id();
  plan.reservation_id = request.reservation_id();
  plan.sender_id = worker_id_;
  plan.layout = layout_;
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<kv_transfer::KvSendSession>> opened =
      transport_->Open(plan, &loop_->kv_storage_for_transfer());
  if (!opened.ok()) {
    unpin();
    return failed(ToGrpc(opened.status()));
  }
  std::vector<kv_transfer::BlockRef> refs;
  refs.reserve(pinned->size());
  for (size_t i = 0; i < pinned->size(); ++i) {
    refs.emplace_back(static_cast<int32_t>(request.first_block() + i),
                      (*pinned)[i]);
  }
  absl::Status sent = context->IsCancelled()
                          ? absl::CancelledError("the puller went away")
                          : (*opened)->SendBlocks(0, layout_.num_layers, refs);
  absl::StatusOr<kv_transfer::SendStats> stats;
  if (sent.ok()) {
    stats = (*opened)->Finish();
  } else {
    (*opened)->Cancel();
    stats = sent;
  }
  unpin();
  if (!stats.ok()) return failed(ToGrpc(stats.status()));
  if (transfer_rate_) {
    transfer_rate_->Add(static_cast<double>(stats->bytes),
                        absl::ToDoubleSeconds(absl::Now() - start));
  }
  if (metrics_) {
    metrics_->served_sent->Increment();
    metrics_->served_pool_blocks->Increment(held->pool);
    metrics_->served_tier_blocks->Increment(from_tier);
  }
  response->set_blocks_sent(static_cast<uint32_t>(pinned->size()));
  response->set_tier_blocks_sent(static_cast<uint32_t>(from_tier));
  response->set_bytes_sent(stats->bytes);
  response->set_worker_id(worker_id_);
  return grpc::Status::OK;
}

// ---------------------------------------------------------------- puller

std::shared_ptr<v1::Worker::Stub> PeerPuller::HolderStub(
    const std::string& address) {
  absl::MutexLock l(&mu_);
  if (!stubs_.contains(address) && stubs_.size() >= kMaxHolderStubs)
    stubs_.erase(stubs_.begin());
  auto& stub = stubs_[address];
  if (stub == nullptr) {
    stub = v1::Worker::NewStub(
        grpc::CreateCustomChannel(address, tls::InternalChannelCredentials(),
                                  wire::InternalChannelArgs()));
  }
  return stub;
}

void PeerPuller::ForgetHolder(const std::string& address) {
  absl::MutexLock l(&mu_);
  stubs_.erase(address);
}

size_t PeerPuller::num_holder_stubs() const {
  absl::MutexLock l(&mu_);
  return stubs_.size();
}

namespace {

// What the router hears of a pull that did not complete, from the holder's
// answer (status codes, never message text).
v1::PeerPullOutcome ReportFor(const grpc::Status& st) {
  switch (st.error_code()) {
    case grpc::StatusCode::OK:
    case grpc::StatusCode::NOT_FOUND:
      return v1::PEER_PULL_OUTCOME_EVICTED;
    case grpc::StatusCode::PERMISSION_DENIED:
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::INVALID_ARGUMENT:
      return v1::PEER_PULL_OUTCOME_REFUSED;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return v1::PEER_PULL_OUTCOME_BUSY;
    default:
      return v1::PEER_PULL_OUTCOME_FAILED;
  }
}

}  // namespace

PeerPuller::Pulled PeerPuller::Pull(grpc::ServerContext* context,
                                    const v1::PrefillRequest& request) {
  Pulled none;
  const v1::PeerPull& want = request.peer_pull();
  if (want.blocks() == 0 || want.holder_address().empty()) return none;
  // 1. On the engine thread: the prefix's hashes, what we hold of it (pinned
  // now, so the chain stays whole), and fresh blocks for the rest.
  struct Plan {
    std::vector<engine::BlockHash> hashes;
    std::vector<int32_t> blocks;  // by logical index: local, then fresh
    int32_t local = 0;
    bool no_blocks = false;
  };
  std::vector<int32_t> prompt(request.token_ids().begin(),
                              request.token_ids().end());
  absl::StatusOr<Plan> planned = loop_->Call([&](engine::Engine& e) {
    Plan p;
    // Without a prefix cache the prefill would not find pulled blocks.
    if (!e.config().enable_prefix_caching) return p;
    engine::ExtendBlockHashes(e.cache_fingerprint(), request.cache_salt(),
                              prompt, e.kv_spec().block_size, &p.hashes);
    p.hashes.resize(std::min<size_t>(p.hashes.size(), want.blocks()));
    engine::BlockManager& bm = e.block_manager();
    p.blocks = bm.Lookup(p.hashes);
    p.local = static_cast<int32_t>(p.blocks.size());
    if (p.blocks.size() >= p.hashes.size()) {
      p.blocks.clear();
      return p;
    }
    bm.Acquire(p.blocks);
    if (!bm.Allocate(static_cast<int64_t>(p.hashes.size()) - p.local,
                     &p.blocks)) {
      e.ReleaseBlocks(p.blocks);
      p.blocks.clear();
      p.no_blocks = true;
    }
    return p;
  });
  Pulled failed;
  failed.report = v1::PEER_PULL_OUTCOME_FAILED;
  if (!planned.ok()) {
    Count(PeerPullMetrics::kFailed);
    return failed;
  }
  Plan& plan = *planned;
  if (plan.no_blocks) {
    Count(PeerPullMetrics::kNoBlocks);
    failed.report = v1::PEER_PULL_OUTCOME_NO_BLOCKS;
    return failed;
  }
  Pulled local;
  local.report = v1::PEER_PULL_OUTCOME_LOCAL;
  if (plan.hashes.empty()) return local;  // no prefix cache, or no full block
  if (plan.blocks.empty()) {
    Count(PeerPullMetrics::kLocal);
    return local;
  }
  // (Engine::ReleaseBlocks releases tail first.)
  auto give_back = [&] {
    loop_->Call([&](engine::Engine& e) { e.ReleaseBlocks(plan.blocks); })
        .IgnoreError();
  };
  // 2. The reservation the holder pushes into, then the holder's pull. A
  // holder that can serve only the first k blocks (the rest evicted, or a bad
  // tier record) says so without sending; the pull then shrinks to those k
  // (a new reservation over the same leading blocks, the others given back)
  // and asks again, at most kMaxAttempts times in all, within one deadline.
  constexpr int kMaxAttempts = 3;
  const std::string pull_id = wire::PullRequestId(request.request_id());
  const absl::Time deadline = absl::Now() + options_.timeout;
  const int32_t asked = static_cast<int32_t>(plan.hashes.size());
  v1::PullBlocksResponse answer;
  grpc::Status st;
  absl::Status received = absl::UnavailableError("no pull attempt");
  for (int attempt = 0; attempt < kMaxAttempts; ++attempt) {
    const uint64_t reservation =
        receiver_->Expect(pull_id, plan.blocks, plan.local);
    v1::PullBlocksRequest ask;
    ask.set_request_id(pull_id);
    for (size_t i = plan.local; i < plan.hashes.size(); ++i)
      ask.add_hashes(BlockHashToBytes(plan.hashes[i]));
    ask.set_first_block(static_cast<uint32_t>(plan.local));
    ask.set_kv_destination(options_.kv_address);
    ask.set_reservation_id(reservation);
    ask.set_partial_ok(true);
    // The router's grant: the holder checks it, and pushes only to the
    // address it names (which must be ours: kv_destination repeats it).
    *ask.mutable_grant() = want;
    *ask.mutable_layout() = kv_transfer::ToProto(layout_);
    // A child call: the request's cancellation and deadline pass on, within
    // the pull's own bound.
    std::unique_ptr<grpc::ClientContext> ctx =
        grpc::ClientContext::FromServerContext(*context);
    ctx->set_deadline(absl::ToChronoTime(deadline));
    answer.Clear();
    st = HolderStub(want.holder_address())->PullBlocks(ctx.get(), ask, &answer);
    const int32_t wanted =
        static_cast<int32_t>(plan.hashes.size()) - plan.local;
    const int32_t available = static_cast<int32_t>(answer.blocks_available());
    if (st.ok() && answer.blocks_sent() == 0 && available > 0 &&
        available < wanted && attempt + 1 < kMaxAttempts) {
      // Nothing was sent: end this reservation, keep the first `available`
      // fresh blocks, give the others back, and ask again.
      receiver_->Cancel(reservation);
      const size_t keep = static_cast<size_t>(plan.local + available);
      std::vector<int32_t> extra(plan.blocks.begin() + keep, plan.blocks.end());
      loop_->Call([&](engine::Engine& e) { e.ReleaseBlocks(extra); })
          .IgnoreError();
      plan.blocks.resize(keep);
      plan.hashes.resize(keep);
      continue;
    }
    if (st.ok() && answer.blocks_sent() != static_cast<uint32_t>(wanted)) {
      st = grpc::Status(grpc::StatusCode::NOT_FOUND,
                        "the holder sent no blocks");
    }
    received =
        st.ok() ? receiver_->Wait(reservation, options_.timeout, deadline,
                                  [context] { return context->IsCancelled(); })
                : absl::UnavailableError(st.error_message());
    if (!received.ok()) {
      // Nothing writes into the blocks once Cancel (or Wait) returned.
      receiver_->Cancel(reservation);
    }
    break;
  }
  if (!received.ok()) {
    give_back();
    const bool evicted =
        st.ok() || st.error_code() == grpc::StatusCode::NOT_FOUND;
    Count(evicted ? PeerPullMetrics::kEvicted : PeerPullMetrics::kFailed);
    // A holder that cannot be reached is dropped with its channel.
    if (st.error_code() == grpc::StatusCode::UNAVAILABLE)
      ForgetHolder(want.holder_address());
    // The holder answered, but the blocks did not arrive: the transfer failed.
    failed.report = st.ok() && answer.blocks_sent() > 0
                        ? v1::PEER_PULL_OUTCOME_FAILED
                        : ReportFor(st);
    return failed;
  }
  // 3. The pulled blocks join this worker's prefix cache (a `stored` event).
  const int32_t n = static_cast<int32_t>(plan.hashes.size());
  absl::Status committed = loop_->Call([&](engine::Engine& e) {
    const engine::BlockHash parent =
        plan.local > 0 ? plan.hashes[plan.local - 1] : engine::BlockHash{};
    e.block_manager().Commit(parent, std::span(plan.blocks).subspan(plan.local),
                             std::span(plan.hashes).subspan(plan.local));
  });
  if (!committed.ok()) {
    Count(PeerPullMetrics::kFailed);
    return failed;  // the loop stopped: the engine and its blocks are gone
  }
  Pulled out;
  out.held = std::move(plan.blocks);
  out.pulled_blocks = n - plan.local;
  out.outcome =
      n < asked ? PeerPullMetrics::kPartial : PeerPullMetrics::kPulled;
  out.report =
      n < asked ? v1::PEER_PULL_OUTCOME_PARTIAL : v1::PEER_PULL_OUTCOME_PULLED;
  Count(out.outcome);
  if (options_.metrics) {
    options_.metrics->blocks_pulled->Increment(out.pulled_blocks);
    options_.metrics->bytes_pulled->Increment(
        static_cast<double>(answer.bytes_sent()));
  }
  return out;
}

void PeerPuller::Release(const Pulled& pulled) {
  if (pulled.held.empty()) return;
  loop_->Call([&](engine::Engine& e) { e.ReleaseBlocks(pulled.held); })
      .IgnoreError();
}

}  // namespace pdserve::prefill
