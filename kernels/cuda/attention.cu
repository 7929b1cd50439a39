#include <mma.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/kv_access.cuh"

namespace pdserve::kernels::cuda {
namespace {

using detail::Fp8E4M3;
using detail::kVecElems;
using detail::KvTraits;

// ---------------------------------------------------------------------------
// Decode: split-K paged attention.

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kPartition = 256;   // tokens per partition
constexpr int kDecodeUnroll = 4;  // independent 16-byte loads per thread

// Thread mapping, for storage type T and head size HD:
//  - a token's K (or V) row of HD elements is read by kThreadsPerToken
//    consecutive lanes, each loading kVecsPerThread 16-byte vectors;
//  - the block's kTokenGroups groups of lanes take tokens round-robin.
template <typename T, int HD>
struct DecodeShape {
  static constexpr int kVec = kVecElems<T>;
  static_assert(HD % kVec == 0, "head_dim must be a multiple of the vector");
  static constexpr int kThreadsPerToken = (HD / kVec) < 32 ? (HD / kVec) : 32;
  static constexpr int kVecsPerThread = HD / (kThreadsPerToken * kVec);
  static constexpr int kElems = kVecsPerThread * kVec;  // dims per thread
  static constexpr int kTokenGroups = kDecodeThreads / kThreadsPerToken;
  // Element offset of this lane's j-th vector within a row.
  __device__ static int Dim(int lane_in_token, int j) {
    return (j * kThreadsPerToken + lane_in_token) * kVec;
  }
};

// grid: (kv_heads * group / GROUP_TILE, num_queries, num_partitions)
// block: kDecodeThreads. Each block serves GROUP_TILE query heads of one KV
// head, so each K/V row is read from memory once for all of them.
template <typename T, int HD, int GROUP_TILE>
__global__ void __launch_bounds__(kDecodeThreads) PagedDecodeAttentionKernel(
    const float* __restrict__ q,  // [num_queries, num_heads, HD]
    PagedKvView cache,
    const int32_t* __restrict__ block_tables,  // [num_seqs, max_blocks]
    int32_t max_blocks_per_seq,
    const int32_t* __restrict__ context_lens,  // [num_queries]
    const int32_t* __restrict__ query_seq,     // [num_queries] or null
    int32_t num_heads, float scale,
    float* __restrict__ out,            // [num_queries, num_heads, HD]
    float* __restrict__ partial_out,    // [num_queries, num_heads, parts, HD]
    float* __restrict__ partial_max,    // [num_queries, num_heads, parts]
    float* __restrict__ partial_sum) {  // [num_queries, num_heads, parts]
  using S = DecodeShape<T, HD>;
  constexpr int kTpt = S::kThreadsPerToken;
  constexpr int kGroups = S::kTokenGroups;
  constexpr int kElems = S::kElems;
  constexpr int kNv = S::kVecsPerThread;

  __shared__ float logits[GROUP_TILE][kPartition];
  __shared__ float reduce[kDecodeWarps][GROUP_TILE][HD];
  __shared__ float stat_max[GROUP_TILE];
  __shared__ float stat_sum[GROUP_TILE];

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int lane_in_token = tid % kTpt;
  const int token_group = tid / kTpt;

  const int group = num_heads / cache.num_kv_heads;
  const int chunks = group / GROUP_TILE;
  const int kv_head = blockIdx.x / chunks;
  const int head0 = kv_head * group + (blockIdx.x % chunks) * GROUP_TILE;
  const int query = blockIdx.y;
  const int part = blockIdx.z;
  const int num_parts = gridDim.z;
  const int seq = query_seq != nullptr ? query_seq[query] : query;
  const int ctx = context_lens[query];
  const int start = part * kPartition;
  // A context beyond the launch's max_context_len (a caller bug) would need
  // partitions this grid lacks, and the reduce step would read partials
  // past its own: the row's output is NaN instead, which the engine turns
  // into an INTERNAL error for that request (engine/sampling.h).
  if (ctx < 0 || ctx > num_parts * kPartition) {
    if (part == 0) {
      for (int i = tid; i < GROUP_TILE * HD; i += kDecodeThreads) {
        out[(static_cast<int64_t>(query) * num_heads + head0 + i / HD) * HD +
            i % HD] = __int_as_float(0x7fc00000);
      }
    }
    return;
  }
  if (start >= ctx) {
    if (ctx == 0 && num_parts == 1) {  // no context: the CPU writes zeros
      for (int i = tid; i < GROUP_TILE * HD; i += kDecodeThreads) {
        out[(static_cast<int64_t>(query) * num_heads + head0 + i / HD) * HD +
            i % HD] = 0.0f;
      }
    }
    return;
  }
  const int n = min(kPartition, ctx - start);
  const int32_t* table =
      block_tables + static_cast<int64_t>(seq) * max_blocks_per_seq;
  const T* data = static_cast<const T*>(cache.data);
  const int bs = cache.block_size;

  // This thread's slice of each query head.
  float q_reg[GROUP_TILE][kElems];
#pragma unroll
  for (int g = 0; g < GROUP_TILE; ++g) {
    const float* qh =
        q + (static_cast<int64_t>(query) * num_heads + head0 + g) * HD;
#pragma unroll
    for (int j = 0; j < kNv; ++j) {
#pragma unroll
      for (int e = 0; e < S::kVec; ++e)
        q_reg[g][j * S::kVec + e] = qh[S::Dim(lane_in_token, j) + e];
    }
  }

  // Pass 1: scores. The loop bounds are uniform over the block, so every
  // lane reaches the shuffles.
  for (int base = 0; base < n; base += kGroups * kDecodeUnroll) {
    uint4 raw[kDecodeUnroll][kNv];
    float kscale[kDecodeUnroll];
#pragma unroll
    for (int u = 0; u < kDecodeUnroll; ++u) {
      const int t = base + u * kGroups + token_group;
      kscale[u] = 1.0f;
      if (t < n) {
        const int pos = start + t;
        const int64_t block = __ldg(table + pos / bs);
        const T* row = data + detail::KvOffset(cache, block, 0, kv_head) +
                       static_cast<int64_t>(pos % bs) * HD;
#pragma unroll
        for (int j = 0; j < kNv; ++j)
          raw[u][j] = detail::Load16(row + S::Dim(lane_in_token, j));
        if constexpr (KvTraits<T>::kScaled) {
          kscale[u] = __ldg(cache.scales +
                            detail::ScaleIndex(cache, block, 0, kv_head));
        }
      } else {
#pragma unroll
        for (int j = 0; j < kNv; ++j) raw[u][j] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kDecodeUnroll; ++u) {
      const int t = base + u * kGroups + token_group;
      float k[kElems];
#pragma unroll
      for (int j = 0; j < kNv; ++j)
        detail::Unpack16<T>(raw[u][j], k + j * S::kVec);
#pragma unroll
      for (int g = 0; g < GROUP_TILE; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < kElems; ++e) dot += q_reg[g][e] * k[e];
#pragma unroll
        for (int mask = kTpt / 2; mask > 0; mask >>= 1)
          dot += __shfl_xor_sync(0xffffffffu, dot, mask);
        if (lane_in_token == 0 && t < n) logits[g][t] = dot * kscale[u] * scale;
      }
    }
  }
  __syncthreads();

  // Softmax within the partition: one warp per query head.
  for (int g = warp; g < GROUP_TILE; g += kDecodeWarps) {
    float m = -INFINITY;
    for (int t = lane; t < n; t += 32) m = fmaxf(m, logits[g][t]);
    m = detail::WarpMax(m);
    float sum = 0.0f;
    for (int t = lane; t < n; t += 32) {
      const float p = expf(logits[g][t] - m);
      logits[g][t] = p;
      sum += p;
    }
    sum = detail::WarpSum(sum);
    if (lane == 0) {
      stat_max[g] = m;
      stat_sum[g] = sum;
    }
  }
  __syncthreads();

  // Pass 2: probability-weighted V.
  float acc[GROUP_TILE][kElems];
#pragma unroll
  for (int g = 0; g < GROUP_TILE; ++g) {
#pragma unroll
    for (int e = 0; e < kElems; ++e) acc[g][e] = 0.0f;
  }
  for (int base = 0; base < n; base += kGroups * kDecodeUnroll) {
    uint4 raw[kDecodeUnroll][kNv];
    float vscale[kDecodeUnroll];
#pragma unroll
    for (int u = 0; u < kDecodeUnroll; ++u) {
      const int t = base + u * kGroups + token_group;
      vscale[u] = 1.0f;
      if (t < n) {
        const int pos = start + t;
        const int64_t block = __ldg(table + pos / bs);
        const T* row = data + detail::KvOffset(cache, block, 1, kv_head) +
                       static_cast<int64_t>(pos % bs) * HD;
#pragma unroll
        for (int j = 0; j < kNv; ++j)
          raw[u][j] = detail::Load16(row + S::Dim(lane_in_token, j));
        if constexpr (KvTraits<T>::kScaled) {
          vscale[u] = __ldg(cache.scales +
                            detail::ScaleIndex(cache, block, 1, kv_head));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kDecodeUnroll; ++u) {
      const int t = base + u * kGroups + token_group;
      if (t < n) {
        float v[kElems];
#pragma unroll
        for (int j = 0; j < kNv; ++j)
          detail::Unpack16<T>(raw[u][j], v + j * S::kVec);
#pragma unroll
        for (int g = 0; g < GROUP_TILE; ++g) {
          const float p = logits[g][t] * vscale[u];
#pragma unroll
          for (int e = 0; e < kElems; ++e) acc[g][e] += p * v[e];
        }
      }
    }
  }
  // Sum the token groups: first the ones sharing a warp (lanes kTpt apart
  // hold the same dims), then across warps through shared memory.
#pragma unroll
  for (int g = 0; g < GROUP_TILE; ++g) {
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
#pragma unroll
      for (int mask = kTpt; mask < 32; mask <<= 1)
        acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], mask);
    }
  }
  if (lane < kTpt) {
#pragma unroll
    for (int g = 0; g < GROUP_TILE; ++g) {
#pragma unroll
      for (int j = 0; j < kNv; ++j) {
#pragma unroll
        for (int e = 0; e < S::kVec; ++e)
          reduce[warp][g][S::Dim(lane_in_token, j) + e] =
              acc[g][j * S::kVec + e];
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < GROUP_TILE * HD; i += kDecodeThreads) {
    const int g = i / HD;
    const int d = i % HD;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) sum += reduce[w][g][d];
    const float value = sum / stat_sum[g];  // stat_sum >= 1: the max's exp
    const int64_t qh = static_cast<int64_t>(query) * num_heads + head0 + g;
    if (num_parts == 1) {
      out[qh * HD + d] = value;
    } else {
      partial_out[(qh * num_parts + part) * HD + d] = value;
    }
  }
  if (num_parts > 1 && tid < GROUP_TILE) {
    const int64_t qh = static_cast<int64_t>(query) * num_heads + head0 + tid;
    partial_max[qh * num_parts + part] = stat_max[tid];
    partial_sum[qh * num_parts + part] = stat_sum[tid];
  }
}

// grid: (num_heads, num_queries); block: 128. Merges the partitions of one
// (query, head): weights sum_p * exp(max_p - max) over the used partitions.
__global__ void __launch_bounds__(128) PagedDecodeReduceKernel(
    const float* __restrict__ partial_out,  // [num_queries, heads, parts, hd]
    const float* __restrict__ partial_max,  // [num_queries, heads, parts]
    const float* __restrict__ partial_sum,  // [num_queries, heads, parts]
    const int32_t* __restrict__ context_lens,  // [num_queries]
    int32_t num_parts, int32_t head_dim,
    float* __restrict__ out) {        // [num_queries, heads, hd]
  extern __shared__ float weights[];  // [num_parts]
  __shared__ float total;
  const int head = blockIdx.x;
  const int query = blockIdx.y;
  const int64_t qh = static_cast<int64_t>(query) * gridDim.x + head;
  const int ctx = context_lens[query];
  const int used = (ctx + kPartition - 1) / kPartition;
  if (ctx < 0 || used > num_parts) {  // see PagedDecodeAttentionKernel
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x)
      out[qh * head_dim + d] = __int_as_float(0x7fc00000);
    return;
  }
  const float* maxes = partial_max + qh * num_parts;
  const float* sums = partial_sum + qh * num_parts;
  if (threadIdx.x == 0) {
    float m = -INFINITY;
    for (int p = 0; p < used; ++p) m = fmaxf(m, maxes[p]);
    float t = 0.0f;
    for (int p = 0; p < used; ++p) {
      weights[p] = sums[p] * expf(maxes[p] - m);
      t += weights[p];
    }
    total = t;
  }
  __syncthreads();
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.0f;
    for (int p = 0; p < used; ++p)
      o += weights[p] * partial_out[(qh * num_parts + p) * head_dim + d];
    out[qh * head_dim + d] = o * inv;
  }
}

