#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sampling.cuh"

namespace pdserve::kernels::cuda {
namespace {

__host__ __device__ inline void Philox4x32_10(uint32_t ctr[4],
                                              uint32_t key[2]) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t{kM0} * ctr[0];
    const uint64_t p1 = uint64_t{kM1} * ctr[2];
    const uint32_t c0 = static_cast<uint32_t>(p1 >> 32) ^ ctr[1] ^ key[0];
    const uint32_t c1 = static_cast<uint32_t>(p1);
    const uint32_t c2 = static_cast<uint32_t>(p0 >> 32) ^ ctr[3] ^ key[1];
    const uint32_t c3 = static_cast<uint32_t>(p0);
    ctr[0] = c0;
    ctr[1] = c1;
    ctr[2] = c2;
    ctr[3] = c3;
    key[0] += kW0;
    key[1] += kW1;
  }
}

__host__ __device__ inline float Uniform(uint64_t seed, int64_t position) {
  const uint64_t pos = static_cast<uint64_t>(position);
  uint32_t ctr[4] = {static_cast<uint32_t>(pos),
                     static_cast<uint32_t>(pos >> 32), 0, 0};
  uint32_t key[2] = {static_cast<uint32_t>(seed),
                     static_cast<uint32_t>(seed >> 32)};
  Philox4x32_10(ctr, key);
  return static_cast<float>(ctr[0] >> 8) * (1.0f / 16777216.0f);
}

constexpr int kArgmaxThreads = 256;
constexpr int kSampleThreads = 1024;

// First maximum of each row, or kInvalidToken when the row holds a NaN.
// grid: rows; block: kArgmaxThreads.
__global__ void __launch_bounds__(kArgmaxThreads)
    ArgmaxKernel(const float* __restrict__ logits,  // [rows, vocab]
                 int64_t vocab, int32_t* __restrict__ tokens) {  // [rows]
  struct Best {
    float value;
    int64_t index;
  };
  struct Op {
    __device__ Best operator()(const Best& a, const Best& b) const {
      if (a.value > b.value) return a;
      if (b.value > a.value) return b;
      return a.index <= b.index ? a : b;
    }
  };
  using Reduce = cub::BlockReduce<Best, kArgmaxThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const float* row = logits + blockIdx.x * vocab;
  Best best{-INFINITY, vocab};
  int nan = 0;
  for (int64_t i = threadIdx.x; i < vocab; i += kArgmaxThreads) {
    const float v = row[i];
    nan |= v != v;
    if (v > best.value || best.index == vocab) {
      if (!(v != v)) best = Best{v, i};
    }
  }
  const Best b = Reduce(temp).Reduce(best, Op());
  const int any_nan = __syncthreads_or(nan);
  if (threadIdx.x == 0) {
    tokens[blockIdx.x] =
        any_nan ? kInvalidToken
                : static_cast<int32_t>(b.index < vocab ? b.index : 0);
  }
}

// keys = logits / temperature (NaN -> -inf), values = ids. grid-stride.
__global__ void PrepareSortKernel(const float* __restrict__ logits,
                                  int32_t rows, int64_t vocab,
                                  const SampleParams* __restrict__ params,
                                  float* __restrict__ keys,
                                  int32_t* __restrict__ ids,
                                  int32_t* __restrict__ offsets) {
  const int64_t n = int64_t{rows} * vocab;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / vocab;
    const float t = params[r].temperature;
    const float inv_t = t > 0.0f ? 1.0f / t : 1.0f;
    const float v = __fmul_rn(logits[i], inv_t);
    keys[i] = v != v ? -INFINITY : v;
    ids[i] = static_cast<int32_t>(i % vocab);
  }
  for (int64_t r = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; r <= rows;
       r += int64_t{gridDim.x} * blockDim.x)
    offsets[r] = static_cast<int32_t>(r * vocab);
}

