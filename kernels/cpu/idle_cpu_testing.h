// For tests that check a call leaves no thread behind when it
// returns (an OpenMP team, for one, keeps its threads after a region, polling
// for the next on the cores that timed kernels need).
#pragma once

#include <dirent.h>

#include <cstdlib>
#include <set>

namespace pdserve::kernels::idle_cpu {

// The ids of this process's threads now (/proc/self/task).
inline std::set<long> ThreadIds() {
  std::set<long> ids;
  if (DIR* dir = ::opendir("/proc/self/task")) {
    while (const dirent* e = ::readdir(dir)) {
      if (e->d_name[0] != '.') ids.insert(std::strtol(e->d_name, nullptr, 10));
    }
    ::closedir(dir);
  }
  return ids;
}

// How many of this process's threads now were not among `before`.
inline int ThreadsStartedSince(const std::set<long>& before) {
  int started = 0;
  for (long id : ThreadIds()) started += before.count(id) == 0 ? 1 : 0;
  return started;
}

}  // namespace pdserve::kernels::idle_cpu
