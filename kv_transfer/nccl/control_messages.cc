#include "kv_transfer/nccl/control_messages.h"

#include <cstring>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kv_transfer/byte_codec.h"
#include "wire/enums.h"

namespace pdserve::kv_transfer::nccl {
namespace {

enum Kind : uint8_t {
  kHello = 1,
  kBegin = 2,
  kManifest = 3,
  kEnd = 4,
  kReply = 5
};

using Writer = ByteWriter;
using Reader = ByteReader;

void WriteLayout(Writer& w, const KvLayout& l) {
  w.Str(l.fingerprint);
  w.I32(l.num_layers);
  w.I32(l.kv_heads);
  w.I32(l.head_dim);
  w.I32(l.block_size);
  // The dtype as its internal-proto number (0: unknown), so both ends agree
  // on one numbering.
  w.I32(l.dtype ? static_cast<int32_t>(wire::DTypeToProto(*l.dtype)) : 0);
  // MLA geometry (0 for MHA/GQA), compared at the handshake like the rest.
  w.I32(l.kv_lora_rank);
  w.I32(l.qk_rope_head_dim);
}

bool ReadLayout(Reader& r, KvLayout* l) {
  int32_t dtype = 0;
  if (!(r.Str(&l->fingerprint) && r.I32(&l->num_layers) &&
        r.I32(&l->kv_heads) && r.I32(&l->head_dim) && r.I32(&l->block_size) &&
        r.I32(&dtype) && r.I32(&l->kv_lora_rank) &&
        r.I32(&l->qk_rope_head_dim))) {
    return false;
  }
  l->dtype = wire::DTypeFromProto(static_cast<v1::KvDtype>(dtype));
  return true;
}

}  // namespace

std::string EncodeMessage(const ControlMessage& message) {
  Writer w;
  std::visit(
      [&w](const auto& m) {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, HelloMessage>) {
          w.U8(kHello);
          w.Str(m.unique_id);
          w.Str(m.sender_id);
        } else if constexpr (std::is_same_v<T, BeginMessage>) {
          w.U8(kBegin);
          w.U64(m.transfer_id);
          w.U64(m.reservation_id);
          w.Str(m.request_id);
          WriteLayout(w, m.layout);
        } else if constexpr (std::is_same_v<T, ManifestMessage>) {
          w.U8(kManifest);
          w.U64(m.transfer_id);
          w.U32(static_cast<uint32_t>(m.spans.size()));
          for (const SpanName& s : m.spans) {
            w.I32(s.layer);
            w.I32(s.block_index);
          }
        } else if constexpr (std::is_same_v<T, EndMessage>) {
          w.U8(kEnd);
          w.U64(m.transfer_id);
          w.U8(m.ok ? 1 : 0);
        } else {
          static_assert(std::is_same_v<T, ReplyMessage>);
          w.U8(kReply);
          w.U32(static_cast<uint32_t>(m.code));
          w.Str(m.message);
          w.U64(m.max_batch_bytes);
        }
      },
      message);
  return w.Take();
}

absl::StatusOr<ControlMessage> DecodeMessage(std::string_view bytes) {
  Reader r(bytes);
  uint8_t kind = 0;
  bool ok = r.U8(&kind);
  ControlMessage out;
  switch (ok ? kind : 0) {
    case kHello: {
      HelloMessage m;
      ok = r.Str(&m.unique_id) && r.Str(&m.sender_id);
      out = std::move(m);
      break;
    }
    case kBegin: {
      BeginMessage m;
      ok = r.U64(&m.transfer_id) && r.U64(&m.reservation_id) &&
           r.Str(&m.request_id) && ReadLayout(r, &m.layout);
      out = std::move(m);
      break;
    }
    case kManifest: {
      ManifestMessage m;
      uint32_t n = 0;
      // The count is checked against the bytes present before reserving.
      ok = r.U64(&m.transfer_id) && r.U32(&n) && n <= r.remaining() / 8;
      if (ok) m.spans.resize(n);
      for (uint32_t i = 0; ok && i < n; ++i) {
        ok = r.I32(&m.spans[i].layer) && r.I32(&m.spans[i].block_index);
      }
      out = std::move(m);
      break;
    }
    case kEnd: {
      EndMessage m;
      uint8_t flag = 0;
      ok = r.U64(&m.transfer_id) && r.U8(&flag) && flag <= 1;
      m.ok = flag == 1;
      out = m;
      break;
    }
    case kReply: {
      ReplyMessage m;
      uint32_t code = 0;
      ok = r.U32(&code) &&
           code <= static_cast<uint32_t>(absl::StatusCode::kUnauthenticated) &&
           r.Str(&m.message) && r.U64(&m.max_batch_bytes);
      m.code = static_cast<absl::StatusCode>(code);
      out = std::move(m);
      break;
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("KV control message of unknown kind ",
                       static_cast<int>(kind), " (", bytes.size(), " bytes)"));
  }
  if (!ok || r.remaining() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed KV control message of kind ",
                     static_cast<int>(kind), " (", bytes.size(), " bytes)"));
  }
  return out;
}

ReplyMessage ReplyFor(const absl::Status& status) {
  ReplyMessage reply;
  reply.code = status.code();
  reply.message = std::string(status.message());
  return reply;
}

absl::Status StatusOf(const ReplyMessage& reply) {
  return absl::Status(reply.code, reply.message);
}

}  // namespace pdserve::kv_transfer::nccl
