#include <cublas_v2.h>
#include <dlfcn.h>

#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gemm.cuh"
#include "kernels/cuda/ops.cuh"

namespace pdserve::kernels::cuda {
namespace {

// cuBLAS is loaded at run time (dlopen) rather than linked: libcublasLt
// carries ~94 KiB of static TLS, and a process that links it cannot start
// threads with small stacks (civetweb's metrics server fails with "Cannot
// create threads"), which would break every CPU-only pdserve process. Loaded
// this way its TLS is allocated dynamically, and only GPU runs load it.
struct CublasApi {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  // The C entry point (C++ also sees an inline overload taking a
  // cudaDataType compute type, so decltype cannot name it).
  using GemmExFn = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t,
                                      cublasOperation_t, int, int, int,
                                      const void*, const void*, cudaDataType,
                                      int, const void*, cudaDataType, int,
                                      const void*, void*, cudaDataType, int,
                                      cublasComputeType_t, cublasGemmAlgo_t);
  GemmExFn gemm_ex = nullptr;
  decltype(&cublasGetStatusName) status_name = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
  std::string error;  // why loading failed, empty when it worked
};

const CublasApi& Cublas() {
  static const CublasApi api = [] {
    CublasApi a;
    const std::string versioned =
        "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
    void* lib = dlopen(versioned.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) lib = dlopen("libcublas.so", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      a.error = "cannot load " + versioned + ": " + (why ? why : "?");
      return a;
    }
    auto sym = [&](const char* name) -> void* {
      void* p = dlsym(lib, name);
      if (p == nullptr && a.error.empty())
        a.error = std::string("cuBLAS lacks ") + name;
      return p;
    };
    a.create = reinterpret_cast<decltype(a.create)>(sym("cublasCreate_v2"));
    a.destroy = reinterpret_cast<decltype(a.destroy)>(sym("cublasDestroy_v2"));
    a.set_stream =
        reinterpret_cast<decltype(a.set_stream)>(sym("cublasSetStream_v2"));
    a.gemm_ex = reinterpret_cast<decltype(a.gemm_ex)>(sym("cublasGemmEx"));
    a.status_name =
        reinterpret_cast<decltype(a.status_name)>(sym("cublasGetStatusName"));
    a.status_string = reinterpret_cast<decltype(a.status_string)>(
        sym("cublasGetStatusString"));
    return a;  // the library stays loaded for the life of the process
  }();
  return api;
}

absl::Status CublasStatus(cublasStatus_t s, const char* expr, const char* file,
                          int line) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const absl::StatusCode code =
      s == CUBLAS_STATUS_ALLOC_FAILED    ? absl::StatusCode::kResourceExhausted
      : s == CUBLAS_STATUS_INVALID_VALUE ? absl::StatusCode::kInvalidArgument
      : s == CUBLAS_STATUS_NOT_INITIALIZED
          ? absl::StatusCode::kFailedPrecondition
          : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(file, ":", line, ": ", expr,
                                         " failed: ", Cublas().status_name(s),
                                         " (", Cublas().status_string(s), ")"));
}

#define PDSERVE_CUBLAS_RETURN_IF_ERROR(expr)                         \
  do {                                                               \
    ::absl::Status pdserve_cublas_status_ =                          \
        CublasStatus((expr), #expr, __FILE__, __LINE__);             \
    if (!pdserve_cublas_status_.ok()) return pdserve_cublas_status_; \
  } while (0)

}  // namespace

absl::StatusOr<std::unique_ptr<GemmRunner>> GemmRunner::Create(
    cudaStream_t stream) {
  const CublasApi& api = Cublas();
  if (!api.error.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("cuBLAS: ", api.error));
  }
  cublasHandle_t handle = nullptr;
  PDSERVE_CUBLAS_RETURN_IF_ERROR(api.create(&handle));
  if (absl::Status s = CublasStatus(api.set_stream(handle, stream),
                                    "cublasSetStream", __FILE__, __LINE__);
      !s.ok()) {
    api.destroy(handle);
    return s;
  }
  return std::unique_ptr<GemmRunner>(new GemmRunner(handle, stream));
}

GemmRunner::~GemmRunner() {
  if (scratch_ != nullptr) cudaFree(scratch_);
  Cublas().destroy(static_cast<cublasHandle_t>(handle_));
}

absl::Status GemmRunner::MatMulNT(const float* x, int64_t m, int64_t k,
                                  const void* w, int64_t n, GemmDtype dtype,
                                  float* y) {
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  if (m < 0 || k <= 0 || n <= 0 || m > kMax || k > kMax || n > kMax) {
    return absl::InvalidArgumentError(
        absl::StrCat("gemm: m=", m, " k=", k, " n=", n));
  }
  if (m == 0) return absl::OkStatus();
  auto handle = static_cast<cublasHandle_t>(handle_);
  const float alpha = 1.0f, beta = 0.0f;
  // Row-major y[m,n] = x[m,k] w[n,k]^T is column-major y^T[n,m] =
  // op_T(W)[n,k] x^T[k,m], where W is w read column-major as [k,n].
  const void* b = x;
  cudaDataType_t type = CUDA_R_32F;
  if (dtype == GemmDtype::kBf16) {
    if (scratch_elems_ < m * k) {
      if (scratch_ != nullptr) cudaFree(scratch_);
      scratch_ = nullptr;
      scratch_elems_ = 0;
      PDSERVE_CUDA_RETURN_IF_ERROR(
          cudaMalloc(&scratch_, m * k * sizeof(uint16_t)));
      scratch_elems_ = m * k;
    }
    if (absl::Status s = InvokeFloatToBf16(x, m * k, scratch_, stream_);
        !s.ok()) {
      return s;
    }
    b = scratch_;
    type = CUDA_R_16BF;
  }
  PDSERVE_CUBLAS_RETURN_IF_ERROR(Cublas().gemm_ex(
      handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
      static_cast<int>(m), static_cast<int>(k), &alpha, w, type,
      static_cast<int>(k), b, type, static_cast<int>(k), &beta, y, CUDA_R_32F,
      static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

}  // namespace pdserve::kernels::cuda
