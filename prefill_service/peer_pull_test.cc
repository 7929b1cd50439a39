// Peer pull between two in-process workers on loopback (port 0), each a real
// EngineLoop (tiny model), KvReceiver, gRPC KV transport and Worker service
// (Prefill + PullBlocks): a pulled prefix gives the same first token and
// logprobs as a cold prefill and counts as cached; a holder that evicted the
// blocks, died mid-pull or is unreachable means recompute with equal output;
// and no block stays referenced on either side.
#include "prefill_service/peer_pull.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "engine/test_util.h"
#include "kv_transfer/grpc/grpc_transport.h"
#include "prefill_service/prefill_handler.h"

namespace pdserve::prefill {
namespace {

// The decode-bound send of the prefill handler: accepted and dropped (the
// tests compare what the prefill computed, not what a decode worker got).
class DropSession : public kv_transfer::KvSendSession {
 public:
  absl::Status SendLayers(int32_t, int32_t) override {
    return absl::OkStatus();
  }
  absl::Status SendBlocks(int32_t, int32_t,
                          std::span<const kv_transfer::BlockRef>) override {
    return absl::OkStatus();
  }
  absl::StatusOr<kv_transfer::SendStats> Finish() override {
    return kv_transfer::SendStats{};
  }
  void Cancel() override {}
};
class DropTransport : public kv_transfer::KvTransport {
 public:
  const char* name() const override { return "drop"; }
  absl::StatusOr<std::unique_ptr<kv_transfer::KvSendSession>> Open(
      const kv_transfer::SendPlan&, engine::KvStorage*) override {
    return std::make_unique<DropSession>();
  }
};

// The router's key in these tests: every Node accepts grants it signed.
const std::string& RouterKey() {
  static const std::string* key = new std::string(wire::NewPeerPullKey());
  return *key;
}

// The router's grant for `request_id`'s pull of `blocks` from `holder` into
// `puller`'s address.
v1::PeerPull Grant(const std::string& holder, const std::string& puller,
                   const std::string& request_id, uint32_t blocks,
                   const std::string& key = RouterKey()) {
  v1::PeerPull g;
  g.set_holder_address(holder);
  g.set_holder_id("holder");
  g.set_blocks(blocks);
  g.set_puller_kv_address(puller);
  g.set_request_id(request_id);
  g.set_expires_unix_ms(absl::ToUnixMillis(absl::Now() + absl::Minutes(1)));
  wire::SignPeerPullGrant(key, &g);
  return g;
}

// Holder behaviour under test: the real one, one that pushes the first
// requested block and then dies (its transfer stream aborts, the RPC fails),
// or one that hangs: it never answers until the caller gives up.
enum class HolderMode { kReal, kDiesMidPull, kHangs };

class Node : public v1::Worker::Service {
 public:
  // `tier`: a KV tier below the pool (with `pool_blocks` > 0: a pool of that
  // many blocks, so that prompts push each other out into the tier).
  // `holder_config`: the holder's caps and test hook (its address and keys
  // are this node's).
  explicit Node(HolderMode mode = HolderMode::kReal,
                absl::Duration pull_timeout = absl::Seconds(5),
                engine::KvTierConfig tier = {}, int64_t pool_blocks = 0,
                PeerBlockHolderConfig holder_config = {})
      : mode_(mode) {
    engine::EngineConfig config;
    config.block_size = 4;
    config.kv_cache_bytes =
        pool_blocks > 0 ? pool_blocks * BlockBytes() : int64_t{4} << 20;
    config.kv_offload = tier;
    auto eng = engine::Engine::Create(engine::testing::TinyWeights(), config);
    EXPECT_TRUE(eng.ok()) << eng.status();
    loop_ = std::make_unique<engine::EngineLoop>(std::move(*eng));
    layout_ = kv_transfer::KvLayout::FromSpec(loop_->kv_spec(), "test-model");
    receiver_ = std::make_unique<kv_transfer::KvReceiver>(
        &loop_->kv_storage_for_transfer(), layout_);
    kv_service_ =
        std::make_unique<kv_transfer::KvTransferService>(receiver_.get());
    transport_ = std::make_unique<kv_transfer::GrpcKvTransport>(
        nullptr, absl::Seconds(30));
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
    kv_transfer::ConfigureInternalServer(&builder);
    builder.RegisterService(this);
    builder.RegisterService(kv_service_.get());
    server_ = builder.BuildAndStart();
    EXPECT_NE(port, 0);
    address_ = "127.0.0.1:" + std::to_string(port);
    metrics_ = std::make_unique<PeerPullMetrics>(registry_);
    keys_.Add(RouterKey());
    holder_config.address = address_;
    holder_config.keys = &keys_;
    EXPECT_TRUE(holder_config.Validate().ok());
    holder_ = std::make_unique<PeerBlockHolder>(
        loop_.get(), transport_.get(), layout_, "holder@" + address_,
        &transfer_rate_, metrics_.get(), holder_config);
    puller_ = std::make_unique<PeerPuller>(
        loop_.get(), receiver_.get(), layout_,
        PeerPullerOptions{address_, pull_timeout, metrics_.get()});
    PrefillOptions options;
    options.puller = puller_.get();
    options.prefill_rate = &prefill_rate_;
    handler_ = std::make_unique<PrefillHandler>(loop_.get(), &drop_, layout_,
                                                "prefill@" + address_, options);
    stub_ = v1::Worker::NewStub(
        grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  }
  ~Node() override {
    server_->Shutdown(std::chrono::system_clock::now());
    loop_->Stop();
  }

  grpc::Status Prefill(grpc::ServerContext* ctx, const v1::PrefillRequest* req,
                       v1::PrefillResponse* resp) override {
    return handler_->Prefill(ctx, *req, resp);
  }
  grpc::Status PullBlocks(grpc::ServerContext* ctx,
                          const v1::PullBlocksRequest* req,
                          v1::PullBlocksResponse* resp) override {
    if (mode_ == HolderMode::kReal) return holder_->PullBlocks(ctx, *req, resp);
    if (mode_ == HolderMode::kHangs) {
      // Until the puller's deadline cancels the call (bounded for safety).
      const absl::Time until = absl::Now() + absl::Seconds(30);
      while (!ctx->IsCancelled() && absl::Now() < until)
        absl::SleepFor(absl::Milliseconds(10));
      return grpc::Status(grpc::StatusCode::CANCELLED, "gave up");
    }
    // Dies mid-pull: pins the first block, pushes it, aborts the stream.
    std::vector<engine::BlockHash> first(1);
    EXPECT_TRUE(BlockHashFromBytes(req->hashes(0), &first[0]));
    auto pinned = loop_->Call([&](engine::Engine& e) {
      std::vector<int32_t> b = e.block_manager().Lookup(first);
      e.block_manager().Acquire(b);
      return b;
    });
    EXPECT_TRUE(pinned.ok() && pinned->size() == 1);
    kv_transfer::SendPlan plan;
    plan.destination = req->kv_destination();
    plan.request_id = req->request_id();
    plan.reservation_id = req->reservation_id();
    plan.sender_id = "dying";
    plan.layout = layout_;
    auto session = transport_->Open(plan, &loop_->kv_storage_for_transfer());
    EXPECT_TRUE(session.ok());
    std::vector<kv_transfer::BlockRef> refs = {
        {static_cast<int32_t>(req->first_block()), (*pinned)[0]}};
    EXPECT_TRUE((*session)->SendBlocks(0, layout_.num_layers, refs).ok());
    (*session)->Cancel();
    loop_->Call([&](engine::Engine& e) { e.ReleaseBlocks(*pinned); })
        .IgnoreError();
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "holder died");
  }

