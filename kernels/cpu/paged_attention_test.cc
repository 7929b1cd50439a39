#include "kernels/cpu/paged_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/matmul.h"

namespace pdserve::kernels {
namespace {

// A paged cache holding one or more sequences whose K/V were written through
// WriteKv into shuffled blocks, plus the fp32 originals for a dense reference.
struct PagedFixture {
  std::vector<uint8_t> data;
  std::vector<float> scales;
  KvLayerView view;
  std::vector<std::vector<int32_t>> tables;
  std::vector<std::vector<float>> k, v;  // per sequence [len, kv_heads, hd]
};

class PagedAttentionTest : public ::testing::Test {
 protected:
  PagedFixture Build(DType dtype, int kv_heads, int hd, int bs,
                     const std::vector<int>& lens) {
    PagedFixture f;
    int total_blocks = 0;
    for (int len : lens) total_blocks += (len + bs - 1) / bs;
    total_blocks += 3;  // unused blocks in between
    f.view = {nullptr, nullptr, dtype, kv_heads, hd, bs};
    f.data.assign(total_blocks * f.view.ElementsPerBlock() * DTypeBytes(dtype),
                  0xAB);
    f.scales.assign(total_blocks * 2 * kv_heads,
                    123.0f);  // stale garbage on purpose
    f.view.data = f.data.data();
    f.view.scales = f.scales.data();
    std::vector<int32_t> perm(total_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng_);
    int next = 0;
    std::normal_distribution<float> dist;
    for (int len : lens) {
      std::vector<int32_t> table;
      for (int b = 0; b < (len + bs - 1) / bs; ++b)
        table.push_back(perm[next++]);
      std::vector<float> k(len * kv_heads * hd), v(len * kv_heads * hd);
      for (auto& x : k) x = dist(rng_);
      for (auto& x : v) x = dist(rng_);
      std::vector<int64_t> slots(len);
      for (int t = 0; t < len; ++t)
        slots[t] = int64_t{table[t / bs]} * bs + t % bs;
      WriteKv(k.data(), v.data(), len, slots.data(), f.view);
      f.tables.push_back(table);
      f.k.push_back(k);
      f.v.push_back(v);
    }
    return f;
  }

  std::mt19937 rng_{11};
};

struct Case {
  DType dtype;
  float tol;  // max |out - ref| allowed; outputs are O(1)
};

TEST_F(PagedAttentionTest, MatchesDenseReferenceOverShapesAndDtypes) {
  // Tolerances: fp32 is exact up to summation order; fp16 (11-bit mantissa),
  // bf16 (8-bit) and int8 (per-block-per-head absmax scale) add storage error.
  const Case cases[] = {{DType::kF32, 1e-5f},
                        {DType::kF16, 3e-3f},
                        {DType::kBF16, 2e-2f},
                        {DType::kI8, 4e-2f}};
  for (const Case& c : cases) {
    for (int group : {1, 4, 8}) {
      for (int bs : {1, 16, 32}) {
        const int kv_heads = 2, hd = 32, heads = kv_heads * group;
        const std::vector<int> lens = {
            1, 37, bs * 3};  // partial and exact last blocks
        PagedFixture f = Build(c.dtype, kv_heads, hd, bs, lens);
        // Each sequence queries its last 5 positions (a prefill chunk).
        std::vector<AttentionSeq> seqs;
        int64_t rows = 0;
        for (size_t s = 0; s < lens.size(); ++s) {
          const int nq = std::min(5, lens[s]);
          seqs.push_back({rows, nq, lens[s] - nq, f.tables[s].data()});
          rows += nq;
        }
        std::normal_distribution<float> dist;
        std::vector<float> q(rows * heads * hd), out(rows * heads * hd);
        for (auto& x : q) x = dist(rng_);
        const float scale = 1.0f / std::sqrt(float(hd));
        PagedAttention(q.data(), heads, seqs, f.view, scale, out.data());
        for (size_t s = 0; s < lens.size(); ++s) {
          for (int qi = 0; qi < seqs[s].num_q; ++qi) {
            const int pos = seqs[s].start_pos + qi;
            const int64_t row = seqs[s].q_row + qi;
            for (int h = 0; h < heads; ++h) {
              const int kvh = h / group;
              const float* qv = &q[(row * heads + h) * hd];
              std::vector<double> w(pos + 1);
              double mx = -1e300, sum = 0;
              for (int t = 0; t <= pos; ++t) {
                double dot = 0;
                for (int i = 0; i < hd; ++i)
                  dot += double(qv[i]) * f.k[s][(t * kv_heads + kvh) * hd + i];
                w[t] = dot * scale;
                mx = std::max(mx, w[t]);
              }
              for (auto& x : w) sum += (x = std::exp(x - mx));
              for (int i = 0; i < hd; ++i) {
                double ref = 0;
                for (int t = 0; t <= pos; ++t)
                  ref += w[t] / sum * f.v[s][(t * kv_heads + kvh) * hd + i];
                ASSERT_NEAR(out[(row * heads + h) * hd + i], ref, c.tol)
                    << DTypeName(c.dtype) << " group=" << group << " bs=" << bs
                    << " seq=" << s << " pos=" << pos;
              }
            }
          }
        }
      }
    }
  }
}

TEST_F(PagedAttentionTest, ChunkedPrefillEqualsOneQueryAtATimeBitForBit) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kI8}) {
    const int kv_heads = 2, group = 4, heads = 8, hd = 64, bs = 16, len = 70;
    PagedFixture f = Build(dtype, kv_heads, hd, bs, {len});
    std::normal_distribution<float> dist;
    std::vector<float> q(len * heads * hd), all(len * heads * hd),
        one(heads * hd);
    for (auto& x : q) x = dist(rng_);
    AttentionSeq seq{0, len, 0, f.tables[0].data()};
    PagedAttention(q.data(), heads, {&seq, 1}, f.view, 0.125f, all.data());
    for (int pos = 0; pos < len; ++pos) {
      AttentionSeq single{0, 1, pos, f.tables[0].data()};
      PagedAttention(q.data() + pos * heads * hd, heads, {&single, 1}, f.view,
                     0.125f, one.data());
      ASSERT_EQ(0, std::memcmp(one.data(), all.data() + pos * heads * hd,
                               one.size() * 4))
          << DTypeName(dtype) << " pos=" << pos;
    }
    (void)group;
  }
}

