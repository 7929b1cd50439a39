// Reading (memory-mapped) and writing of the safetensors format:
//   u64 little-endian header length N | N bytes JSON header | data buffer
// where the header maps tensor name -> {dtype, shape, data_offsets} relative
// to the data buffer. Every offset, size and shape is checked against the
// file before use, so a corrupt or truncated file is an error naming the file
// and tensor, never an out-of-bounds read.
// SafetensorsFile is immutable after Open and safe to read from many threads.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"

namespace pdserve::engine {

struct TensorView {
  std::string name;
  DType dtype = DType::kF32;  // F32, F16 or BF16
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
  int64_t NumElements() const;
};

class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(
      const std::string& path);
  // Parses an in-memory image (used by Open and by the fuzzer/tests).
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromBuffer(
      const uint8_t* data, size_t size, const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  // NOT_FOUND naming the file when absent.
  absl::StatusOr<const TensorView*> Find(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, TensorView> tensors_;
};

// Converts a tensor to fp32 into `out` (resized to NumElements()).
void TensorToFloat(const TensorView& t, std::vector<float>* out);

struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;  // F32, F16 or BF16; values converted from fp32
  std::vector<int64_t> shape;
  const float* values = nullptr;  // NumElements(shape) floats
};

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<TensorToWrite>& tensors);

}  // namespace pdserve::engine