struct DecodeArgs {
  const float* q;
  PagedKvView cache;
  const int32_t* block_tables;
  int32_t max_blocks_per_seq;
  const int32_t* context_lens;
  const int32_t* query_seq;
  int32_t num_queries;
  int32_t num_heads;
  float scale;
  float* out;
  float* partial_out;
  float* partial_max;
  float* partial_sum;
  int32_t num_parts;
};

template <typename T, int HD, int GROUP_TILE>
void LaunchDecode(const DecodeArgs& a, cudaStream_t stream) {
  const int group = a.num_heads / a.cache.num_kv_heads;
  const dim3 grid(a.cache.num_kv_heads * (group / GROUP_TILE), a.num_queries,
                  a.num_parts);
  PagedDecodeAttentionKernel<T, HD, GROUP_TILE>
      <<<grid, kDecodeThreads, 0, stream>>>(
          a.q, a.cache, a.block_tables, a.max_blocks_per_seq, a.context_lens,
          a.query_seq, a.num_heads, a.scale, a.out, a.partial_out,
          a.partial_max, a.partial_sum);
}

// The largest group tile (query heads per block) that divides the group.
// One-byte types hold 16 dims per thread, so their tile stops at 4 to keep
// registers in check; a group of 8 then reads each row twice (the second
// read mostly from L2).
template <typename T, int HD>
void LaunchDecodeForGroup(const DecodeArgs& a, cudaStream_t stream) {
  const int group = a.num_heads / a.cache.num_kv_heads;
  constexpr bool kWide = sizeof(T) >= 2;
  if (kWide && group % 8 == 0) {
    LaunchDecode<T, HD, kWide ? 8 : 4>(a, stream);
  } else if (group % 4 == 0) {
    LaunchDecode<T, HD, 4>(a, stream);
  } else if (group % 2 == 0) {
    LaunchDecode<T, HD, 2>(a, stream);
  } else {
    LaunchDecode<T, HD, 1>(a, stream);
  }
}

