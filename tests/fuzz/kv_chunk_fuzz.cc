// Fuzzes the receiving side of KV transfer: KvChunk messages decoded from
// arbitrary bytes are fed, as KvTransferService::Push does, through the real
// KvReceiver (handshake, per-span validation, completion) against a real
// reservation in a real KvPool.
//
// Input: one byte choosing the KV dtype (low bits) and whether the sender
// ends cleanly (high bit), then frames of [u16 little-endian length][a
// serialized pdserve.v1.KvChunk]. The reservation is "r1" / id 1 for logical
// blocks {6, 2, 4} with the first block already present, so only physical
// blocks 2 and 4 may change. Beyond ASan/UBSan, the target checks the safety
// contract itself: every other block (data and scales) keeps its sentinel
// bytes, and the reservation is gone once Wait returns.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "absl/time/time.h"
#include "engine/kv_cache.h"
#include "kv_transfer/grpc/grpc_transport.h"
#include "kv_transfer/receiver.h"
#include "pdserve/v1/internal.pb.h"

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

  // The Push loop: the first message carries the header, then every span of
  // every message is written until one is rejected.
  size_t at = 1;
  bool begun = false, rejected = false;
  uint64_t stream_id = 0;
  while (at + 2 <= size && !rejected) {
    const size_t len = data[at] | (size_t{data[at + 1]} << 8);
    at += 2;
    if (len > size - at) break;
    pdserve::v1::KvChunk chunk;
    const bool parsed = chunk.ParseFromArray(data + at, static_cast<int>(len));
    at += len;
    if (!parsed) break;  // gRPC would fail the stream: no more writes
    if (!begun) {
      if (!chunk.has_header()) break;
      stream_id = chunk.header().reservation_id();
      if (!receiver
               .Begin(stream_id, chunk.header().request_id(),
                      pdserve::kv_transfer::FromProto(chunk.header().layout()))
               .ok())
        break;
      begun = true;
    }
    for (const auto& span : chunk.spans()) {
      if (!receiver
               .Write(stream_id, static_cast<int32_t>(span.layer()),
                      static_cast<int32_t>(span.block_index()), span.data(),
                      span.scales())
               .ok()) {
        rejected = true;
        break;
      }
    }
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
