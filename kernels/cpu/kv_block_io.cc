// Writing and reading one head's rows of a KV block (paged_attention.h):
// WriteKv's conversion to the cache's dtype (int8 with a per-block scale)
// and ReadKvBlock's widening back to fp32.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/kv_elem.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/paged_attention.h"
#include "kernels/cpu/paged_attention_internal.h"
#include "kernels/cpu/task_pool.h"

namespace pdserve::kernels {
namespace {

using paged_attention_internal::ActiveAttnIsa;
using paged_attention_internal::AttnIsa;

// Converts n elements of src to t (int8: times inv, 1 / the block's scale)
// as StoreKvElem does and stores them at element `dst` of base. The lines
// written are usually in no cache (a sequence's slot in a block of the
// pool): the elements are converted into a stack buffer first and stored
// with one copy per 128 elements, so that the pending stores of many rows
// fit the store buffer at once instead of one row's scalar stores filling
// it.
void StoreRow(const float* src, int n, DType t, float inv, void* base,
              int64_t dst) {
  const int64_t elem = static_cast<int64_t>(DTypeBytes(t));
  char* out = static_cast<char*>(base) + dst * elem;
  if (t == DType::kF32) {
    std::memcpy(out, src, n * sizeof(float));
    return;
  }
  if (t == DType::kFp8E4M3) return;  // a CUDA-only KV dtype, as StoreKvElem
  constexpr int kChunk = 128;
  alignas(64) char buf[kChunk * 2];
  for (int i0 = 0; i0 < n; i0 += kChunk) {
    const int len = std::min(kChunk, n - i0);
    for (int i = 0; i < len; ++i) {
      const float x = t == DType::kI8 ? src[i0 + i] * inv : src[i0 + i];
      StoreKvElem(buf, t, i, x);
    }
    std::memcpy(out + i0 * elem, buf, len * elem);
  }
}

void WriteOne(const float* src, int64_t block, int offset, int kv, int head,
              const KvLayerView& c) {
  const int64_t base = c.Offset(block, kv, head);
  const int64_t dst = base + int64_t{offset} * c.head_dim;
  if (c.dtype != DType::kI8) {
    StoreRow(src, c.head_dim, c.dtype, 1.0f, c.data, dst);
    return;
  }
  float& scale = c.Scale(block, kv, head);
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
  StoreRow(src, c.head_dim, DType::kI8, inv, c.data, dst);
}

}  // namespace

void WriteKv(const float* k, const float* v, int64_t num_tokens,
             const int64_t* slots, const KvLayerView& cache) {
  const int64_t stride = int64_t{cache.num_kv_heads} * cache.head_dim;
  // Over heads: tokens of one (block, head) stay in order. Large writes (a
  // prefill chunk) go to the kernel helpers as well (task_pool.h); small ones
  // run on the caller alone.
  auto heads = [&](int64_t h_begin, int64_t h_end, bool) {
    for (int64_t h = h_begin; h < h_end; ++h) {
      for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t block = slots[t] / cache.block_size;
        const int offset = static_cast<int>(slots[t] % cache.block_size);
        const int64_t at = t * stride + h * cache.head_dim;
        WriteOne(k + at, block, offset, 0, static_cast<int>(h), cache);
        WriteOne(v + at, block, offset, 1, static_cast<int>(h), cache);
      }
    }
  };
  RunChunks(cache.num_kv_heads, 1,
            num_tokens * stride > 8192 ? KernelThreads() : 1, heads);
}

