// The wire form of one KvChunk (internal.proto) built and read without
// copying KV bytes in user space.
//
// ChunkEncoder lays a chunk out as gRPC slices: small owned slices for the
// protobuf tags and lengths, and slices that point straight at the sender's
// pool for each span's data and scales. Those slices are counted by a
// SliceTracker, so the sender can wait until gRPC has let go of every one of
// them before its blocks are unpinned.
//
// DecodeChunk parses a received message from its slices as they came off
// the socket, handing each span's data to the caller as one or more views
// into those slices (a span may straddle slices); the caller copies them
// straight into its pool. Malformed input is INVALID_ARGUMENT, never a
// crash or an out-of-bounds read.
//
// Both speak the exact protobuf encoding of KvChunk, so either end
// interoperates with a peer that uses the generated message classes.
//
// ChunkEncoder and DecodeChunk are not thread-safe; SliceTracker is.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "pdserve/v1/internal.pb.h"

namespace pdserve::kv_transfer {

// Counts slices that reference memory the owner must keep alive.
class SliceTracker {
 public:
  // A slice over [data, data + bytes), not copied; counted until gRPC drops
  // its last reference.
  grpc::Slice Wrap(const uint8_t* data, size_t bytes);
  // Waits until every wrapped slice was released, at most until `deadline`.
  // Returns false on timeout (the owner must then not free the memory).
  bool AwaitReleased(absl::Time deadline);
  int64_t outstanding() const;

 private:
  static void Release(void* tracker);
  mutable absl::Mutex mu_;
  int64_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;
};

class ChunkEncoder {
 public:
  // The first chunk of a stream carries the header.
  void SetHeader(const v1::KvTransferHeader& header);
  // Appends one span; `data` and `scales` are referenced, not copied, and
  // must stay valid until `tracker` reports them released.
  void AddSpan(uint32_t layer, uint32_t block_index, const uint8_t* data,
               size_t data_bytes, const uint8_t* scales, size_t scale_bytes,
               SliceTracker* tracker);
  bool empty() const { return parts_.empty(); }
  size_t payload_bytes() const { return payload_bytes_; }  // span bytes
  // The chunk as a ByteBuffer; the encoder is empty again.
  grpc::ByteBuffer Take();

 private:
  // A part is either a range of meta_ (owned bytes) or a wrapped slice.
  struct Part {
    size_t meta_begin = 0, meta_end = 0;
    grpc::Slice slice;
    bool is_meta = true;
  };
  void AppendMetaEnd();  // closes the open meta range, if any
  std::string meta_;
  size_t meta_open_ = 0;  // start of the meta range not yet in parts_
  std::vector<Part> parts_;
  size_t payload_bytes_ = 0;
};

struct DecodedSpan {
  uint32_t layer = 0;
  uint32_t block_index = 0;
  // Views into the message's slices, in order; their sizes add up to the
  // field's length.
  absl::InlinedVector<std::string_view, 2> data;
  absl::InlinedVector<std::string_view, 1> scales;
};

// Parses one KvChunk. Calls `on_header` for a header and `on_span` for each
// span, in wire order; stops at the first error either returns. The views
// are valid while `slices` lives.
absl::Status DecodeChunk(
    const std::vector<grpc::Slice>& slices,
    absl::FunctionRef<absl::Status(const v1::KvTransferHeader&)> on_header,
    absl::FunctionRef<absl::Status(const DecodedSpan&)> on_span);

}  // namespace pdserve::kv_transfer
