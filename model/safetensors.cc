#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/json.h"
#include "common/status_macros.h"

namespace pdserve::engine {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100 << 20;

absl::StatusOr<DType> ParseStDType(const std::string& s) {
  if (s == "F32") return DType::kF32;
  if (s == "F16") return DType::kF16;
  if (s == "BF16") return DType::kBF16;
  return absl::UnimplementedError(absl::StrCat(
      "dtype ", s, " is not supported (supported: F32, F16, BF16)"));
}

const char* StDTypeName(DType t) {
  switch (t) {
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    default:
      return "F32";
  }
}

}  // namespace

int64_t TensorView::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) munmap(map_, map_size_);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(
    const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(
        absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a regular file"));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* map = nullptr;
  if (size > 0) {
    map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
      ::close(fd);
      return absl::InternalError(
          absl::StrCat(path, ": mmap failed: ", std::strerror(errno)));
    }
  }
  ::close(fd);
  auto file = FromBuffer(static_cast<const uint8_t*>(map), size, path);
  if (!file.ok()) {
    if (map != nullptr) munmap(map, size);
    return file.status();
  }
  (*file)->map_ = map;
  (*file)->map_size_ = size;
  return file;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromBuffer(
    const uint8_t* data, size_t size, const std::string& path) {
  auto corrupt = [&](const std::string& m) {
    return absl::DataLossError(
        absl::StrCat(path, ": corrupt safetensors file: ", m));
  };
  if (size < 8)
    return corrupt(absl::StrCat(
        "file is ", size, " bytes, shorter than the 8-byte header length"));
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | data[i];
  if (header_len > kMaxHeaderBytes || header_len > size - 8) {
    return corrupt(absl::StrCat("header length ", header_len,
                                " exceeds the file (", size, " bytes) or the ",
                                kMaxHeaderBytes, "-byte limit"));
  }
  const std::string header(reinterpret_cast<const char*>(data + 8), header_len);
  auto root = json::Parse(header, absl::StrCat(path, " header"));
  if (!root.ok()) return corrupt(std::string(root.status().message()));
  if (!root->is_object()) return corrupt("header is not a JSON object");
  const uint8_t* buffer = data + 8 + header_len;
  const uint64_t buffer_len = size - 8 - header_len;
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  for (const auto& [name, entry] : root->items()) {
    if (name == "__metadata__") continue;
    const std::string what = absl::StrCat(path, ": tensor \"", name, "\"");
    if (!entry.is_object())
      return corrupt(absl::StrCat("tensor \"", name, "\" is not an object"));
    TensorView t;
    t.name = name;
    ASSIGN_OR_RETURN(std::string dtype, json::GetString(entry, "dtype", what));
    auto parsed = ParseStDType(dtype);
    if (!parsed.ok())
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": ", parsed.status().message()));
    t.dtype = *parsed;
    const json::Value* shape = json::Find(entry, "shape");
    const json::Value* offsets = json::Find(entry, "data_offsets");
    if (shape == nullptr || !shape->is_array() || offsets == nullptr ||
        !offsets->is_array() || offsets->size() != 2 || shape->size() > 8) {
      return corrupt(absl::StrCat(
          "tensor \"", name, "\" needs a shape list and two data_offsets"));
    }
    int64_t numel = 1;
    for (const json::Value& d : *shape) {
      ASSIGN_OR_RETURN(int64_t dim, json::AsInt(d, what, 0, int64_t{1} << 40));
      t.shape.push_back(dim);
      if (dim != 0 && numel > (int64_t{1} << 50) / dim)
        return corrupt(absl::StrCat("tensor \"", name, "\" is too large"));
      numel *= dim;
    }
    ASSIGN_OR_RETURN(int64_t begin, json::AsInt((*offsets)[0], what, 0));
    ASSIGN_OR_RETURN(int64_t end, json::AsInt((*offsets)[1], what, 0));
    if (begin > end || static_cast<uint64_t>(end) > buffer_len) {
      return corrupt(absl::StrCat("tensor \"", name, "\" data_offsets [", begin,
                                  ", ", end, "] lie outside the ", buffer_len,
                                  "-byte data buffer (truncated file?)"));
    }
    t.nbytes = static_cast<size_t>(end - begin);
    if (static_cast<uint64_t>(numel) * DTypeBytes(t.dtype) != t.nbytes) {
      return corrupt(absl::StrCat("tensor \"", name, "\" has ", t.nbytes,
                                  " bytes but shape needs ",
                                  numel * DTypeBytes(t.dtype)));
    }
    t.data = buffer + begin;
    file->tensors_.emplace(name, std::move(t));
  }
  return file;
}

absl::StatusOr<const TensorView*> SafetensorsFile::Find(
    const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(
        absl::StrCat(path_, ": missing tensor \"", name, "\""));
  }
  return &it->second;
}

void TensorToFloat(const TensorView& t, std::vector<float>* out) {
  const int64_t n = t.NumElements();
  out->resize(n);
  // An empty tensor has no data pointer to copy from (memcpy with null is UB).
  if (n == 0) return;
  switch (t.dtype) {
    case DType::kF32:
      std::memcpy(out->data(), t.data, n * 4);
      break;
    case DType::kF16:
    case DType::kBF16: {
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, t.data + 2 * i, 2);
        (*out)[i] = t.dtype == DType::kF16 ? F16ToFloat(h) : Bf16ToFloat(h);
      }
      break;
    }
    case DType::kI8:
    case DType::kFp8E4M3:  // never a safetensors dtype here (see ParseStDType)
      break;
  }
}

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<TensorToWrite>& tensors) {
  json::OrderedValue root;
  root["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    const uint64_t bytes = n * DTypeBytes(t.dtype);
    root[t.name] = {{"dtype", StDTypeName(t.dtype)},
                    {"shape", t.shape},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string header = json::Dump(root);
  while ((header.size() + 8) % 8 != 0)
    header += ' ';  // keep the data 8-byte aligned
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out)
    return absl::PermissionDeniedError(absl::StrCat(path, ": cannot write"));
  uint8_t len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<uint8_t>(header.size() >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(header.data(), header.size());
  std::vector<uint8_t> buf;
  for (const auto& t : tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    buf.resize(n * DTypeBytes(t.dtype));
    for (int64_t i = 0; i < n; ++i) {
      if (t.dtype == DType::kF32) {
        std::memcpy(&buf[4 * i], &t.values[i], 4);
      } else {
        const uint16_t h = t.dtype == DType::kF16 ? FloatToF16(t.values[i])
                                                  : FloatToBf16(t.values[i]);
        std::memcpy(&buf[2 * i], &h, 2);
      }
    }
    out.write(reinterpret_cast<const char*>(buf.data()), buf.size());
  }
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace pdserve::engine
