#include "kv_transfer/grpc/chunk_codec.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace pdserve::kv_transfer {
namespace {

// Protobuf wire types and the KvChunk / KvBlockSpan field tags.
constexpr uint32_t kVarint = 0, kFixed64 = 1, kLengthDelimited = 2,
                   kFixed32 = 5;
constexpr uint8_t kChunkHeaderTag = (1 << 3) | kLengthDelimited;
constexpr uint8_t kChunkSpanTag = (2 << 3) | kLengthDelimited;
constexpr uint8_t kSpanLayerTag = (1 << 3) | kVarint;
constexpr uint8_t kSpanBlockTag = (2 << 3) | kVarint;
constexpr uint8_t kSpanDataTag = (3 << 3) | kLengthDelimited;
constexpr uint8_t kSpanScalesTag = (4 << 3) | kLengthDelimited;

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

void PutVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

absl::Status Malformed(const char* what) {
  return absl::InvalidArgumentError(absl::StrCat("malformed KV chunk: ", what));
}

// Reads protobuf wire format across a message's slices, never past `limit`.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices)
      : slices_(slices) {
    for (const grpc::Slice& s : slices_) limit_ += s.size();
    Normalize();
  }
  size_t consumed() const { return consumed_; }
  size_t limit() const { return limit_; }
  void set_limit(size_t limit) { limit_ = limit; }
  bool done() const { return consumed_ >= limit_; }

  bool ReadVarint(uint64_t* out) {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!ReadByte(&b)) return false;
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) {
        *out = v;
        return true;
      }
    }
    return false;  // more than 10 bytes
  }
  template <typename Views>
  bool ReadPieces(size_t n, Views* out) {
    if (n > limit_ - consumed_) return false;
    while (n > 0) {
      const grpc::Slice& s = slices_[index_];
      const size_t take = std::min(n, s.size() - offset_);
      out->emplace_back(reinterpret_cast<const char*>(s.begin()) + offset_,
                        take);
      Advance(take);
      n -= take;
    }
    return true;
  }
  bool Skip(size_t n) {
    if (n > limit_ - consumed_) return false;
    while (n > 0) {
      const size_t take = std::min(n, slices_[index_].size() - offset_);
      Advance(take);
      n -= take;
    }
    return true;
  }
  bool SkipField(uint32_t wire_type) {
    uint64_t n;
    switch (wire_type) {
      case kVarint:
        return ReadVarint(&n);
      case kFixed64:
        return Skip(8);
      case kLengthDelimited:
        return ReadVarint(&n) && Skip(n);
      case kFixed32:
        return Skip(4);
      default:
        return false;  // groups are not part of this message
    }
  }

 private:
  bool ReadByte(uint8_t* b) {
    if (consumed_ >= limit_) return false;
    *b = slices_[index_].begin()[offset_];
    Advance(1);
    return true;
  }
  void Advance(size_t n) {
    offset_ += n;
    consumed_ += n;
    Normalize();
  }
  // Moves past exhausted (and empty) slices.
  void Normalize() {
    while (index_ < slices_.size() && offset_ == slices_[index_].size()) {
      ++index_;
      offset_ = 0;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0, offset_ = 0, consumed_ = 0, limit_ = 0;
};

}  // namespace

grpc::Slice SliceTracker::Wrap(const uint8_t* data, size_t bytes) {
  {
    absl::MutexLock l(&mu_);
    ++outstanding_;
  }
  return grpc::Slice(const_cast<uint8_t*>(data), bytes, &SliceTracker::Release,
                     this);
}

void SliceTracker::Release(void* tracker) {
  auto* t = static_cast<SliceTracker*>(tracker);
  absl::MutexLock l(&t->mu_);
  --t->outstanding_;
}

bool SliceTracker::AwaitReleased(absl::Time deadline) {
  absl::MutexLock l(&mu_);
  return mu_.AwaitWithDeadline(
      absl::Condition(
          +[](int64_t* n) { return *n == 0; }, &outstanding_),
      deadline);
}

int64_t SliceTracker::outstanding() const {
  absl::MutexLock l(&mu_);
  return outstanding_;
}

void ChunkEncoder::SetHeader(const v1::KvTransferHeader& header) {
  const std::string bytes = header.SerializeAsString();
  meta_.push_back(static_cast<char>(kChunkHeaderTag));
  PutVarint(&meta_, bytes.size());
  meta_ += bytes;
}

void ChunkEncoder::AppendMetaEnd() {
  if (meta_.size() > meta_open_) {
    Part p;
    p.meta_begin = meta_open_;
    p.meta_end = meta_.size();
    parts_.push_back(std::move(p));
    meta_open_ = meta_.size();
  }
}

