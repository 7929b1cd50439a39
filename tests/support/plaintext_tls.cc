// Linked into in-process tests that start pdserve servers and channels on
// loopback: installs the plaintext TLS config before main(), the explicit
// opt-in that common/tls.h requires (without it internal servers refuse to
// start and channels refuse plaintext). Tests of TLS itself do not link it.
#include <cstdio>
#include <cstdlib>

#include "common/tls.h"

namespace {

const bool kPlaintextInstalled = [] {
  const absl::Status s =
      pdserve::tls::Install(pdserve::tls::TlsConfig::Plaintext());
  if (!s.ok()) {
    std::fprintf(stderr, "plaintext TLS install failed: %s\n",
                 s.ToString().c_str());
    std::abort();
  }
  return true;
}();

}  // namespace
