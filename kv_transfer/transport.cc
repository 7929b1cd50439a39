#include "kv_transfer/transport.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pdserve::kv_transfer {

KvLayout KvLayout::FromSpec(const engine::KvCacheSpec& spec,
                            const std::string& fingerprint) {
  return {fingerprint,       spec.num_layers,      spec.num_kv_heads,
          spec.head_dim,     spec.block_size,      spec.dtype,
          spec.kv_lora_rank, spec.qk_rope_head_dim};
}

namespace {
std::string DTypeText(const std::optional<DType>& t) {
  return t ? DTypeName(*t) : "unknown";
}
}  // namespace

std::string KvLayout::DebugString() const {
  return absl::StrCat("fingerprint=", fingerprint, " layers=", num_layers,
                      " kv_heads=", kv_heads, " head_dim=", head_dim,
                      " block_size=", block_size, " dtype=", DTypeText(dtype),
                      kv_lora_rank > 0 || qk_rope_head_dim > 0
                          ? absl::StrCat(" kv_lora_rank=", kv_lora_rank,
                                         " qk_rope_head_dim=", qk_rope_head_dim)
                          : "");
}

const char* KvTransportName(KvTransportKind kind) {
  switch (kind) {
    case KvTransportKind::kGrpc:
      return "grpc";
    case KvTransportKind::kNccl:
      return "nccl";
    case KvTransportKind::kShm:
      return "shm";
    case KvTransportKind::kCudaIpc:
      return "cuda_ipc";
  }
  return "?";
}

absl::StatusOr<KvTransportKind> ParseKvTransport(absl::string_view name) {
  if (name == "grpc") return KvTransportKind::kGrpc;
  if (name == "nccl") return KvTransportKind::kNccl;
  if (name == "shm") return KvTransportKind::kShm;
  if (name == "cuda_ipc") return KvTransportKind::kCudaIpc;
  return absl::InvalidArgumentError(
      absl::StrCat("--kv-transport must be grpc, nccl, shm or cuda_ipc, got \"",
                   name, "\""));
}

absl::Status CheckLayouts(const KvLayout& sender, const KvLayout& receiver) {
  std::vector<std::string> diffs;
  auto cmp = [&](const char* name, const auto& a, const auto& b) {
    if (a != b)
      diffs.push_back(absl::StrCat(name, ": sender ", a, " vs receiver ", b));
  };
  cmp("model fingerprint", sender.fingerprint, receiver.fingerprint);
  cmp("num_layers", sender.num_layers, receiver.num_layers);
  cmp("kv_heads", sender.kv_heads, receiver.kv_heads);
  cmp("head_dim", sender.head_dim, receiver.head_dim);
  cmp("block_size", sender.block_size, receiver.block_size);
  // An MLA cache (latent rows) and an MHA/GQA one (K and V per head) never
  // exchange blocks, even where the row widths happen to agree.
  auto attention = [](const KvLayout& l) {
    return l.kv_lora_rank > 0 ? "MLA latent" : "MHA/GQA";
  };
  if ((sender.kv_lora_rank > 0) != (receiver.kv_lora_rank > 0)) {
    diffs.push_back(absl::StrCat("kv cache kind: sender ", attention(sender),
                                 " vs receiver ", attention(receiver)));
  }
  cmp("kv_lora_rank", sender.kv_lora_rank, receiver.kv_lora_rank);
  cmp("qk_rope_head_dim", sender.qk_rope_head_dim, receiver.qk_rope_head_dim);
  if (sender.dtype != receiver.dtype || !sender.dtype) {
    diffs.push_back(absl::StrCat("kv dtype: sender ", DTypeText(sender.dtype),
                                 " vs receiver ", DTypeText(receiver.dtype)));
  }
  if (diffs.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("KV layout mismatch: ", absl::StrJoin(diffs, "; ")));
}

}  // namespace pdserve::kv_transfer
