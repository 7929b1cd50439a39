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

#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "engine/engine_loop.h"
#include "kv_transfer/receiver.h"
#include "pdserve/v1/internal.grpc.pb.h"

namespace pdserve::decode {

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

 private:
  // Streams engine outputs until the request finishes, is cancelled or fails.
  grpc::Status StreamOutputs(
      grpc::ServerContext* context, const std::string& id,
      const std::shared_ptr<engine::RequestStream>& stream,
      v1::WorkerGenerateResponse base,
      grpc::ServerWriter<v1::WorkerGenerateResponse>* writer);
  std::shared_ptr<v1::Worker::Stub> PrefillStub(const std::string& address);

  engine::EngineLoop* loop_;
  kv_transfer::KvReceiver* receiver_;
  const DecodeOptions options_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<v1::Worker::Stub>> stubs_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::decode
