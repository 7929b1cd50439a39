// For tests that check a measurement leaves no thread running after it
// returns: the CPU time the whole process burns while the calling thread
// sleeps.
#pragma once

#include <time.h>
#include <unistd.h>

namespace pdserve::kernels::idle_cpu {

inline double ProcessCpuMs() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e3 +
         static_cast<double>(t.tv_nsec) / 1e6;
}

// CPU milliseconds this process burns while the calling thread sleeps 30 ms.
inline double CpuMsDuringASleep() {
  const double cpu0 = ProcessCpuMs();
  ::usleep(30'000);
  return ProcessCpuMs() - cpu0;
}

// Waits (up to about 3 s) until nothing else in the process runs while this
// thread sleeps: OpenBLAS's threads poll for work for a while after the
// library starts, before any measurement a test makes.
inline void WaitUntilQuiet() {
  for (int i = 0; i < 100 && CpuMsDuringASleep() >= 1.0; ++i) {
  }
}

}  // namespace pdserve::kernels::idle_cpu
