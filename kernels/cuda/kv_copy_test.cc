// Gather/scatter of paged KV spans on the GPU against a CPU reference on
// random data. Needs a CUDA device; skips with the reason when none is found.
#include "kernels/cuda/kv_copy.cuh"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "kernels/cuda/cuda_check.h"

namespace pdserve::kernels::cuda {
namespace {

// Device memory for one test, freed at scope exit.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    EXPECT_EQ(cudaMalloc(&ptr_, std::max<size_t>(bytes, 1)), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  uint8_t* get() const { return static_cast<uint8_t*>(ptr_); }
  void Upload(const void* host, size_t bytes, size_t offset = 0) {
    ASSERT_LE(offset + bytes, bytes_);
    ASSERT_EQ(cudaMemcpy(get() + offset, host, bytes, cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  std::vector<uint8_t> Download(size_t bytes, size_t offset = 0) const {
    std::vector<uint8_t> out(bytes);
    EXPECT_LE(offset + bytes, bytes_);
    EXPECT_EQ(
        cudaMemcpy(out.data(), get() + offset, bytes, cudaMemcpyDeviceToHost),
        cudaSuccess);
    return out;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

std::vector<uint8_t> RandomBytes(std::mt19937* rng, size_t n) {
  std::vector<uint8_t> out(n);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : out) b = static_cast<uint8_t>(byte(*rng));
  return out;
}

// Paged per-layer buffers, mirrored on host (the reference) and device. Each
// layer's device buffer starts `misalign` bytes past a 256-byte boundary.
struct PagedBuffers {
  PagedBuffers(std::mt19937* rng, int32_t layers, int64_t blocks, int64_t span,
               size_t misalign)
      : num_layers(layers),
        num_blocks(blocks),
        span_bytes(span),
        offset(misalign) {
    const size_t layer_bytes = static_cast<size_t>(blocks * span);
    for (int32_t l = 0; l < layers; ++l) {
      host.push_back(RandomBytes(rng, layer_bytes));
      device.push_back(std::make_unique<DeviceBuffer>(layer_bytes + misalign));
      device.back()->Upload(host.back().data(), layer_bytes, misalign);
      bases.push_back(device.back()->get() + misalign);
    }
    table = std::make_unique<DeviceBuffer>(bases.size() * sizeof(uint8_t*));
    table->Upload(bases.data(), bases.size() * sizeof(uint8_t*));
  }
  std::vector<uint8_t> DeviceLayer(int32_t l) const {
    return device[l]->Download(static_cast<size_t>(num_blocks * span_bytes),
                               offset);
  }
  uint8_t* const* device_table() const {
    return reinterpret_cast<uint8_t* const*>(table->get());
  }

  int32_t num_layers;
  int64_t num_blocks;
  int64_t span_bytes;
  size_t offset;
  std::vector<std::vector<uint8_t>> host;  // [layer][num_blocks * span_bytes]
  std::vector<std::unique_ptr<DeviceBuffer>> device;
  std::vector<uint8_t*> bases;
  std::unique_ptr<DeviceBuffer> table;
};

std::unique_ptr<DeviceBuffer> UploadSpans(
    const std::vector<KvBlockSpan>& spans) {
  auto buffer =
      std::make_unique<DeviceBuffer>(spans.size() * sizeof(KvBlockSpan));
  buffer->Upload(spans.data(), spans.size() * sizeof(KvBlockSpan));
  return buffer;
}

class KvCopyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    const cudaError_t error = cudaGetDeviceCount(&count);
    if (error != cudaSuccess || count == 0) {
      GTEST_SKIP() << "no CUDA device: "
                   << (error != cudaSuccess
                           ? cudaGetErrorString(error)
                           : "cudaGetDeviceCount reports 0 devices");
    }
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
  std::mt19937 rng_{1234};
};

struct Shape {
  int64_t span_bytes;
  size_t misalign;  // of the layer buffers and the staging buffer
};

// Sizes: an fp16 block (16-byte words), a realistic 64 KiB block, int8 scales
// of 3 heads (24 bytes: unaligned every other span), an odd size, and
// buffers that start off a 16-byte boundary.
const Shape kShapes[] = {{2 * 2 * 16 * 8 * 2, 0}, {2 * 8 * 16 * 128 * 2, 0},
                         {2 * 3 * 4, 0},          {7, 0},
                         {4096 + 16, 4},          {256, 1}};

TEST_F(KvCopyTest,
       GatherMatchesCpuReferenceIncludingRepeatedAndUnalignedSpans) {
  for (const Shape& shape : kShapes) {
    PagedBuffers paged(&rng_, 3, 11, shape.span_bytes, shape.misalign);
    std::vector<KvBlockSpan> spans;
    std::uniform_int_distribution<int32_t> layer(0, 2), block(0, 10);
    for (int i = 0; i < 37; ++i) spans.push_back({layer(rng_), block(rng_)});
    spans.push_back(spans.front());  // a span may be gathered twice
    auto device_spans = UploadSpans(spans);
    const size_t staging_bytes = spans.size() * shape.span_bytes;
    DeviceBuffer staging(staging_bytes + shape.misalign);
    ASSERT_TRUE(
        InvokeGatherKvBlocks(
            reinterpret_cast<const uint8_t* const*>(paged.device_table()),
            paged.num_layers, paged.num_blocks, shape.span_bytes,
            reinterpret_cast<const KvBlockSpan*>(device_spans->get()),
            static_cast<int32_t>(spans.size()), staging.get() + shape.misalign,
            stream_)
            .ok());
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    std::vector<uint8_t> want;
    for (const KvBlockSpan& s : spans) {
      const uint8_t* src =
          paged.host[s.layer].data() + s.block * shape.span_bytes;
      want.insert(want.end(), src, src + shape.span_bytes);
    }
    EXPECT_EQ(staging.Download(staging_bytes, shape.misalign), want)
        << "span_bytes=" << shape.span_bytes << " misalign=" << shape.misalign;
  }
}

TEST_F(KvCopyTest, ScatterWritesExactlyTheNamedBlocksAndLeavesOthersUntouched) {
  for (const Shape& shape : kShapes) {
    PagedBuffers paged(&rng_, 3, 11, shape.span_bytes, shape.misalign);
    // Distinct (layer, block) pairs in random order, about half of them.
    std::vector<KvBlockSpan> all;
    for (int32_t l = 0; l < 3; ++l) {
      for (int32_t b = 0; b < 11; ++b) all.push_back({l, b});
    }
    std::shuffle(all.begin(), all.end(), rng_);
    std::vector<KvBlockSpan> spans(all.begin(), all.begin() + all.size() / 2);
    auto device_spans = UploadSpans(spans);
    const size_t staging_bytes = spans.size() * shape.span_bytes;
    const std::vector<uint8_t> incoming = RandomBytes(&rng_, staging_bytes);
    DeviceBuffer staging(staging_bytes + shape.misalign);
    staging.Upload(incoming.data(), staging_bytes, shape.misalign);
    ASSERT_TRUE(InvokeScatterKvBlocks(
                    paged.device_table(), paged.num_layers, paged.num_blocks,
                    shape.span_bytes,
                    reinterpret_cast<const KvBlockSpan*>(device_spans->get()),
                    static_cast<int32_t>(spans.size()),
                    staging.get() + shape.misalign, stream_)
                    .ok());
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    for (size_t i = 0; i < spans.size(); ++i) {
      std::copy_n(incoming.data() + i * shape.span_bytes, shape.span_bytes,
                  paged.host[spans[i].layer].data() +
                      spans[i].block * shape.span_bytes);
    }
    for (int32_t l = 0; l < 3; ++l) {
      EXPECT_EQ(paged.DeviceLayer(l), paged.host[l])
          << "layer " << l << " span_bytes=" << shape.span_bytes
          << " misalign=" << shape.misalign;
    }
  }
}

TEST_F(KvCopyTest, GatherThenScatterMovesBlocksBetweenPools) {
  const int64_t span = 2 * 4 * 16 * 64 * 2;
  PagedBuffers source(&rng_, 4, 9, span, 0), target(&rng_, 4, 13, span, 0);
  std::vector<KvBlockSpan> from, to;
  for (int32_t l = 0; l < 4; ++l) {
    for (int32_t i = 0; i < 5; ++i) {
      from.push_back({l, 8 - i});
      to.push_back({l, 2 * i + 1});
    }
  }
  auto device_from = UploadSpans(from), device_to = UploadSpans(to);
  DeviceBuffer staging(from.size() * span);
  ASSERT_TRUE(
      InvokeGatherKvBlocks(
          reinterpret_cast<const uint8_t* const*>(source.device_table()), 4, 9,
          span, reinterpret_cast<const KvBlockSpan*>(device_from->get()),
          static_cast<int32_t>(from.size()), staging.get(), stream_)
          .ok());
  ASSERT_TRUE(InvokeScatterKvBlocks(
                  target.device_table(), 4, 13, span,
                  reinterpret_cast<const KvBlockSpan*>(device_to->get()),
                  static_cast<int32_t>(to.size()), staging.get(), stream_)
                  .ok());
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  for (size_t i = 0; i < from.size(); ++i) {
    std::copy_n(source.host[from[i].layer].data() + from[i].block * span, span,
                target.host[to[i].layer].data() + to[i].block * span);
  }
  for (int32_t l = 0; l < 4; ++l) {
    EXPECT_EQ(target.DeviceLayer(l), target.host[l]) << "layer " << l;
  }
}

TEST_F(KvCopyTest, SpansOutsideTheBuffersAreNotCopied) {
  const int64_t span = 64;
  PagedBuffers paged(&rng_, 2, 4, span, 0);
  const std::vector<KvBlockSpan> spans = {
      {0, 4}, {2, 0}, {-1, 1}, {1, -3}, {1, 3}};
  auto device_spans = UploadSpans(spans);
  const std::vector<uint8_t> incoming = RandomBytes(&rng_, spans.size() * span);
  DeviceBuffer staging(incoming.size());
  staging.Upload(incoming.data(), incoming.size());
  ASSERT_TRUE(InvokeScatterKvBlocks(
                  paged.device_table(), 2, 4, span,
                  reinterpret_cast<const KvBlockSpan*>(device_spans->get()),
                  static_cast<int32_t>(spans.size()), staging.get(), stream_)
                  .ok());
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  std::copy_n(incoming.data() + 4 * span, span,
              paged.host[1].data() + 3 * span);  // the valid one
  for (int32_t l = 0; l < 2; ++l) {
    EXPECT_EQ(paged.DeviceLayer(l), paged.host[l]) << "layer " << l;
  }
}

// Argument checks happen before any CUDA call, so this runs without a device.
TEST(KvCopyArgumentsTest, RejectsNonPositiveSizesAndNullTables) {
  uint8_t byte = 0;
  const uint8_t* base = &byte;
  const KvBlockSpan span;
  EXPECT_EQ(
      InvokeGatherKvBlocks(&base, 1, 1, 0, &span, 1, &byte, nullptr).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      InvokeGatherKvBlocks(&base, 0, 1, 16, &span, 1, &byte, nullptr).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      InvokeScatterKvBlocks(nullptr, 1, 1, 16, &span, 1, &byte, nullptr).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      InvokeScatterKvBlocks(nullptr, 1, 1, 16, nullptr, -1, nullptr, nullptr)
          .code(),
      absl::StatusCode::kInvalidArgument);
  // Nothing to copy is not an error and launches nothing.
  EXPECT_TRUE(
      InvokeGatherKvBlocks(nullptr, 1, 1, 16, nullptr, 0, nullptr, nullptr)
          .ok());
}

TEST(CudaCheckTest, StatusNamesTheExpressionFileAndError) {
  const absl::Status s = PDSERVE_CUDA_STATUS(cudaErrorMemoryAllocation);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("kv_copy_test.cc:"), std::string::npos) << s;
  EXPECT_NE(s.message().find("cudaErrorMemoryAllocation"), std::string::npos)
      << s;
  EXPECT_TRUE(PDSERVE_CUDA_STATUS(cudaSuccess).ok());
#if defined(PDSERVE_HAVE_NCCL)
  const absl::Status n = PDSERVE_NCCL_STATUS(ncclRemoteError);
  EXPECT_EQ(n.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(n.message().find("ncclRemoteError"), std::string::npos) << n;
  EXPECT_TRUE(PDSERVE_NCCL_STATUS(ncclInProgress).ok());
#endif
}

}  // namespace
}  // namespace pdserve::kernels::cuda
