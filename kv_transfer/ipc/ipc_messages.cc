#include "kv_transfer/ipc/ipc_messages.h"

#include <cstring>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kv_transfer/byte_codec.h"
#include "kv_transfer/grpc/grpc_transport.h"

namespace pdserve::kv_transfer::ipc {
namespace {

enum Kind : uint8_t {
  kOpen = 1,
  kManifest = 2,
  kCopied = 3,
  kEnd = 4,
  kReply = 5
};

using Writer = ByteWriter;
using Reader = ByteReader;

bool ValidKind(uint8_t k) {
  return k == static_cast<uint8_t>(PeerMemoryKind::kShm) ||
         k == static_cast<uint8_t>(PeerMemoryKind::kCudaIpc);
}

// The layout as the internal proto's KvLayout bytes, so both ends agree on
// one encoding of every handshake field (MLA fields included).
void WriteLayout(Writer& w, const KvLayout& l) {
  w.Str(ToProto(l).SerializeAsString());
}
bool ReadLayout(Reader& r, KvLayout* l) {
  std::string bytes;
  v1::KvLayout proto;
  if (!r.Str(&bytes) || !proto.ParseFromString(bytes)) return false;
  *l = FromProto(proto);
  return true;
}

void WriteExport(Writer& w, const KvExport& e) {
  w.U64(e.export_id);
  w.U8(static_cast<uint8_t>(e.kind));
  w.I32(e.device);
  w.I64(e.num_blocks);
  w.U64(e.data_bytes);
  w.U64(e.scale_bytes);
  w.U32(static_cast<uint32_t>(e.regions.size()));
  for (const ExportedRegion& r : e.regions) {
    w.U64(r.bytes);
    w.Str(r.handle);
  }
  w.U32(static_cast<uint32_t>(e.layers.size()));
  for (const LayerPlacement& p : e.layers) {
    w.U32(p.data_region);
    w.U64(p.data_offset);
    w.U32(p.scale_region);
    w.U64(p.scale_offset);
  }
}
bool ReadExport(Reader& r, KvExport* e) {
  uint8_t kind = 0;
  uint32_t n = 0;
  if (!(r.U64(&e->export_id) && r.U8(&kind) && ValidKind(kind) &&
        r.I32(&e->device) && r.I64(&e->num_blocks) && r.U64(&e->data_bytes) &&
        r.U64(&e->scale_bytes) && r.Count(&n, 12))) {
    return false;
  }
  e->kind = static_cast<PeerMemoryKind>(kind);
  e->regions.resize(n);
  for (ExportedRegion& region : e->regions) {
    if (!(r.U64(&region.bytes) && r.Str(&region.handle))) return false;
  }
  if (!r.Count(&n, 24)) return false;
  e->layers.resize(n);
  for (LayerPlacement& p : e->layers) {
    if (!(r.U32(&p.data_region) && r.U64(&p.data_offset) &&
          r.U32(&p.scale_region) && r.U64(&p.scale_offset))) {
      return false;
    }
  }
  return true;
}

}  // namespace

std::string EncodeMessage(const IpcMessage& message) {
  Writer w;
  std::visit(
      [&w](const auto& m) {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, OpenMessage>) {
          w.U8(kOpen);
          w.U8(static_cast<uint8_t>(m.kind));
          w.Str(m.sender_id);
          w.U64(m.reservation_id);
          w.Str(m.request_id);
          WriteLayout(w, m.layout);
        } else if constexpr (std::is_same_v<T, ManifestMessage>) {
          w.U8(kManifest);
          w.U32(static_cast<uint32_t>(m.spans.size()));
          for (const SpanName& s : m.spans) {
            w.I32(s.layer);
            w.I32(s.block_index);
          }
        } else if constexpr (std::is_same_v<T, CopiedMessage>) {
          w.U8(kCopied);
          w.U8(m.ok ? 1 : 0);
        } else if constexpr (std::is_same_v<T, EndMessage>) {
          w.U8(kEnd);
          w.U8(m.ok ? 1 : 0);
        } else {
          static_assert(std::is_same_v<T, ReplyMessage>);
          w.U8(kReply);
          w.U32(static_cast<uint32_t>(m.code));
          w.Str(m.message);
          w.U8(m.exported ? 1 : 0);
          if (m.exported) WriteExport(w, *m.exported);
          w.U32(static_cast<uint32_t>(m.blocks.size()));
          for (int32_t b : m.blocks) w.I32(b);
        }
      },
      message);
  return w.Take();
}

absl::StatusOr<IpcMessage> DecodeMessage(std::string_view bytes) {
  Reader r(bytes);
  uint8_t kind = 0;
  bool ok = r.U8(&kind);
  IpcMessage out;
  switch (ok ? kind : 0) {
    case kOpen: {
      OpenMessage m;
      uint8_t backend = 0;
      ok = r.U8(&backend) && ValidKind(backend) && r.Str(&m.sender_id) &&
           r.U64(&m.reservation_id) && r.Str(&m.request_id) &&
           ReadLayout(r, &m.layout);
      m.kind = static_cast<PeerMemoryKind>(backend);
      out = std::move(m);
      break;
    }
    case kManifest: {
      ManifestMessage m;
      uint32_t n = 0;
      ok = r.Count(&n, 8);
      if (ok) m.spans.resize(n);
      for (uint32_t i = 0; ok && i < n; ++i) {
        ok = r.I32(&m.spans[i].layer) && r.I32(&m.spans[i].block_index);
      }
      out = std::move(m);
      break;
    }
    case kCopied:
    case kEnd: {
      uint8_t flag = 0;
      ok = r.U8(&flag) && flag <= 1;
      if (kind == kCopied) {
        out = CopiedMessage{flag == 1};
      } else {
        out = EndMessage{flag == 1};
      }
      break;
    }
    case kReply: {
      ReplyMessage m;
      uint32_t code = 0, n = 0;
      uint8_t has_export = 0;
      ok = r.U32(&code) &&
           code <= static_cast<uint32_t>(absl::StatusCode::kUnauthenticated) &&
           r.Str(&m.message) && r.U8(&has_export) && has_export <= 1;
      m.code = static_cast<absl::StatusCode>(code);
      if (ok && has_export == 1) {
        m.exported.emplace();
        ok = ReadExport(r, &*m.exported);
      }
      ok = ok && r.Count(&n, 4);
      if (ok) m.blocks.resize(n);
      for (uint32_t i = 0; ok && i < n; ++i) ok = r.I32(&m.blocks[i]);
      out = std::move(m);
      break;
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("KV ipc control message of unknown kind ",
                       static_cast<int>(kind), " (", bytes.size(), " bytes)"));
  }
  if (!ok || r.remaining() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed KV ipc control message of kind ",
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

}  // namespace pdserve::kv_transfer::ipc