// One block per row of sorted (value desc, id asc) candidates.
__global__ void __launch_bounds__(kSampleThreads) SampleSortedKernel(
    const float* __restrict__ keys,   // [rows, vocab], sorted per row
    const int32_t* __restrict__ ids,  // [rows, vocab]
    int64_t vocab, const SampleParams* __restrict__ params,
    int32_t* __restrict__ tokens) {
  using Scan = cub::BlockScan<double, kSampleThreads>;
  using Reduce = cub::BlockReduce<double, kSampleThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } temp;
  __shared__ double total_s;
  __shared__ int64_t found;
  __shared__ double found_mass;

  const int64_t r = blockIdx.x;
  const SampleParams p = params[r];
  if (!(p.temperature > 0.0f)) return;  // greedy: ArgmaxKernel's answer
  // A row with a NaN stays invalid (ArgmaxKernel ran first on this stream);
  // every thread returns here, before any barrier.
  if (tokens[r] == kInvalidToken) return;
  const float* key = keys + r * vocab;
  const int32_t* id = ids + r * vocab;
  const int64_t n =
      p.top_k > 0 && p.top_k < vocab ? static_cast<int64_t>(p.top_k) : vocab;
  const double mx = key[0];
  auto prob = [&](int64_t i) -> double {
    return i < n ? exp(static_cast<double>(key[i]) - mx) : 0.0;
  };

  // Total mass of the top-k candidates.
  double local = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kSampleThreads) local += prob(i);
  const double total = Reduce(temp.reduce).Sum(local);
  if (threadIdx.x == 0) total_s = total;
  __syncthreads();

  // Finds the first index whose inclusive prefix sum satisfies `pred`,
  // scanning chunk by chunk; returns n when none does.
  auto first_prefix = [&](auto pred, double* mass_at) -> int64_t {
    double running = 0.0;
    __syncthreads();  // every thread has read the previous call's result
    if (threadIdx.x == 0) found = n;
    __syncthreads();
    for (int64_t c0 = 0; c0 < n; c0 += kSampleThreads) {
      const int64_t i = c0 + threadIdx.x;
      double inclusive, chunk;
      Scan(temp.scan).InclusiveSum(prob(i), inclusive, chunk);
      inclusive += running;
      if (i < n && pred(inclusive)) {
        atomicMin(reinterpret_cast<unsigned long long*>(&found),
                  static_cast<unsigned long long>(i));
      }
      __syncthreads();
      if (found < n) {
        if (i == found) found_mass = inclusive;
        __syncthreads();
        *mass_at = found_mass;
        return found;
      }
      running += chunk;
      __syncthreads();  // temp storage is reused by the next scan
    }
    *mass_at = running;
    return n;
  };

  const double tot = total_s;
  int64_t kept = n;
  double kept_mass = tot;
  const double top_p = p.top_p <= 0.0f ? 1.0 : static_cast<double>(p.top_p);
  if (top_p < 1.0) {
    double mass;
    const int64_t cut =
        first_prefix([&](double s) { return s / tot >= top_p; }, &mass);
    if (cut < n) {
      kept = cut + 1;
      kept_mass = mass;
    }
  }
  const double u = static_cast<double>(Uniform(p.seed, p.position)) * kept_mass;
  double unused;
  const int64_t pick = first_prefix([&](double s) { return u < s; }, &unused);
  if (threadIdx.x == 0) tokens[r] = id[pick < kept ? pick : kept - 1];
}

constexpr int64_t kAlign = 256;
int64_t AlignUp(int64_t b) { return (b + kAlign - 1) / kAlign * kAlign; }

struct Layout {
  int64_t params, offsets, keys_in, keys_out, ids_in, ids_out, temp;
  int64_t temp_bytes, total;
};

