#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/moe.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kFeatures = 32;  // output features per thread block
constexpr int kRowLanes = 8;   // rows of a group handled side by side

int64_t Align(int64_t n) { return (n + 255) / 256 * 256; }

// One thread: counts per expert, offsets, then the slots of each expert in
// slot order (stable, so the grouping is a pure function of the routing).
// order: [m * k]; offsets: [num_experts + 1].
__global__ void GroupSlotsKernel(const int32_t* __restrict__ experts,
                                 int32_t slots, int32_t num_experts,
                                 int32_t* __restrict__ offsets,
                                 int32_t* __restrict__ fill,
                                 int32_t* __restrict__ order) {
  for (int e = 0; e <= num_experts; ++e) offsets[e] = 0;
  for (int s = 0; s < slots; ++s) ++offsets[experts[s] + 1];
  for (int e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  for (int e = 0; e < num_experts; ++e) fill[e] = offsets[e];
  for (int s = 0; s < slots; ++s) order[fill[experts[s]]++] = s;
}

// grid (num_experts, ceil(inter / kFeatures)), block (kFeatures, kRowLanes):
// act[slot, j] = silu(x . gate_j) * (x . up_j) for the expert's slots.
__global__ void ExpertUpKernel(const float* __restrict__ x,
                               const float* __restrict__ gate_up,
                               const int32_t* __restrict__ offsets,
                               const int32_t* __restrict__ order, int32_t k,
                               int32_t hidden, int32_t inter,
                               float* __restrict__ act) {  // [slots, inter]
  const int e = blockIdx.x;
  const int j = blockIdx.y * kFeatures + threadIdx.x;
  if (j >= inter) return;
  const float* g = gate_up + (int64_t{e} * 2 * inter + j) * hidden;
  const float* u = gate_up + (int64_t{e} * 2 * inter + inter + j) * hidden;
  for (int i = offsets[e] + threadIdx.y; i < offsets[e + 1]; i += kRowLanes) {
    const int slot = order[i];
    const float* row = x + int64_t{slot / k} * hidden;
    float sg = 0.0f, su = 0.0f;
    for (int c = 0; c < hidden; ++c) {
      sg += row[c] * g[c];
      su += row[c] * u[c];
    }
    act[int64_t{slot} * inter + j] = sg / (1.0f + __expf(-sg)) * su;
  }
}

// grid (num_experts, ceil(hidden / kFeatures)), block (kFeatures, kRowLanes):
// slot_out[slot, h] = act[slot] . down_h.
__global__ void ExpertDownKernel(const float* __restrict__ act,
                                 const float* __restrict__ down,
                                 const int32_t* __restrict__ offsets,
                                 const int32_t* __restrict__ order,
                                 int32_t hidden, int32_t inter,
                                 float* __restrict__ slot_out) {
  const int e = blockIdx.x;
  const int h = blockIdx.y * kFeatures + threadIdx.x;
  if (h >= hidden) return;
  const float* d = down + (int64_t{e} * hidden + h) * inter;
  for (int i = offsets[e] + threadIdx.y; i < offsets[e + 1]; i += kRowLanes) {
    const int slot = order[i];
    const float* a = act + int64_t{slot} * inter;
    float s = 0.0f;
    for (int c = 0; c < inter; ++c) s += a[c] * d[c];
    slot_out[int64_t{slot} * hidden + h] = s;
  }
}

// y[t, h] = sum over ranks r in order of weights[t, r] * slot_out[t*k + r, h].
__global__ void CombineKernel(const float* __restrict__ slot_out,
                              const float* __restrict__ weights, int32_t m,
                              int32_t k, int32_t hidden,
                              float* __restrict__ y) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= int64_t{m} * hidden) return;
  const int64_t t = i / hidden, h = i % hidden;
  float s = weights[t * k] * slot_out[(t * k) * hidden + h];
  for (int r = 1; r < k; ++r)
    s += weights[t * k + r] * slot_out[(t * k + r) * hidden + h];
  y[i] = s;
}

}  // namespace

int64_t GroupedMoeWorkspaceBytes(int32_t m, int32_t k, int32_t hidden,
                                 int32_t inter, int32_t num_experts) {
  const int64_t slots = int64_t{m} * k;
  return Align((num_experts + 1) * 4) + Align(num_experts * 4) +
         Align(slots * 4) + Align(slots * inter * 4) +
         Align(slots * hidden * 4);
}

absl::Status InvokeGroupedMoe(const float* x, const int32_t* experts,
                              const float* weights, const float* gate_up,
                              const float* down, int32_t m, int32_t k,
                              int32_t hidden, int32_t inter,
                              int32_t num_experts, void* workspace,
                              int64_t workspace_bytes, float* y,
                              cudaStream_t stream) {
  if (m < 0 || k <= 0 || hidden <= 0 || inter <= 0 || num_experts <= 0) {
    return absl::InvalidArgumentError("grouped MoE: bad shape");
  }
  const int64_t need =
      GroupedMoeWorkspaceBytes(m, k, hidden, inter, num_experts);
  if (workspace_bytes < need) {
    return absl::InvalidArgumentError(absl::StrCat(
        "grouped MoE: workspace of ", workspace_bytes, " bytes, need ", need));
  }
  if (m == 0) return absl::OkStatus();
  const int32_t slots = m * k;
  char* w = static_cast<char*>(workspace);
  int32_t* offsets = reinterpret_cast<int32_t*>(w);
  w += Align((num_experts + 1) * 4);
  int32_t* fill = reinterpret_cast<int32_t*>(w);
  w += Align(num_experts * 4);
  int32_t* order = reinterpret_cast<int32_t*>(w);
  w += Align(int64_t{slots} * 4);
  float* act = reinterpret_cast<float*>(w);
  w += Align(int64_t{slots} * inter * 4);
  float* slot_out = reinterpret_cast<float*>(w);
  GroupSlotsKernel<<<1, 1, 0, stream>>>(experts, slots, num_experts, offsets,
                                        fill, order);
  const dim3 block(kFeatures, kRowLanes);
  ExpertUpKernel<<<dim3(num_experts, (inter + kFeatures - 1) / kFeatures),
                   block, 0, stream>>>(x, gate_up, offsets, order, k, hidden,
                                       inter, act);
  ExpertDownKernel<<<dim3(num_experts, (hidden + kFeatures - 1) / kFeatures),
                     block, 0, stream>>>(act, down, offsets, order, hidden,
                                         inter, slot_out);
  const int64_t n = int64_t{m} * hidden;
  CombineKernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(
      slot_out, weights, m, k, hidden, y);
  return PDSERVE_CUDA_STATUS(cudaGetLastError());
}

}  // namespace pdserve::kernels::cuda