// A prefill chunk of many query states runs in lane form on AVX-512 (16
// states side by side); one query at a time and the portable instruction set
// run the per-unit path. All three give the same bits, for every KV dtype,
// query group, head_dim, a chunk that starts inside a block after a cached
// prefix, and a partly filled last block.
TEST_F(PagedAttentionTest, LaneFormPrefillEqualsOneQueryAtATimeBitForBit) {
  struct Geometry {
    int kv_heads, group, hd;
  };
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kI8}) {
    for (const Geometry& g :
         {Geometry{2, 4, 64}, Geometry{1, 8, 64}, Geometry{3, 1, 64},
          Geometry{2, 2, 128}, Geometry{1, 3, 64}}) {
      const int heads = g.kv_heads * g.group, hd = g.hd, bs = 16, len = 93;
      const int start = 37, nq = len - start;
      PagedFixture f = Build(dtype, g.kv_heads, hd, bs, {len});
      std::normal_distribution<float> dist;
      std::vector<float> q(int64_t{nq} * heads * hd);
      for (auto& x : q) x = dist(rng_);
      // Some scores tie at the block maximum and some are exactly zero.
      for (int i = 0; i < hd; ++i) q[i] = 0.0f;
      AttentionSeq chunk{0, nq, start, f.tables[0].data()};
      std::vector<float> best(q.size()), portable(q.size()),
          one(int64_t{heads} * hd);
      PagedAttention(q.data(), heads, {&chunk, 1}, f.view, 0.125f, best.data());
      ASSERT_TRUE(SetPagedAttentionIsa(PagedAttentionIsa::kPortable));
      PagedAttention(q.data(), heads, {&chunk, 1}, f.view, 0.125f,
                     portable.data());
      SetPagedAttentionIsa(PagedAttentionIsa::kBest);
      const std::string where = std::string(DTypeName(dtype)) +
                                " kv_heads=" + std::to_string(g.kv_heads) +
                                " group=" + std::to_string(g.group) +
                                " hd=" + std::to_string(hd);
      ASSERT_EQ(0, std::memcmp(best.data(), portable.data(),
                               best.size() * sizeof(float)))
          << where;
      for (int i = 0; i < nq; ++i) {
        AttentionSeq single{0, 1, start + i, f.tables[0].data()};
        PagedAttention(q.data() + int64_t{i} * heads * hd, heads, {&single, 1},
                       f.view, 0.125f, one.data());
        ASSERT_EQ(0,
                  std::memcmp(one.data(), best.data() + int64_t{i} * heads * hd,
                              one.size() * sizeof(float)))
            << where << " query=" << i;
      }
    }
  }
}

