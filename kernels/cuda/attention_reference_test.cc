// The tensor-core prefill kernel and the split-K decode kernel against a
// float64 reference computed from exactly the KV values the GPU reads (the
// layer is written by InvokeReshapeAndCache and decoded on the host), with a
// per-element error bound derived from each kernel's arithmetic instead of a
// fixed tolerance. Built to catch a wrong kernel, not rounding:
//   - chunk boundaries: one sequence prefilled as chunks that start and end
//     on and off the 64-query / 64-key tiles and the 16-token blocks, all
//     chunks in one launch (blockIdx.z indexing, q_row offsets);
//   - prefix hits: chunks after up to 8,000 cached tokens, contexts to 8k;
//   - head_dim 64 and 128, GQA 4, every KV dtype (scales for int8 / fp8);
//   - peaked scores: each query aimed at one visible key with a logit of
//     ~40 (a mis-indexed key, tile, block or a wrong online-softmax rescale
//     between tiles with very different maxima moves the output by O(1)),
//     and aimed at its first future key (a causal-mask leak moves it by
//     O(1));
//   - contexts beyond a launch's bound give NaN rows, never a read past the
//     partials or the block table.
//
// Error bound (first order, per output element d of query row r, head h):
// with p_t the reference softmax weights and delta_t the bound on the error
// of score t,
//   |out - ref| <= sum_t p_t (delta_t + sum_s p_s delta_s) |v_td|
//                  + u_pv * sum_t p_t |v_td|
// (a score error delta_t moves weight t by at most a factor exp(delta_t +
// mean delta); the weights and V then carry their own rounding u_pv). The
// test allows twice that plus 1e-5 for second-order terms.
//   prefill: Q and K are rounded to fp16 (unit roundoff u = 2^-11) and their
//     products accumulate exactly enough in fp32, so delta_t = 2u * scale *
//     sum_i |q_i k_ti|; P and V are rounded to fp16: u_pv = 2u.
//   decode: fp32 throughout (u = 2^-24): delta_t = (head_dim + 2) u * scale *
//     sum_i |q_i k_ti| (a dot product's rounding), u_pv = (context + 4) u
//     (the weighted sum over the context and the partition merge).
// A wrong key in a peaked row moves the output by |v_a - v_b| ~ 1.4 against
// a bound of ~0.1 there; on unpeaked N(0, 1) rows the bound is ~1e-2 (head_dim
// 128), far below the error of a dropped tile at contexts under ~1k.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/cache.cuh"
#include "kernels/cuda/test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::DeviceArray;
using testing::DeviceKvLayer;

constexpr double kFp16Unit = 1.0 / 2048;      // 2^-11
constexpr double kFp32Unit = 1.0 / 16777216;  // 2^-24

enum class Aim { kNone, kVisibleKey, kFutureKey };

const char* AimName(Aim a) {
  return a == Aim::kNone         ? "N(0,1) scores"
         : a == Aim::kVisibleKey ? "peaked on a visible key"
                                 : "peaked on the first future key";
}

struct Chunk {
  int start;  // cached tokens before the chunk
  int num_q;
};

// One sequence of `context` tokens in a shuffled paged layer, decoded back
// to the floats the GPU reads.
struct Sequence {
  Sequence(std::mt19937* rng, KvDtype dtype, int kv_heads, int block_size,
           int head_dim, int context)
      : kv_heads(kv_heads),
        block_size(block_size),
        head_dim(head_dim),
        context(context) {
    const int blocks = (context + block_size - 1) / block_size;
    std::vector<int32_t> ids(blocks + 5);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), *rng);
    table.assign(ids.begin(), ids.begin() + blocks);
    std::vector<int64_t> slots(context);
    for (int t = 0; t < context; ++t)
      slots[t] = int64_t{table[t / block_size]} * block_size + t % block_size;
    const size_t row = static_cast<size_t>(kv_heads) * head_dim;
    DeviceArray<float> k(testing::RandomFloats(rng, context * row));
    DeviceArray<float> v(testing::RandomFloats(rng, context * row));
    DeviceArray<int64_t> dslots(slots);
    layer = std::make_unique<DeviceKvLayer>(dtype, ids.size(), kv_heads,
                                            block_size, head_dim);
    EXPECT_TRUE(InvokeReshapeAndCache(k.get(), v.get(), dslots.get(), context,
                                      layer->view, nullptr)
                    .ok());
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    decoded = layer->DecodeToFloat();
  }
  // K (which 0) or V (1) of position t, KV head kh.
  const float* At(int which, int t, int kh) const {
    const int64_t block = table[t / block_size];
    return decoded.data() +
           ((block * 2 + which) * kv_heads + kh) * int64_t{block_size} *
               head_dim +
           int64_t{t % block_size} * head_dim;
  }

  int kv_heads, block_size, head_dim, context;
  std::vector<int32_t> table;
  std::unique_ptr<DeviceKvLayer> layer;
  std::vector<float> decoded;
};