Layout MakeLayout(int32_t rows, int64_t vocab) {
  Layout l{};
  const int64_t items = int64_t{rows} * vocab;
  size_t temp_bytes = 0;
  cub::DeviceSegmentedRadixSort::SortPairsDescending(
      nullptr, temp_bytes, static_cast<const float*>(nullptr),
      static_cast<float*>(nullptr), static_cast<const int32_t*>(nullptr),
      static_cast<int32_t*>(nullptr), static_cast<int>(items), rows,
      static_cast<const int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr));
  int64_t at = 0;
  l.params = at;
  at += AlignUp(rows * static_cast<int64_t>(sizeof(SampleParams)));
  l.offsets = at;
  at += AlignUp((rows + 1) * 4);
  l.keys_in = at;
  at += AlignUp(items * 4);
  l.keys_out = at;
  at += AlignUp(items * 4);
  l.ids_in = at;
  at += AlignUp(items * 4);
  l.ids_out = at;
  at += AlignUp(items * 4);
  l.temp = at;
  l.temp_bytes = static_cast<int64_t>(temp_bytes);
  at += AlignUp(l.temp_bytes);
  l.total = at;
  return l;
}

}  // namespace

std::array<uint32_t, 4> PhiloxHost(std::array<uint32_t, 4> counter,
                                   std::array<uint32_t, 2> key) {
  Philox4x32_10(counter.data(), key.data());
  return counter;
}

float UniformForPositionHost(uint64_t seed, int64_t position) {
  return Uniform(seed, position);
}

int64_t SamplingWorkspaceBytes(int32_t rows, int64_t vocab) {
  if (rows <= 0 || vocab <= 0) return 0;
  return MakeLayout(rows, vocab).total;
}

absl::Status InvokeSample(const float* logits, int32_t rows, int64_t vocab,
                          const SampleParams* params, int32_t* tokens,
                          void* workspace, int64_t workspace_bytes,
                          cudaStream_t stream) {
  if (rows < 0 || vocab <= 0 ||
      int64_t{rows} * vocab > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sample: rows=", rows, " vocab=", vocab, " (rows * vocab < 2^31)"));
  }
  if (rows == 0) return absl::OkStatus();
  const Layout l = MakeLayout(rows, vocab);
  if (workspace == nullptr || workspace_bytes < l.total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sample: workspace of ", workspace_bytes, " bytes, need ", l.total));
  }
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  auto* d_params = reinterpret_cast<SampleParams*>(ws + l.params);
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_params, params,
                                               rows * sizeof(SampleParams),
                                               cudaMemcpyHostToDevice, stream));
  ArgmaxKernel<<<rows, kArgmaxThreads, 0, stream>>>(logits, vocab, tokens);
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  bool any_random = false;
  for (int32_t r = 0; r < rows; ++r) any_random |= params[r].temperature > 0.0f;
  if (!any_random) return absl::OkStatus();

  auto* offsets = reinterpret_cast<int32_t*>(ws + l.offsets);
  auto* keys_in = reinterpret_cast<float*>(ws + l.keys_in);
  auto* keys_out = reinterpret_cast<float*>(ws + l.keys_out);
  auto* ids_in = reinterpret_cast<int32_t*>(ws + l.ids_in);
  auto* ids_out = reinterpret_cast<int32_t*>(ws + l.ids_out);
  const int64_t items = int64_t{rows} * vocab;
  const unsigned grid =
      static_cast<unsigned>(std::min<int64_t>((items + 255) / 256, 4096));
  PrepareSortKernel<<<grid, 256, 0, stream>>>(logits, rows, vocab, d_params,
                                              keys_in, ids_in, offsets);
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  size_t temp_bytes = static_cast<size_t>(l.temp_bytes);
  PDSERVE_CUDA_RETURN_IF_ERROR(
      cub::DeviceSegmentedRadixSort::SortPairsDescending(
          ws + l.temp, temp_bytes, keys_in, keys_out, ids_in, ids_out,
          static_cast<int>(items), rows, offsets, offsets + 1, 0,
          static_cast<int>(sizeof(float) * 8), stream));
  SampleSortedKernel<<<rows, kSampleThreads, 0, stream>>>(
      keys_out, ids_out, vocab, d_params, tokens);
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace pdserve::kernels::cuda