void ChunkEncoder::AddSpan(uint32_t layer, uint32_t block_index,
                           const uint8_t* data, size_t data_bytes,
                           const uint8_t* scales, size_t scale_bytes,
                           SliceTracker* tracker) {
  // Zero scalars are omitted and so are empty scales, as protobuf does.
  size_t body = 1 + VarintSize(data_bytes) + data_bytes;
  if (layer != 0) body += 1 + VarintSize(layer);
  if (block_index != 0) body += 1 + VarintSize(block_index);
  if (scale_bytes != 0) body += 1 + VarintSize(scale_bytes) + scale_bytes;
  meta_.push_back(static_cast<char>(kChunkSpanTag));
  PutVarint(&meta_, body);
  if (layer != 0) {
    meta_.push_back(static_cast<char>(kSpanLayerTag));
    PutVarint(&meta_, layer);
  }
  if (block_index != 0) {
    meta_.push_back(static_cast<char>(kSpanBlockTag));
    PutVarint(&meta_, block_index);
  }
  meta_.push_back(static_cast<char>(kSpanDataTag));
  PutVarint(&meta_, data_bytes);
  AppendMetaEnd();
  if (data_bytes != 0) {
    Part p;
    p.is_meta = false;
    p.slice = tracker->Wrap(data, data_bytes);
    parts_.push_back(std::move(p));
  }
  if (scale_bytes != 0) {
    // A few dozen bytes: cheaper to copy than to reference.
    meta_.push_back(static_cast<char>(kSpanScalesTag));
    PutVarint(&meta_, scale_bytes);
    meta_.append(reinterpret_cast<const char*>(scales), scale_bytes);
  }
  payload_bytes_ += data_bytes + scale_bytes;
}

grpc::ByteBuffer ChunkEncoder::Take() {
  AppendMetaEnd();
  const grpc::Slice meta(meta_);
  std::vector<grpc::Slice> slices;
  slices.reserve(parts_.size());
  for (Part& p : parts_) {
    slices.push_back(p.is_meta ? meta.sub(p.meta_begin, p.meta_end)
                               : std::move(p.slice));
  }
  grpc::ByteBuffer out(slices.data(), slices.size());
  meta_.clear();
  meta_open_ = 0;
  parts_.clear();
  payload_bytes_ = 0;
  return out;
}

absl::Status DecodeChunk(
    const std::vector<grpc::Slice>& slices,
    absl::FunctionRef<absl::Status(const v1::KvTransferHeader&)> on_header,
    absl::FunctionRef<absl::Status(const DecodedSpan&)> on_span) {
  SliceReader in(slices);
  const size_t end = in.limit();
  DecodedSpan span;
  while (!in.done()) {
    uint64_t tag, len;
    if (!in.ReadVarint(&tag)) return Malformed("truncated field tag");
    const uint32_t field = static_cast<uint32_t>(tag >> 3);
    const uint32_t wire = static_cast<uint32_t>(tag & 7);
    if ((field == 1 || field == 2) && wire == kLengthDelimited) {
      if (!in.ReadVarint(&len) || len > end - in.consumed()) {
        return Malformed("truncated field length");
      }
      if (field == 1) {
        absl::InlinedVector<std::string_view, 2> pieces;
        in.ReadPieces(len, &pieces);
        std::string bytes;
        for (std::string_view p : pieces) bytes.append(p);
        v1::KvTransferHeader header;
        if (!header.ParseFromString(bytes)) return Malformed("bad header");
        if (absl::Status s = on_header(header); !s.ok()) return s;
        continue;
      }
      // A span: its fields, up to the span's end.
      span.layer = span.block_index = 0;
      span.data.clear();
      span.scales.clear();
      const size_t span_end = in.consumed() + len;
      in.set_limit(span_end);
      while (!in.done()) {
        uint64_t t, v;
        if (!in.ReadVarint(&t)) return Malformed("truncated span field");
        const uint32_t f = static_cast<uint32_t>(t >> 3);
        const uint32_t w = static_cast<uint32_t>(t & 7);
        if ((f == 1 || f == 2) && w == kVarint) {
          if (!in.ReadVarint(&v)) return Malformed("truncated span index");
          (f == 1 ? span.layer : span.block_index) = static_cast<uint32_t>(v);
        } else if ((f == 3 || f == 4) && w == kLengthDelimited) {
          if (!in.ReadVarint(&v) || v > span_end - in.consumed()) {
            return Malformed("truncated span bytes");
          }
          // The last occurrence wins, as in protobuf.
          if (f == 3) {
            span.data.clear();
            in.ReadPieces(v, &span.data);
          } else {
            span.scales.clear();
            in.ReadPieces(v, &span.scales);
          }
        } else if (!in.SkipField(w)) {
          return Malformed("bad span field");
        }
      }
      if (in.consumed() != span_end) return Malformed("span overruns");
      in.set_limit(end);
      if (absl::Status s = on_span(span); !s.ok()) return s;
      continue;
    }
    if (!in.SkipField(wire)) return Malformed("bad field");
  }
  if (in.consumed() != end) return Malformed("trailing bytes");
  return absl::OkStatus();
}

}  // namespace pdserve::kv_transfer
