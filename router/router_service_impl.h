// The router's service object behind RouterServer (router_service.h), one
// struct shared by two files: router_service.cc (configuration, RouterServer
// lifecycle, worker registration and ListWorkers) and
// router_service_generate.cc (the request path of Generate: tokenize and
// validate, choose workers, attempts, retries and migration). Internal to
// the router library. Thread-safe as RouterServer: every member is either
// fixed after Create, atomic, or itself thread-safe.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "router/router_metrics.h"
#include "router/router_service.h"
#include "router/tenant_limiter.h"
#include "wire/peer_pull_grant.h"
#include "wire/sampling_convert.h"

namespace pdserve::router {

struct RouterServer::Impl final : public v1::Router::Service,
                                  public v1::RouterControl::Service {
  RouterConfig config;
  std::unique_ptr<engine::Tokenizer> tokenizer;
  PrefixIndex index;
  std::unique_ptr<WorkerRegistry> registry;
  std::unique_ptr<Policy> policy;
  std::unique_ptr<RouterMetrics> m;
  metrics::Registry::CollectorHandle collector;
  std::unique_ptr<grpc::Server> server;
  std::atomic<uint64_t> next_id{1};
  std::unique_ptr<Authenticator> auth;  // null: no --auth-tokens
  TenantLimiter limiter;
  std::atomic<int32_t> in_flight{0};  // Generate calls, for load shedding
  // Workers know a request by an id unique to this router process and
  // attempt. `request_id` is not: it is client-chosen, or req-N, which starts
  // again at 1 when the router restarts; and a worker aborts by id, so a
  // stale handler of an earlier request with the same id (its router died,
  // the worker has not noticed yet) would cancel the new one.
  const std::string instance = [] {
    std::random_device rd;
    return absl::StrFormat("%08x%08x", rd(), rd());
  }();
  std::atomic<uint64_t> next_attempt{1};
  // Peer pull: the key this router signs pull grants with (handed to every
  // worker in its status polls, wire/peer_pull_grant.h), and the holders it
  // skips for a while after their pulls failed.
  const std::string peer_pull_key = wire::NewPeerPullKey();
  std::unique_ptr<PeerPullBackoff> peer_pull_backoff;

  // --- RouterControl (router_service.cc)

  // RouterControl is internal: with TLS on, only mTLS peers (a client
  // certificate from the cluster CA) may register workers or list them.
  grpc::Status CheckInternalPeer(const grpc::ServerContext& ctx);

  grpc::Status RegisterWorker(grpc::ServerContext* ctx,
                              const v1::RegisterWorkerRequest* req,
                              v1::RegisterWorkerResponse*) override;

  grpc::Status ListWorkers(grpc::ServerContext* ctx,
                           const v1::ListWorkersRequest*,
                           v1::ListWorkersResponse* resp) override;

  // --- The request path (router_service_generate.cc)

  // One Generate call's state across its attempts (retries before the first
  // token, migrations after it). Lives on the stack of the gRPC thread that
  // serves the call; nothing else touches it.
  struct Call {
    grpc::ServerContext* ctx = nullptr;
    grpc::ServerWriter<v1::GenerateResponse>* writer = nullptr;
    const v1::GenerateRequest* req = nullptr;
    const Tenant* tenant = nullptr;
    absl::Time start;
    // Fixed at intake.
    std::string id;               // the client's, or req-N
    std::vector<int32_t> prompt;  // token ids
    engine::SamplingParams sampling;
    std::string cache_salt;  // with the tenant folded in
    absl::Time deadline;     // the client's, capped by --request-timeout-ms
    // Progress, kept across attempts so a migration continues the stream.
    std::vector<int32_t> generated;  // tokens already sent to the client
    std::optional<engine::TextStream> text;
    std::vector<WorkerIndex> exclude;  // workers that failed this call
    std::string prefill_worker, decode_worker;
    uint32_t cached = 0;  // prompt tokens the first attempt found cached
    bool cached_known = false;
    absl::Time last_token;
  };

  // Where one attempt runs. The views are copies taken at routing time.
  struct Route {
    WorkerView decode;
    std::optional<WorkerView> prefill;  // none: the decode worker prefills
    std::vector<int32_t> tokens;        // prompt + tokens generated so far
    int64_t uncached = 0;    // prefill tokens charged to the prefill side
    v1::PeerPull peer_pull;  // blocks == 0: no pull
  };

  // How one attempt ended.
  struct Attempt {
    enum Outcome {
      kFinished,         // a finish reason: `final` is the last message
      kClientCancelled,  // the client went away
      kWorkerFailed,     // the stream ended early with `status`
    } outcome = kWorkerFailed;
    std::string finish;  // kFinished: the public finish reason
    v1::GenerateResponse final;
    grpc::Status status;
  };

  void Finish(const std::string& reason, absl::Time start);

  grpc::Status Generate(
      grpc::ServerContext* ctx, const v1::GenerateRequest* req,
      grpc::ServerWriter<v1::GenerateResponse>* writer) override;

  // RESOURCE_EXHAUSTED with the retry hint in the message and in the
  // `retry-after-ms` trailing metadata.
  static grpc::Status RetryLater(grpc::ServerContext* ctx, absl::Duration after,
                                 const std::string& why);

  grpc::Status Authenticate(grpc::ServerContext* ctx, Tenant* tenant);

  // INVALID_ARGUMENT naming the limit, counted in limit_rejections.
  grpc::Status OverLimit(const char* limit, const std::string& why);

  grpc::Status CheckRequestLimits(const engine::SamplingParams& sampling,
                                  size_t prompt_tokens);

  // Tokenizes the prompt (or checks the token ids) and validates sampling
  // and the request limits into `call`. INVALID_ARGUMENT (or the limit's
  // code) on bad input; touches no worker.
  grpc::Status TokenizeAndValidate(const v1::GenerateRequest& req, Call& call);

  // Fills the call's fixed fields that follow admission: salt, id, deadline.
  void StartCall(Call& call);

  // Picks the workers for the next attempt from the up, non-draining ones,
  // minus those excluded, and records speculative index entries for them.
  // INVALID_ARGUMENT when the request cannot fit any decode worker's
  // max_model_len; else the policy's status (UNAVAILABLE: nobody can decode).
  absl::StatusOr<Route> ChooseWorkers(const Call& call);

  // Whether the prefill worker `p` should pull the prompt's prefix from
  // another worker (router/peer_pull.h), from the index and measured rates.
  v1::PeerPull PeerPullFor(const WorkerView& p,
                           const std::vector<engine::BlockHash>& chain,
                           const std::vector<WorkerView>& workers);

  // The decode worker's request for this attempt: the sequence so far, the
  // tokens still owed, and where to prefill. Stop strings stay here (the
  // router applies them to the text it streams).
  v1::WorkerGenerateRequest WorkerRequest(const Call& call, const Route& route);

  // The grant the holder checks (wire/peer_pull_grant.h): the prefill
  // worker's registered address as the only destination, for the pull of
  // `request_id`'s prefill.
  void SignPeerPull(const Route& route, const std::string& request_id,
                    v1::PeerPull* pull);

  // What the prefill worker reported of the pull it was told to make: a
  // success ends the holder's backoff, a failure of the holder's starts one.
  void NotePeerPullOutcome(const Route& route, v1::PeerPullOutcome outcome);

  // Runs one attempt on `route`, streaming tokens to the client as they
  // arrive (every message but the last is written here; the last one is
  // returned in Attempt::final). Router-side load is charged while it runs
  // and undone however it ends.
  Attempt RunAttempt(Call& call, const Route& route);

  // Sends the last message (the last tokens, their text and the usage) and
  // counts the request as finished with `finish`.
  grpc::Status FinishCall(Call& call, const std::string& finish,
                          v1::GenerateResponse& last);

  // After a failed attempt: OK to try again elsewhere (the failed worker is
  // excluded and marked down), or the status that ends the call.
  grpc::Status DecideRetry(Call& call, const Route& route,
                           const grpc::Status& failure);

  // Validate, admit, then attempt on chosen workers until one finishes the
  // stream, the client leaves, a failure is final, or max_retries runs out.
  grpc::Status GenerateImpl(grpc::ServerContext* ctx,
                            const v1::GenerateRequest& req,
                            grpc::ServerWriter<v1::GenerateResponse>* writer,
                            absl::Time start, const Tenant& tenant);
};

}  // namespace pdserve::router
