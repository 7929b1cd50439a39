// The fp32 FMA throughput a GEMM path could reach on this machine, measured
// by a microkernel of independent FMA chains (no memory traffic). Benchmarks
// divide achieved FLOP/s by it. Thread-safe; runs on `threads` threads
// started for the measurement (RunOnOwnThreads), none left running after it.
#pragma once

#include "kernels/cpu/packed_gemm.h"

namespace pdserve::kernels {

// GFLOP/s (an FMA counts 2) with `isa`'s vectors (portable: scalar fma),
// over about `seconds` of wall time, best of a few repetitions.
double MeasureFmaPeakGflops(GemmIsa isa, int threads, double seconds = 0.3);

// The same for AVX512-BF16 VDPBF16PS (GemmNumerics::kBf16Dot): 64 FLOPs per
// instruction. 0 where the CPU lacks it.
double MeasureBf16DotPeakGflops(int threads, double seconds = 0.3);

// The same for AVX512-VNNI VPDPBUSD (GemmNumerics::kInt8Dot): 128 integer
// ops per instruction, in G ops/s. 0 where the CPU lacks it.
double MeasureInt8DotPeakGops(int threads, double seconds = 0.3);

// The same for AVX-VNNI's 256-bit VPDPBUSD (kInt8Dot on per-row int8 weights
// where the path is AVX2): 64 integer ops per instruction. 0 where the CPU
// lacks it.
double MeasureAvxVnniPeakGops(int threads, double seconds = 0.3);

// The same for the AVX2 kernel of kInt8Dot without VNNI: VPSIGNB,
// VPMADDUBSW, VPMADDWD and VPADDD per 32 byte pairs, 64 integer ops. 0
// where the CPU lacks AVX2.
double MeasureAvx2DotPeakGops(int threads, double seconds = 0.3);
// The same for AMX-INT8 TDPBSSD (GemmNumerics::kInt8Dot at batch sizes that
// take AMX): 16 x 16 x k_bytes multiply-adds per instruction, 2 ops each.
// k_bytes = 64 is the instruction's peak; the kernel multiplies one block
// (k_bytes = 32) per instruction. 0 where AMX-INT8 is absent or not
// permitted.
double MeasureAmxInt8PeakGops(int threads, double seconds = 0.3,
                              int k_bytes = 64);

}  // namespace pdserve::kernels
