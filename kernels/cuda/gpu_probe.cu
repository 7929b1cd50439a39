// gpu_probe: the first thing scripts/gpu-check.sh runs on a GPU machine.
// Prints the CUDA driver and runtime versions and every visible device, then
// launches one trivial kernel built for this build's architectures
// (PDSERVE_CUDA_ARCHS) and checks its result. Exits 0 only when a device is
// visible and the kernel ran, so that a driver older than the bundled
// runtime, a container without the device, or a build for the wrong
// architecture ends the check at once, before any test binary could skip
// every test and look like a pass.
//
//   device 0: NVIDIA H200, compute 9.0, 132 SMs, 139.8 GiB
//   driver CUDA 13.0 (13000), runtime CUDA 13.0 (13000)
//   probe kernel: OK
#include <cuda_runtime_api.h>

#include <cstdio>

namespace {

// out[i] = i * 3 + 1 for i < n.
__global__ void ProbeKernel(int* __restrict__ out,  // [n]
                            int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = i * 3 + 1;
}

void PrintVersion(const char* what, int v) {
  std::printf("%s CUDA %d.%d (%d)", what, v / 1000, (v % 1000) / 10, v);
}

int Fail(const char* what, cudaError_t e) {
  std::printf("NO DEVICE: %s: %s (%s)\n", what, cudaGetErrorName(e),
              cudaGetErrorString(e));
  return 1;
}

}  // namespace

int main() {
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);  // 0 when no driver is installed
  cudaRuntimeGetVersion(&runtime);
  PrintVersion("driver", driver);
  std::printf(", ");
  PrintVersion("runtime", runtime);
  std::printf("\n");
  if (driver == 0) {
    std::printf("NO DEVICE: no CUDA driver is loaded (libcuda.so.1)\n");
    return 1;
  }
  if (driver < runtime) {
    std::printf(
        "NO DEVICE: the driver supports CUDA %d.%d, older than the bundled "
        "runtime %d.%d; rebuild with the machine's CUDA version\n",
        driver / 1000, (driver % 1000) / 10, runtime / 1000,
        (runtime % 1000) / 10);
    return 1;
  }
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    return Fail("cudaGetDeviceCount", e);
  }
  if (count == 0) {
    std::printf("NO DEVICE: cudaGetDeviceCount reports 0 devices\n");
    return 1;
  }
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp p{};
    if (cudaError_t e = cudaGetDeviceProperties(&p, d); e != cudaSuccess) {
      return Fail("cudaGetDeviceProperties", e);
    }
    std::printf("device %d: %s, compute %d.%d, %d SMs, %.1f GiB\n", d, p.name,
                p.major, p.minor, p.multiProcessorCount,
                static_cast<double>(p.totalGlobalMem) / (1 << 30));
  }
  constexpr int kN = 1000;
  int* dev = nullptr;
  if (cudaError_t e = cudaMalloc(&dev, kN * sizeof(int)); e != cudaSuccess) {
    return Fail("cudaMalloc", e);
  }
  ProbeKernel<<<(kN + 255) / 256, 256>>>(dev, kN);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    // cudaErrorNoKernelImageForDevice: built for other architectures.
    return Fail("probe kernel launch", e);
  }
  int host[kN];
  if (cudaError_t e =
          cudaMemcpy(host, dev, sizeof host, cudaMemcpyDeviceToHost);
      e != cudaSuccess) {
    return Fail("probe kernel result copy", e);
  }
  cudaFree(dev);
  for (int i = 0; i < kN; ++i) {
    if (host[i] != i * 3 + 1) {
      std::printf("NO DEVICE: probe kernel wrote %d at %d, want %d\n", host[i],
                  i, i * 3 + 1);
      return 1;
    }
  }
  std::printf("probe kernel: OK\n");
  return 0;
}
