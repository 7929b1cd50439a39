// Kernel benchmarks, run by scripts/gpu-check.sh on a lent GPU. They live in
// the GPU test binary so that one self-contained binary carries tests and
// figures; under ctest they skip unless PDSERVE_GPU_BENCH=1 (benchmarks are
// not tests, STYLE.md). Each prints one line per configuration:
//   decode attention: achieved GB/s of KV read and the fraction of the
//     device's peak (H200: 4.8 TB/s; --peak from PDSERVE_GPU_PEAK_GBPS);
//   prefill attention: TFLOP/s (4 * heads * head_dim * causal pairs);
//   gather/scatter: GB/s and the ratio to a device-to-device cudaMemcpy.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/kv_copy.cuh"
#include "kernels/cuda/test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::DeviceArray;

double PeakGbps() {
  const char* env = std::getenv("PDSERVE_GPU_PEAK_GBPS");
  return env != nullptr ? std::atof(env) : 4800.0;
}

class KernelBench : public testing::GpuTest {
 protected:
  void SetUp() override {
    const char* env = std::getenv("PDSERVE_GPU_BENCH");
    if (env == nullptr || std::string(env) != "1") {
      GTEST_SKIP() << "benchmark: set PDSERVE_GPU_BENCH=1 to run";
    }
    testing::GpuTest::SetUp();
  }
  // Mean milliseconds of `fn` (returning its launch's absl::Status) over
  // enough iterations for ~50 ms, or the first error of any launch, event or
  // the stream: a figure is never printed for launches that failed.
  template <typename Fn>
  absl::StatusOr<double> TimeMs(Fn fn) {
    absl::Status first;
    auto run = [&] {
      absl::Status s = fn();
      if (first.ok() && !s.ok()) first = s;
    };
    auto check = [&](cudaError_t e) {
      if (first.ok() && e != cudaSuccess) first = PDSERVE_CUDA_STATUS(e);
    };
    for (int i = 0; i < 2; ++i) run();
    cudaEvent_t a = nullptr, b = nullptr;
    check(cudaEventCreate(&a));
    check(cudaEventCreate(&b));
    float once = 0, total = 0;
    int iters = 0;
    if (first.ok()) {
      check(cudaEventRecord(a, stream_));
      run();
      check(cudaEventRecord(b, stream_));
      check(cudaEventSynchronize(b));
      check(cudaEventElapsedTime(&once, a, b));
      iters =
          std::clamp(static_cast<int>(50.0 / std::max(once, 0.001f)), 3, 200);
    }
    if (first.ok()) {
      check(cudaEventRecord(a, stream_));
      for (int i = 0; i < iters && first.ok(); ++i) run();
      check(cudaEventRecord(b, stream_));
      check(cudaEventSynchronize(b));
      check(cudaEventElapsedTime(&total, a, b));
    }
    check(cudaStreamSynchronize(stream_));  // faults of the kernels
    check(cudaGetLastError());
    if (a != nullptr) cudaEventDestroy(a);
    if (b != nullptr) cudaEventDestroy(b);
    if (!first.ok()) return first;
    return static_cast<double>(total) / iters;
  }
};

