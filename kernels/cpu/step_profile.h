// Per-step time breakdown of the CPU forward pass and the engine loop around
// it, for `pdserve bench engine --profile`.
//
// A StepProfile collects wall time per Phase on the thread that installed it
// (ProfileCollector); with none installed, which is the default, every timer
// below is one thread-local load and a branch, so unprofiled runs keep their
// speed. GemmNT also records, on the calling thread, what its OpenMP region
// costs around the kernels: the fork (from the region's start until the
// calling thread runs its first tile), the join (from the calling thread's
// last tile until every thread has left the region: waiting for the slowest
// thread, which includes imbalance and a preempted partner), the barriers
// between k blocks, and the activation packing. Those overlap the GEMM phases
// (a part of each GEMM's time), so they are reported as "of which".
// Not synchronised: one collector per thread, read by that thread.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <string>

namespace pdserve::kernels {

enum class Phase : int {
  kSchedule,      // the engine picks the batch, allocates blocks
  kEmbedding,     // token rows of the embedding matrix
  kNorm,          // RMSNorms (input, post-attention, q/k, final), fused add
  kQkvGemm,       // the fused q/k/v projection
  kQkvSplit,      // bias and the copy of q, k, v out of the fused rows
  kRope,          // rotary embedding of q and k
  kKvWrite,       // this step's K/V rows into the paged pool
  kAttention,     // paged attention over each sequence's prefix
  kOGemm,         // o_proj
  kGateUpGemm,    // the fused gate/up projection
  kActivation,    // SiLU(gate) * up
  kDownGemm,      // down_proj
  kMoe,           // sparse MLP layers, whole (router, experts)
  kMla,           // DeepSeek's latent attention, whole
  kLogitsGather,  // copy of the rows that need logits
  kLmHead,        // the output matrix
  kSampling,      // masks, sampling, retiring finished sequences
  kCount
};
inline constexpr int kNumPhases = static_cast<int>(Phase::kCount);
const char* PhaseName(Phase p);  // "qkv_gemm", ...

struct StepProfile {
  std::array<int64_t, kNumPhases> ns{};     // wall time per phase
  std::array<int64_t, kNumPhases> calls{};  // timed spans per phase
  // GEMMs (GemmNT, any numerics); a part of the GEMM phases' time.
  int64_t gemm_calls = 0;
  int64_t parallel_regions = 0;  // OpenMP regions GemmNT opened
  int64_t barriers = 0;          // barriers between k blocks inside them
  int64_t fork_ns = 0;           // region start -> calling thread's 1st tile
  int64_t join_ns = 0;           // calling thread's last tile -> region end
  int64_t barrier_ns = 0;        // calling thread waiting at k-block barriers
  int64_t pack_ns = 0;           // calling thread packing activations
  void Clear() { *this = StepProfile(); }
  void Add(const StepProfile& o);
};

// The profile of the calling thread (null when none is installed).
StepProfile* ActiveProfile();

// Installs `profile` for the calling thread while alive (restores the
// previous one on destruction).
class ProfileCollector {
 public:
  explicit ProfileCollector(StepProfile* profile);
  ~ProfileCollector();
  ProfileCollector(const ProfileCollector&) = delete;
  ProfileCollector& operator=(const ProfileCollector&) = delete;

 private:
  StepProfile* previous_;
};

inline int64_t ProfileNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Adds the scope's wall time to `phase` of the active profile, if any.
class PhaseTimer {
 public:
  explicit PhaseTimer(Phase phase)
      : profile_(ActiveProfile()),
        phase_(phase),
        start_(profile_ ? ProfileNowNs() : 0) {}
  ~PhaseTimer() { Stop(); }
  // Ends the span early (the destructor then adds nothing).
  void Stop() {
    if (profile_ == nullptr) return;
    const int i = static_cast<int>(phase_);
    profile_->ns[i] += ProfileNowNs() - start_;
    ++profile_->calls[i];
    profile_ = nullptr;
  }
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

 private:
  StepProfile* profile_;
  Phase phase_;
  int64_t start_;
};

}  // namespace pdserve::kernels
