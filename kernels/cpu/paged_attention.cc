#include "kernels/cpu/paged_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/matmul.h"

namespace pdserve::kernels {
namespace {

constexpr int kQueryChunk = 32;  // queries per attention task

inline float LoadElem(const void* base, DType t, int64_t idx) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(base)[idx];
    case DType::kF16:
      return F16ToFloat(static_cast<const uint16_t*>(base)[idx]);
    case DType::kBF16:
      return Bf16ToFloat(static_cast<const uint16_t*>(base)[idx]);
    case DType::kI8:
      return static_cast<float>(static_cast<const int8_t*>(base)[idx]);
  }
  return 0;
}

inline void StoreElem(void* base, DType t, int64_t idx, float v) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(base)[idx] = v;
      break;
    case DType::kF16:
      static_cast<uint16_t*>(base)[idx] = FloatToF16(v);
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(base)[idx] = FloatToBf16(v);
      break;
    case DType::kI8: {
      const float r = std::nearbyint(v);
      static_cast<int8_t*>(base)[idx] =
          static_cast<int8_t>(std::clamp(r, -127.0f, 127.0f));
      break;
    }
  }
}

void WriteOne(const float* src, int64_t block, int offset, int kv, int head,
              const KvLayerView& c) {
  const int64_t base = c.Offset(block, kv, head);
  const int64_t dst = base + int64_t{offset} * c.head_dim;
  if (c.dtype != DType::kI8) {
    for (int d = 0; d < c.head_dim; ++d)
      StoreElem(c.data, c.dtype, dst + d, src[d]);
    return;
  }
  float& scale = c.scales[(block * 2 + kv) * c.num_kv_heads + head];
  if (offset == 0) scale = 0;
  float amax = 0;
  for (int d = 0; d < c.head_dim; ++d) amax = std::max(amax, std::fabs(src[d]));
  const float needed = amax / 127.0f;
  if (needed > scale) {
    // Requantise the entries already in this block to the larger scale.
    int8_t* q = static_cast<int8_t*>(c.data);
    if (scale > 0) {
      const float ratio = scale / needed;
      for (int64_t i = base; i < dst; ++i) {
        q[i] = static_cast<int8_t>(
            std::clamp(std::nearbyint(q[i] * ratio), -127.0f, 127.0f));
      }
    }
    scale = needed;
  }
  const float inv = scale > 0 ? 1.0f / scale : 0.0f;
  for (int d = 0; d < c.head_dim; ++d)
    StoreElem(c.data, DType::kI8, dst + d, src[d] * inv);
}

// One query state's online-softmax step over a block's `valid` scores:
// scaled by the block's running max, the state's acc[d] rescaled, then
// acc += p_t * v_t for t in order. Every element sees the same operations in
// the same order in both versions (separate multiply and add: this file is
// built in ISO C++ mode, so nothing is contracted into an FMA), so the AVX-512
// version and the portable one agree bit for bit; p_t and the sum l do not
// depend on acc, so computing them first changes no bit either.
inline void ScoresToWeights(const float* scores, int valid, float* m, float* l,
                            float* p, float* correction) {
  float block_max = -std::numeric_limits<float>::infinity();
  for (int t = 0; t < valid; ++t) block_max = std::max(block_max, scores[t]);
  const float new_m = std::max(*m, block_max);
  *correction = std::exp(*m - new_m);
  *l *= *correction;
  for (int t = 0; t < valid; ++t) {
    p[t] = std::exp(scores[t] - new_m);
    *l += p[t];
  }
  *m = new_m;
}

void AccumulatePortable(const float* p, int valid, float correction,
                        const float* v, int d, float* a) {
  for (int i = 0; i < d; ++i) a[i] *= correction;
  for (int t = 0; t < valid; ++t) {
    const float* vv = v + int64_t{t} * d;
    for (int i = 0; i < d; ++i) a[i] += p[t] * vv[i];
  }
}

__attribute__((target("avx512f"))) void AccumulateAvx512(const float* p,
                                                         int valid,
                                                         float correction,
                                                         const float* v, int d,
                                                         float* a) {
  const __m512 c = _mm512_set1_ps(correction);
  int i = 0;
  for (; i + 16 <= d; i += 16) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a + i), c);
    for (int t = 0; t < valid; ++t) {
      acc = _mm512_add_ps(
          acc, _mm512_mul_ps(_mm512_set1_ps(p[t]),
                             _mm512_loadu_ps(v + int64_t{t} * d + i)));
    }
    _mm512_storeu_ps(a + i, acc);
  }
  for (; i < d; ++i) {
    float x = a[i] * correction;
    for (int t = 0; t < valid; ++t) x += p[t] * v[int64_t{t} * d + i];
    a[i] = x;
  }
}

bool& Avx512Enabled() {
  static bool enabled = __builtin_cpu_supports("avx512f");
  return enabled;
}

}  // namespace

void SetPagedAttentionAvx512(bool enabled) {
  Avx512Enabled() = enabled && __builtin_cpu_supports("avx512f");
}