// A batch of many sequences runs each task over every KV head; a sequence
// alone runs a task per head. Both give the same bits, on any thread count.
TEST_F(PagedAttentionTest, ABatchEqualsEachSequenceAloneBitForBit) {
  const int saved_threads = KernelThreads();
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kI8}) {
    const int kv_heads = 4, group = 4, heads = kv_heads * group, hd = 64,
              bs = 16;
    // Decode rows (one query each) and one prefill chunk of 9 queries.
    std::vector<int> lens;
    for (int s = 0; s < 12; ++s) lens.push_back(1 + 23 * s % 97);
    lens.push_back(40);
    PagedFixture f = Build(dtype, kv_heads, hd, bs, lens);
    std::vector<AttentionSeq> seqs;
    int64_t rows = 0;
    for (size_t s = 0; s < lens.size(); ++s) {
      const int nq = s + 1 == lens.size() ? 9 : 1;
      seqs.push_back({rows, nq, lens[s] - nq, f.tables[s].data()});
      rows += nq;
    }
    std::normal_distribution<float> dist;
    std::vector<float> q(rows * heads * hd);
    for (auto& x : q) x = dist(rng_);
    for (int threads : {1, 2, 3}) {
      SetKernelThreads(threads);
      std::vector<float> batch(q.size());
      PagedAttention(q.data(), heads, seqs, f.view, 0.125f, batch.data());
      for (size_t s = 0; s < seqs.size(); ++s) {
        AttentionSeq alone = seqs[s];
        alone.q_row = 0;
        const int64_t offset = seqs[s].q_row * heads * hd;
        std::vector<float> one(int64_t{alone.num_q} * heads * hd);
        PagedAttention(q.data() + offset, heads, {&alone, 1}, f.view, 0.125f,
                       one.data());
        ASSERT_EQ(0, std::memcmp(one.data(), batch.data() + offset,
                                 one.size() * sizeof(float)))
            << DTypeName(dtype) << " threads=" << threads << " seq=" << s;
      }
    }
  }
  SetKernelThreads(saved_threads);
}

TEST_F(PagedAttentionTest, EveryInstructionSetGivesTheSameBits) {
  const PagedAttentionIsa isas[] = {PagedAttentionIsa::kAvx2,
                                    PagedAttentionIsa::kAvx512};
  for (PagedAttentionIsa isa : isas) {
    if (!SetPagedAttentionIsa(isa))
      std::printf("[ note ] this CPU lacks %s: not compared\n",
                  isa == PagedAttentionIsa::kAvx2 ? "AVX2+FMA" : "AVX-512F");
  }
  SetPagedAttentionIsa(PagedAttentionIsa::kBest);
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kI8}) {
    // head_dim 64 (whole vectors), 24 and 72 (tails), 8 (tail only); block
    // sizes 16, 1 and 20 (keys padded to 16 and 32).
    for (auto [hd, bs] : {std::pair{64, 16}, {24, 16}, {72, 1}, {8, 20}}) {
      for (int group : {1, 3, 4, 8}) {
        const int kv_heads = 2, heads = kv_heads * group;
        const std::vector<int> lens = {1, 37, 70};
        PagedFixture f = Build(dtype, kv_heads, hd, bs, lens);
        std::vector<AttentionSeq> seqs;
        int64_t rows = 0;
        for (size_t s = 0; s < lens.size(); ++s) {
          // A prefill chunk of up to 40 queries ending at the sequence's end.
          const int nq = std::min(40, lens[s]);
          seqs.push_back({rows, nq, lens[s] - nq, f.tables[s].data()});
          rows += nq;
        }
        std::normal_distribution<float> dist(0.0f, 2.0f);
        std::vector<float> q(rows * heads * hd);
        for (auto& x : q) x = dist(rng_);
        const float scale = 1.0f / std::sqrt(float(hd));
        std::vector<float> portable(q.size());
        ASSERT_TRUE(SetPagedAttentionIsa(PagedAttentionIsa::kPortable));
        PagedAttention(q.data(), heads, seqs, f.view, scale, portable.data());
        for (PagedAttentionIsa isa : isas) {
          if (!SetPagedAttentionIsa(isa)) continue;
          std::vector<float> out(q.size());
          PagedAttention(q.data(), heads, seqs, f.view, scale, out.data());
          ASSERT_EQ(0, std::memcmp(portable.data(), out.data(), out.size() * 4))
              << DTypeName(dtype) << " hd=" << hd << " bs=" << bs
              << " group=" << group << " isa=" << static_cast<int>(isa);
        }
        SetPagedAttentionIsa(PagedAttentionIsa::kBest);
      }
    }
  }
}