template <typename T>
bool LaunchDecodeForHeadDim(const DecodeArgs& a, cudaStream_t stream) {
  switch (a.cache.head_dim) {
    case 16:
      LaunchDecodeForGroup<T, 16>(a, stream);
      return true;
    case 32:
      LaunchDecodeForGroup<T, 32>(a, stream);
      return true;
    case 64:
      LaunchDecodeForGroup<T, 64>(a, stream);
      return true;
    case 128:
      LaunchDecodeForGroup<T, 128>(a, stream);
      return true;
  }
  return false;
}

absl::Status CheckCache(const PagedKvView& cache, int32_t num_heads) {
  if (cache.data == nullptr || cache.num_kv_heads <= 0 ||
      cache.block_size <= 0 || num_heads <= 0 ||
      num_heads % cache.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "paged attention: bad geometry (num_heads=", num_heads,
        " kv_heads=", cache.num_kv_heads, " block_size=", cache.block_size,
        "; heads must be a multiple of kv_heads)"));
  }
  if (cache.head_dim != 16 && cache.head_dim != 32 && cache.head_dim != 64 &&
      cache.head_dim != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged attention: head_dim ", cache.head_dim,
                     " is not supported (16, 32, 64 or 128)"));
  }
  if (KvDtypeHasScales(cache.dtype) && cache.scales == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "paged attention: ", KvDtypeName(cache.dtype), " KV needs scales"));
  }
  return absl::OkStatus();
}

