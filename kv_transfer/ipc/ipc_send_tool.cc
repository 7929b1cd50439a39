// A shm KV sender in its own process, for ipc_kill_test: fills a pool with
// the deterministic test contents and sends them over the shm transport to
// DEST (a KvTransfer server with IpcKvTransferService).
// usage: ipc_send_tool DEST RESERVATION DTYPE NUM_BLOCKS SEED MODE
//   MODE: all   sends every layer and finishes
//         stall  the first batch's reply arrives, then it prints
//                "claimed" and hangs before copying, until killed
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "kv_transfer/ipc/ipc_transport.h"
#include "kv_transfer/nccl/grpc_control_channel.h"
#include "kv_transfer/test_blocks.h"

int main(int argc, char** argv) {
  using namespace pdserve;
  if (argc != 7) {
    std::fprintf(stderr,
                 "usage: ipc_send_tool DEST RESERVATION DTYPE NUM_BLOCKS SEED "
                 "MODE\n");
    return 2;
  }
  const auto spec = kv_transfer::testing::TestSpec(*ParseDType(argv[3]));
  const int num_blocks = std::atoi(argv[4]);
  const uint64_t seed = std::strtoull(argv[5], nullptr, 10);
  const std::string mode = argv[6];
  auto pool = std::move(*engine::KvPool::Create(spec, 2 * num_blocks + 1));
  kv_transfer::SendPlan plan;
  plan.destination = argv[1];
  plan.reservation_id = std::strtoull(argv[2], nullptr, 10);
  plan.request_id = "r";
  plan.sender_id = "ipc_send_tool";
  plan.layout = kv_transfer::KvLayout::FromSpec(spec, "test-model");
  for (int i = 0; i < num_blocks; ++i) {
    kv_transfer::testing::FillBlock(pool.get(), seed, i, 2 * i + 1);
    plan.blocks.emplace_back(i, 2 * i + 1);
  }
  kv_transfer::nccl::GrpcControlChannelFactory control;
  auto backend = kv_transfer::ipc::NewShmBackend();
  kv_transfer::ipc::IpcTransportConfig config;
  if (mode == "stall") {
    config.before_copy_for_test = [] {
      std::fprintf(stdout, "claimed\n");
      std::fflush(stdout);
      pause();
    };
  }
  kv_transfer::ipc::IpcKvTransport transport(&control, backend.get(), nullptr,
                                             config);
  auto session = transport.Open(plan, pool.get());
  if (!session.ok()) {
    std::fprintf(stderr, "%s\n", session.status().ToString().c_str());
    return 3;
  }
  absl::Status s = (*session)->SendLayers(0, spec.num_layers);
  if (s.ok()) s = (*session)->Finish().status();
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 10 + static_cast<int>(s.code());
  }
  return 0;
}
