// In-process ControlChannel for tests: two ends joined by a pair of message
// queues, and a ControlChannelFactory that hands the far end of each new
// pair to a listener registered under a destination name, as a gRPC server
// would. Thread-safe.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "kv_transfer/nccl/control_channel.h"

namespace pdserve::kv_transfer::nccl {

// Two connected ends: what one Sends, the other Receives, in order.
std::pair<std::unique_ptr<ControlChannel>, std::unique_ptr<ControlChannel>>
MakeFakeControlChannelPair();

class FakeControlNetwork : public ControlChannelFactory {
 public:
  using Acceptor = std::function<void(std::unique_ptr<ControlChannel>)>;
  // Connections to `destination` hand their far end to `accept`, called on
  // the connecting thread; it must not block.
  void Listen(const std::string& destination, Acceptor accept);
  void StopListening(const std::string& destination);

  // UNAVAILABLE when nobody listens on `destination`.
  absl::StatusOr<std::unique_ptr<ControlChannel>> Connect(
      const std::string& destination) override;
  int connections() const;

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Acceptor> listeners_ ABSL_GUARDED_BY(mu_);
  int connections_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pdserve::kv_transfer::nccl
