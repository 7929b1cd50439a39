// A KV sender in its own process, for kv_transfer_test: fills a pool with the
// deterministic test contents and pushes them over the grpc transport.
// usage: kv_send_tool DEST RESERVATION REQUEST DTYPE NUM_BLOCKS SKIP MODE SEED
//   MODE: all | layerwise | mismatch | stall
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "kv_transfer/grpc/grpc_transport.h"
#include "kv_transfer/test_blocks.h"

int main(int argc, char** argv) {
  using namespace pdserve;
  if (argc != 9) {
    std::fprintf(stderr,
                 "usage: kv_send_tool DEST RESERVATION REQUEST DTYPE "
                 "NUM_BLOCKS SKIP MODE SEED\n");
    return 2;
  }
  const std::string mode = argv[7];
  auto spec = kv_transfer::testing::TestSpec(*ParseDType(argv[4]));
  const int num_blocks = std::atoi(argv[5]), skip = std::atoi(argv[6]);
  const uint64_t seed = std::strtoull(argv[8], nullptr, 10);
  auto pool = std::move(*engine::KvPool::Create(spec, 2 * num_blocks + 1));
  kv_transfer::SendPlan plan;
  plan.destination = argv[1];
  plan.reservation_id = std::strtoull(argv[2], nullptr, 10);
  plan.request_id = argv[3];
  plan.sender_id = "kv_send_tool";
  plan.layout = kv_transfer::KvLayout::FromSpec(spec, "test-model");
  if (mode == "mismatch") plan.layout.block_size = 32;
  for (int i = skip; i < num_blocks; ++i) {
    const int32_t physical =
        2 * i + 1;  // any mapping: the receiver never sees it
    kv_transfer::testing::FillBlock(pool.get(), seed, i, physical);
    plan.blocks.emplace_back(i, physical);
  }
  kv_transfer::GrpcKvTransport transport(nullptr);
  auto session = transport.Open(plan, pool.get());
  if (!session.ok()) return 3;
  absl::Status s;
  if (mode == "layerwise") {
    for (int l = 0; l < spec.num_layers && s.ok(); ++l)
      s = (*session)->SendLayers(l, l + 1);
  } else if (mode == "stall") {
    s = (*session)->SendLayers(0, 1);
    // Push what we have, then hang until killed.
    std::fprintf(stdout, "sent-first-layer\n");
    std::fflush(stdout);
    pause();
  } else {
    s = (*session)->SendLayers(0, spec.num_layers);
  }
  if (s.ok()) {
    auto done = (*session)->Finish();
    s = done.status();
  }
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 10 + static_cast<int>(s.code());
  }
  return 0;
}
