// gRPC channel settings for every internal connection between pdserve
// processes (router -> workers, decode -> prefill, prefill -> decode KV
// pushes): one place, so the router need not link the KV transports to get
// them. Thread-safe (returns a fresh object).
#pragma once

#include <grpcpp/support/channel_arguments.h>

namespace pdserve::wire {

// Message size caps that fit the largest KV chunk and event snapshot (64 MiB).
inline constexpr int kInternalMaxMessageBytes = 64 << 20;

grpc::ChannelArguments InternalChannelArgs();

}  // namespace pdserve::wire
