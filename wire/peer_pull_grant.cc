#include "wire/peer_pull_grant.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace pdserve::wire {
namespace {

// The signed bytes: a domain tag, then each field length-prefixed, so no two
// different grants have the same encoding.
std::string GrantBytes(const v1::PeerPull& g) {
  std::string out = "pdserve.peer_pull_grant.v1";
  auto field = [&out](const std::string& s) {
    const uint64_t n = s.size();
    out.append(reinterpret_cast<const char*>(&n), sizeof(n));
    out.append(s);
  };
  field(g.holder_address());
  field(g.puller_kv_address());
  field(g.request_id());
  field(std::to_string(g.blocks()));
  field(std::to_string(g.expires_unix_ms()));
  return out;
}

std::string Mac(const std::string& key, const v1::PeerPull& g) {
  const std::string bytes = GrantBytes(g);
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(),
           mac, &len) == nullptr) {
    return "";
  }
  return std::string(reinterpret_cast<const char*>(mac), len);
}

}  // namespace

std::string NewPeerPullKey() {
  std::string key(kPeerPullKeyBytes, '\0');
  // RAND_bytes fails only without an entropy source; an empty key is never
  // accepted by PeerPullKeys, so pulls are then refused, not forged.
  if (RAND_bytes(reinterpret_cast<unsigned char*>(key.data()),
                 static_cast<int>(key.size())) != 1) {
    return "";
  }
  return key;
}

void SignPeerPullGrant(const std::string& key, v1::PeerPull* grant) {
  grant->set_grant_mac(Mac(key, *grant));
}

void PeerPullKeys::Add(const std::string& key) {
  if (key.size() != kPeerPullKeyBytes) return;
  absl::MutexLock l(&mu_);
  auto it = std::find(keys_.begin(), keys_.end(), key);
  if (it != keys_.end()) {
    if (it + 1 == keys_.end()) return;  // the newest already
    keys_.erase(it);
  }
  keys_.push_back(key);
  if (keys_.size() > kMaxKeys) keys_.erase(keys_.begin());
}

bool PeerPullKeys::empty() const {
  absl::MutexLock l(&mu_);
  return keys_.empty();
}

absl::Status PeerPullKeys::Verify(const v1::PeerPull& grant,
                                  const std::string& holder_address,
                                  const std::string& pull_request_id,
                                  uint64_t end_block, absl::Time now) const {
  std::vector<std::string> keys;
  {
    absl::MutexLock l(&mu_);
    keys = keys_;
  }
  if (keys.empty()) {
    return absl::FailedPreconditionError(
        "no router has given this worker a peer-pull key yet: pulls are "
        "served only under a router's grant");
  }
  bool signed_by_router = false;
  const std::string& got = grant.grant_mac();
  for (const std::string& key : keys) {
    const std::string want = Mac(key, grant);
    if (!want.empty() && want.size() == got.size() &&
        CRYPTO_memcmp(want.data(), got.data(), want.size()) == 0) {
      signed_by_router = true;
      break;
    }
  }
  if (!signed_by_router) {
    return absl::PermissionDeniedError(
        "the peer-pull grant is not signed by a router this worker knows");
  }
  if (grant.holder_address() != holder_address) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the peer-pull grant names holder ", grant.holder_address(),
        ", not this worker (", holder_address, ")"));
  }
  if (absl::FromUnixMillis(grant.expires_unix_ms()) < now) {
    return absl::PermissionDeniedError("the peer-pull grant has expired");
  }
  if (PullRequestId(grant.request_id()) != pull_request_id) {
    return absl::PermissionDeniedError(
        "the pull's request id is not the one the grant was made for");
  }
  if (end_block > grant.blocks()) {
    return absl::PermissionDeniedError(
        absl::StrCat("the pull asks for blocks up to ", end_block,
                     "; the grant covers ", grant.blocks()));
  }
  return absl::OkStatus();
}

}  // namespace pdserve::wire