namespace {

// The intrinsics below draw GCC 12's false positive too (see above).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// out[i] = element i of `src` (bf16, fp16 or int8) as fp32, times `scale` for
// int8, for i < n. Every conversion is exact and int8 takes one rounding
// multiply, so every instruction set gives the same bits.
void WidenPortable(const void* src, DType t, int64_t n, float scale,
                   float* out) {
  const float s = t == DType::kI8 ? scale : 1.0f;
  for (int64_t i = 0; i < n; ++i) out[i] = LoadKvElem(src, t, i) * s;
}

PDSERVE_ATTN_AVX512 void WidenAvx512(const void* src, DType t, int64_t n,
                                     float scale, float* out) {
  int64_t i = 0;
  if (t == DType::kBF16) {
    const auto* h = static_cast<const uint16_t*>(src);
    for (; i + 16 <= n; i += 16) {
      const __m512i w = _mm512_slli_epi32(
          _mm512_cvtepu16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))),
          16);
      _mm512_storeu_ps(out + i, _mm512_castsi512_ps(w));
    }
  } else if (t == DType::kF16) {
    const auto* h = static_cast<const uint16_t*>(src);
    for (; i + 16 <= n; i += 16) {
      _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(h + i))));
    }
  } else if (t == DType::kI8) {
    const auto* b = static_cast<const int8_t*>(src);
    const __m512 s = _mm512_set1_ps(scale);
    for (; i + 16 <= n; i += 16) {
      const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i))));
      _mm512_storeu_ps(out + i, _mm512_mul_ps(f, s));
    }
  }
  WidenPortable(static_cast<const char*>(src) + i * DTypeBytes(t), t, n - i,
                scale, out + i);
}

__attribute__((target("avx2,fma,f16c"))) void WidenAvx2(const void* src,
                                                        DType t, int64_t n,
                                                        float scale,
                                                        float* out) {
  int64_t i = 0;
  if (t == DType::kBF16) {
    const auto* h = static_cast<const uint16_t*>(src);
    for (; i + 8 <= n; i += 8) {
      const __m256i w = _mm256_slli_epi32(
          _mm256_cvtepu16_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))),
          16);
      _mm256_storeu_ps(out + i, _mm256_castsi256_ps(w));
    }
  } else if (t == DType::kF16) {
    const auto* h = static_cast<const uint16_t*>(src);
    for (; i + 8 <= n; i += 8) {
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                    reinterpret_cast<const __m128i*>(h + i))));
    }
  } else if (t == DType::kI8) {
    const auto* b = static_cast<const int8_t*>(src);
    const __m256 s = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8) {
      const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + i))));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(f, s));
    }
  }
  WidenPortable(static_cast<const char*>(src) + i * DTypeBytes(t), t, n - i,
                scale, out + i);
}

void Widen(AttnIsa isa, const void* src, DType t, int64_t n, float scale,
           float* out) {
  static const bool f16c = __builtin_cpu_supports("f16c");
  switch (isa) {
    case AttnIsa::kAvx512:
      return WidenAvx512(src, t, n, scale, out);
    case AttnIsa::kAvx2:
      if (f16c) return WidenAvx2(src, t, n, scale, out);
      break;
    case AttnIsa::kPortable:
      break;
  }
  WidenPortable(src, t, n, scale, out);
}

#pragma GCC diagnostic pop

}  // namespace

void ReadKvBlock(const KvLayerView& cache, int64_t block, int kv, int head,
                 int count, float* out) {
  const int64_t base = cache.Offset(block, kv, head);
  const int64_t n = int64_t{count} * cache.head_dim;
  if (cache.dtype == DType::kF32) {
    std::copy_n(static_cast<const float*>(cache.data) + base, n, out);
    return;
  }
  const float scale =
      cache.dtype == DType::kI8 ? cache.Scale(block, kv, head) : 1.0f;
  Widen(ActiveAttnIsa(),
        static_cast<const char*>(cache.data) +
            base * static_cast<int64_t>(DTypeBytes(cache.dtype)),
        cache.dtype, n, scale, out);
}

// Brings the K and V of the units a task computes next into L1, a share at
// a time between the steps of the current units: the hardware prefetchers
// do not run far enough ahead of the arithmetic for it to overlap the

}  // namespace pdserve::kernels