  v1::PrefillRequest Request(const std::string& id, int tokens) const {
    v1::PrefillRequest r;
    r.set_request_id(id);
    for (int i = 0; i < tokens; ++i) r.add_token_ids(1 + (i * 13) % 250);
    r.mutable_sampling()->set_max_tokens(4);
    r.mutable_sampling()->set_logprobs(true);
    r.mutable_sampling()->set_top_logprobs(5);
    r.set_kv_destination("dropped:1");
    *r.mutable_layout() = kv_transfer::ToProto(layout_);
    return r;
  }
  absl::StatusOr<v1::PrefillResponse> Run(const v1::PrefillRequest& r) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(60));
    v1::PrefillResponse resp;
    grpc::Status s = stub_->Prefill(&ctx, r, &resp);
    if (!s.ok()) return absl::InternalError(s.error_message());
    return resp;
  }
  int64_t ActiveBlocks() {
    auto n = loop_->Call(
        [](engine::Engine& e) { return e.block_manager().num_active(); });
    return n.ok() ? *n : -1;
  }
  int64_t CachedPrefixBlocks(const v1::PrefillRequest& r) {
    std::vector<int32_t> prompt(r.token_ids().begin(), r.token_ids().end());
    auto n = loop_->Call([&](engine::Engine& e) {
      std::vector<engine::BlockHash> hashes;
      engine::ExtendBlockHashes(e.cache_fingerprint(), r.cache_salt(), prompt,
                                e.kv_spec().block_size, &hashes);
      return static_cast<int64_t>(e.block_manager().Lookup(hashes).size());
    });
    return n.ok() ? *n : -1;
  }
  // fp32 KV, block size 4, every layer.
  static int64_t BlockBytes() {
    const engine::ModelConfig& mc = engine::testing::TinyWeights()->config;
    return int64_t{4} * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 4;
  }
  std::vector<engine::BlockHash> Hashes(const v1::PrefillRequest& r) {
    std::vector<int32_t> prompt(r.token_ids().begin(), r.token_ids().end());
    auto h = loop_->Call([&](engine::Engine& e) {
      std::vector<engine::BlockHash> hashes;
      engine::ExtendBlockHashes(e.cache_fingerprint(), r.cache_salt(), prompt,
                                e.kv_spec().block_size, &hashes);
      return hashes;
    });
    return h.ok() ? *h : std::vector<engine::BlockHash>{};
  }
  engine::KvTier* Tier() {
    auto t = loop_->Call([](engine::Engine& e) { return e.kv_tier(); });
    return t.ok() ? *t : nullptr;
  }
  // Leading blocks of `r`'s prompt the tier holds, once its writes are done.
  int64_t TierPrefixBlocks(const v1::PrefillRequest& r) {
    engine::KvTier* t = Tier();
    if (t == nullptr || !t->WaitForWrites(absl::Seconds(30))) return -1;
    return t->Match(Hashes(r));
  }
  // Takes `n` free pool blocks (a request in flight, as far as a pull can
  // tell); Unhold gives them back.
  std::vector<int32_t> Hold(int64_t n) {
    auto b = loop_->Call([&](engine::Engine& e) {
      std::vector<int32_t> blocks;
      EXPECT_TRUE(e.block_manager().Allocate(n, &blocks));
      return blocks;
    });
    return b.ok() ? *b : std::vector<int32_t>{};
  }
  void Unhold(const std::vector<int32_t>& blocks) {
    ASSERT_TRUE(
        loop_->Call([&](engine::Engine& e) { e.ReleaseBlocks(blocks); }).ok());
  }
  engine::KvTierStats TierStats() {
    auto s = loop_->Call([](engine::Engine& e) { return e.Stats(); });
    return s.ok() ? s->kv_tier : engine::KvTierStats{};
  }
  void ClearCache() {
    ASSERT_TRUE(
        loop_->Call([](engine::Engine& e) { e.block_manager().ClearCache(); })
            .ok());
  }