// Llama-3-8B attention geometry: 32 query heads over 8 KV heads, head_dim
// 128, block size 16.
TEST_F(KernelBench, DecodeAttentionBandwidth) {
  constexpr int kKvHeads = 8, kHeads = 32, kHd = 128, kBs = 16;
  const int batches[] = {1, 8, 32, 64, 128, 256};
  const int contexts[] = {1024, 4096, 16384, 32768};
  for (KvDtype dtype : {KvDtype::kBF16, KvDtype::kFp8E4M3}) {
    const int64_t max_blocks_per_seq = 32768 / kBs;
    const int64_t num_blocks = 256 * max_blocks_per_seq;
    testing::DeviceKvLayer layer(dtype, num_blocks, kKvHeads, kBs, kHd);
    ASSERT_EQ(cudaMemset(layer.data.get(), 0x3a, layer.data.size()),
              cudaSuccess);
    if (KvDtypeHasScales(dtype)) {
      ASSERT_TRUE(cudaMemset(layer.scales.get(), 0, layer.scales.size() * 4) ==
                  cudaSuccess);
    }
    std::vector<int32_t> ids(num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng_);
    DeviceArray<int32_t> tables(ids);  // [256][max_blocks_per_seq]
    DeviceArray<float> q(256 * kHeads * kHd), out(256 * kHeads * kHd);
    q.Zero();
    const int64_t ws_bytes =
        PagedDecodeAttentionWorkspaceBytes(256, kHeads, kHd, 32768);
    DeviceArray<uint8_t> ws(static_cast<size_t>(ws_bytes));
    for (int batch : batches) {
      for (int ctx : contexts) {
        DeviceArray<int32_t> lens(std::vector<int32_t>(batch, ctx));
        const absl::StatusOr<double> timed = TimeMs([&] {
          return InvokePagedDecodeAttention(
              q.get(), layer.view, tables.get(),
              static_cast<int32_t>(max_blocks_per_seq), lens.get(), nullptr,
              batch, kHeads, ctx, 0.088f, out.get(), ws.get(), ws_bytes,
              stream_);
        });
        ASSERT_TRUE(timed.ok()) << KvDtypeName(dtype) << " batch " << batch
                                << " context " << ctx << ": " << timed.status();
        const double ms = *timed;
        const double bytes =
            2.0 * batch * ctx * kKvHeads * kHd * KvDtypeBytes(dtype);
        const double gbps = bytes / (ms * 1e-3) / 1e9;
        std::printf(
            "BENCH decode_attention dtype=%s batch=%d context=%d time_us=%.1f "
            "GB/s=%.0f peak_fraction=%.2f\n",
            KvDtypeName(dtype), batch, ctx, ms * 1e3, gbps, gbps / PeakGbps());
      }
    }
  }
}

TEST_F(KernelBench, PrefillAttentionThroughput) {
  constexpr int kKvHeads = 8, kHeads = 32, kHd = 128, kBs = 16;
  struct Shape {
    int cached, new_tokens, seqs;
  };
  for (const Shape& s : {Shape{0, 4096, 1}, Shape{8192, 2048, 1},
                         Shape{0, 1024, 8}, Shape{0, 16384, 1}}) {
    const int ctx = s.cached + s.new_tokens;
    const int blocks_per_seq = (ctx + kBs - 1) / kBs;
    testing::DeviceKvLayer layer(
        KvDtype::kBF16, int64_t{blocks_per_seq} * s.seqs, kKvHeads, kBs, kHd);
    ASSERT_EQ(cudaMemset(layer.data.get(), 0x3a, layer.data.size()),
              cudaSuccess);
    std::vector<int32_t> table(static_cast<size_t>(blocks_per_seq) * s.seqs);
    std::iota(table.begin(), table.end(), 0);
    DeviceArray<int32_t> dtable(table);
    std::vector<PrefillSeq> seqs(s.seqs);
    for (int i = 0; i < s.seqs; ++i) {
      seqs[i].q_row = i * s.new_tokens;
      seqs[i].num_q = s.new_tokens;
      seqs[i].start_pos = s.cached;
    }
    DeviceArray<PrefillSeq> dseqs(seqs);
    const size_t rows = static_cast<size_t>(s.new_tokens) * s.seqs;
    DeviceArray<float> q(rows * kHeads * kHd), out(rows * kHeads * kHd);
    q.Zero();
    const absl::StatusOr<double> timed = TimeMs([&] {
      return InvokePagedPrefillAttention(
          q.get(), layer.view, dseqs.get(), s.seqs, dtable.get(),
          blocks_per_seq, kHeads, s.new_tokens, 0.088f, out.get(), stream_);
    });
    ASSERT_TRUE(timed.ok()) << "cached " << s.cached << " new " << s.new_tokens
                            << ": " << timed.status();
    const double ms = *timed;
    // Causal pairs: each new token i sees cached + i + 1 keys.
    const double pairs =
        static_cast<double>(s.seqs) *
        (static_cast<double>(s.new_tokens) * s.cached +
         static_cast<double>(s.new_tokens) * (s.new_tokens + 1) / 2);
    const double tflops = 4.0 * kHeads * kHd * pairs / (ms * 1e-3) / 1e12;
    std::printf(
        "BENCH prefill_attention seqs=%d cached=%d new=%d time_ms=%.2f "
        "TFLOP/s=%.1f\n",
        s.seqs, s.cached, s.new_tokens, ms, tflops);
  }
}

