// The decode side of a request (and the whole request when prefill is
// local): reserve blocks first (reusing this worker's cached prefix), have
// the named prefill worker compute and push the missing KV, stream the first
// token at once, then continuous-batching decode until a finish reason.
//
// Failure handling: a reservation that cannot be admitted waits on the engine
// side, in FIFO order, up to the admission timeout, then RESOURCE_EXHAUSTED
// (one that could never fit is refused at once); a prefill worker that fails or
// a transfer that stalls ends the request with UNAVAILABLE and frees every
// block; a client cancel or deadline aborts the sequence. Thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <list>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "engine/engine_loop.h"
#include "kv_transfer/receiver.h"
#include "pdserve/v1/internal.grpc.pb.h"

namespace pdserve::decode {

// Prefill workers' stubs by address, shared by concurrent requests. Addresses
// come from the router and change with pod-IP churn, so the cache is
// bounded: a stub whose call failed at the transport level (its worker is
// gone) is dropped, and past `capacity` the least recently used one is. A
// call in flight keeps its own reference. Thread-safe.
class PrefillStubCache {
 public:
  explicit PrefillStubCache(size_t capacity = 64) : capacity_(capacity) {}
  std::shared_ptr<v1::Worker::Stub> Get(const std::string& address)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Drops `address`'s stub if it is still `stub` (a newer one stays).
  void Forget(const std::string& address,
              const std::shared_ptr<v1::Worker::Stub>& stub)
      ABSL_LOCKS_EXCLUDED(mu_);
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Cached {
    std::shared_ptr<v1::Worker::Stub> stub;
    std::list<std::string>::iterator lru;  // position in lru_
  };
  const size_t capacity_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Cached> stubs_ ABSL_GUARDED_BY(mu_);
  std::list<std::string> lru_ ABSL_GUARDED_BY(mu_);  // most recent first
};

struct DecodeOptions {
  std::string worker_id;
  std::string kv_address;  // where prefill workers push KV (this worker)
  absl::Duration admission_timeout = absl::Seconds(10);
  absl::Duration kv_stall_timeout = absl::Seconds(10);
};

class DecodeHandler {
 public:
  DecodeHandler(engine::EngineLoop* loop, kv_transfer::KvReceiver* receiver,
                DecodeOptions options)
      : loop_(loop), receiver_(receiver), options_(std::move(options)) {}

  grpc::Status Generate(grpc::ServerContext* context,
                        const v1::WorkerGenerateRequest& request,
                        grpc::ServerWriter<v1::WorkerGenerateResponse>* writer);

  // Prefill stubs held (bounded; see PrefillStubCache).
  size_t cached_prefill_stubs() const { return stubs_.size(); }

 private:
  // Streams engine outputs until the request finishes, is cancelled or fails.
  grpc::Status StreamOutputs(
      grpc::ServerContext* context, const std::string& id,
      const std::shared_ptr<engine::RequestStream>& stream,
      v1::WorkerGenerateResponse base,
      grpc::ServerWriter<v1::WorkerGenerateResponse>* writer);

  engine::EngineLoop* loop_;
  kv_transfer::KvReceiver* receiver_;
  const DecodeOptions options_;
  PrefillStubCache stubs_;
};

}  // namespace pdserve::decode