// How one kernel's arithmetic rounds (see the bound above): a score's error
// is u_qk * scale * sum_i |q_i k_ti|; the weights and V add u_pv[r] for row r.
struct Rounding {
  double u_qk = 0;
  std::vector<double> u_pv;
};

struct Reference {
  std::vector<double> out;
  std::vector<std::vector<double>> bound;  // one per Rounding
};

// float64 attention of each query row (position pos[r]) over positions
// [0, pos[r]], and the error bound of each rounding. Rows run in parallel.
Reference Attend(const Sequence& s, const std::vector<float>& q,
                 const std::vector<int>& pos, int heads, float scale,
                 const std::vector<Rounding>& roundings) {
  const int d = s.head_dim, ratio = heads / s.kv_heads;
  const size_t n_out = pos.size() * heads * d;
  Reference ref;
  ref.out.assign(n_out, 0.0);
  ref.bound.assign(roundings.size(), std::vector<double>(n_out, 0.0));
#pragma omp parallel for schedule(dynamic)
  for (int64_t r = 0; r < static_cast<int64_t>(pos.size()); ++r) {
    const int n = pos[r] + 1;
    std::vector<double> w(n), mag(n);
    for (int h = 0; h < heads; ++h) {
      const float* qr = q.data() + (r * heads + h) * d;
      const int kh = h / ratio;
      double mx = -std::numeric_limits<double>::infinity();
      for (int t = 0; t < n; ++t) {
        const float* k = s.At(0, t, kh);
        double dot = 0, m = 0;
        for (int i = 0; i < d; ++i) {
          dot += double{qr[i]} * k[i];
          m += std::fabs(double{qr[i]} * k[i]);
        }
        w[t] = dot * scale;
        mag[t] = scale * m;
        mx = std::max(mx, w[t]);
      }
      double z = 0;
      for (int t = 0; t < n; ++t) z += w[t] = std::exp(w[t] - mx);
      double mean_mag = 0;
      for (int t = 0; t < n; ++t) mean_mag += w[t] / z * mag[t];
      const size_t at = (r * heads + h) * d;
      for (int t = 0; t < n; ++t) {
        const double p = w[t] / z;
        const float* v = s.At(1, t, kh);
        for (int i = 0; i < d; ++i) ref.out[at + i] += p * v[i];
        for (size_t k = 0; k < roundings.size(); ++k) {
          const Rounding& ro = roundings[k];
          const double f = p * (ro.u_qk * (mag[t] + mean_mag) + ro.u_pv[r]);
          for (int i = 0; i < d; ++i)
            ref.bound[k][at + i] += f * std::fabs(v[i]);
        }
      }
    }
  }
  return ref;
}

// Queries for rows at `pos`: N(0, 1), or aimed at one key so its logit is
// ~40 above the typical score (kVisibleKey: a key at or before the row's
// position, spread over the context; kFutureKey: position + 1, which the
// row must not see).
std::vector<float> Queries(std::mt19937* rng, const Sequence& s,
                           const std::vector<int>& pos, int heads, float scale,
                           Aim aim) {
  const int d = s.head_dim, ratio = heads / s.kv_heads;
  std::vector<float> q = testing::RandomFloats(rng, pos.size() * heads * d,
                                               aim == Aim::kNone ? 1.0f : 0.1f);
  if (aim == Aim::kNone) return q;
  for (size_t r = 0; r < pos.size(); ++r) {
    int target =
        aim == Aim::kFutureKey
            ? pos[r] + 1
            : static_cast<int>((uint64_t{r} * 7919 + 13) % (pos[r] + 1));
    if (target >= s.context) continue;  // the last position has no future
    for (int h = 0; h < heads; ++h) {
      const float* k = s.At(0, target, h / ratio);
      double norm2 = 0;
      for (int i = 0; i < d; ++i) norm2 += double{k[i]} * k[i];
      const double c = 40.0 / (scale * norm2);
      for (int i = 0; i < d; ++i)
        q[(r * heads + h) * d + i] += static_cast<float>(c * k[i]);
    }
  }
  return q;
}

