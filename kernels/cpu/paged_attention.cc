#include "kernels/cpu/paged_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/paged_attention_internal.h"
#include "kernels/cpu/task_pool.h"
#include "kernels/cpu/vec_exp.h"

// PagedAttention's driver: tasks over sequences, query chunks and KV heads,
// each walking its (block, head) units two at a time over the arithmetic of
// attention_block.cc. WriteKv and ReadKvBlock are in kv_block_io.cc.

namespace pdserve::kernels {
namespace {

using paged_attention_internal::AccumulateLanes;
using paged_attention_internal::AccumulateStates;
using paged_attention_internal::AccumulateWidenedStates;
using paged_attention_internal::ActiveAttnIsa;
using paged_attention_internal::AttnIsa;
using paged_attention_internal::BestAttnIsa;
using paged_attention_internal::BlockLanes;
using paged_attention_internal::kAccStates;
using paged_attention_internal::kLaneStates;
using paged_attention_internal::Scores;
using paged_attention_internal::ScoresPair;
using paged_attention_internal::ScoresToWeights;
using paged_attention_internal::TransposeKeys;
using paged_attention_internal::TransposeKeysWidened;

// Queries per attention task: a task's query states, accumulators and
// transposed queries stay within L1 at head_dim 64.
constexpr int kQueryChunk = 8;
// (sequence, query chunk) pairs per thread from which a task takes every KV
// head.
constexpr int kTasksPerThread = 4;

// Software prefetch of the K and V a task reads next. A unit is one head's K
// or V of one block (4 KiB in fp32 at head_dim 64), a run where the hardware
// prefetcher starts over. Its lines are requested a share at a time over the
// current pair's steps, since a whole unit's lines requested at once stall
// the loads that follow them. Where they go depends on the CPU
// (KvPrefetchHint): on an Intel Xeon an L1 prefetch (T0) held one of the
// core's few L1 miss buffers until its line arrived, which capped the lines
// in flight (attention_bench, 32 sequences x 256 tokens of fp32 KV: 1.87 ms
// a call with T0, 1.66 with T2); on an AMD EPYC (Zen 5) the T2 requests
// themselves arrived at a third of T0's rate.
bool& KvPrefetchToL1() {
  static bool l1 = __builtin_cpu_is("amd");
  return l1;
}

class KvPrefetcher {
 public:
  // Queues unit (block, head)'s K, then its V.
  void Add(const KvLayerView& cache, int64_t block, int head) {
    const int64_t elem = static_cast<int64_t>(DTypeBytes(cache.dtype));
    const int64_t bytes = int64_t{cache.block_size} * cache.head_dim * elem;
    for (int kv = 0; kv < 2 && count_ < kMaxRanges; ++kv) {
      ranges_[count_++] = {static_cast<const char*>(cache.data) +
                               cache.Offset(block, kv, head) * elem,
                           bytes};
    }
  }
  // Queued lines not yet requested.
  int64_t Pending() const {
    int64_t lines = 0;
    for (int i = next_; i < count_; ++i)
      lines += (ranges_[i].bytes - (i == next_ ? offset_ : 0) + 63) / 64;
    return lines;
  }
  // Requests up to `lines` more queued lines.
  void Issue(int64_t lines) {
    while (lines > 0 && next_ < count_) {
      const Range& r = ranges_[next_];
      if (l1_) {
        for (; lines > 0 && offset_ < r.bytes; --lines, offset_ += 64)
          _mm_prefetch(r.p + offset_, _MM_HINT_T0);
      } else {
        for (; lines > 0 && offset_ < r.bytes; --lines, offset_ += 64)
          _mm_prefetch(r.p + offset_, _MM_HINT_T2);
      }
      if (offset_ >= r.bytes) {
        ++next_;
        offset_ = 0;
      }
    }
    if (next_ == count_) next_ = count_ = 0;
  }

