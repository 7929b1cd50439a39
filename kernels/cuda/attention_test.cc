// Paged decode and prefill attention on the GPU against the CPU kernel
// (kernels/cpu/paged_attention.h) over GQA ratios, block sizes, head sizes,
// partial blocks, contexts up to 32k and every KV dtype. The cache is written
// by InvokeReshapeAndCache and decoded on the host, so the reference sees
// exactly the values the GPU reads; differences come from arithmetic only.
//
// Tolerances (|gpu - cpu| <= atol + rtol * |cpu|, outputs are O(1)):
//   decode (fp32 math):            atol 2e-4, rtol 1e-3
//   prefill (fp16 tensor cores):   atol 2e-2, rtol 2e-2
#include "kernels/cuda/attention.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/paged_attention.h"
#include "kernels/cuda/cache.cuh"
#include "kernels/cuda/test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::DeviceArray;
using testing::DeviceKvLayer;

struct Geometry {
  int kv_heads;
  int ratio;  // query heads per KV head
  int block_size;
  int head_dim;
};

std::string Describe(const Geometry& g, KvDtype dtype) {
  return absl::StrCat(KvDtypeName(dtype), " kv_heads=", g.kv_heads,
                      " ratio=", g.ratio, " block_size=", g.block_size,
                      " head_dim=", g.head_dim);
}

// Sequences with `contexts[i]` tokens in a shuffled paged layer.
struct PagedBatch {
  PagedBatch(std::mt19937* rng, const Geometry& g, KvDtype dtype,
             const std::vector<int>& contexts)
      : geometry(g), context(contexts) {
    num_seqs = static_cast<int>(contexts.size());
    int64_t total_blocks = 0;
    for (int c : contexts) {
      max_blocks = std::max(max_blocks, (c + g.block_size - 1) / g.block_size);
      total_blocks += (c + g.block_size - 1) / g.block_size;
    }
    max_blocks = std::max(max_blocks, 1);
    num_blocks = total_blocks + 3;
    std::vector<int32_t> ids(num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), *rng);
    tables.assign(static_cast<size_t>(num_seqs) * max_blocks, 0);
    int64_t next = 0;
    std::vector<int64_t> slots;
    for (int s = 0; s < num_seqs; ++s) {
      const int nb = (contexts[s] + g.block_size - 1) / g.block_size;
      for (int b = 0; b < nb; ++b) tables[s * max_blocks + b] = ids[next++];
      for (int pos = 0; pos < contexts[s]; ++pos) {
        slots.push_back(int64_t{tables[s * max_blocks + pos / g.block_size]} *
                            g.block_size +
                        pos % g.block_size);
      }
    }
    const size_t row = static_cast<size_t>(g.kv_heads) * g.head_dim;
    const std::vector<float> k = testing::RandomFloats(rng, slots.size() * row);
    const std::vector<float> v = testing::RandomFloats(rng, slots.size() * row);
    layer = std::make_unique<DeviceKvLayer>(dtype, num_blocks, g.kv_heads,
                                            g.block_size, g.head_dim);
    DeviceArray<float> dk(k), dv(v);
    DeviceArray<int64_t> dslots(slots);
    EXPECT_TRUE(InvokeReshapeAndCache(dk.get(), dv.get(), dslots.get(),
                                      static_cast<int64_t>(slots.size()),
                                      layer->view, nullptr)
                    .ok());
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    reference = layer->DecodeToFloat();
    device_tables = std::make_unique<DeviceArray<int32_t>>(tables);
  }

  kernels::KvLayerView ReferenceView() {
    kernels::KvLayerView v;
    v.data = reference.data();
    v.dtype = DType::kF32;
    v.num_kv_heads = geometry.kv_heads;
    v.head_dim = geometry.head_dim;
    v.block_size = geometry.block_size;
    return v;
  }

  Geometry geometry;
  std::vector<int> context;
  int num_seqs = 0;
  int max_blocks = 0;
  int64_t num_blocks = 0;
  std::vector<int32_t> tables;  // [num_seqs][max_blocks]
  std::unique_ptr<DeviceKvLayer> layer;
  std::vector<float> reference;  // decoded layer, fp32
  std::unique_ptr<DeviceArray<int32_t>> device_tables;
};

// Returns "" when every element is within tolerance, else the first miss.
std::string Compare(const std::vector<float>& got,
                    const std::vector<float>& want, float atol, float rtol) {
  if (got.size() != want.size()) return "size mismatch";
  double max_err = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float err = std::fabs(got[i] - want[i]);
    max_err = std::max<double>(max_err, err);
    if (!(err <= atol + rtol * std::fabs(want[i]))) {
      return absl::StrCat("element ", i, ": gpu ", got[i], " cpu ", want[i],
                          " (|diff| ", err, ")");
    }
  }
  return "";
}

