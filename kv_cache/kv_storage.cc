#include "kv_cache/kv_storage.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace pdserve::engine {
namespace {

class PlainStaging final : public HostStagingBuffer {
 public:
  explicit PlainStaging(size_t bytes) : bytes_(bytes) {}
  void* data() override { return bytes_.data(); }
  size_t size() const override { return bytes_.size(); }

 private:
  std::vector<unsigned char> bytes_;
};

}  // namespace

std::string KvMemoryName(const KvMemory& m) {
  return m.kind == MemoryKind::kHost ? std::string("host")
                                     : absl::StrCat("cuda:", m.device);
}

absl::Status MissingScales(int32_t layer, int64_t block) {
  return absl::InvalidArgumentError(absl::StrCat(
      "KV span (layer ", layer, ", block ", block,
      ") has scales but no scale buffer was given; refusing to copy its data "
      "without them"));
}

std::unique_ptr<HostStagingBuffer> KvStorage::AllocateStaging(size_t bytes) {
  return std::make_unique<PlainStaging>(bytes);
}

}  // namespace pdserve::engine
