// Fuzzes the safetensors parser (model/safetensors.h) on an in-memory file:
// any input must give a Status or tensors whose data lies inside the buffer,
// and converting every tensor to fp32 must stay in bounds (ASan checks).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = pdserve::engine::SafetensorsFile::FromBuffer(data, size, "fuzz");
  if (!file.ok()) return 0;
  std::vector<float> values;
  for (const auto& [name, t] : (*file)->tensors()) {
    if (t.data < data || t.data + t.nbytes > data + size) std::abort();
    if (!(*file)->Find(name).ok()) std::abort();
    pdserve::engine::TensorToFloat(t, &values);
  }
  return 0;
}
