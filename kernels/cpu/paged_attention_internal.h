// What the paged attention files share, and nothing else includes: the
// instruction-set choice, and the per-block arithmetic of attention_block.cc
// that paged_attention.cc's driver calls (kv_block_io.cc widens KV with the
// same choice). Every vector function carries its own target attribute, so
// the files run only where the choice found the instructions. Stateless and
// thread-safe, but for SetPagedAttentionIsa's setting.
#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace pdserve::kernels::paged_attention_internal {

#define PDSERVE_ATTN_AVX512 __attribute__((target("avx512f")))
#define PDSERVE_ATTN_AVX2 __attribute__((target("avx2,fma")))

enum class AttnIsa { kPortable, kAvx2, kAvx512 };
AttnIsa BestAttnIsa();
// The instruction set attention runs on (SetPagedAttentionIsa sets it).
AttnIsa& ActiveAttnIsa();

// Most states per ScoresToWeights and AccumulateStates call.
constexpr int kAccStates = 4;

// kt[i * ldk + t] = k[t * d + i] for t < count, 0 for count <= t < ldk: a
// block's fp32 keys [count][d], one row per dimension.
void TransposeKeys(AttnIsa isa, const float* k, int count, int d, int ldk,
                   float* kt);
// The same for a bf16, fp16 or int8 block (int8: times `scale`), widened as
// it is read, with the bits TransposeKeys gives for the block widened by
// ReadKvBlock. AVX-512 only; ldk == 16 and d % 16 == 0.
void TransposeKeysWidened(DType t, const void* k, int count, int d, float scale,
                          float* kt);

// Scores of `ns` query states (q rows qs[s]) against transposed keys kt:
// out[s * ldk + t] for every t < ldk, each an FMA chain over i in order,
// times scale.
void Scores(AttnIsa isa, const float* const* qs, int ns, const float* kt, int d,
            int ldk, float scale, float* out);
// Scores of two units at once, ns states each: what Scores gives for each,
// with the two units' FMA chains interleaved.
void ScoresPair(AttnIsa isa, const float* const* qa, const float* kta,
                float* outa, const float* const* qb, const float* ktb,
                float* outb, int ns, int d, int ldk, float scale);

// The online-softmax step of ns <= kAccStates states over a block's `valid`
// scores (state j's at scores + j * ldk): m[j] and l[j] updated, p + j * ldk
// the weights, c[j] the factor for the accumulators.
void ScoresToWeights(AttnIsa isa, const float* scores, int ldk, int ns,
                     int valid, float* m, float* l, float* p, float* c);

// acc = acc * c[s], then + p_t * v_t for t < valid in order, for ns <=
// kAccStates consecutive states (accumulators a + s * d; weights
// p[s * ldp + t]) over fp32 V rows v [valid][d].
void AccumulateStates(AttnIsa isa, const float* p, int ldp, int ns, int valid,
                      const float* c, const float* v, int d, float* a);
// The same over a bf16, fp16 or int8 V block (int8: times v_scale), widened
// as it is read, with the bits of the widen-first path. AVX-512 only;
// d % 16 == 0.
void AccumulateWidenedStates(DType t, const float* p, int ldp, int ns,
                             int valid, const float* c, const void* v,
                             float v_scale, int d, float* a);

// Lane form (AVX-512 only, 16-token blocks): 16 query states side by side,
// state s in lane s, for tasks with many states (prefill chunks). Per state
// it gives the bits of Scores, ScoresToWeights and AccumulateStates.
constexpr int kLaneStates = 16;

// Scores of 16 states against a block's keys k [16][d] (fp32 rows; d 64 or
// 128), times scale, and the online-softmax step over the first valid[s]
// keys of state s (0: the state sees none of the block, and its m and l are
// left as they are). The states' queries are transposed: qt[i * 16 + s].
// Weights p[t * 16 + s] for every t < 16 (those from valid[s] on unused);
// c[s] the factor for the accumulators.
void BlockLanes(const float* qt, const float* k, int d, float scale,
                const int32_t* valid, float* m, float* l, float* p, float* c);

// AccumulateStates (t == kF32, v fp32 rows) or AccumulateWidenedStates (bf16,
// fp16, int8: v the raw block) for ns <= kAccStates consecutive states whose
// weights are in lane form: p[t * 16 + s] for state s of the run. d % 16 == 0.
void AccumulateLanes(DType t, const float* p, int ns, int valid, const float* c,
                     const void* v, float v_scale, int d, float* a);

}  // namespace pdserve::kernels::paged_attention_internal
