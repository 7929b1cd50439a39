// Peer-pull grants: the router's signed permission for one pull. The router
// decides every pull (router/peer_pull.h) and knows each worker's registered
// address; it signs {holder, puller's KV address, request, blocks, expiry}
// with HMAC-SHA256 under a random key of its own, which it hands to every
// worker in its status polls (WorkerInfoRequest.peer_pull_key). A holder
// serves PullBlocks only under a grant that verifies, names the holder
// itself, has not expired and covers the blocks asked for, and pushes only to
// the grant's puller address: never to an address taken from the caller.
//
// Pure functions and a thread-safe key set.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "pdserve/v1/internal.pb.h"

namespace pdserve::wire {

inline constexpr size_t kPeerPullKeyBytes = 32;

// A fresh random key (kPeerPullKeyBytes, from the OS's CSPRNG).
std::string NewPeerPullKey();

// Sets grant_mac of `grant` (every other field already set) under `key`.
void SignPeerPullGrant(const std::string& key, v1::PeerPull* grant);

// The keys a worker accepts grants under: the routers that polled it most
// recently (a few, so that a router restart or two routers over one pool
// keep working). Thread-safe.
class PeerPullKeys {
 public:
  static constexpr size_t kMaxKeys = 4;
  // Adds `key` (ignored unless kPeerPullKeyBytes long); the oldest key goes
  // once there are more than kMaxKeys.
  void Add(const std::string& key) ABSL_LOCKS_EXCLUDED(mu_);
  bool empty() const ABSL_LOCKS_EXCLUDED(mu_);

  // OK when `grant` carries a MAC that one of the keys made, names
  // `holder_address`, has not expired at `now`, and covers a pull of
  // `request_id` (the puller's "pull:..." id) ending at block `end_block`.
  // FAILED_PRECONDITION when no router has given a key yet; PERMISSION_DENIED
  // naming the first check that failed otherwise.
  absl::Status Verify(const v1::PeerPull& grant,
                      const std::string& holder_address,
                      const std::string& pull_request_id, uint64_t end_block,
                      absl::Time now) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  std::vector<std::string> keys_ ABSL_GUARDED_BY(mu_);  // oldest first
};

// The request id of the pull that `request_id`'s prefill makes.
inline std::string PullRequestId(const std::string& request_id) {
  return "pull:" + request_id;
}

}  // namespace pdserve::wire