int32_t NumPartitions(int32_t max_context_len) {
  return std::max<int32_t>(1, (max_context_len + kPartition - 1) / kPartition);
}

// ---------------------------------------------------------------------------
// Prefill: tiled flash attention on the tensor cores.

namespace wmma = nvcuda::wmma;

constexpr int kPrefillThreads = 128;  // 4 warps, 16 query rows each
constexpr int kBlockQ = 64;
constexpr int kBlockK = 64;

// Shared-memory plan of one prefill block (byte offsets, 128-byte aligned).
template <int HD>
struct PrefillSmem {
  static constexpr int kLdH = HD + 8;       // fp16 Q/K/V rows (elements)
  static constexpr int kLdP = kBlockK + 8;  // fp16 P rows
  static constexpr int kWideS = HD > kBlockK ? HD : kBlockK;
  static constexpr int kLdS = kWideS + 4;  // fp32 S / PV rows
  static constexpr int kLdO = HD + 4;      // fp32 O rows
  static constexpr int Align(int b) { return (b + 127) / 128 * 128; }
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + Align(kBlockQ * kLdH * 2);
  static constexpr int kV = kK + Align(kBlockK * kLdH * 2);
  static constexpr int kS = kV + Align(kBlockK * kLdH * 2);
  static constexpr int kP = kS + Align(kBlockQ * kLdS * 4);
  static constexpr int kO = kP + Align(kBlockQ * kLdP * 2);
  static constexpr int kBytes = kO + Align(kBlockQ * kLdO * 4);
};