void WriteKv(const float* k, const float* v, int64_t num_tokens,
             const int64_t* slots, const KvLayerView& cache) {
  const int64_t stride = int64_t{cache.num_kv_heads} * cache.head_dim;
  // Parallel over heads: tokens of one (block, head) stay in order.
#pragma omp parallel for schedule(static) \
    num_threads(KernelThreads()) if (num_tokens * stride > 8192)
  for (int h = 0; h < cache.num_kv_heads; ++h) {
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t block = slots[t] / cache.block_size;
      const int offset = static_cast<int>(slots[t] % cache.block_size);
      WriteOne(k + t * stride + int64_t{h} * cache.head_dim, block, offset, 0,
               h, cache);
      WriteOne(v + t * stride + int64_t{h} * cache.head_dim, block, offset, 1,
               h, cache);
    }
  }
}

void ReadKvBlock(const KvLayerView& cache, int64_t block, int kv, int head,
                 int count, float* out) {
  const int64_t base = cache.Offset(block, kv, head);
  const int64_t n = int64_t{count} * cache.head_dim;
  if (cache.dtype == DType::kF32) {
    std::copy_n(static_cast<const float*>(cache.data) + base, n, out);
    return;
  }
  const float scale =
      cache.dtype == DType::kI8
          ? cache.scales[(block * 2 + kv) * cache.num_kv_heads + head]
          : 1.0f;
  for (int64_t i = 0; i < n; ++i)
    out[i] = LoadElem(cache.data, cache.dtype, base + i) * scale;
}

void PagedAttention(const float* q, int32_t num_heads,
                    std::span<const AttentionSeq> seqs,
                    const KvLayerView& cache, float scale, float* out) {
  const int kv_heads = cache.num_kv_heads;
  const int group = num_heads / kv_heads;
  const int d = cache.head_dim;
  const int bs = cache.block_size;
  struct Task {
    int seq;
    int kv_head;
    int q_begin;
    int q_end;
  };
  std::vector<Task> tasks;
  for (int s = 0; s < static_cast<int>(seqs.size()); ++s) {
    for (int h = 0; h < kv_heads; ++h) {
      for (int q0 = 0; q0 < seqs[s].num_q; q0 += kQueryChunk) {
        tasks.push_back({s, h, q0, std::min(seqs[s].num_q, q0 + kQueryChunk)});
      }
    }
  }
  const int64_t row_stride = int64_t{num_heads} * d;
#pragma omp parallel num_threads( \
    std::min <int>(KernelThreads(), static_cast <int>(tasks.size())))
  {
    std::vector<float> kbuf(int64_t{bs} * d), vbuf(int64_t{bs} * d);
    std::vector<float> acc, m, l;
    // A block's scores for the query group, [group][bs], then its weights.
    std::vector<float> scores(int64_t{group} * bs), weights(bs);
    const bool avx512 = Avx512Enabled();
#pragma omp for schedule(dynamic, 1)
    for (size_t ti = 0; ti < tasks.size(); ++ti) {
      const Task& task = tasks[ti];
      const AttentionSeq& seq = seqs[task.seq];
      const int nq = task.q_end - task.q_begin;
      const int states = nq * group;
      acc.assign(int64_t{states} * d, 0.0f);
      m.assign(states, -std::numeric_limits<float>::infinity());
      l.assign(states, 0.0f);
      const int last_pos = seq.start_pos + task.q_end - 1;
      const int num_blocks = last_pos / bs + 1;
      for (int b = 0; b < num_blocks; ++b) {
        const int64_t block = seq.block_table[b];
        const int block_start = b * bs;
        const int count = std::min(bs, last_pos - block_start + 1);
        ReadKvBlock(cache, block, 0, task.kv_head, count, kbuf.data());
        ReadKvBlock(cache, block, 1, task.kv_head, count, vbuf.data());
        for (int qi = 0; qi < nq; ++qi) {
          const int pos = seq.start_pos + task.q_begin + qi;
          const int valid = std::min(count, pos - block_start + 1);
          if (valid <= 0) continue;
          const int64_t row = seq.q_row + task.q_begin + qi;
          // The group's heads are consecutive in q: one tile of dots, each
          // DotFixedOrder's bits, then scaled.
          DotsFixedOrder(
              q + row * row_stride + int64_t{task.kv_head} * group * d, group,
              d, kbuf.data(), valid, d, d, scores.data(), bs);
          for (int g = 0; g < group; ++g) {
            const int st = qi * group + g;
            float* s = scores.data() + int64_t{g} * bs;
            for (int t = 0; t < valid; ++t) s[t] *= scale;
            float correction;
            ScoresToWeights(s, valid, &m[st], &l[st], weights.data(),
                            &correction);
            float* a = acc.data() + int64_t{st} * d;
            if (avx512) {
              AccumulateAvx512(weights.data(), valid, correction, vbuf.data(),
                               d, a);
            } else {
              AccumulatePortable(weights.data(), valid, correction, vbuf.data(),
                                 d, a);
            }
          }
        }
      }
      for (int qi = 0; qi < nq; ++qi) {
        const int64_t row = seq.q_row + task.q_begin + qi;
        for (int g = 0; g < group; ++g) {
          const int head = task.kv_head * group + g;
          const int st = qi * group + g;
          const float inv = l[st] > 0 ? 1.0f / l[st] : 0.0f;
          float* o = out + row * row_stride + int64_t{head} * d;
          for (int i = 0; i < d; ++i) o[i] = acc[int64_t{st} * d + i] * inv;
        }
      }
    }
  }
}

}  // namespace pdserve::kernels
