// Helpers shared by the CUDA kernel tests and benchmarks: device buffers,
// the skip-without-GPU fixture, and host decoding of every KV dtype (the
// reference side of each comparison). Test-only; not thread-safe.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "kernels/cuda/paged_kv.cuh"

namespace pdserve::kernels::cuda::testing {

// Device memory of a test, freed at scope exit.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(size_t n) { Resize(n); }
  explicit DeviceArray(const std::vector<T>& host) {
    Resize(host.size());
    Upload(host);
  }
  ~DeviceArray() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  void Resize(size_t n) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    n_ = n;
    EXPECT_EQ(cudaMalloc(&ptr_, std::max<size_t>(n, 1) * sizeof(T)),
              cudaSuccess);
  }
  void Upload(const std::vector<T>& host) {
    ASSERT_LE(host.size(), n_);
    ASSERT_EQ(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  std::vector<T> Download() const {
    std::vector<T> out(n_);
    EXPECT_EQ(
        cudaMemcpy(out.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost),
        cudaSuccess);
    return out;
  }
  void Zero() { EXPECT_EQ(cudaMemset(ptr_, 0, n_ * sizeof(T)), cudaSuccess); }
  T* get() const { return static_cast<T*>(ptr_); }
  size_t size() const { return n_; }

 private:
  void* ptr_ = nullptr;
  size_t n_ = 0;
};

// Empty when a device is usable, else the reason to skip.
inline std::string NoGpuReason() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    return std::string("no CUDA device: ") + cudaGetErrorString(error);
  }
  if (count == 0) return "no CUDA device: cudaGetDeviceCount reports 0";
  return "";
}

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string reason = NoGpuReason();
    if (!reason.empty()) GTEST_SKIP() << reason;
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  void Sync() { ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess); }
  cudaStream_t stream_ = nullptr;
  std::mt19937 rng_{20261201};
};

inline std::vector<float> RandomFloats(std::mt19937* rng, size_t n,
                                       float stddev = 1.0f) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> out(n);
  for (auto& x : out) x = dist(*rng);
  return out;
}

// fp8-e4m3 (OCP, as CUDA's __nv_fp8_e4m3): bias 7, no infinities, 0x7f/0xff
// NaN.
inline float Fp8E4M3ToFloat(uint8_t b) {
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int exp = (b >> 3) & 0xf;
  const int mant = b & 0x7;
  if (exp == 15 && mant == 7) return NAN;
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant) / 8.0f, -6);
  return sign * std::ldexp(1.0f + static_cast<float>(mant) / 8.0f, exp - 7);
}

// Decodes a whole layer of device-format KV bytes (+ scales) into fp32 in the
// same layout, so the CPU reference can run on exactly the values the GPU
// reads.
inline std::vector<float> DecodeLayer(const std::vector<uint8_t>& bytes,
                                      const std::vector<float>& scales,
                                      KvDtype dtype, int64_t num_blocks,
                                      int kv_heads, int block_size,
                                      int head_dim) {
  const int64_t span = int64_t{block_size} * head_dim;
  const int64_t n = num_blocks * 2 * kv_heads * span;
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) {
    const float s = KvDtypeHasScales(dtype) ? scales[i / span] : 1.0f;
    switch (dtype) {
      case KvDtype::kF32: {
        float f;
        std::memcpy(&f, bytes.data() + i * 4, 4);
        out[i] = f;
        break;
      }
      case KvDtype::kF16:
      case KvDtype::kBF16: {
        uint16_t h;
        std::memcpy(&h, bytes.data() + i * 2, 2);
        out[i] = dtype == KvDtype::kF16 ? F16ToFloat(h) : Bf16ToFloat(h);
        break;
      }
      case KvDtype::kI8:
        out[i] = static_cast<float>(static_cast<int8_t>(bytes[i])) * s;
        break;
      case KvDtype::kFp8E4M3:
        out[i] = Fp8E4M3ToFloat(bytes[i]) * s;
        break;
    }
  }
  return out;
}

// A paged layer on the device, with byte access for the reference.
struct DeviceKvLayer {
  DeviceKvLayer(KvDtype dtype, int64_t num_blocks, int kv_heads, int block_size,
                int head_dim) {
    view.dtype = dtype;
    view.num_blocks = num_blocks;
    view.num_kv_heads = kv_heads;
    view.block_size = block_size;
    view.head_dim = head_dim;
    data.Resize(static_cast<size_t>(view.LayerBytes()));
    data.Zero();
    view.data = data.get();
    if (KvDtypeHasScales(dtype)) {
      scales.Resize(static_cast<size_t>(view.ScaleCount()));
      scales.Zero();
      view.scales = scales.get();
    }
  }
  std::vector<float> DecodeToFloat() const {
    return DecodeLayer(
        data.Download(),
        KvDtypeHasScales(view.dtype) ? scales.Download() : std::vector<float>{},
        view.dtype, view.num_blocks, view.num_kv_heads, view.block_size,
        view.head_dim);
  }
  PagedKvView view;
  DeviceArray<uint8_t> data;
  DeviceArray<float> scales;
};

inline const KvDtype kAllKvDtypes[] = {KvDtype::kF32, KvDtype::kF16,
                                       KvDtype::kBF16, KvDtype::kI8,
                                       KvDtype::kFp8E4M3};

}  // namespace pdserve::kernels::cuda::testing
