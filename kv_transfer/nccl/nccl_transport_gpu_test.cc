// The `nccl` KV transport over real NCCL: a prefill rank on GPU 0 sends to a
// decode rank on GPU 1 in this process, with the in-process control channel
// standing in for gRPC. Tests that need GPUs skip with the reason when the
// machine has too few.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kv_transfer/nccl/fake_control_channel.h"
#include "kv_transfer/nccl/nccl_communicator.h"
#include "kv_transfer/nccl/nccl_receiver.h"
#include "kv_transfer/nccl/nccl_transport.h"
#include "kv_transfer/nccl/test_util.h"

namespace pdserve::kv_transfer::nccl {
namespace {

using testing::Holds;
using testing::kDecode;
using testing::kModel;
using testing::Prefill;
using testing::Spec;

int DeviceCount(std::string* why) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    *why = cudaGetErrorString(error);
    return 0;
  }
  *why = absl::StrCat("cudaGetDeviceCount reports ", count);
  return count;
}

#define SKIP_UNLESS_GPUS(n)                                \
  do {                                                     \
    std::string why;                                       \
    if (DeviceCount(&why) < (n))                           \
      GTEST_SKIP() << "needs " << (n) << " GPUs: " << why; \
  } while (0)

TEST(NcclCommunicatorTest, RejectsAMalformedUniqueIdBeforeTouchingTheDevice) {
  NcclCommunicatorFactory factory(0);
  auto comm = factory.Create("short", Communicator::kSenderRank,
                             absl::Now() + absl::Seconds(1), absl::Seconds(1));
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(NcclCommunicatorTest, PeerThatNeverJoinsTimesOut) {
  SKIP_UNLESS_GPUS(1);
  NcclCommunicatorFactory factory(0);
  auto id = factory.NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  const absl::Time start = absl::Now();
  auto comm = factory.Create(*id, Communicator::kSenderRank,
                             absl::Now() + absl::Seconds(2), absl::Seconds(2));
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded)
      << comm.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
}

TEST(NcclTransportGpuTest, EveryDtypeArrivesByteIdenticalBetweenTwoGpus) {
  SKIP_UNLESS_GPUS(2);
  NcclCommunicatorFactory prefill_gpu(0), decode_gpu(1);
  for (DType dtype : {DType::kF16, DType::kBF16, DType::kI8}) {
    const engine::KvCacheSpec spec = Spec(dtype);
    auto pool = *engine::KvPool::Create(spec, 16);
    KvReceiver receiver(pool.get(), KvLayout::FromSpec(spec, kModel));
    NcclReceiverConfig receiver_config;
    receiver_config.timeout = absl::Seconds(30);
    NcclKvReceiveEndpoint endpoint(&receiver, &decode_gpu, receiver_config);
    FakeControlNetwork network;
    network.Listen(kDecode, [&](std::unique_ptr<ControlChannel> c) {
      endpoint.Serve(std::move(c));
    });
    NcclTransportConfig config;
    config.timeout = absl::Seconds(30);
    config.max_batch_bytes =
        4 * spec.LayerBlockBytes() + 64;  // several batches per call
    NcclKvTransport transport(&network, &prefill_gpu, nullptr, config);

    const std::vector<int32_t> reserved = {9, 3, 12, 0, 7};
    const uint64_t id = receiver.Expect("req-1", reserved, 1);
    Prefill prefill(spec, id, "req-1", 5, 1, 21);
    auto session = transport.Open(prefill.plan, prefill.pool.get());
    ASSERT_TRUE(session.ok()) << session.status();
    for (int l = 0; l < spec.num_layers; ++l) {
      ASSERT_TRUE((*session)->SendLayers(l, l + 1).ok());
    }
    auto stats = (*session)->Finish();
    ASSERT_TRUE(stats.ok()) << stats.status();
    ASSERT_TRUE(
        receiver.Wait(id, absl::Seconds(30), absl::Now() + absl::Seconds(60))
            .ok());
    for (int i = 1; i < 5; ++i) {
      for (int l = 0; l < spec.num_layers; ++l) {
        EXPECT_TRUE(Holds(pool.get(), 21, l, i, reserved[i]))
            << DTypeName(dtype) << " " << l << " " << i;
      }
    }
    network.StopListening(kDecode);
    endpoint.Shutdown();
  }
}

}  // namespace
}  // namespace pdserve::kv_transfer::nccl