  const std::string& address() const { return address_; }
  PeerPullMetrics& metrics() { return *metrics_; }
  PeerBlockHolder& holder() { return *holder_; }
  PeerPuller& puller() { return *puller_; }
  RateMeter& transfer_rate() { return transfer_rate_; }
  RateMeter& prefill_rate() { return prefill_rate_; }

 private:
  const HolderMode mode_;
  metrics::Registry registry_;
  std::unique_ptr<engine::EngineLoop> loop_;
  kv_transfer::KvLayout layout_;
  std::unique_ptr<kv_transfer::KvReceiver> receiver_;
  std::unique_ptr<kv_transfer::KvTransferService> kv_service_;
  std::unique_ptr<kv_transfer::GrpcKvTransport> transport_;
  DropTransport drop_;
  RateMeter transfer_rate_, prefill_rate_;
  std::unique_ptr<PeerPullMetrics> metrics_;
  wire::PeerPullKeys keys_;
  std::unique_ptr<PeerBlockHolder> holder_;
  std::unique_ptr<PeerPuller> puller_;
  std::unique_ptr<PrefillHandler> handler_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

class PeerPullTest : public ::testing::Test {
 protected:
  static constexpr int kTokens = 42;  // 10 full blocks of 4 + 2 tokens
  static constexpr int kBlocks = 10;