TEST_F(KernelBench, GatherScatterVersusMemcpy) {
  // One layer-block of Llama-3-8B in bf16: 2 x 8 x 16 x 128 x 2 = 64 KiB.
  const int64_t span = 2 * 8 * 16 * 128 * 2;
  const int32_t layers = 4;
  const int64_t blocks = 2048;
  const int32_t num_spans = 4096;  // 256 MiB per copy
  std::vector<std::unique_ptr<DeviceArray<uint8_t>>> pools;
  std::vector<uint8_t*> bases;
  for (int l = 0; l < layers; ++l) {
    pools.push_back(std::make_unique<DeviceArray<uint8_t>>(blocks * span));
    bases.push_back(pools.back()->get());
  }
  DeviceArray<uint8_t*> dbases(bases);
  std::vector<KvBlockSpan> spans(num_spans);
  std::uniform_int_distribution<int32_t> layer(0, layers - 1),
      block(0, blocks - 1);
  for (auto& s : spans) s = {layer(rng_), block(rng_)};
  // Scatter needs distinct blocks.
  std::vector<KvBlockSpan> distinct;
  for (int32_t l = 0; l < layers && distinct.size() < spans.size(); ++l) {
    for (int32_t b = 0; b < blocks && distinct.size() < spans.size(); ++b)
      distinct.push_back({l, b});
  }
  std::shuffle(distinct.begin(), distinct.end(), rng_);
  DeviceArray<KvBlockSpan> dspans(spans), ddistinct(distinct);
  DeviceArray<uint8_t> staging(num_spans * span), other(num_spans * span);
  const double bytes = static_cast<double>(num_spans) * span;
  const absl::StatusOr<double> memcpy_ms = TimeMs([&] {
    return PDSERVE_CUDA_STATUS(
        cudaMemcpyAsync(other.get(), staging.get(), num_spans * span,
                        cudaMemcpyDeviceToDevice, stream_));
  });
  ASSERT_TRUE(memcpy_ms.ok()) << memcpy_ms.status();
  const absl::StatusOr<double> gather_ms = TimeMs([&] {
    return InvokeGatherKvBlocks(
        reinterpret_cast<const uint8_t* const*>(dbases.get()), layers, blocks,
        span, dspans.get(), num_spans, staging.get(), stream_);
  });
  ASSERT_TRUE(gather_ms.ok()) << gather_ms.status();
  const absl::StatusOr<double> scatter_ms = TimeMs([&] {
    return InvokeScatterKvBlocks(dbases.get(), layers, blocks, span,
                                 ddistinct.get(), num_spans, staging.get(),
                                 stream_);
  });
  ASSERT_TRUE(scatter_ms.ok()) << scatter_ms.status();
  auto gbps = [&](double ms) { return bytes / (ms * 1e-3) / 1e9; };
  std::printf("BENCH kv_copy span_bytes=%ld spans=%d memcpy_d2d GB/s=%.0f\n",
              static_cast<long>(span), num_spans, gbps(*memcpy_ms));
  std::printf("BENCH kv_copy gather GB/s=%.0f vs_memcpy=%.2f\n",
              gbps(*gather_ms), *memcpy_ms / *gather_ms);
  std::printf("BENCH kv_copy scatter GB/s=%.0f vs_memcpy=%.2f\n",
              gbps(*scatter_ms), *memcpy_ms / *scatter_ms);
}

}  // namespace
}  // namespace pdserve::kernels::cuda
