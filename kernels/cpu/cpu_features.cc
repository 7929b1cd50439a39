#include "kernels/cpu/cpu_features.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace pdserve::kernels {
namespace {

uint64_t Xgetbv0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t{hi} << 32) | lo;
}

CpuFeatures Detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27);
  const bool fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave) return f;
  const uint64_t xcr0 = Xgetbv0();
  const bool os_ymm = (xcr0 & 0x6) == 0x6;
  const bool os_zmm = (xcr0 & 0xe6) == 0xe6;
  const bool os_tile = (xcr0 & (3u << 17)) == (3u << 17);
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  const unsigned leaf7_max_sub = a;
  f.avx2 = os_ymm && (b & (1u << 5));
  f.fma = os_ymm && fma;
  f.f16c = os_ymm && f16c;
  f.avx512f = os_zmm && (b & (1u << 16));
  f.avx512bw = os_zmm && (b & (1u << 30));
  f.avx512vl = os_zmm && (b & (1u << 31));
  f.avx512vnni = os_zmm && (c & (1u << 11));
  f.avx512vbmi = os_zmm && (c & (1u << 1));
  f.avx512fp16 = os_zmm && (d & (1u << 23));
  const bool amx_tile = d & (1u << 24);
  f.amx_bf16 = os_tile && amx_tile && (d & (1u << 22));
  f.amx_int8 = os_tile && amx_tile && (d & (1u << 25));
  if (leaf7_max_sub >= 1) {
    __cpuid_count(7, 1, a, b, c, d);
    f.avxvnni = os_ymm && (a & (1u << 4));
    f.avx512bf16 = os_zmm && (a & (1u << 5));
  }
#if defined(__linux__) && defined(SYS_arch_prctl)
  if (f.amx_bf16 || f.amx_int8) {
    constexpr int kArchReqXcompPerm = 0x1023;
    constexpr int kXfeatureXtiledata = 18;
    f.amx_usable =
        syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }
#endif
  return f;
}

}  // namespace

std::string CpuFeatures::ToString() const {
  std::string s;
  auto add = [&s](bool on, const char* name) {
    if (!on) return;
    if (!s.empty()) s += ' ';
    s += name;
  };
  add(avx2, "avx2");
  add(fma, "fma");
  add(f16c, "f16c");
  add(avxvnni, "avxvnni");
  add(avx512f, "avx512f");
  add(avx512bw, "avx512bw");
  add(avx512vl, "avx512vl");
  add(avx512bf16, "avx512bf16");
  add(avx512vnni, "avx512vnni");
  add(avx512vbmi, "avx512vbmi");
  add(avx512fp16, "avx512fp16");
  add(amx_bf16, "amx-bf16");
  add(amx_int8, "amx-int8");
  add(amx_usable, "amx-permitted");
  add(cap == Cap::kAvx512, "cap=avx512");
  add(cap == Cap::kAvx2, "cap=avx2");
  return s.empty() ? "none" : s;
}

std::optional<CpuFeatures::Cap> ParseCpuIsaCap(std::string_view name) {
  if (name == "native") return CpuFeatures::Cap::kNative;
  if (name == "avx512") return CpuFeatures::Cap::kAvx512;
  if (name == "avx2") return CpuFeatures::Cap::kAvx2;
  return std::nullopt;
}

CpuFeatures CapCpuFeatures(CpuFeatures f, CpuFeatures::Cap cap) {
  if (cap == CpuFeatures::Cap::kNative) return f;
  f.cap = cap;
  f.amx_bf16 = f.amx_int8 = f.amx_usable = false;
  if (cap == CpuFeatures::Cap::kAvx2) {
    f.avx512f = f.avx512bw = f.avx512vl = f.avx512bf16 = f.avx512vnni =
        f.avx512vbmi = f.avx512fp16 = false;
  }
  return f;
}

const CpuFeatures& DetectCpuFeatures() {
  static const CpuFeatures features = [] {
    CpuFeatures::Cap cap = CpuFeatures::Cap::kNative;
    if (const char* env = std::getenv("PDSERVE_CPU_ISA"); env != nullptr) {
      const std::optional<CpuFeatures::Cap> parsed = ParseCpuIsaCap(env);
      if (parsed.has_value()) {
        cap = *parsed;
      } else {
        std::fprintf(stderr,
                     "PDSERVE_CPU_ISA=%s is not avx2, avx512 or native; "
                     "using the CPU's own features\n",
                     env);
      }
    }
    return CapCpuFeatures(Detect(), cap);
  }();
  return features;
}

}  // namespace pdserve::kernels
