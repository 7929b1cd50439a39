// The soak's hostile inputs at two trust boundaries, each one attempt:
//  - header garbage on the router's OpenAI HTTP front (Authorization values
//    with a tab, 0x7F, 0xE9 or NUL bytes, oversized or repeated headers);
//  - a hostile shm peer at a decode worker's same-node KV endpoint: forged
//    or malformed messages on its KvTransfer.Control stream (an unknown
//    reservation, the wrong transport kind, a manifest before any Open,
//    garbage, a flood of frames) and forged requests on its pool fd socket
//    (a guessed token, fds attached, garbage, a connection left silent).
// Each returns what happened; the soak requires the processes to stay up,
// every refusal to carry a clear status, and nothing to leak.
#pragma once

#include <grpcpp/grpcpp.h>
#include <sys/types.h>

#include <random>
#include <string>

namespace pdserve::soak {

struct HostileResult {
  std::string variant;
  // Set when the target answered: the status it gave (for the pool socket:
  // OK only if it handed out an fd for a forged token, which must never
  // happen).
  bool answered = false;
  grpc::StatusCode code = grpc::StatusCode::OK;
  std::string message;
};

// One request with garbage in its headers to the HTTP front on `port`, with
// a body that is valid for the served `model` (so the request gets past
// body validation to where headers are used). Any answer counts as handled
// (what a bad Authorization gets is the HTTP front's own contract);
// `answered` is false if the connection was refused or dropped.
HostileResult HttpHeaderGarbage(int port, const std::string& model,
                                std::mt19937_64* rng);

// One hostile KvTransfer.Control stream to the worker at `address`.
HostileResult HostileShmStream(const std::string& address,
                               std::mt19937_64* rng);

// One forged request to the pool fd socket of the worker process `pid`
// (found in /proc/net/unix). `answered` is false when it has none (not a
// shm decode worker, or restarting). *leaked_fds: how many fds this attempt
// attached that the worker still holds afterwards (must be 0).
HostileResult HostileShmSocket(pid_t pid, std::mt19937_64* rng,
                               int* leaked_fds);

}  // namespace pdserve::soak