class PagedAttentionTest : public testing::GpuTest {
 protected:
  // Decode: one query per sequence at its last position.
  void CheckDecode(const Geometry& g, KvDtype dtype,
                   const std::vector<int>& contexts) {
    PagedBatch batch(&rng_, g, dtype, contexts);
    const int num_heads = g.kv_heads * g.ratio;
    const int n = batch.num_seqs;
    const std::vector<float> q = testing::RandomFloats(
        &rng_, static_cast<size_t>(n) * num_heads * g.head_dim);
    const float scale = 1.0f / std::sqrt(static_cast<float>(g.head_dim));
    std::vector<kernels::AttentionSeq> seqs;
    for (int s = 0; s < n; ++s) {
      seqs.push_back(
          {s, 1, contexts[s] - 1, batch.tables.data() + s * batch.max_blocks});
    }
    std::vector<float> want(q.size());
    kernels::PagedAttention(q.data(), num_heads, seqs, batch.ReferenceView(),
                            scale, want.data());

    const int max_ctx = *std::max_element(contexts.begin(), contexts.end());
    DeviceArray<float> dq(q), dout(q.size());
    DeviceArray<int32_t> dctx(
        std::vector<int32_t>(contexts.begin(), contexts.end()));
    const int64_t ws_bytes =
        PagedDecodeAttentionWorkspaceBytes(n, num_heads, g.head_dim, max_ctx);
    DeviceArray<uint8_t> ws(
        static_cast<size_t>(std::max<int64_t>(ws_bytes, 1)));
    ASSERT_TRUE(InvokePagedDecodeAttention(
                    dq.get(), batch.layer->view, batch.device_tables->get(),
                    batch.max_blocks, dctx.get(), nullptr, n, num_heads,
                    max_ctx, scale, dout.get(), ws.get(), ws_bytes, stream_)
                    .ok());
    Sync();
    const std::string miss = Compare(dout.Download(), want, 2e-4f, 1e-3f);
    EXPECT_EQ(miss, "") << "decode " << Describe(g, dtype);
  }

  // Prefill: num_q[s] new queries ending at contexts[s]. Checked both with
  // the tensor-core prefill kernel and with the decode kernel given one row
  // per query (the exact fp32 path the backend can use instead).
  void CheckPrefill(const Geometry& g, KvDtype dtype,
                    const std::vector<int>& contexts,
                    const std::vector<int>& num_q) {
    PagedBatch batch(&rng_, g, dtype, contexts);
    const int num_heads = g.kv_heads * g.ratio;
    const int n = batch.num_seqs;
    const int rows = std::accumulate(num_q.begin(), num_q.end(), 0);
    const std::vector<float> q = testing::RandomFloats(
        &rng_, static_cast<size_t>(rows) * num_heads * g.head_dim);
    const float scale = 1.0f / std::sqrt(static_cast<float>(g.head_dim));
    std::vector<kernels::AttentionSeq> seqs;
    std::vector<PrefillSeq> pseqs;
    std::vector<int32_t> row_ctx, row_seq;
    int row = 0;
    for (int s = 0; s < n; ++s) {
      const int start = contexts[s] - num_q[s];
      seqs.push_back(
          {row, num_q[s], start, batch.tables.data() + s * batch.max_blocks});
      PrefillSeq p;
      p.q_row = row;
      p.num_q = num_q[s];
      p.start_pos = start;
      pseqs.push_back(p);
      for (int i = 0; i < num_q[s]; ++i) {
        row_ctx.push_back(start + i + 1);
        row_seq.push_back(s);
      }
      row += num_q[s];
    }
    std::vector<float> want(q.size());
    kernels::PagedAttention(q.data(), num_heads, seqs, batch.ReferenceView(),
                            scale, want.data());

    DeviceArray<float> dq(q), dout(q.size());
    DeviceArray<PrefillSeq> dseqs(pseqs);
    const int max_q = *std::max_element(num_q.begin(), num_q.end());
    ASSERT_TRUE(InvokePagedPrefillAttention(
                    dq.get(), batch.layer->view, dseqs.get(), n,
                    batch.device_tables->get(), batch.max_blocks, num_heads,
                    max_q, scale, dout.get(), stream_)
                    .ok());
    Sync();
    std::string miss = Compare(dout.Download(), want, 2e-2f, 2e-2f);
    EXPECT_EQ(miss, "") << "prefill " << Describe(g, dtype);

    const int max_ctx = *std::max_element(contexts.begin(), contexts.end());
    DeviceArray<int32_t> dctx(row_ctx), dseq(row_seq);
    const int64_t ws_bytes = PagedDecodeAttentionWorkspaceBytes(
        rows, num_heads, g.head_dim, max_ctx);
    DeviceArray<uint8_t> ws(
        static_cast<size_t>(std::max<int64_t>(ws_bytes, 1)));
    dout.Zero();
    ASSERT_TRUE(InvokePagedDecodeAttention(
                    dq.get(), batch.layer->view, batch.device_tables->get(),
                    batch.max_blocks, dctx.get(), dseq.get(), rows, num_heads,
                    max_ctx, scale, dout.get(), ws.get(), ws_bytes, stream_)
                    .ok());
    Sync();
    miss = Compare(dout.Download(), want, 2e-4f, 1e-3f);
    EXPECT_EQ(miss, "") << "prefill via decode rows " << Describe(g, dtype);
  }
};

