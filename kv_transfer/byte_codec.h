// Little-endian binary writer/reader for the KV transports' control
// messages (kv_transfer/nccl/control_messages.cc, kv_transfer/ipc/
// ipc_messages.cc). The reader never reads past its input and bounds every
// length and count by the bytes actually present, so a hostile peer's frame
// fails to decode instead of allocating or overrunning.
#ifndef PDSERVE_KV_TRANSFER_BYTE_CODEC_H_
#define PDSERVE_KV_TRANSFER_BYTE_CODEC_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace pdserve::kv_transfer {

// Strings longer than this are rejected; no legitimate field comes close.
inline constexpr uint32_t kMaxControlStringBytes = 1 << 20;

class ByteWriter {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U32(uint32_t v) { Raw(&v, sizeof v); }
  void U64(uint64_t v) { Raw(&v, sizeof v); }
  void I32(int32_t v) { Raw(&v, sizeof v); }
  void I64(int64_t v) { Raw(&v, sizeof v); }
  void Str(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  std::string Take() { return std::move(out_); }

 private:
  // Little-endian hosts only (x86-64, aarch64), like the rest of pdserve's
  // binary formats.
  void Raw(const void* p, size_t n) {
    out_.append(static_cast<const char*>(p), n);
  }
  std::string out_;
};

class ByteReader {
 public:
  explicit ByteReader(std::string_view in) : in_(in) {}
  bool U8(uint8_t* v) { return Raw(v, sizeof *v); }
  bool U32(uint32_t* v) { return Raw(v, sizeof *v); }
  bool U64(uint64_t* v) { return Raw(v, sizeof *v); }
  bool I32(int32_t* v) { return Raw(v, sizeof *v); }
  bool I64(int64_t* v) { return Raw(v, sizeof *v); }
  bool Str(std::string* s) {
    uint32_t n = 0;
    if (!U32(&n) || n > kMaxControlStringBytes || n > in_.size()) return false;
    s->assign(in_.substr(0, n));
    in_.remove_prefix(n);
    return true;
  }
  // A count of items of at least `item_bytes` each, checked against the
  // bytes present before anything is reserved.
  bool Count(uint32_t* n, size_t item_bytes) {
    return U32(n) && *n <= in_.size() / item_bytes;
  }
  size_t remaining() const { return in_.size(); }

 private:
  bool Raw(void* p, size_t n) {
    if (in_.size() < n) return false;
    std::memcpy(p, in_.data(), n);
    in_.remove_prefix(n);
    return true;
  }
  std::string_view in_;
};

}  // namespace pdserve::kv_transfer

#endif  // PDSERVE_KV_TRANSFER_BYTE_CODEC_H_