// Where the K and V prefetch puts its lines (L1 or L2) is a hint: the
// results are the same bits either way, decode rows and prefill chunks.
TEST_F(PagedAttentionTest, TheKvPrefetchHintNeverChangesAResult) {
  const int kv_heads = 2, group = 4, heads = kv_heads * group, hd = 64;
  const std::vector<int> lens = {1, 168, 70};
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kI8}) {
    PagedFixture f = Build(dtype, kv_heads, hd, 16, lens);
    std::vector<AttentionSeq> seqs;
    int64_t rows = 0;
    for (size_t s = 0; s < lens.size(); ++s) {
      const int nq = s == 2 ? 30 : 1;
      seqs.push_back({rows, nq, lens[s] - nq, f.tables[s].data()});
      rows += nq;
    }
    std::normal_distribution<float> dist(0.0f, 2.0f);
    std::vector<float> q(rows * heads * hd);
    for (auto& x : q) x = dist(rng_);
    std::vector<float> l1(q.size()), l2(q.size());
    SetKvPrefetchHint(KvPrefetchHint::kL1);
    PagedAttention(q.data(), heads, seqs, f.view, 0.125f, l1.data());
    SetKvPrefetchHint(KvPrefetchHint::kL2);
    PagedAttention(q.data(), heads, seqs, f.view, 0.125f, l2.data());
    SetKvPrefetchHint(KvPrefetchHint::kBest);
    EXPECT_EQ(0, std::memcmp(l1.data(), l2.data(), l1.size() * 4))
        << DTypeName(dtype);
  }
}

// Widening a stored block to fp32 gives the same bits on every instruction
// set, over every bf16 and fp16 bit pattern but NaNs (zeros, subnormals,
// infinities) and every int8 value, at lengths with and without a tail.
TEST_F(PagedAttentionTest, ReadKvBlockGivesTheSameBitsOnEveryInstructionSet) {
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kI8}) {
    const int hd = 8, bs = 1024, kv_heads = 1;
    KvLayerView view{nullptr, nullptr, dtype, kv_heads, hd, bs};
    std::vector<uint8_t> data(8 * view.ElementsPerBlock() * DTypeBytes(dtype));
    std::vector<float> scales(8 * 2 * kv_heads, 0.0371f);
    view.data = data.data();
    view.scales = scales.data();
    // Blocks 0-3 (K and V of each) hold consecutive bit patterns from 0.
    const int64_t elements = int64_t{4} * view.ElementsPerBlock();
    for (int64_t i = 0; i < elements; ++i) {
      if (dtype == DType::kI8) {
        data[i] = static_cast<uint8_t>(i % 255 + 129);  // -127..127
      } else {
        uint16_t bits = static_cast<uint16_t>(i);
        const bool nan = dtype == DType::kBF16
                             ? (bits & 0x7f80) == 0x7f80 && (bits & 0x7f)
                             : (bits & 0x7c00) == 0x7c00 && (bits & 0x3ff);
        if (nan) bits = 0x3c00;
        std::memcpy(&data[i * 2], &bits, 2);
      }
    }
    for (int count : {bs, 1, 3, 37}) {
      for (int64_t block = 0; block < 4; ++block) {
        for (int kv = 0; kv < 2; ++kv) {
          std::vector<float> want(int64_t{count} * hd), got(want.size());
          ASSERT_TRUE(SetPagedAttentionIsa(PagedAttentionIsa::kPortable));
          ReadKvBlock(view, block, kv, 0, count, want.data());
          for (PagedAttentionIsa isa :
               {PagedAttentionIsa::kAvx2, PagedAttentionIsa::kAvx512}) {
            if (!SetPagedAttentionIsa(isa)) continue;
            std::fill(got.begin(), got.end(), -1.0f);
            ReadKvBlock(view, block, kv, 0, count, got.data());
            ASSERT_EQ(0, std::memcmp(want.data(), got.data(),
                                     want.size() * sizeof(float)))
                << DTypeName(dtype) << " count=" << count << " block=" << block
                << " kv=" << kv;
          }
        }
      }
    }
  }
  SetPagedAttentionIsa(PagedAttentionIsa::kBest);
}