// Loads rows [kv0, kv0 + kBlockK) of K and V for one KV head into shared
// memory as fp16 (dequantised); rows at or past kv_end become zeros so that
// masked probabilities (0) never meet garbage.
template <typename T, int HD>
__device__ void LoadKvTile(const PagedKvView& cache,
                           const int32_t* __restrict__ table, int kv_head,
                           int kv0, int kv_end, __half* ks, __half* vs) {
  constexpr int kVec = kVecElems<T>;
  constexpr int kVecsPerRow = HD / kVec;
  constexpr int kLdH = PrefillSmem<HD>::kLdH;
  const T* data = static_cast<const T*>(cache.data);
  const int bs = cache.block_size;
  for (int i = threadIdx.x; i < 2 * kBlockK * kVecsPerRow;
       i += kPrefillThreads) {
    const int which = i / (kBlockK * kVecsPerRow);  // 0: K, 1: V
    const int rem = i % (kBlockK * kVecsPerRow);
    const int r = rem / kVecsPerRow;
    const int v = rem % kVecsPerRow;
    const int pos = kv0 + r;
    __half* dst = (which == 0 ? ks : vs) + r * kLdH + v * kVec;
    if (pos < kv_end) {
      const int64_t block = __ldg(table + pos / bs);
      const T* src = data + detail::KvOffset(cache, block, which, kv_head) +
                     static_cast<int64_t>(pos % bs) * HD + v * kVec;
      float f[kVec];
      detail::Unpack16<T>(detail::Load16(src), f);
      float s = 1.0f;
      if constexpr (KvTraits<T>::kScaled) {
        s = __ldg(cache.scales +
                  detail::ScaleIndex(cache, block, which, kv_head));
      }
#pragma unroll
      for (int e = 0; e < kVec; ++e) dst[e] = detail::ToHalfSat(f[e] * s);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) dst[e] = __float2half_rn(0.0f);
    }
  }
}

