#include "kernels/cpu/step_profile.h"

namespace pdserve::kernels {
namespace {

StepProfile*& Slot() {
  thread_local StepProfile* profile = nullptr;
  return profile;
}

}  // namespace

const char* PhaseName(Phase p) {
  switch (p) {
    case Phase::kSchedule:
      return "schedule";
    case Phase::kEmbedding:
      return "embedding";
    case Phase::kNorm:
      return "rms_norm";
    case Phase::kQkvGemm:
      return "qkv_gemm";
    case Phase::kQkvSplit:
      return "qkv_split";
    case Phase::kRope:
      return "rope";
    case Phase::kKvWrite:
      return "kv_write";
    case Phase::kAttention:
      return "attention";
    case Phase::kOGemm:
      return "o_gemm";
    case Phase::kGateUpGemm:
      return "gate_up_gemm";
    case Phase::kActivation:
      return "silu_mul";
    case Phase::kDownGemm:
      return "down_gemm";
    case Phase::kMoe:
      return "moe_mlp";
    case Phase::kMla:
      return "mla_attention";
    case Phase::kLogitsGather:
      return "logits_gather";
    case Phase::kLmHead:
      return "lm_head";
    case Phase::kSampling:
      return "sampling";
    case Phase::kCount:
      break;
  }
  return "?";
}

void StepProfile::Add(const StepProfile& o) {
  for (int i = 0; i < kNumPhases; ++i) {
    ns[i] += o.ns[i];
    calls[i] += o.calls[i];
  }
  gemm_calls += o.gemm_calls;
  parallel_regions += o.parallel_regions;
  barriers += o.barriers;
  fork_ns += o.fork_ns;
  join_ns += o.join_ns;
  barrier_ns += o.barrier_ns;
  pack_ns += o.pack_ns;
}

StepProfile* ActiveProfile() { return Slot(); }

ProfileCollector::ProfileCollector(StepProfile* profile) : previous_(Slot()) {
  Slot() = profile;
}

ProfileCollector::~ProfileCollector() { Slot() = previous_; }

}  // namespace pdserve::kernels