TEST(AttentionExpTest, WithinTwoUlpOfExpAndZeroBelowTheRange) {
  EXPECT_EQ(AttentionExpForTesting(0.0f), 1.0f);
  EXPECT_EQ(AttentionExpForTesting(-87.5f), 0.0f);
  EXPECT_EQ(AttentionExpForTesting(-std::numeric_limits<float>::infinity()),
            0.0f);
  // NaN propagates (see NanInTheCacheReachesTheOutputOfEveryQueryThatSeesIt).
  EXPECT_TRUE(std::isnan(AttentionExpForTesting(std::nanf(""))));
  float worst = 0;
  for (float x = -87.0f; x <= 0.0f; x += 0.00137f) {
    const double want = std::exp(double(x));
    const float got = AttentionExpForTesting(x);
    // In units of the float spacing at the true value (normal range only).
    if (want < 1.2e-38) continue;
    const double ulp = std::ldexp(1.0, std::ilogb(want) - 23);
    worst = std::max(worst, float(std::fabs(got - want) / ulp));
  }
  EXPECT_LE(worst, 2.0f);
  std::printf("[ note ] attention exp: worst %.2f ulp over [-87, 0]\n", worst);
}

// What a NaN does to a request: a NaN in a key (corrupt KV, a kernel fault
// upstream) must reach the output of every query that attends to it, on
// every instruction set, so that the logits hold NaN and the engine ends the
// request with INTERNAL (engine/sampling.h, kInvalidLogitsToken). An exp
// that mapped NaN to 0 would drop that key and serve wrong tokens silently.
// Queries before the poisoned position do not see it and stay finite.
TEST_F(PagedAttentionTest,
       NanInTheCacheReachesTheOutputOfEveryQueryThatSeesIt) {
  const int kv_heads = 2, heads = 4, hd = 64, bs = 16, len = 40, bad = 21;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    PagedFixture f = Build(dtype, kv_heads, hd, bs, {len});
    // Poison the key of position `bad`, KV head 0, by rewriting it.
    std::vector<float> k = f.k[0], v = f.v[0];
    k[(bad * kv_heads + 0) * hd + 5] = std::numeric_limits<float>::quiet_NaN();
    std::vector<int64_t> slots(len);
    for (int t = 0; t < len; ++t)
      slots[t] = int64_t{f.tables[0][t / bs]} * bs + t % bs;
    WriteKv(k.data(), v.data(), len, slots.data(), f.view);
    std::normal_distribution<float> dist;
    std::vector<float> q(len * heads * hd);
    for (auto& x : q) x = dist(rng_);
    AttentionSeq seq{0, len, 0, f.tables[0].data()};
    for (PagedAttentionIsa isa :
         {PagedAttentionIsa::kPortable, PagedAttentionIsa::kAvx2,
          PagedAttentionIsa::kAvx512}) {
      if (!SetPagedAttentionIsa(isa)) continue;
      std::vector<float> out(q.size());
      PagedAttention(q.data(), heads, {&seq, 1}, f.view, 0.125f, out.data());
      for (int pos = 0; pos < len; ++pos) {
        for (int h = 0; h < heads; ++h) {
          // Query heads 0 and 1 read KV head 0 (GQA group of 2).
          const bool sees = pos >= bad && h / (heads / kv_heads) == 0;
          const float* o = out.data() + (pos * heads + h) * hd;
          const bool any_nan =
              std::any_of(o, o + hd, [](float x) { return std::isnan(x); });
          ASSERT_EQ(any_nan, sees)
              << DTypeName(dtype) << " isa " << static_cast<int>(isa) << " pos "
              << pos << " head " << h;
        }
      }
    }
    SetPagedAttentionIsa(PagedAttentionIsa::kBest);
  }
}

TEST_F(PagedAttentionTest, Int8TokenByTokenWritesEqualOneChunkWrite) {
  const int kv_heads = 1, hd = 8, bs = 16, len = 16;
  PagedFixture f = Build(DType::kI8, kv_heads, hd, bs, {len});
  std::vector<uint8_t> chunk_data = f.data;
  std::vector<float> chunk_scales = f.scales;
  // Rewrite the same values one token at a time into the same block.
  std::vector<int64_t> slots(len);
  for (int t = 0; t < len; ++t) slots[t] = int64_t{f.tables[0][0]} * bs + t;
  for (int t = 0; t < len; ++t) {
    WriteKv(f.k[0].data() + t * hd, f.v[0].data() + t * hd, 1, &slots[t],
            f.view);
  }
  EXPECT_EQ(chunk_data, f.data);
  EXPECT_EQ(chunk_scales, f.scales);
}

}  // namespace
}  // namespace pdserve::kernels