// Returns "" when every element is within twice its bound plus 1e-5, else
// the first element that is not.
std::string Check(const std::vector<float>& got,
                  const std::vector<double>& want,
                  const std::vector<double>& bound) {
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]);
    const double allowed = 2 * bound[i] + 1e-5;
    if (!(err <= allowed)) {
      return absl::StrCat("element ", i, ": gpu ", got[i], " reference ",
                          want[i], " |diff| ", err, " > allowed ", allowed);
    }
  }
  return "";
}

// The two kernels' roundings for rows at `pos` (context pos + 1).
std::vector<Rounding> Roundings(const std::vector<int>& pos, int head_dim) {
  Rounding prefill{2 * kFp16Unit,
                   std::vector<double>(pos.size(), 2 * kFp16Unit)};
  Rounding decode{(head_dim + 2) * kFp32Unit, {}};
  for (int p : pos) decode.u_pv.push_back((p + 1 + 4) * kFp32Unit);
  return {prefill, decode};
}

class AttentionReferenceTest : public testing::GpuTest {
 protected:
  // Prefill of `chunks` of one sequence in one launch, then the same rows
  // through the decode kernel (one row per query, split-K partitions).
  void Run(KvDtype dtype, int head_dim, int context,
           const std::vector<Chunk>& chunks, Aim aim) {
    constexpr int kKvHeads = 1, kHeads = 4, kBlockSize = 16;
    const std::string what =
        absl::StrCat(KvDtypeName(dtype), " head_dim ", head_dim, " context ",
                     context, ", ", AimName(aim));
    Sequence s(&rng_, dtype, kKvHeads, kBlockSize, head_dim, context);
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    std::vector<int> pos;
    std::vector<PrefillSeq> pseqs;
    std::vector<int32_t> tables;
    for (const Chunk& c : chunks) {
      ASSERT_LE(c.start + c.num_q, context);
      PrefillSeq p;
      p.q_row = static_cast<int32_t>(pos.size());
      p.num_q = c.num_q;
      p.start_pos = c.start;
      pseqs.push_back(p);
      tables.insert(tables.end(), s.table.begin(), s.table.end());
      for (int i = 0; i < c.num_q; ++i) pos.push_back(c.start + i);
    }
    const int rows = static_cast<int>(pos.size());
    const int max_blocks = static_cast<int>(s.table.size());
    const std::vector<float> q = Queries(&rng_, s, pos, kHeads, scale, aim);
    DeviceArray<float> dq(q), dout(q.size());
    DeviceArray<PrefillSeq> dseqs(pseqs);
    DeviceArray<int32_t> dtables(tables);
    int max_q = 0;
    for (const Chunk& c : chunks) max_q = std::max(max_q, c.num_q);
    ASSERT_TRUE(InvokePagedPrefillAttention(
                    dq.get(), s.layer->view, dseqs.get(),
                    static_cast<int32_t>(chunks.size()), dtables.get(),
                    max_blocks, kHeads, max_q, scale, dout.get(), stream_)
                    .ok());
    Sync();
    const Reference ref =
        Attend(s, q, pos, kHeads, scale, Roundings(pos, head_dim));
    EXPECT_EQ(Check(dout.Download(), ref.out, ref.bound[0]), "")
        << "prefill, " << what;

    // Decode kernel over the same rows.
    std::vector<int32_t> ctx(rows), seq(rows, 0);
    for (int r = 0; r < rows; ++r) ctx[r] = pos[r] + 1;
    DeviceArray<int32_t> dctx(ctx), dseq(seq), dtable(s.table);
    const int64_t ws_bytes =
        PagedDecodeAttentionWorkspaceBytes(rows, kHeads, head_dim, context);
    DeviceArray<uint8_t> ws(
        static_cast<size_t>(std::max<int64_t>(ws_bytes, 1)));
    dout.Zero();
    ASSERT_TRUE(InvokePagedDecodeAttention(
                    dq.get(), s.layer->view, dtable.get(), max_blocks,
                    dctx.get(), dseq.get(), rows, kHeads, context, scale,
                    dout.get(), ws.get(), ws_bytes, stream_)
                    .ok());
    Sync();
    EXPECT_EQ(Check(dout.Download(), ref.out, ref.bound[1]), "")
        << "decode, " << what;
  }
};

// Chunks of a 700-token prompt that cover every position once, with starts
// and ends on and off the 64-token tiles and 16-token blocks.
const std::vector<Chunk> kChunks700 = {{0, 64},    {64, 1},   {65, 63},
                                       {128, 129}, {257, 15}, {272, 428}};