// grid: (ceil(max_num_q / kBlockQ), num_heads, num_seqs); block: 128.
// Warp w owns query rows [16w, 16w + 16) of the tile; lanes 2r and 2r + 1
// own row r's softmax state, each for half of the columns.
template <typename T, int HD>
__global__ void __launch_bounds__(kPrefillThreads) PagedPrefillAttentionKernel(
    const float* __restrict__ q,  // [rows, num_heads, HD]
    PagedKvView cache,
    const PrefillSeq* __restrict__ seqs,       // [num_seqs]
    const int32_t* __restrict__ block_tables,  // [num_seqs, max_blocks]
    int32_t max_blocks_per_seq, int32_t num_heads, float scale,
    float* __restrict__ out) {  // [rows, num_heads, HD]
  using L = PrefillSmem<HD>;
  const PrefillSeq s = seqs[blockIdx.z];
  const int head = blockIdx.y;
  const int q0 = blockIdx.x * kBlockQ;
  if (q0 >= s.num_q) return;
  // Positions past the sequence's block-table row (a caller bug) would read
  // another sequence's table: NaN rows instead, as in the decode kernel.
  if (s.start_pos < 0 || int64_t{s.start_pos} + s.num_q >
                             int64_t{max_blocks_per_seq} * cache.block_size) {
    for (int i = threadIdx.x; i < kBlockQ * HD; i += kPrefillThreads) {
      const int qi = q0 + i / HD;
      if (qi < s.num_q) {
        out[(static_cast<int64_t>(s.q_row + qi) * num_heads + head) * HD +
            i % HD] = __int_as_float(0x7fc00000);
      }
    }
    return;
  }
  const int kv_head = head / (num_heads / cache.num_kv_heads);
  const int32_t* table =
      block_tables + static_cast<int64_t>(blockIdx.z) * max_blocks_per_seq;

  extern __shared__ __align__(128) unsigned char smem[];
  __half* qs = reinterpret_cast<__half*>(smem + L::kQ);
  __half* ks = reinterpret_cast<__half*>(smem + L::kK);
  __half* vs = reinterpret_cast<__half*>(smem + L::kV);
  float* ss = reinterpret_cast<float*>(smem + L::kS);
  __half* ps = reinterpret_cast<__half*>(smem + L::kP);
  float* os = reinterpret_cast<float*>(smem + L::kO);

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  for (int i = tid; i < kBlockQ * HD; i += kPrefillThreads) {
    const int r = i / HD;
    const int d = i % HD;
    const int qi = q0 + r;
    const float v =
        qi < s.num_q
            ? q[(static_cast<int64_t>(s.q_row + qi) * num_heads + head) * HD +
                d]
            : 0.0f;
    qs[r * L::kLdH + d] = detail::ToHalfSat(v);
  }
  for (int i = tid; i < kBlockQ * L::kLdO; i += kPrefillThreads) os[i] = 0.0f;

  const int row = warp * 16 + lane / 2;  // this lane's query row in the tile
  const int qi = q0 + row;
  const bool row_valid = qi < s.num_q;
  const int qpos = s.start_pos + qi;
  const int col0 = (lane & 1) * (kBlockK / 2);
  const int dcol0 = (lane & 1) * (HD / 2);
  float m = -INFINITY;  // running max of this row's scaled scores
  float l = 0.0f;       // running sum of exp(score - m)

  const int last_q = min(s.num_q, q0 + kBlockQ) - 1;
  const int kv_end = s.start_pos + last_q + 1;  // keys this tile can see
  const int num_tiles = (kv_end + kBlockK - 1) / kBlockK;
  __syncthreads();

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int kv0 = tile * kBlockK;
    LoadKvTile<T, HD>(cache, table, kv_head, kv0, kv_end, ks, vs);
    __syncthreads();

    // S = Q K^T for this warp's 16 rows.
    for (int n = 0; n < kBlockK / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
        wmma::load_matrix_sync(a, qs + warp * 16 * L::kLdH + kk * 16, L::kLdH);
        // K stored [key][dim] is K^T in column-major order.
        wmma::load_matrix_sync(b, ks + n * 16 * L::kLdH + kk * 16, L::kLdH);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(ss + warp * 16 * L::kLdS + n * 16, acc, L::kLdS,
                              wmma::mem_row_major);
    }
    __syncwarp();

    // Online softmax over this tile's columns, causal mask by position.
    float tile_max = -INFINITY;
    for (int c = col0; c < col0 + kBlockK / 2; ++c) {
      const bool valid = row_valid && kv0 + c <= qpos;
      if (valid) tile_max = fmaxf(tile_max, ss[row * L::kLdS + c] * scale);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    const float m_new = fmaxf(m, tile_max);
    const float alpha = m_new == -INFINITY ? 1.0f : expf(m - m_new);
    float psum = 0.0f;
    for (int c = col0; c < col0 + kBlockK / 2; ++c) {
      const bool valid = row_valid && kv0 + c <= qpos;
      const float p =
          valid ? expf(ss[row * L::kLdS + c] * scale - m_new) : 0.0f;
      ps[row * L::kLdP + c] = __float2half_rn(p);
      psum += p;
    }
    psum += __shfl_xor_sync(0xffffffffu, psum, 1);
    l = l * alpha + psum;
    m = m_new;
    __syncwarp();

    // PV for this warp's rows, into the S buffer (no longer needed).
    for (int n = 0; n < HD / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> b;
        wmma::load_matrix_sync(a, ps + warp * 16 * L::kLdP + kk * 16, L::kLdP);
        wmma::load_matrix_sync(b, vs + kk * 16 * L::kLdH + n * 16, L::kLdH);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(ss + warp * 16 * L::kLdS + n * 16, acc, L::kLdS,
                              wmma::mem_row_major);
    }
    __syncwarp();
    for (int d = dcol0; d < dcol0 + HD / 2; ++d) {
      os[row * L::kLdO + d] =
          os[row * L::kLdO + d] * alpha + ss[row * L::kLdS + d];
    }
    __syncthreads();  // K/V tiles are overwritten next
  }

  if (row_valid) {
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    float* o =
        out + (static_cast<int64_t>(s.q_row + qi) * num_heads + head) * HD;
    for (int d = dcol0; d < dcol0 + HD / 2; ++d)
      o[d] = os[row * L::kLdO + d] * inv;
  }
}

