#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kNormThreads = 256;

// grid: rows; block: kNormThreads.
__global__ void __launch_bounds__(kNormThreads) RmsNormKernel(
    const float* __restrict__ x,       // [rows, dim]
    float* __restrict__ residual,      // [rows, dim] or null
    const float* __restrict__ weight,  // [dim]
    int64_t dim, float eps,
    float* out) {  // [rows, dim]; may alias x, so not __restrict__
  __shared__ double partial[kNormThreads / 32];
  const int64_t r = blockIdx.x;
  const float* in = x + r * dim;
  float* res = residual != nullptr ? residual + r * dim : nullptr;
  double sum_sq = 0.0;
  for (int64_t i = threadIdx.x; i < dim; i += kNormThreads) {
    float val = in[i];
    if (res != nullptr) {
      val = __fadd_rn(res[i], val);
      res[i] = val;
    }
    sum_sq += static_cast<double>(val) * val;
  }
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1)
    sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, mask);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum_sq;
  __syncthreads();
  double total = 0.0;
#pragma unroll
  for (int w = 0; w < kNormThreads / 32; ++w) total += partial[w];
  const float inv = static_cast<float>(
      1.0 / sqrt(total / static_cast<double>(dim) + static_cast<double>(eps)));
  float* o = out + r * dim;
  for (int64_t i = threadIdx.x; i < dim; i += kNormThreads) {
    const float val = res != nullptr ? res[i] : in[i];
    o[i] = __fmul_rn(__fmul_rn(val, inv), weight[i]);
  }
}

// grid: rows; block: 128.
__global__ void RopeKernel(float* __restrict__ x,  // [rows, heads, hd]
                           int64_t heads, int64_t head_dim,
                           const int32_t* __restrict__ positions,  // [rows]
                           const float* __restrict__ inv_freq) {   // [hd / 2]
  const int64_t r = blockIdx.x;
  const int64_t half = head_dim / 2;
  const float pos = static_cast<float>(positions[r]);
  for (int64_t i = threadIdx.x; i < heads * half; i += blockDim.x) {
    const int64_t h = i / half;
    const int64_t j = i % half;
    const float angle = __fmul_rn(pos, inv_freq[j]);
    const float c = cosf(angle);
    const float s = sinf(angle);
    float* v = x + (r * heads + h) * head_dim;
    const float a = v[j];
    const float b = v[j + half];
    v[j] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    v[j + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
  }
}

__global__ void SiluAndMulKernel(const float* __restrict__ gate_up,
                                 int64_t rows, int64_t inter,
                                 float* __restrict__ out) {
  const int64_t n = rows * inter;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / inter;
    const int64_t c = i % inter;
    const float g = gate_up[r * 2 * inter + c];
    const float u = gate_up[r * 2 * inter + inter + c];
    out[i] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
  }
}

__global__ void SplitQkvKernel(const float* __restrict__ qkv,
                               const float* __restrict__ bias, int64_t rows,
                               int64_t q_dim, int64_t kv_dim,
                               float* __restrict__ q, float* __restrict__ k,
                               float* __restrict__ v) {
  const int64_t width = q_dim + 2 * kv_dim;
  const int64_t n = rows * width;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / width;
    const int64_t c = i % width;
    float val = qkv[i];
    if (bias != nullptr) val = __fadd_rn(val, bias[c]);
    if (c < q_dim) {
      q[r * q_dim + c] = val;
    } else if (c < q_dim + kv_dim) {
      k[r * kv_dim + c - q_dim] = val;
    } else {
      v[r * kv_dim + c - q_dim - kv_dim] = val;
    }
  }
}

__global__ void GatherRowsKernel(const float* __restrict__ table,
                                 int64_t table_rows, int64_t dim,
                                 const int32_t* __restrict__ ids,
                                 float* __restrict__ out) {
  const int64_t r = blockIdx.x;
  const int32_t id = ids[r];
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    out[r * dim + i] =
        id >= 0 && id < table_rows ? table[int64_t{id} * dim + i] : 0.0f;
  }
}

__global__ void FloatToBf16Kernel(const float* __restrict__ in, int64_t n,
                                  __nv_bfloat16* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}

unsigned GridFor(int64_t n, int threads) {
  return static_cast<unsigned>(
      std::clamp<int64_t>((n + threads - 1) / threads, 1, 65535));
}

}  // namespace

absl::Status InvokeRmsNorm(const float* x, float* residual, const float* weight,
                           int64_t rows, int64_t dim, float eps, float* out,
                           cudaStream_t stream) {
  if (rows < 0 || dim <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rms_norm: rows=", rows, " dim=", dim));
  }
  if (rows == 0) return absl::OkStatus();
  RmsNormKernel<<<static_cast<unsigned>(rows), kNormThreads, 0, stream>>>(
      x, residual, weight, dim, eps, out);
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status InvokeRope(float* x, int64_t rows, int64_t heads, int64_t head_dim,
                        const int32_t* positions, const float* inv_freq,
                        cudaStream_t stream) {
  if (rows < 0 || heads <= 0 || head_dim <= 0 || head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rope: rows=", rows, " heads=", heads, " head_dim=", head_dim));
  }
  if (rows == 0) return absl::OkStatus();
  RopeKernel<<<static_cast<unsigned>(rows), 128, 0, stream>>>(
      x, heads, head_dim, positions, inv_freq);
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status InvokeSiluAndMul(const float* gate_up, int64_t rows, int64_t inter,
                              float* out, cudaStream_t stream) {
  if (rows < 0 || inter <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("silu_and_mul: rows=", rows, " inter=", inter));
  }
  if (rows == 0) return absl::OkStatus();
  SiluAndMulKernel<<<GridFor(rows * inter, 256), 256, 0, stream>>>(
      gate_up, rows, inter, out);
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status InvokeSplitQkv(const float* qkv, const float* bias, int64_t rows,
                            int64_t q_dim, int64_t kv_dim, float* q, float* k,
                            float* v, cudaStream_t stream) {
  if (rows < 0 || q_dim <= 0 || kv_dim <= 0) {
    return absl::InvalidArgumentError("split_qkv: bad shape");
  }
  if (rows == 0) return absl::OkStatus();
  SplitQkvKernel<<<GridFor(rows * (q_dim + 2 * kv_dim), 256), 256, 0, stream>>>(
      qkv, bias, rows, q_dim, kv_dim, q, k, v);
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status InvokeGatherRows(const float* table, int64_t table_rows,
                              int64_t dim, const int32_t* ids, int64_t rows,
                              float* out, cudaStream_t stream) {
  if (rows < 0 || dim <= 0) {
    return absl::InvalidArgumentError("gather_rows: bad shape");
  }
  if (rows == 0) return absl::OkStatus();
  GatherRowsKernel<<<static_cast<unsigned>(rows), 128, 0, stream>>>(
      table, table_rows, dim, ids, out);
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status InvokeFloatToBf16(const float* in, int64_t n, uint16_t* out,
                               cudaStream_t stream) {
  if (n < 0) return absl::InvalidArgumentError("float_to_bf16: n < 0");
  if (n == 0) return absl::OkStatus();
  FloatToBf16Kernel<<<GridFor(n, 256), 256, 0, stream>>>(
      in, n, reinterpret_cast<__nv_bfloat16*>(out));
  PDSERVE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace pdserve::kernels::cuda
