// A receiving worker's gRPC server for transfer tests: `service` on a free
// 127.0.0.1 port, insecure, with room for 64 MiB messages.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>

namespace pdserve::kv_transfer::testing {

// Returns the started server and sets *port (0 if it did not start).
inline std::unique_ptr<grpc::Server> StartTestServer(grpc::Service* service,
                                                     int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           port);
  builder.RegisterService(service);
  builder.SetMaxReceiveMessageSize(64 << 20);
  return builder.BuildAndStart();
}

}  // namespace pdserve::kv_transfer::testing
