// Linear layers on the GPU through cuBLAS: y[m, n] = x[m, k] . w[n, k]^T with
// weights in Hugging Face [out, in] layout, as kernels/cpu/matmul.h. No
// hand-written GEMM.
//
//  - kBf16: weights bf16, activations converted to bf16 (round to nearest
//    even), fp32 accumulation and fp32 output: the serving default.
//  - kF32: fp32 throughout with CUBLAS_COMPUTE_32F and the default math mode
//    (no TF32), for checking the GPU backend against the CPU reference.
//
// A GemmRunner owns a cuBLAS handle bound to one stream and a scratch buffer
// for bf16 activations; it is not thread-safe (one per engine thread).
// cuBLAS is loaded with dlopen on first use (see gemm.cu for why); Create
// fails with FAILED_PRECONDITION when libcublas cannot be found.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace pdserve::kernels::cuda {

enum class GemmDtype { kF32, kBf16 };

class GemmRunner {
 public:
  static absl::StatusOr<std::unique_ptr<GemmRunner>> Create(
      cudaStream_t stream);
  ~GemmRunner();
  GemmRunner(const GemmRunner&) = delete;
  GemmRunner& operator=(const GemmRunner&) = delete;

  // x: [m, k] fp32 (device); w: [n, k] of `dtype` (device; bf16 as uint16
  // bits); y: [m, n] fp32 (device), overwritten.
  absl::Status MatMulNT(const float* x, int64_t m, int64_t k, const void* w,
                        int64_t n, GemmDtype dtype, float* y);

 private:
  GemmRunner(void* handle, cudaStream_t stream)
      : handle_(handle), stream_(stream) {}
  void* handle_;  // cublasHandle_t
  cudaStream_t stream_;
  uint16_t* scratch_ = nullptr;  // bf16 activations
  int64_t scratch_elems_ = 0;
};

}  // namespace pdserve::kernels::cuda