// GQA 1/4/8 (and an odd 3, and 2 as in the tiny preset), block sizes 16/32,
// head sizes 16..128.
const Geometry kGeometries[] = {
    {2, 1, 16, 128}, {2, 4, 16, 128}, {2, 8, 32, 128}, {1, 8, 16, 64},
    {4, 4, 32, 64},  {2, 2, 16, 16},  {3, 3, 32, 32},  {8, 1, 16, 64},
};

// Contexts around block and partition (256) edges: partial blocks, one
// token, exactly one partition, one past it, several partitions.
const std::vector<int> kContexts = {1,   15,  16,  17,   33,
                                    255, 256, 257, 1000, 4097};

TEST_F(PagedAttentionTest, DecodeMatchesCpuForEveryDtypeAndGeometry) {
  for (KvDtype dtype : testing::kAllKvDtypes) {
    for (const Geometry& g : kGeometries) CheckDecode(g, dtype, kContexts);
  }
}

TEST_F(PagedAttentionTest, DecodeMatchesCpuAtLongContexts) {
  for (KvDtype dtype : testing::kAllKvDtypes) {
    CheckDecode({2, 8, 16, 128}, dtype, {32768, 20000, 8191});
    CheckDecode({1, 4, 32, 64}, dtype, {32768});
  }
}

TEST_F(PagedAttentionTest, DecodeOfEmptyContextIsZero) {
  const Geometry g{2, 4, 16, 64};
  PagedBatch batch(&rng_, g, KvDtype::kBF16, {0, 5});
  const int num_heads = 8;
  DeviceArray<float> dq(testing::RandomFloats(&rng_, 2 * num_heads * 64));
  DeviceArray<float> dout(2 * num_heads * 64);
  DeviceArray<int32_t> dctx(std::vector<int32_t>{0, 5});
  std::vector<float> nan_fill(2 * num_heads * 64, NAN);
  dout.Upload(nan_fill);
  ASSERT_TRUE(InvokePagedDecodeAttention(
                  dq.get(), batch.layer->view, batch.device_tables->get(),
                  batch.max_blocks, dctx.get(), nullptr, 2, num_heads, 5,
                  0.125f, dout.get(), nullptr, 0, stream_)
                  .ok());
  Sync();
  const std::vector<float> out = dout.Download();
  for (int i = 0; i < num_heads * 64; ++i) ASSERT_EQ(out[i], 0.0f) << i;
  for (int i = num_heads * 64; i < 2 * num_heads * 64; ++i)
    ASSERT_TRUE(std::isfinite(out[i])) << i;
}

TEST_F(PagedAttentionTest, PrefillMatchesCpuWithCachedPrefixAndChunks) {
  // (context after the chunk, new tokens): whole prompts, chunks after a
  // cached prefix, a one-token chunk, tiles that end mid-block.
  const std::vector<int> contexts = {1, 17, 100, 300, 1000, 2100, 64, 65};
  const std::vector<int> num_q = {1, 17, 37, 300, 129, 64, 64, 1};
  for (KvDtype dtype : testing::kAllKvDtypes) {
    for (const Geometry& g : kGeometries) {
      CheckPrefill(g, dtype, contexts, num_q);
    }
  }
}

// Argument checks come before any CUDA call, so this runs without a device.
TEST(PagedAttentionArgumentsTest, RejectsUnsupportedHeadDimAndMissingScales) {
  cudaStream_t stream_ = nullptr;
  PagedKvView view;
  int dummy = 0;
  view.data = &dummy;
  view.num_kv_heads = 2;
  view.block_size = 16;
  view.head_dim = 96;
  view.dtype = KvDtype::kF16;
  EXPECT_EQ(
      InvokePagedDecodeAttention(nullptr, view, nullptr, 1, nullptr, nullptr, 1,
                                 4, 16, 1.0f, nullptr, nullptr, 0, stream_)
          .code(),
      absl::StatusCode::kInvalidArgument);
  view.head_dim = 64;
  view.dtype = KvDtype::kI8;
  EXPECT_EQ(InvokePagedPrefillAttention(nullptr, view, nullptr, 1, nullptr, 1,
                                        4, 1, 1.0f, nullptr, stream_)
                .code(),
            absl::StatusCode::kInvalidArgument);
  view.dtype = KvDtype::kF16;
  EXPECT_EQ(
      InvokePagedDecodeAttention(nullptr, view, nullptr, 1, nullptr, nullptr, 1,
                                 3, 16, 1.0f, nullptr, nullptr, 0, stream_)
          .code(),
      absl::StatusCode::kInvalidArgument);  // 3 heads over 2 KV heads
}

}  // namespace
}  // namespace pdserve::kernels::cuda