  // The holder's cold prefill: the reference every pull is compared with.
  v1::PrefillResponse Warm(Node& holder) {
    auto cold = holder.Run(holder.Request("cold", kTokens));
    EXPECT_TRUE(cold.ok()) << cold.status();
    EXPECT_EQ(cold->cached_prompt_tokens(), 0u);
    EXPECT_EQ(holder.CachedPrefixBlocks(holder.Request("x", kTokens)), kBlocks);
    return *cold;
  }
  v1::PrefillRequest PullRequest(Node& puller, const Node& holder,
                                 int blocks = kBlocks) {
    v1::PrefillRequest r = puller.Request("pulled", kTokens);
    *r.mutable_peer_pull() =
        Grant(holder.address(), puller.address(), "pulled", blocks);
    return r;
  }
  static void ExpectSameOutput(const v1::PrefillResponse& a,
                               const v1::PrefillResponse& b) {
    EXPECT_EQ(a.first_token(), b.first_token());
    // Bit-identical logprobs (top 5 included): the same logits.
    EXPECT_EQ(a.first_token_logprobs().SerializeAsString(),
              b.first_token_logprobs().SerializeAsString());
    EXPECT_TRUE(a.has_first_token_logprobs());
  }
};

TEST_F(PeerPullTest, PulledPrefixGivesTheColdOutputAndCountsAsCached) {
  Node holder, puller;
  const v1::PrefillResponse cold = Warm(holder);
  auto pulled = puller.Run(PullRequest(puller, holder));
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  ExpectSameOutput(cold, *pulled);
  EXPECT_EQ(pulled->pulled_blocks(), static_cast<uint32_t>(kBlocks));
  EXPECT_EQ(pulled->peer_pull_outcome(), v1::PEER_PULL_OUTCOME_PULLED);
  // The last full block is recomputed to sample from, at most.
  EXPECT_GE(pulled->cached_prompt_tokens(), (kBlocks - 1) * 4u);
  EXPECT_EQ(puller.metrics().count(PeerPullMetrics::kPulled), 1);
  EXPECT_EQ(puller.metrics().blocks_pulled->Value(), kBlocks);
  EXPECT_GT(puller.metrics().bytes_pulled->Value(), 0);
  EXPECT_EQ(holder.metrics().served_sent->Value(), 1);
  EXPECT_GT(holder.transfer_rate().rate(), 0);
  EXPECT_GT(holder.prefill_rate().rate(), 0);
  // The pulled blocks are now this worker's prefix cache (KV events).
  EXPECT_EQ(puller.CachedPrefixBlocks(puller.Request("x", kTokens)), kBlocks);
  EXPECT_EQ(holder.ActiveBlocks(), 0);
  EXPECT_EQ(puller.ActiveBlocks(), 0);
}

TEST_F(PeerPullTest, PartOfThePrefixLocalPullsOnlyTheRest) {
  Node holder, puller;
  const v1::PrefillResponse cold = Warm(holder);
  // The puller holds the first 3 blocks (a 13-token prompt's prefix).
  ASSERT_TRUE(puller.Run(puller.Request("short", 13)).ok());
  auto pulled = puller.Run(PullRequest(puller, holder));
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  ExpectSameOutput(cold, *pulled);
  EXPECT_EQ(pulled->pulled_blocks(), static_cast<uint32_t>(kBlocks - 3));
  EXPECT_EQ(holder.ActiveBlocks(), 0);
  EXPECT_EQ(puller.ActiveBlocks(), 0);
}

TEST_F(PeerPullTest, HolderThatEvictedTheBlocksMeansRecompute) {
  Node holder, puller;
  const v1::PrefillResponse cold = Warm(holder);
  holder.ClearCache();  // evicted before the pull arrives
  auto pulled = puller.Run(PullRequest(puller, holder));
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  ExpectSameOutput(cold, *pulled);
  EXPECT_EQ(pulled->pulled_blocks(), 0u);
  EXPECT_EQ(pulled->cached_prompt_tokens(), 0u);
  EXPECT_EQ(puller.metrics().count(PeerPullMetrics::kEvicted), 1);
  EXPECT_EQ(holder.metrics().served_not_found->Value(), 1);
  EXPECT_EQ(holder.ActiveBlocks(), 0);
  EXPECT_EQ(puller.ActiveBlocks(), 0);
}

TEST_F(PeerPullTest, HolderWithPartOfThePrefixServesThatPart) {
  // The holder caches only the first 3 blocks (a 13-token prompt), no tier:
  // the router's count was stale. The puller gets those 3 and computes the
  // rest (before partial pulls, this was a NOT_FOUND and a full recompute).
  Node holder, puller, reference;
  const v1::PrefillResponse cold = Warm(reference);
  ASSERT_TRUE(holder.Run(holder.Request("short", 13)).ok());
  auto pulled = puller.Run(PullRequest(puller, holder));
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  ExpectSameOutput(cold, *pulled);
  EXPECT_EQ(pulled->pulled_blocks(), 3u);
  EXPECT_EQ(pulled->cached_prompt_tokens(), 3 * 4u);
  EXPECT_EQ(puller.metrics().count(PeerPullMetrics::kPartial), 1);
  EXPECT_EQ(holder.metrics().served_partial->Value(), 1);
  EXPECT_EQ(holder.metrics().served_pool_blocks->Value(), 3);
  EXPECT_EQ(holder.ActiveBlocks(), 0);
  EXPECT_EQ(puller.ActiveBlocks(), 0);
}

TEST_F(PeerPullTest, HolderThatDiesMidPullMeansRecompute) {
  Node holder(HolderMode::kDiesMidPull), puller;
  const v1::PrefillResponse cold = Warm(holder);
  auto pulled = puller.Run(PullRequest(puller, holder));
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  ExpectSameOutput(cold, *pulled);
  EXPECT_EQ(pulled->pulled_blocks(), 0u);
  EXPECT_EQ(pulled->cached_prompt_tokens(), 0u);
  EXPECT_EQ(puller.metrics().count(PeerPullMetrics::kFailed), 1);
  EXPECT_EQ(holder.ActiveBlocks(), 0);
  EXPECT_EQ(puller.ActiveBlocks(), 0);
  // The partly written blocks never entered the puller's prefix cache as
  // pulled ones; what it caches now it computed itself, and a second run is
  // a plain local hit with the same output.
  auto again = puller.Run(puller.Request("again", kTokens));
  ASSERT_TRUE(again.ok());
  ExpectSameOutput(cold, *again);
}

TEST_F(PeerPullTest, HolderThatHangsIsGivenUpAtThePullDeadline) {
  Node holder(HolderMode::kHangs);
  Node puller(HolderMode::kReal, absl::Milliseconds(300));
  Node reference;
  const v1::PrefillResponse cold = Warm(reference);
  const absl::Time start = absl::Now();
  auto pulled = puller.Run(PullRequest(puller, holder));
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  ExpectSameOutput(cold, *pulled);
  EXPECT_EQ(pulled->pulled_blocks(), 0u);
  EXPECT_EQ(puller.metrics().count(PeerPullMetrics::kFailed), 1);
  EXPECT_EQ(puller.ActiveBlocks(), 0);
}

TEST_F(PeerPullTest, GoneHolderMeansRecompute) {
  v1::PrefillResponse cold;
  std::string gone_address;
  {
    Node holder;
    cold = Warm(holder);
    gone_address = holder.address();
  }  // the holder process is gone: its port refuses
  Node puller;
  v1::PrefillRequest r = puller.Request("pulled", kTokens);
  *r.mutable_peer_pull() =
      Grant(gone_address, puller.address(), "pulled", kBlocks);
  auto pulled = puller.Run(r);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  ExpectSameOutput(cold, *pulled);
  EXPECT_EQ(puller.metrics().count(PeerPullMetrics::kFailed), 1);
  EXPECT_EQ(pulled->peer_pull_outcome(), v1::PEER_PULL_OUTCOME_FAILED);
  EXPECT_EQ(puller.ActiveBlocks(), 0);
  // The unreachable holder's channel is not kept.
  EXPECT_EQ(puller.puller().num_holder_stubs(), 0u);
}

TEST_F(PeerPullTest, PrefixAlreadyLocalPullsNothing) {
  Node holder, puller;
  const v1::PrefillResponse cold = Warm(holder);
  ASSERT_TRUE(puller.Run(puller.Request("own", kTokens)).ok());
  auto pulled = puller.Run(PullRequest(puller, holder));
  ASSERT_TRUE(pulled.ok());
  ExpectSameOutput(cold, *pulled);
  EXPECT_EQ(pulled->pulled_blocks(), 0u);
  EXPECT_EQ(puller.metrics().count(PeerPullMetrics::kLocal), 1);
  EXPECT_EQ(holder.metrics().served_sent->Value(), 0);
}

TEST_F(PeerPullTest, HolderUnpinsWhenItsSendFails) {
  Node holder, puller;
  Warm(holder);
  // A reservation the puller never made: the transfer is refused.
  v1::PullBlocksRequest ask;
  ask.set_request_id("pull:bogus");
  std::vector<int32_t> prompt;
  v1::PrefillRequest r = holder.Request("x", kTokens);
  prompt.assign(r.token_ids().begin(), r.token_ids().end());
  // Hashes as the holder computes them (same model and salt).
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(
      holder.address(), grpc::InsecureChannelCredentials()));
  // Learn the chain from the puller's identical engine.
  std::vector<engine::BlockHash> hashes;
  {
    engine::EngineConfig config;
    config.block_size = 4;
    auto e = engine::Engine::Create(engine::testing::TinyWeights(), config);
    ASSERT_TRUE(e.ok());
    engine::ExtendBlockHashes((*e)->cache_fingerprint(), "", prompt, 4,
                              &hashes);
  }
  for (const auto& h : hashes) ask.add_hashes(BlockHashToBytes(h));
  ask.set_kv_destination(puller.address());
  *ask.mutable_grant() =
      Grant(holder.address(), puller.address(), "bogus", kBlocks);
  ask.set_reservation_id(12345);
  *ask.mutable_layout() = r.layout();
  grpc::ClientContext ctx;
  v1::PullBlocksResponse resp;
  const grpc::Status s = stub->PullBlocks(&ctx, ask, &resp);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(holder.metrics().served_failed->Value(), 1);
  EXPECT_EQ(holder.ActiveBlocks(), 0);
  EXPECT_EQ(puller.ActiveBlocks(), 0);
}