struct PrefillArgs {
  const float* q;
  PagedKvView cache;
  const PrefillSeq* seqs;
  int32_t num_seqs;
  const int32_t* block_tables;
  int32_t max_blocks_per_seq;
  int32_t num_heads;
  int32_t max_num_q;
  float scale;
  float* out;
};

template <typename T, int HD>
absl::Status LaunchPrefill(const PrefillArgs& a, cudaStream_t stream) {
  constexpr int kBytes = PrefillSmem<HD>::kBytes;
  auto kernel = PagedPrefillAttentionKernel<T, HD>;
  // Above 48 KiB a kernel must opt in; done once per instantiation.
  static const cudaError_t attr = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  PDSERVE_CUDA_RETURN_IF_ERROR(attr);
  const dim3 grid((a.max_num_q + kBlockQ - 1) / kBlockQ, a.num_heads,
                  a.num_seqs);
  kernel<<<grid, kPrefillThreads, kBytes, stream>>>(
      a.q, a.cache, a.seqs, a.block_tables, a.max_blocks_per_seq, a.num_heads,
      a.scale, a.out);
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

template <typename T>
absl::Status LaunchPrefillForHeadDim(const PrefillArgs& a,
                                     cudaStream_t stream) {
  switch (a.cache.head_dim) {
    case 16:
      return LaunchPrefill<T, 16>(a, stream);
    case 32:
      return LaunchPrefill<T, 32>(a, stream);
    case 64:
      return LaunchPrefill<T, 64>(a, stream);
    case 128:
      return LaunchPrefill<T, 128>(a, stream);
  }
  return absl::InvalidArgumentError("unsupported head_dim");
}

}  // namespace

int32_t DecodePartitionTokens() { return kPartition; }

int64_t PagedDecodeAttentionWorkspaceBytes(int32_t num_queries,
                                           int32_t num_heads, int32_t head_dim,
                                           int32_t max_context_len) {
  const int64_t parts = NumPartitions(max_context_len);
  if (parts == 1) return 0;
  return int64_t{num_queries} * num_heads * parts * (head_dim + 2) *
         static_cast<int64_t>(sizeof(float));
}

