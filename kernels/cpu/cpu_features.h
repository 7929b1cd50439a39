// What this CPU (and the OS) lets pdserve's kernels use, detected once at
// first use from cpuid/xgetbv (and, for AMX, the Linux
// arch_prctl(ARCH_REQ_XCOMP_PERM) permission). Thread-safe: the result is
// computed once and immutable.
//
// PDSERVE_CPU_ISA caps what DetectCpuFeatures reports, read once with the
// detection, so that a slower path can be measured on a faster machine:
//   avx2    clears every AVX-512 bit (VNNI, BF16, VBMI and FP16 included) and
//           AMX: the GEMM kernels (packed_gemm*.cc) and the peak
//           microkernels (fma_peak.cc) run as on an AVX2-only CPU;
//   avx512  clears the AMX bits only;
//   native  (or unset) reports what the CPU and OS have.
// Any other value reports the CPU as is and says so on stderr. The GEMM
// kernels give the same bits on every path, so the cap changes speed, never
// results. Paged attention, the optional BLAS path and the structured-output
// masks pick their instructions with __builtin_cpu_supports, which the cap
// does not reach.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace pdserve::kernels {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  // AVX-VNNI: VPDPBUSD on 256-bit VEX registers (no AVX-512 needed).
  bool avxvnni = false;
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

  // Which cap PDSERVE_CPU_ISA applied (kNative: none).
  enum class Cap { kNative, kAvx512, kAvx2 };
  Cap cap = Cap::kNative;

  // "avx2 fma f16c avx512f ..." (the present ones), then "cap=avx2" or
  // "cap=avx512" when capped, for logs and benchmarks.
  std::string ToString() const;
};

// "avx2", "avx512" or "native" (the PDSERVE_CPU_ISA values); nullopt for
// anything else.
std::optional<CpuFeatures::Cap> ParseCpuIsaCap(std::string_view name);

// `detected` with the bits above `cap` cleared (see the header comment).
CpuFeatures CapCpuFeatures(CpuFeatures detected, CpuFeatures::Cap cap);

// The CPU's features under the PDSERVE_CPU_ISA cap, detected at first call.
const CpuFeatures& DetectCpuFeatures();

}  // namespace pdserve::kernels
