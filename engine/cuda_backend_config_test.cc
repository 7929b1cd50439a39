// The CUDA device a worker names (--kv-cuda-device, EngineConfig::cuda_device)
// reaches the backend the engine creates, so the backend, its KV pool and
// the KV transports use one device. On CPU: a recording factory stands in
// for the CUDA backend (the CUDA backend's own refusal of a device it does
// not have runs in engine_cuda_test).
#include <gtest/gtest.h>

#include "engine/backend.h"
#include "engine/engine.h"
#include "engine/test_util.h"

namespace pdserve::engine {
namespace {

int32_t seen_device = -1;

absl::StatusOr<std::unique_ptr<Backend>> RecordingFactory(
    std::shared_ptr<const ModelWeights> weights, const BackendConfig& config) {
  seen_device = config.cuda_device;
  BackendConfig cpu = config;
  cpu.device = Device::kCpu;
  return CreateBackend(std::move(weights), cpu);
}

TEST(CudaBackendConfigTest, TheEnginesCudaDeviceReachesTheBackend) {
  SetBackendFactory(Device::kCuda, RecordingFactory);
  EngineConfig config;
  config.device = Device::kCuda;
  config.cuda_device = 3;
  auto engine = Engine::Create(testing::TinyWeights(), config);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ(seen_device, 3);
  config.cuda_device = -1;
  seen_device = -7;
  EXPECT_EQ(Engine::Create(testing::TinyWeights(), config).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(seen_device, -7) << "a negative device reached the factory";
  SetBackendFactory(Device::kCuda, nullptr);
}

}  // namespace
}  // namespace pdserve::engine
