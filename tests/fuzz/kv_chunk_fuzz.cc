// Fuzzes the receiving side of KV transfer: KvChunk messages are decoded
// from arbitrary bytes by the real zero-copy decoder (DecodeChunk, fed the
// message in slices) and fed, as KvTransferService::Push does, through the
// real KvReceiver (handshake, per-span validation, completion) against a
// real reservation in a real KvPool.
//
// Input: one byte choosing the KV dtype (low bits) and whether the sender
// ends cleanly (high bit), then frames of [u16 little-endian length][u8
// slice size: 0 = one slice, else 1..32 bytes][a serialized KvChunk]. The
// reservation is "r1" / id 1 for logical blocks {6, 2, 4} with the first block
// already present, so only physical blocks 2 and 4 may change. Beyond
// ASan/UBSan, the target checks the safety contract itself: every other block
// (data and scales) keeps its sentinel bytes, and the reservation is gone once
// Wait returns.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kv_cache/kv_cache.h"
#include "kv_transfer/grpc/chunk_codec.h"
#include "kv_transfer/receiver.h"
#include "pdserve/v1/internal.pb.h"
#include "wire/enums.h"

namespace {

using pdserve::DType;
using pdserve::engine::KvCacheSpec;
using pdserve::engine::KvPool;
using pdserve::kv_transfer::KvLayout;
using pdserve::kv_transfer::KvReceiver;

constexpr int64_t kPoolBlocks = 8;
constexpr uint8_t kSentinel = 0xA5;
constexpr int32_t kReserved[] = {6, 2, 4};
constexpr int32_t kSkipBlocks = 1;

// kv_transfer::FromProto (grpc_transport.cc, kept out of this build so the
// target does not link the transport's channels and credentials).
KvLayout FromProto(const pdserve::v1::KvTransferHeader& header) {
  const pdserve::v1::KvLayout& p = header.layout();
  return {p.fingerprint(),
          static_cast<int32_t>(p.num_layers()),
          static_cast<int32_t>(p.kv_heads()),
          static_cast<int32_t>(p.head_dim()),
          static_cast<int32_t>(p.block_size()),
          pdserve::wire::DTypeFromProto(p.dtype())};
}

bool Writable(int64_t block) { return block == 2 || block == 4; }

void Fill(KvPool* pool) {
  const KvCacheSpec& spec = pool->spec();
  for (int l = 0; l < spec.num_layers; ++l) {
    for (int64_t b = 0; b < kPoolBlocks; ++b) {
      std::memset(pool->LayerBlockData(l, b), kSentinel,
                  spec.LayerBlockBytes());
      if (float* s = pool->LayerBlockScales(l, b))
        std::memset(s, kSentinel, 2 * spec.num_kv_heads * sizeof(float));
    }
  }
}

void CheckUntouched(KvPool* pool) {
  const KvCacheSpec& spec = pool->spec();
  for (int l = 0; l < spec.num_layers; ++l) {
    for (int64_t b = 0; b < kPoolBlocks; ++b) {
      if (Writable(b)) continue;
      const uint8_t* d = pool->LayerBlockData(l, b);
      for (int64_t i = 0; i < spec.LayerBlockBytes(); ++i)
        if (d[i] != kSentinel) std::abort();  // a write escaped the reservation
      if (const float* s = pool->LayerBlockScales(l, b)) {
        const auto* p = reinterpret_cast<const uint8_t*>(s);
        for (size_t i = 0; i < 2 * spec.num_kv_heads * sizeof(float); ++i)
          if (p[i] != kSentinel) std::abort();
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kI8};
  KvCacheSpec spec;
  spec.num_layers = 2;
  spec.num_kv_heads = 2;
  spec.head_dim = 4;
  spec.block_size = 4;
  spec.dtype = kDTypes[(data[0] & 0x7f) % 3];
  const bool sender_ok = (data[0] & 0x80) == 0;
  auto pool = KvPool::Create(spec, kPoolBlocks);
  if (!pool.ok()) std::abort();
  Fill(pool->get());
  KvReceiver receiver(pool->get(), KvLayout::FromSpec(spec, "00ff"));
  const uint64_t id = receiver.Expect(
      "r1", std::vector<int32_t>(std::begin(kReserved), std::end(kReserved)),
      kSkipBlocks);

  // The receiving loop of KvTransferService::Push (PushReactor::Consume):
  // each message is decoded from its slices by DecodeChunk; the first header
  // opens the stream, later headers are ignored, every span is written until
  // one is rejected.
  size_t at = 1;
  bool begun = false, rejected = false;
  uint64_t stream_id = 0;
  while (at + 3 <= size && !rejected) {
    const size_t len = data[at] | (size_t{data[at + 1]} << 8);
    const size_t slice_bytes = data[at + 2] == 0 ? len : data[at + 2] % 32 + 1;
    at += 3;
    if (len > size - at) break;
    // The message as the socket might deliver it: in slices of slice_bytes,
    // so fields and spans straddle slice boundaries.
    std::vector<grpc::Slice> slices;
    for (size_t i = 0; i < len; i += slice_bytes)
      slices.emplace_back(data + at + i, std::min(slice_bytes, len - i));
    at += len;
    bool first = !begun;
    const absl::Status s = pdserve::kv_transfer::DecodeChunk(
        slices,
        [&](const pdserve::v1::KvTransferHeader& header) -> absl::Status {
          if (!first) return absl::OkStatus();
          first = false;
          stream_id = header.reservation_id();
          absl::Status b =
              receiver.Begin(stream_id, header.request_id(), FromProto(header));
          if (!b.ok()) return b;
          begun = true;
          return absl::OkStatus();
        },
        [&](const pdserve::kv_transfer::DecodedSpan& span) -> absl::Status {
          if (!begun) return absl::InvalidArgumentError("no header");
          size_t data_bytes = 0;
          for (std::string_view p : span.data) data_bytes += p.size();
          if (data_bytes > len) std::abort();  // views beyond the message
          return receiver.Write(stream_id, static_cast<int32_t>(span.layer),
                                static_cast<int32_t>(span.block_index),
                                std::span<const std::string_view>(
                                    span.data.data(), span.data.size()),
                                std::span<const std::string_view>(
                                    span.scales.data(), span.scales.size()));
        });
    if (!s.ok()) rejected = true;  // gRPC ends the stream with that status
  }
  if (begun && !rejected) receiver.End(stream_id, sender_ok);
  (void)receiver.Wait(id, absl::ZeroDuration(), absl::Now());
  if (receiver.num_reservations() != 0) std::abort();
  // Once the reservation ended nothing more may be written.
  receiver.Cancel(id);
  if (receiver.Write(id, 0, 1, std::string(spec.LayerBlockBytes(), '\0'), "")
          .ok())
    std::abort();
  CheckUntouched(pool->get());
  return 0;
}