 private:
  struct Range {
    const char* p;
    int64_t bytes;
  };
  static constexpr int kMaxRanges = 4;  // two units' K and V
  Range ranges_[kMaxRanges];
  const bool l1_ = KvPrefetchToL1();
  int count_ = 0, next_ = 0;
  int64_t offset_ = 0;
};

}  // namespace

bool SetPagedAttentionIsa(PagedAttentionIsa isa) {
  switch (isa) {
    case PagedAttentionIsa::kBest:
      ActiveAttnIsa() = BestAttnIsa();
      return true;
    case PagedAttentionIsa::kPortable:
      ActiveAttnIsa() = AttnIsa::kPortable;
      return true;
    case PagedAttentionIsa::kAvx2:
      if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
        return false;
      ActiveAttnIsa() = AttnIsa::kAvx2;
      return true;
    case PagedAttentionIsa::kAvx512:
      if (!__builtin_cpu_supports("avx512f")) return false;
      ActiveAttnIsa() = AttnIsa::kAvx512;
      return true;
  }
  return false;
}

void SetKvPrefetchHint(KvPrefetchHint hint) {
  KvPrefetchToL1() = hint == KvPrefetchHint::kBest
                         ? __builtin_cpu_is("amd")
                         : hint == KvPrefetchHint::kL1;
}

float AttentionExpForTesting(float x) { return vec_exp::ExpPortable(x); }

void PagedAttention(const float* q, int32_t num_heads,
                    std::span<const AttentionSeq> seqs,
                    const KvLayerView& cache, float scale, float* out) {
  const int kv_heads = cache.num_kv_heads;
  const int group = num_heads / kv_heads;
  const int d = cache.head_dim;
  const int bs = cache.block_size;
  // A task is a sequence's query chunk over a range of KV heads. With enough
  // (sequence, chunk) pairs to share out, a task takes every head, and walks
  // a block's heads one after another: the block's K (and V) of all heads
  // are contiguous, so the task reads long runs instead of one head's few
  // KiB per block. With few pairs (batch 1) each head is its own task, so
  // that the threads share the work. A head's numbers are the same either
  // way.
  struct Task {
    int seq;
    int head_begin;
    int head_end;
    int q_begin;
    int q_end;
  };
  int64_t chunks = 0;
  for (const AttentionSeq& seq : seqs)
    chunks += (seq.num_q + kQueryChunk - 1) / kQueryChunk;
  const int heads_per_task =
      chunks >= int64_t{kTasksPerThread} * KernelThreads() ? kv_heads : 1;
  std::vector<Task> tasks;
  for (int s = 0; s < static_cast<int>(seqs.size()); ++s) {
    for (int h = 0; h < kv_heads; h += heads_per_task) {
      for (int q0 = 0; q0 < seqs[s].num_q; q0 += kQueryChunk) {
        tasks.push_back({s, h, std::min(kv_heads, h + heads_per_task), q0,
                         std::min(seqs[s].num_q, q0 + kQueryChunk)});
      }
    }
  }
  const int64_t row_stride = int64_t{num_heads} * d;
  // Tasks go to the calling thread and whichever kernel helpers are awake
  // (task_pool.h); each task's numbers depend only on the task. Scratch is
  // per thread and kept between calls.
  // One (block, head) unit of a task between its preparation and its
  // softmax: the block's keys transposed, its V rows, its states' scores.
  struct Unit {
    int hi, block_start, count, first_state;
    int64_t block;
    const float* vb;
    // A bf16, fp16 or int8 V block read in place (widened by the
    // accumulation), and its int8 scale; null when vb holds the V rows.
    const void* v_raw;
    float v_scale;
    float *kbuf, *vbuf, *kt, *scores;  // this unit's scratch
  };
  struct Scratch {
    std::vector<float> kbuf, vbuf, kt, acc, m, l, scores, weights, qt;
    std::vector<const float*> qs;
    std::vector<int32_t> lane_pos;
  };
  const int ldk = (bs + 15) / 16 * 16;
  const AttnIsa isa = ActiveAttnIsa();
  const bool widen_in_place =
      isa == AttnIsa::kAvx512 && ldk == 16 && d % 16 == 0 &&
      (cache.dtype == DType::kBF16 || cache.dtype == DType::kF16 ||
       cache.dtype == DType::kI8);
  // Tasks of many query states (prefill chunks) run in lane form: 16 states
  // side by side through each block's scores and softmax, so a block's keys
  // are read in place instead of transposed, and the softmax runs once per
  // 16 states. Each state's numbers are those of the unit path below.
  const bool lanes_ok =
      isa == AttnIsa::kAvx512 && bs == 16 && (d == 64 || d == 128);
  auto run_lanes = [&](const Task& task, Scratch& sc) {
    const AttentionSeq& seq = seqs[task.seq];
    const int nq = task.q_end - task.q_begin;
    const int states = nq * group;
    const int groups = (states + kLaneStates - 1) / kLaneStates;
    const int padded = groups * kLaneStates;
    const int last_pos = seq.start_pos + task.q_end - 1;
    const int num_blocks = last_pos / bs + 1;
    const bool f32 = cache.dtype == DType::kF32;
    sc.qt.resize(int64_t{groups} * d * kLaneStates);
    sc.acc.resize(int64_t{padded} * d);
    sc.m.resize(padded);
    sc.l.resize(padded);
    sc.weights.resize(int64_t{bs} * kLaneStates + kLaneStates);
    // Each lane's query position (-1 past the last state: it sees nothing).
    sc.lane_pos.assign(padded, -1);
    for (int st = 0; st < states; ++st)
      sc.lane_pos[st] = seq.start_pos + task.q_begin + st / group;
    float* p = sc.weights.data();
    float* corrections = p + int64_t{bs} * kLaneStates;
    for (int kv_head = task.head_begin; kv_head < task.head_end; ++kv_head) {
      // State st = qi * group + g reads query head kv_head * group + g of
      // row qi; lanes past the last state hold zero queries and see nothing.
      std::fill(sc.qt.begin(), sc.qt.end(), 0.0f);
      for (int st = 0; st < states; ++st) {
        const float* row_q =
            q + (seq.q_row + task.q_begin + st / group) * row_stride +
            (int64_t{kv_head} * group + st % group) * d;
        float* qt = sc.qt.data() + int64_t{st / kLaneStates} * d * kLaneStates +
                    st % kLaneStates;
        for (int i = 0; i < d; ++i) qt[int64_t{i} * kLaneStates] = row_q[i];
      }
      std::fill(sc.acc.begin(), sc.acc.end(), 0.0f);
      std::fill(sc.m.begin(), sc.m.end(),
                -std::numeric_limits<float>::infinity());
      std::fill(sc.l.begin(), sc.l.end(), 0.0f);
      for (int b = 0; b < num_blocks; ++b) {
        const int64_t block = seq.block_table[b];
        const int block_start = b * bs;
        const int count = std::min(bs, last_pos - block_start + 1);
        const float* kb;
        const void* vb;
        float v_scale = 1.0f;
        if (f32) {
          const float* data = static_cast<const float*>(cache.data);
          kb = data + cache.Offset(block, 0, kv_head);
          vb = data + cache.Offset(block, 1, kv_head);
        } else {
          // Keys widened as ReadKvBlock widens them (the bits the unit
          // path's transpose reads); V widened by the accumulation.
          ReadKvBlock(cache, block, 0, kv_head, count, sc.kbuf.data());
          kb = sc.kbuf.data();
          const auto* data = static_cast<const char*>(cache.data);
          vb = data + cache.Offset(block, 1, kv_head) *
                          static_cast<int64_t>(DTypeBytes(cache.dtype));
          if (cache.dtype == DType::kI8)
            v_scale = cache.Scale(block, 1, kv_head);
        }
        for (int g = 0; g < groups; ++g) {
          alignas(64) int32_t valid[kLaneStates];
          bool any = false;
          for (int s = 0; s < kLaneStates; ++s) {
            valid[s] = std::clamp(
                sc.lane_pos[g * kLaneStates + s] - block_start + 1, 0, count);
            any |= valid[s] > 0;
          }
          if (!any) continue;
          const int64_t s0 = int64_t{g} * kLaneStates;
          BlockLanes(sc.qt.data() + s0 * d, kb, d, scale, valid,
                     sc.m.data() + s0, sc.l.data() + s0, p, corrections);
          // Runs of up to kAccStates states that see the same keys.
          for (int s = 0; s < kLaneStates;) {
            if (valid[s] == 0) {
              ++s;
              continue;
            }
            int ns = 1;
            while (ns < kAccStates && s + ns < kLaneStates &&
                   valid[s + ns] == valid[s])
              ++ns;
            AccumulateLanes(cache.dtype, p + s, ns, valid[s], corrections + s,
                            vb, v_scale, d, sc.acc.data() + (s0 + s) * d);
            s += ns;
          }
        }
      }
      for (int st = 0; st < states; ++st) {
        const int64_t row = seq.q_row + task.q_begin + st / group;
        const int head = kv_head * group + st % group;
        const float inv = sc.l[st] > 0 ? 1.0f / sc.l[st] : 0.0f;
        float* o = out + row * row_stride + int64_t{head} * d;
        const float* acc = sc.acc.data() + int64_t{st} * d;
        for (int i = 0; i < d; ++i) o[i] = acc[i] * inv;
      }
    }
  };
  auto run = [&](int64_t t_begin, int64_t t_end, bool) {
    // Per unit of a pair: widened K and V, keys transposed and zero-padded
    // to ldk (a multiple of 16), the states' scores [states][ldk]; the
    // weights of up to kAccStates states; per head of the task, its states'
    // accumulators, running maxima and sums, and query rows.
    thread_local Scratch sc;
    sc.kbuf.resize(2 * int64_t{bs} * d);
    sc.vbuf.resize(2 * int64_t{bs} * d);
    sc.kt.resize(2 * int64_t{d} * ldk);
    sc.weights.resize(int64_t{kAccStates} * ldk);
    std::vector<float>&acc_all = sc.acc, &m_all = sc.m, &l_all = sc.l,
    &weights = sc.weights;
    std::vector<const float*>& qs_all = sc.qs;
    Unit unit[2] = {};
    for (int64_t ti = t_begin; ti < t_end; ++ti) {
      const Task& task = tasks[ti];
      const AttentionSeq& seq = seqs[task.seq];
      const int nq = task.q_end - task.q_begin;
      const int states = nq * group;
      if (lanes_ok && states >= kLaneStates) {
        run_lanes(task, sc);
        continue;
      }
      const int nh = task.head_end - task.head_begin;
      acc_all.assign(int64_t{nh} * states * d, 0.0f);
      m_all.assign(int64_t{nh} * states,
                   -std::numeric_limits<float>::infinity());
      l_all.assign(int64_t{nh} * states, 0.0f);
      sc.scores.resize(2 * int64_t{states} * ldk);
      for (int i = 0; i < 2; ++i) {
        unit[i].kbuf = sc.kbuf.data() + i * int64_t{bs} * d;
        unit[i].vbuf = sc.vbuf.data() + i * int64_t{bs} * d;
        unit[i].kt = sc.kt.data() + i * int64_t{d} * ldk;
        unit[i].scores = sc.scores.data() + i * int64_t{states} * ldk;
      }
      // State st = qi * group + g of KV head h reads query head h * group + g
      // of its row; the group's heads are consecutive in q.
      qs_all.resize(int64_t{nh} * states);
      for (int hi = 0; hi < nh; ++hi) {
        const int kv_head = task.head_begin + hi;
        for (int qi = 0; qi < nq; ++qi) {
          const float* row_q = q +
                               (seq.q_row + task.q_begin + qi) * row_stride +
                               int64_t{kv_head} * group * d;
          for (int g = 0; g < group; ++g)
            qs_all[int64_t{hi} * states + qi * group + g] =
                row_q + int64_t{g} * d;
        }
      }
      const int last_pos = seq.start_pos + task.q_end - 1;
      const int num_blocks = last_pos / bs + 1;
      // The task's (block, head) units in order, a block's heads one after
      // another, two at a time: both units' keys are transposed and their
      // scores computed together (twice the independent FMA chains), then
      // each unit's softmax and accumulation run in unit order, so every
      // state sees its blocks in order as before.
      const int units = num_blocks * nh;
      auto prepare = [&](int u, Unit& x) {
        x.hi = u % nh;
        x.block = seq.block_table[u / nh];
        x.block_start = u / nh * bs;
        x.count = std::min(bs, last_pos - x.block_start + 1);
        // Queries before this block (causal) see none of it.
        const int first_q =
            std::max(0, x.block_start - seq.start_pos - task.q_begin);
        x.first_state = std::min(first_q, nq) * group;
        if (x.first_state >= states) return;
        const int kv_head = task.head_begin + x.hi;
        // fp32 blocks are read in place; with AVX-512 and 16-token blocks so
        // are the others, widened by the key transpose and the
        // accumulation; else they are widened into scratch first.
        const float* kb = x.kbuf;
        x.vb = x.vbuf;
        x.v_raw = nullptr;
        if (cache.dtype == DType::kF32) {
          const float* data = static_cast<const float*>(cache.data);
          kb = data + cache.Offset(x.block, 0, kv_head);
          x.vb = data + cache.Offset(x.block, 1, kv_head);
        } else if (widen_in_place) {
          const auto* data = static_cast<const char*>(cache.data);
          const int64_t elem = static_cast<int64_t>(DTypeBytes(cache.dtype));
          const bool i8 = cache.dtype == DType::kI8;
          const float k_scale = i8 ? cache.Scale(x.block, 0, kv_head) : 1.0f;
          x.v_scale = i8 ? cache.Scale(x.block, 1, kv_head) : 1.0f;
          x.v_raw = data + cache.Offset(x.block, 1, kv_head) * elem;
          const void* k_raw = data + cache.Offset(x.block, 0, kv_head) * elem;
          TransposeKeysWidened(cache.dtype, k_raw, x.count, d, k_scale, x.kt);
          return;
        } else {
          ReadKvBlock(cache, x.block, 0, kv_head, x.count, x.kbuf);
          ReadKvBlock(cache, x.block, 1, kv_head, x.count, x.vbuf);
        }
        TransposeKeys(isa, kb, x.count, d, ldk, x.kt);
      };
      // The next pair's K and V are requested over the current pair's
      // steps, `share` lines at a time.
      KvPrefetcher prefetcher;
      int64_t share = 0;
      auto finish = [&](const Unit& x) {
        float* acc = acc_all.data() + int64_t{x.hi} * states * d;
        float* m = m_all.data() + int64_t{x.hi} * states;
        float* l = l_all.data() + int64_t{x.hi} * states;
        // States in runs of up to kAccStates that see the same keys of the
        // block (a query's group, or whole queries once the block is behind
        // them), accumulated together.
        auto valid_of = [&](int st) {
          const int pos = seq.start_pos + task.q_begin + st / group;
          return std::min(x.count, pos - x.block_start + 1);
        };
        for (int st = x.first_state; st < states;) {
          const int valid = valid_of(st);
          int ns = 1;
          while (ns < kAccStates && st + ns < states &&
                 valid_of(st + ns) == valid)
            ++ns;
          float corrections[kAccStates];
          ScoresToWeights(isa, x.scores + int64_t{st} * ldk, ldk, ns, valid,
                          &m[st], &l[st], weights.data(), corrections);
          prefetcher.Issue(share);
          float* a = acc + int64_t{st} * d;
          if (x.v_raw == nullptr) {
            AccumulateStates(isa, weights.data(), ldk, ns, valid, corrections,
                             x.vb, d, a);
          } else {
            AccumulateWidenedStates(cache.dtype, weights.data(), ldk, ns, valid,
                                    corrections, x.v_raw, x.v_scale, d, a);
          }
          st += ns;
        }
      };
      auto qs_of = [&](const Unit& x) {
        return qs_all.data() + int64_t{x.hi} * states + x.first_state;
      };
      auto queue = [&](int u) {
        prefetcher.Add(cache, seq.block_table[u / nh],
                       task.head_begin + u % nh);
      };
      // The first pair's K and V, all at once: nothing runs before their
      // loads to spread them over, and the lines in flight still shorten
      // the wait (attention_bench, one thread, fp32 KV: 7-9% a call).
      for (int u = 0; u < std::min(units, 2); ++u) queue(u);
      prefetcher.Issue(prefetcher.Pending());
      for (int u = 0; u < units; u += 2) {
        Unit& a = unit[0];
        Unit& c = unit[1];
        const bool two = u + 1 < units;
        // The next pair's K and V, over this pair's seven steps.
        for (int next = u + 2; next < std::min(units, u + 4); ++next)
          queue(next);
        share = (prefetcher.Pending() + 6) / 7;
        prefetcher.Issue(share);
        prepare(u, a);
        prefetcher.Issue(share);
        if (two) prepare(u + 1, c);
        prefetcher.Issue(share);
        if (two && a.first_state == c.first_state && a.first_state < states) {
          ScoresPair(isa, qs_of(a), a.kt,
                     a.scores + int64_t{a.first_state} * ldk, qs_of(c), c.kt,
                     c.scores + int64_t{c.first_state} * ldk,
                     states - a.first_state, d, ldk, scale);
        } else {
          if (a.first_state < states) {
            Scores(isa, qs_of(a), states - a.first_state, a.kt, d, ldk, scale,
                   a.scores + int64_t{a.first_state} * ldk);
          }
          if (two && c.first_state < states) {
            Scores(isa, qs_of(c), states - c.first_state, c.kt, d, ldk, scale,
                   c.scores + int64_t{c.first_state} * ldk);
          }
        }
        prefetcher.Issue(share);
        finish(a);
        prefetcher.Issue(share);
        if (two) finish(c);
        prefetcher.Issue(prefetcher.Pending());
      }
      for (int hi = 0; hi < nh; ++hi) {
        const int kv_head = task.head_begin + hi;
        const float* acc = acc_all.data() + int64_t{hi} * states * d;
        const float* l = l_all.data() + int64_t{hi} * states;
        for (int qi = 0; qi < nq; ++qi) {
          const int64_t row = seq.q_row + task.q_begin + qi;
          for (int g = 0; g < group; ++g) {
            const int head = kv_head * group + g;
            const int st = qi * group + g;
            const float inv = l[st] > 0 ? 1.0f / l[st] : 0.0f;
            float* o = out + row * row_stride + int64_t{head} * d;
            for (int i = 0; i < d; ++i) o[i] = acc[int64_t{st} * d + i] * inv;
          }
        }
      }
    }
  };
  RunChunks(static_cast<int64_t>(tasks.size()), 1, KernelThreads(), run);
}

}  // namespace pdserve::kernels
