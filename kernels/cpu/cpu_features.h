// What this CPU (and the OS) lets pdserve's kernels use, detected once at
// first use from cpuid/xgetbv (and, for AMX, the Linux
// arch_prctl(ARCH_REQ_XCOMP_PERM) permission). Thread-safe: the result is
// computed once and immutable.
#pragma once

#include <string>

namespace pdserve::kernels {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512bf16 = false;
  bool avx512vnni = false;
  bool avx512vbmi = false;  // vpermb (byte permutes across the register)
  bool avx512fp16 = false;
  bool amx_bf16 = false;
  bool amx_int8 = false;
  // AMX tiles are present and the kernel granted this process XTILEDATA.
  bool amx_usable = false;

  // "avx2 fma f16c avx512f ..." (the present ones), for logs and benchmarks.
  std::string ToString() const;
};

const CpuFeatures& DetectCpuFeatures();

}  // namespace pdserve::kernels