TEST_F(PeerPullTest, HolderRefusesMalformedRequests) {
  Node holder;
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(
      holder.address(), grpc::InsecureChannelCredentials()));
  v1::PullBlocksRequest ask;
  ask.set_request_id("pull:x");
  *ask.mutable_grant() = Grant(holder.address(), "127.0.0.1:1", "x", 1);
  *ask.mutable_layout() = holder.Request("x", 4).layout();
  ask.add_hashes("short");
  grpc::ClientContext ctx;
  v1::PullBlocksResponse resp;
  EXPECT_EQ(stub->PullBlocks(&ctx, ask, &resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(holder.ActiveBlocks(), 0);
}

// The holder pushes only where the router's grant says: a caller naming
// another destination, or carrying a grant for someone else, a forged one or
// none, is refused before anything is pinned, and nothing is sent.
TEST_F(PeerPullTest, PullNamingAnotherDestinationIsRefused) {
  Node holder, puller, victim;
  Warm(holder);
  const std::vector<engine::BlockHash> hashes =
      holder.Hashes(holder.Request("x", kTokens));
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(
      holder.address(), grpc::InsecureChannelCredentials()));
  auto ask_with = [&](const v1::PeerPull& grant, const std::string& dest) {
    v1::PullBlocksRequest ask;
    ask.set_request_id("pull:r1");
    for (int i = 0; i < kBlocks; ++i)
      ask.add_hashes(BlockHashToBytes(hashes[i]));
    ask.set_kv_destination(dest);
    ask.set_reservation_id(1);
    *ask.mutable_layout() = holder.Request("x", 4).layout();
    *ask.mutable_grant() = grant;
    grpc::ClientContext ctx;
    v1::PullBlocksResponse resp;
    return stub->PullBlocks(&ctx, ask, &resp).error_code();
  };
  const v1::PeerPull mine =
      Grant(holder.address(), puller.address(), "r1", kBlocks);
  // The puller's grant, someone else's destination.
  EXPECT_EQ(ask_with(mine, victim.address()),
            grpc::StatusCode::PERMISSION_DENIED);
  // The grant rewritten to the victim's address no longer verifies.
  v1::PeerPull rewritten = mine;
  rewritten.set_puller_kv_address(victim.address());
  EXPECT_EQ(ask_with(rewritten, victim.address()),
            grpc::StatusCode::PERMISSION_DENIED);
  // Signed by a key no router gave this holder; or no grant at all.
  EXPECT_EQ(ask_with(Grant(holder.address(), victim.address(), "r1", kBlocks,
                           wire::NewPeerPullKey()),
                     victim.address()),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(ask_with(v1::PeerPull(), victim.address()),
            grpc::StatusCode::PERMISSION_DENIED);
  // A grant naming another holder.
  EXPECT_EQ(ask_with(Grant(victim.address(), puller.address(), "r1", kBlocks),
                     puller.address()),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(holder.metrics().served_refused->Value(), 5);
  EXPECT_EQ(holder.metrics().served_sent->Value(), 0);
  EXPECT_EQ(holder.ActiveBlocks(), 0);
  EXPECT_EQ(victim.ActiveBlocks(), 0);
}

TEST_F(PeerPullTest, PullerWithSomeoneElsesGrantRecomputesAndReportsRefused) {
  Node holder, puller, other;
  const v1::PrefillResponse cold = Warm(holder);
  // The grant names `other` as the puller: `puller` sends its own address as
  // kv_destination, which the holder refuses.
  v1::PrefillRequest r = puller.Request("pulled", kTokens);
  *r.mutable_peer_pull() =
      Grant(holder.address(), other.address(), "pulled", kBlocks);
  auto got = puller.Run(r);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameOutput(cold, *got);
  EXPECT_EQ(got->pulled_blocks(), 0u);
  EXPECT_EQ(got->peer_pull_outcome(), v1::PEER_PULL_OUTCOME_REFUSED);
  EXPECT_EQ(holder.metrics().served_refused->Value(), 1);
  EXPECT_EQ(holder.ActiveBlocks(), 0);
  EXPECT_EQ(puller.ActiveBlocks(), 0);
  EXPECT_EQ(other.ActiveBlocks(), 0);
}

TEST_F(PeerPullTest, PullOverTheBlocksPerCallCapIsResourceExhausted) {
  PeerBlockHolderConfig caps;
  caps.max_blocks_per_pull = kBlocks - 1;
  Node holder(HolderMode::kReal, absl::Seconds(5), {}, 0, caps);
  Node puller;
  const v1::PrefillResponse cold = Warm(holder);
  auto got = puller.Run(PullRequest(puller, holder));
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameOutput(cold, *got);
  EXPECT_EQ(got->pulled_blocks(), 0u);
  EXPECT_EQ(got->peer_pull_outcome(), v1::PEER_PULL_OUTCOME_BUSY);
  EXPECT_EQ(holder.metrics().served_busy->Value(), 1);
  EXPECT_EQ(holder.metrics().served_sent->Value(), 0);
  // At the cap it is served.
  Node puller2;
  auto fits = puller2.Run(PullRequest(puller2, holder, kBlocks - 1));
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(fits->pulled_blocks(), static_cast<uint32_t>(kBlocks - 1));
  EXPECT_EQ(holder.ActiveBlocks(), 0);
  EXPECT_EQ(puller.ActiveBlocks(), 0);
  EXPECT_EQ(puller2.ActiveBlocks(), 0);
}

TEST_F(PeerPullTest, PullsPastTheConcurrencyCapAreResourceExhausted) {
  constexpr int kCap = 2;
  // Each served pull waits, holding its blocks, until the test lets go.
  absl::Notification release;
  PeerBlockHolderConfig caps;
  caps.max_concurrent_pulls = kCap;
  caps.before_send_for_test = [&release] {
    release.WaitForNotificationWithTimeout(absl::Seconds(30));
  };
  Node holder(HolderMode::kReal, absl::Seconds(20), {}, 0, caps);
  const v1::PrefillResponse cold = Warm(holder);
  std::vector<std::unique_ptr<Node>> pullers;
  for (int i = 0; i <= kCap; ++i)
    pullers.push_back(
        std::make_unique<Node>(HolderMode::kReal, absl::Seconds(20)));
  std::vector<absl::StatusOr<v1::PrefillResponse>> got(kCap);
  std::vector<std::thread> threads;
  for (int i = 0; i < kCap; ++i) {
    threads.emplace_back(
        [&, i] { got[i] = pullers[i]->Run(PullRequest(*pullers[i], holder)); });
  }
  // Both pulls hold their blocks in the holder now.
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (holder.holder().active_pulls() < kCap && absl::Now() < until)
    absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(holder.holder().active_pulls(), kCap);
  // The next one is turned away at once, and recomputes.
  auto busy = pullers[kCap]->Run(PullRequest(*pullers[kCap], holder));
  ASSERT_TRUE(busy.ok()) << busy.status();
  EXPECT_EQ(busy->peer_pull_outcome(), v1::PEER_PULL_OUTCOME_BUSY);
  ExpectSameOutput(cold, *busy);
  EXPECT_EQ(holder.metrics().served_busy->Value(), 1);
  release.Notify();
  for (auto& t : threads) t.join();
  for (int i = 0; i < kCap; ++i) {
    ASSERT_TRUE(got[i].ok()) << got[i].status();
    EXPECT_EQ(got[i]->peer_pull_outcome(), v1::PEER_PULL_OUTCOME_PULLED);
    ExpectSameOutput(cold, *got[i]);
  }
  EXPECT_EQ(holder.metrics().served_sent->Value(), kCap);
  EXPECT_EQ(holder.holder().active_pulls(), 0);
  EXPECT_EQ(holder.ActiveBlocks(), 0);
  for (auto& p : pullers) EXPECT_EQ(p->ActiveBlocks(), 0);
}

// A holder whose pool pushed the prompt out into its disk tier: pulls are
// served from the tier too.
class PeerPullFromTierTest : public PeerPullTest {
 protected:
  void SetUp() override {
    dir_ = engine::testing::TempDir(
        std::string("peer_pull_tier_") +
        ::testing::UnitTest::GetInstance()->current_test_info()->name());
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  engine::KvTierConfig Tier() const {
    engine::KvTierConfig t;
    t.dir = dir_;
    t.capacity_bytes = int64_t{64} << 20;
    return t;
  }
  // A holder with a 16-block pool (by default) over a disk tier.
  std::unique_ptr<Node> TieredHolder(int64_t pool_blocks = 16) {
    return std::make_unique<Node>(HolderMode::kReal, absl::Seconds(5), Tier(),
                                  pool_blocks);
  }
  // Runs other prompts on `holder` until none of the reference prompt's
  // blocks is left in its pool, and waits until they are in its tier.
  void PushOutToTier(Node& holder) {
    const v1::PrefillRequest a = holder.Request("x", kTokens);
    for (int i = 0; i < 6 && holder.CachedPrefixBlocks(a) > 0; ++i) {
      v1::PrefillRequest other = holder.Request(absl::StrCat("other", i), 40);
      other.set_cache_salt(absl::StrCat("salt", i));
      ASSERT_TRUE(holder.Run(other).ok());
    }
    ASSERT_EQ(holder.CachedPrefixBlocks(a), 0);
    ASSERT_EQ(holder.TierPrefixBlocks(a), kBlocks);
  }
  std::string dir_;
};

TEST_F(PeerPullFromTierTest, PullServedFromTheHoldersTierGivesTheColdOutput) {
  auto holder = TieredHolder();
  Node puller;
  const v1::PrefillResponse cold = Warm(*holder);
  PushOutToTier(*holder);
  const int64_t loaded_before = holder->TierStats().blocks_loaded;
  auto pulled = puller.Run(PullRequest(puller, *holder));
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  ExpectSameOutput(cold, *pulled);
  EXPECT_EQ(pulled->pulled_blocks(), static_cast<uint32_t>(kBlocks));
  EXPECT_GE(pulled->cached_prompt_tokens(), (kBlocks - 1) * 4u);
  EXPECT_EQ(puller.metrics().count(PeerPullMetrics::kPulled), 1);
  EXPECT_EQ(holder->metrics().served_sent->Value(), 1);
  EXPECT_EQ(holder->metrics().served_tier_blocks->Value(), kBlocks);
  EXPECT_EQ(holder->metrics().served_pool_blocks->Value(), 0);
  EXPECT_EQ(holder->TierStats().blocks_loaded - loaded_before, kBlocks);
  // The holder read them into blocks it never committed: its pool still
  // lacks the prompt, and they went back to its free list.
  EXPECT_EQ(holder->CachedPrefixBlocks(holder->Request("x", kTokens)), 0);
  EXPECT_EQ(holder->ActiveBlocks(), 0);
  EXPECT_EQ(puller.ActiveBlocks(), 0);
}

TEST_F(PeerPullFromTierTest, PullTakesThePoolPartAndTheTierPartOfOnePrefix) {
  auto holder = TieredHolder();
  Node puller;
  const v1::PrefillResponse cold = Warm(*holder);
  PushOutToTier(*holder);
  // A 17-token prompt with the same start loads the first 4 blocks back into
  // the holder's pool; the other 6 stay in its tier only.
  ASSERT_TRUE(holder->Run(holder->Request("head", 17)).ok());
  ASSERT_EQ(holder->CachedPrefixBlocks(holder->Request("x", kTokens)), 4);
  auto pulled = puller.Run(PullRequest(puller, *holder));
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  ExpectSameOutput(cold, *pulled);
  EXPECT_EQ(pulled->pulled_blocks(), static_cast<uint32_t>(kBlocks));
  EXPECT_EQ(holder->metrics().served_pool_blocks->Value(), 4);
  EXPECT_EQ(holder->metrics().served_tier_blocks->Value(), kBlocks - 4);
  EXPECT_EQ(holder->ActiveBlocks(), 0);
  EXPECT_EQ(puller.ActiveBlocks(), 0);
}

TEST_F(PeerPullFromTierTest, ConcurrentPullsFromOneHoldersTier) {
  // Two pullers read the same tier records at once: both get the cold
  // output and nothing stays referenced on any of the three. The holder's
  // pool has room for both reads (2 x 10 of 24 blocks); with 16 the second
  // one would get the 6 blocks there is room for (a partial pull).
  auto holder = TieredHolder(24);
  Node a, b;
  const v1::PrefillResponse cold = Warm(*holder);
  PushOutToTier(*holder);
  absl::StatusOr<v1::PrefillResponse> got_a, got_b;
  std::thread ta([&] { got_a = a.Run(PullRequest(a, *holder)); });
  std::thread tb([&] { got_b = b.Run(PullRequest(b, *holder)); });
  ta.join();
  tb.join();
  ASSERT_TRUE(got_a.ok()) << got_a.status();
  ASSERT_TRUE(got_b.ok()) << got_b.status();
  ExpectSameOutput(cold, *got_a);
  ExpectSameOutput(cold, *got_b);
  EXPECT_EQ(got_a->pulled_blocks(), static_cast<uint32_t>(kBlocks));
  EXPECT_EQ(got_b->pulled_blocks(), static_cast<uint32_t>(kBlocks));
  EXPECT_EQ(holder->metrics().served_tier_blocks->Value(), 2 * kBlocks);
  EXPECT_EQ(holder->ActiveBlocks(), 0);
  EXPECT_EQ(a.ActiveBlocks(), 0);
  EXPECT_EQ(b.ActiveBlocks(), 0);
  // The tier still holds the prompt (reads leave records in place).
  EXPECT_EQ(holder->TierPrefixBlocks(holder->Request("x", kTokens)), kBlocks);
}

TEST_F(PeerPullFromTierTest, HolderWithoutRoomForTheTierReadsServesWhatFits) {
  // 12 of the holder's 16 blocks are busy: only 4 tier records can be read
  // back for the pull, so the puller gets those 4 and computes the rest.
  auto holder = TieredHolder();
  Node puller;
  const v1::PrefillResponse cold = Warm(*holder);
  PushOutToTier(*holder);
  const std::vector<int32_t> busy = holder->Hold(12);
  ASSERT_EQ(busy.size(), 12u);
  auto pulled = puller.Run(PullRequest(puller, *holder));
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  ExpectSameOutput(cold, *pulled);
  EXPECT_EQ(pulled->pulled_blocks(), 4u);
  EXPECT_EQ(puller.metrics().count(PeerPullMetrics::kPartial), 1);
  EXPECT_EQ(holder->metrics().served_partial->Value(), 1);
  EXPECT_EQ(holder->metrics().served_tier_blocks->Value(), 4);
  EXPECT_EQ(holder->ActiveBlocks(), 12);  // only the busy ones
  holder->Unhold(busy);
  EXPECT_EQ(holder->ActiveBlocks(), 0);
  EXPECT_EQ(puller.ActiveBlocks(), 0);
  // Nothing was lost from the tier: all 10 records are still there.
  EXPECT_EQ(holder->TierPrefixBlocks(holder->Request("x", kTokens)), kBlocks);
}

enum class TierFault { kCorrupt, kTruncate, kDelete };

class PeerPullTierFaultTest : public PeerPullFromTierTest,
                              public ::testing::WithParamInterface<TierFault> {
 protected:
  // Damages the holder's tier file of block `i` of the reference prompt.
  void Damage(Node& holder, int i) {
    const std::vector<engine::BlockHash> hashes =
        holder.Hashes(holder.Request("x", kTokens));
    const std::string path = holder.Tier()->PathFor(hashes[i]);
    ASSERT_TRUE(std::filesystem::exists(path)) << path;
    switch (GetParam()) {
      case TierFault::kCorrupt: {
        std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
        f.seekg(-1, std::ios::end);
        char c = 0;
        f.read(&c, 1);
        f.seekp(-1, std::ios::end);
        c = static_cast<char>(c ^ 0x5a);
        f.write(&c, 1);
        break;
      }
      case TierFault::kTruncate:
        std::filesystem::resize_file(path,
                                     std::filesystem::file_size(path) / 2);
        break;
      case TierFault::kDelete:
        std::filesystem::remove(path);
        break;
    }
  }
  engine::KvTierFailure Expected() const {
    switch (GetParam()) {
      case TierFault::kCorrupt:
        return engine::KvTierFailure::kCorrupt;
      case TierFault::kTruncate:
        return engine::KvTierFailure::kShort;
      case TierFault::kDelete:
        return engine::KvTierFailure::kMissing;
    }
    return engine::KvTierFailure::kCorrupt;
  }
};

TEST_P(PeerPullTierFaultTest,
       BadTierRecordEndsThePullThereAndTheRestIsRecomputed) {
  auto holder = TieredHolder();
  Node puller;
  const v1::PrefillResponse cold = Warm(*holder);
  PushOutToTier(*holder);
  Damage(*holder, 6);
  auto pulled = puller.Run(PullRequest(puller, *holder));
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  ExpectSameOutput(cold, *pulled);
  // Blocks 0..5 were valid: pulled; 6.. recomputed by the puller.
  EXPECT_EQ(pulled->pulled_blocks(), 6u);
  EXPECT_EQ(pulled->cached_prompt_tokens(), 6 * 4u);
  EXPECT_EQ(puller.metrics().count(PeerPullMetrics::kPartial), 1);
  EXPECT_EQ(puller.metrics().count(PeerPullMetrics::kPulled), 0);
  EXPECT_EQ(holder->metrics().served_partial->Value(), 1);
  EXPECT_EQ(holder->metrics().served_sent->Value(), 1);
  EXPECT_EQ(holder->metrics().served_tier_blocks->Value(), 6);
  EXPECT_EQ(holder->TierStats().failures[static_cast<int>(Expected())], 1);
  EXPECT_EQ(holder->ActiveBlocks(), 0);
  EXPECT_EQ(puller.ActiveBlocks(), 0);
  // The puller now caches the whole prompt (6 pulled, the rest computed):
  // a second run is a local hit with the same output.
  auto again = puller.Run(puller.Request("again", kTokens));
  ASSERT_TRUE(again.ok());
  ExpectSameOutput(cold, *again);
  EXPECT_EQ(puller.ActiveBlocks(), 0);
}

TEST_P(PeerPullTierFaultTest, BadFirstTierRecordMeansNotFoundAndRecompute) {
  auto holder = TieredHolder();
  Node puller;
  const v1::PrefillResponse cold = Warm(*holder);
  PushOutToTier(*holder);
  Damage(*holder, 0);
  auto pulled = puller.Run(PullRequest(puller, *holder));
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  ExpectSameOutput(cold, *pulled);
  EXPECT_EQ(pulled->pulled_blocks(), 0u);
  EXPECT_EQ(pulled->cached_prompt_tokens(), 0u);
  EXPECT_EQ(puller.metrics().count(PeerPullMetrics::kEvicted), 1);
  EXPECT_EQ(holder->metrics().served_not_found->Value(), 1);
  EXPECT_EQ(holder->metrics().served_sent->Value(), 0);
  EXPECT_EQ(holder->TierStats().failures[static_cast<int>(Expected())], 1);
  EXPECT_EQ(holder->ActiveBlocks(), 0);
  EXPECT_EQ(puller.ActiveBlocks(), 0);
}

INSTANTIATE_TEST_SUITE_P(Faults, PeerPullTierFaultTest,
                         ::testing::Values(TierFault::kCorrupt,
                                           TierFault::kTruncate,
                                           TierFault::kDelete),
                         [](const ::testing::TestParamInfo<TierFault>& info) {
                           switch (info.param) {
                             case TierFault::kCorrupt:
                               return std::string("Corrupt");
                             case TierFault::kTruncate:
                               return std::string("Truncated");
                             case TierFault::kDelete:
                               return std::string("Missing");
                           }
                           return std::string("Unknown");
                         });

TEST_F(PeerPullFromTierTest,
       HolderWithoutPartialOkAnswersNotFoundForAShortRun) {
  // An older puller (no partial_ok) gets all or nothing, as before.
  auto holder = TieredHolder();
  Warm(*holder);
  PushOutToTier(*holder);
  // Block 6's tier file is gone.
  const std::vector<engine::BlockHash> hashes =
      holder->Hashes(holder->Request("x", kTokens));
  ASSERT_TRUE(std::filesystem::remove(holder->Tier()->PathFor(hashes[6])));
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(
      holder->address(), grpc::InsecureChannelCredentials()));
  v1::PullBlocksRequest ask;
  ask.set_request_id("pull:old");
  for (int i = 0; i < kBlocks; ++i) ask.add_hashes(BlockHashToBytes(hashes[i]));
  ask.set_kv_destination("127.0.0.1:1");
  *ask.mutable_grant() =
      Grant(holder->address(), "127.0.0.1:1", "old", kBlocks);
  ask.set_reservation_id(1);
  *ask.mutable_layout() = holder->Request("x", 4).layout();
  grpc::ClientContext ctx;
  v1::PullBlocksResponse resp;
  EXPECT_EQ(stub->PullBlocks(&ctx, ask, &resp).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(holder->metrics().served_not_found->Value(), 1);
  EXPECT_EQ(holder->ActiveBlocks(), 0);
  // With partial_ok, the same question is told how many are there.
  ask.set_partial_ok(true);
  grpc::ClientContext ctx2;
  ASSERT_TRUE(stub->PullBlocks(&ctx2, ask, &resp).ok());
  EXPECT_EQ(resp.blocks_sent(), 0u);
  EXPECT_EQ(resp.blocks_available(), 6u);
  EXPECT_EQ(holder->ActiveBlocks(), 0);
}

TEST(RateMeterTest, AveragesSamplesAndIgnoresEmptyOnes) {
  RateMeter m(0.5);
  EXPECT_EQ(m.rate(), 0);
  m.Add(100, 1);
  EXPECT_EQ(m.rate(), 100);
  m.Add(300, 1);
  EXPECT_EQ(m.rate(), 200);
  m.Add(0, 1);
  m.Add(10, 0);
  EXPECT_EQ(m.rate(), 200);
}

}  // namespace
}  // namespace pdserve::prefill