absl::Status InvokePagedDecodeAttention(
    const float* q, const PagedKvView& cache, const int32_t* block_tables,
    int32_t max_blocks_per_seq, const int32_t* context_lens,
    const int32_t* query_seq, int32_t num_queries, int32_t num_heads,
    int32_t max_context_len, float scale, float* out, void* workspace,
    int64_t workspace_bytes, cudaStream_t stream) {
  if (absl::Status s = CheckCache(cache, num_heads); !s.ok()) return s;
  if (num_queries < 0 || max_context_len < 0) {
    return absl::InvalidArgumentError(
        "decode attention: negative query count or context length");
  }
  if (num_queries == 0) return absl::OkStatus();
  if (num_queries > 65535) {  // grid y
    return absl::InvalidArgumentError(absl::StrCat(
        "decode attention: ", num_queries, " queries in one call (max 65535)"));
  }
  const int32_t parts = NumPartitions(max_context_len);
  const int64_t need = PagedDecodeAttentionWorkspaceBytes(
      num_queries, num_heads, cache.head_dim, max_context_len);
  if (need > 0 && (workspace == nullptr || workspace_bytes < need)) {
    return absl::InvalidArgumentError(
        absl::StrCat("decode attention: workspace of ", workspace_bytes,
                     " bytes, need ", need));
  }
  DecodeArgs a{q,
               cache,
               block_tables,
               max_blocks_per_seq,
               context_lens,
               query_seq,
               num_queries,
               num_heads,
               scale,
               out,
               nullptr,
               nullptr,
               nullptr,
               parts};
  if (parts > 1) {
    const int64_t qh = int64_t{num_queries} * num_heads;
    a.partial_out = static_cast<float*>(workspace);
    a.partial_max = a.partial_out + qh * parts * cache.head_dim;
    a.partial_sum = a.partial_max + qh * parts;
  }
  switch (cache.dtype) {
    case KvDtype::kF32:
      LaunchDecodeForHeadDim<float>(a, stream);
      break;
    case KvDtype::kF16:
      LaunchDecodeForHeadDim<__half>(a, stream);
      break;
    case KvDtype::kBF16:
      LaunchDecodeForHeadDim<__nv_bfloat16>(a, stream);
      break;
    case KvDtype::kI8:
      LaunchDecodeForHeadDim<int8_t>(a, stream);
      break;
    case KvDtype::kFp8E4M3:
      LaunchDecodeForHeadDim<Fp8E4M3>(a, stream);
      break;
  }
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (parts > 1) {
    PagedDecodeReduceKernel<<<dim3(num_heads, num_queries), 128,
                              parts * sizeof(float), stream>>>(
        a.partial_out, a.partial_max, a.partial_sum, context_lens, parts,
        cache.head_dim, out);
    PDSERVE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  return absl::OkStatus();
}

absl::Status InvokePagedPrefillAttention(
    const float* q, const PagedKvView& cache, const PrefillSeq* seqs,
    int32_t num_seqs, const int32_t* block_tables, int32_t max_blocks_per_seq,
    int32_t num_heads, int32_t max_num_q, float scale, float* out,
    cudaStream_t stream) {
  if (absl::Status s = CheckCache(cache, num_heads); !s.ok()) return s;
  if (num_seqs < 0 || max_num_q < 0) {
    return absl::InvalidArgumentError(
        "prefill attention: negative sequence or query count");
  }
  if (num_seqs == 0 || max_num_q == 0) return absl::OkStatus();
  if (num_seqs > 65535) {  // grid z
    return absl::InvalidArgumentError(absl::StrCat(
        "prefill attention: ", num_seqs, " sequences in one call (max 65535)"));
  }
  const PrefillArgs a{
      q,         cache,     seqs,  num_seqs, block_tables, max_blocks_per_seq,
      num_heads, max_num_q, scale, out};
  switch (cache.dtype) {
    case KvDtype::kF32:
      return LaunchPrefillForHeadDim<float>(a, stream);
    case KvDtype::kF16:
      return LaunchPrefillForHeadDim<__half>(a, stream);
    case KvDtype::kBF16:
      return LaunchPrefillForHeadDim<__nv_bfloat16>(a, stream);
    case KvDtype::kI8:
      return LaunchPrefillForHeadDim<int8_t>(a, stream);
    case KvDtype::kFp8E4M3:
      return LaunchPrefillForHeadDim<Fp8E4M3>(a, stream);
  }
  return absl::InvalidArgumentError("prefill attention: unknown KV dtype");
}

}  // namespace pdserve::kernels::cuda