TEST_F(AttentionReferenceTest, PrefillChunksMatchFloat64ForEveryDtype) {
  for (KvDtype dtype : testing::kAllKvDtypes) {
    for (int head_dim : {64, 128}) {
      for (Aim aim : {Aim::kNone, Aim::kVisibleKey, Aim::kFutureKey})
        Run(dtype, head_dim, 700, kChunks700, aim);
    }
  }
}

// Prefix hits: chunks after 1,000 to 8,000 cached tokens, ending at 8k.
TEST_F(AttentionReferenceTest, ChunksAfterLongCachedPrefixesMatchFloat64) {
  const std::vector<Chunk> chunks = {
      {1000, 64}, {4095, 2}, {7999, 65}, {8128, 64}};
  for (KvDtype dtype : {KvDtype::kF16, KvDtype::kFp8E4M3}) {
    for (int head_dim : {64, 128}) {
      for (Aim aim : {Aim::kNone, Aim::kVisibleKey, Aim::kFutureKey})
        Run(dtype, head_dim, 8192, chunks, aim);
    }
  }
}

// A context above the launch's max_context_len (decode) or past the block
// table (prefill) makes that row NaN, and leaves the other rows right.
TEST_F(AttentionReferenceTest, ContextsBeyondTheLaunchBoundGiveNanRows) {
  constexpr int kHeads = 4, kHd = 64;
  Sequence s(&rng_, KvDtype::kBF16, 1, 16, kHd, 1024);
  const float scale = 0.125f;
  const std::vector<int> pos = {511, 1023};
  const std::vector<float> q =
      Queries(&rng_, s, pos, kHeads, scale, Aim::kNone);
  DeviceArray<float> dq(q), dout(q.size());
  DeviceArray<int32_t> dtable(s.table);
  const int max_blocks = static_cast<int>(s.table.size());
  // Row 1 claims 1024 positions but the launch says at most 512: with the
  // workspace sized for 512, its reduce step would read past the partials.
  DeviceArray<int32_t> dctx(std::vector<int32_t>{512, 1024});
  DeviceArray<int32_t> dseq(std::vector<int32_t>{0, 0});
  const int64_t ws_bytes =
      PagedDecodeAttentionWorkspaceBytes(2, kHeads, kHd, 512);
  DeviceArray<uint8_t> ws(static_cast<size_t>(std::max<int64_t>(ws_bytes, 1)));
  ASSERT_TRUE(InvokePagedDecodeAttention(dq.get(), s.layer->view, dtable.get(),
                                         max_blocks, dctx.get(), dseq.get(), 2,
                                         kHeads, 512, scale, dout.get(),
                                         ws.get(), ws_bytes, stream_)
                  .ok());
  Sync();
  std::vector<float> out = dout.Download();
  const Reference ref =
      Attend(s, q, {511}, kHeads, scale, Roundings({511}, kHd));
  const std::vector<float> row0(out.begin(), out.begin() + kHeads * kHd);
  EXPECT_EQ(Check(row0, ref.out, ref.bound[1]), "");
  for (int i = kHeads * kHd; i < 2 * kHeads * kHd; ++i)
    ASSERT_TRUE(std::isnan(out[i])) << "decode element " << i;
  // Prefill: the second sequence's chunk ends past its (shortened) table.
  std::vector<PrefillSeq> pseqs(2);
  pseqs[0] = {0, 1, 511, 0};
  pseqs[1] = {1, 1, 1023, 0};
  DeviceArray<PrefillSeq> dseqs(pseqs);
  std::vector<int32_t> tables(s.table.begin(), s.table.begin() + 32);
  tables.insert(tables.end(), s.table.begin(), s.table.begin() + 32);
  DeviceArray<int32_t> dtables(tables);  // 32 blocks = 512 positions per row
  ASSERT_TRUE(InvokePagedPrefillAttention(dq.get(), s.layer->view, dseqs.get(),
                                          2, dtables.get(), 32, kHeads, 1,
                                          scale, dout.get(), stream_)
                  .ok());
  Sync();
  out = dout.Download();
  const std::vector<float> prefill_row0(out.begin(),
                                        out.begin() + kHeads * kHd);
  EXPECT_EQ(Check(prefill_row0, ref.out, ref.bound[0]), "");
  for (int i = kHeads * kHd; i < 2 * kHeads * kHd; ++i)
    ASSERT_TRUE(std::isnan(out[i])) << "prefill element " << i;
}

}  // namespace
}  // namespace pdserve::kernels::cuda
