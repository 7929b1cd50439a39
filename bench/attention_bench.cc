// Paged decode attention on its own: a batch of sequences, one query each,
// over a KV pool whose caches are flushed (CLFLUSH) before every timed call,
// so K and V come from memory as in a decode step of a large batch.
//
// usage: attention_bench [THREADS] [CONTEXT] [SEQS] [KV_DTYPE] [ORDER] [REPS]
//                        [SHAPE] [CACHES]
//
//   THREADS   kernel threads (default 2)
//   CONTEXT   tokens of KV per sequence (default 256)
//   SEQS      sequences in the batch (default 32)
//   KV_DTYPE  fp32, bf16, fp16 or int8 (default fp32)
//   ORDER     in-order (a sequence's blocks follow each other in the pool,
//             as in a fresh engine) or shuffled (blocks anywhere, as in a
//             pool after churn); default in-order
//   REPS      timed calls (default 30)
//   SHAPE     1b: the Llama 3.2 1B layer's 32 query heads and 8 KV heads
//             (default); small: the `small` preset's 8 and 2
//   CACHES    cold: K and V flushed before every call (default); warm:
//             nothing flushed, so the calls read K and V from the caches
//             and the time is the arithmetic alone (where the pool fits)
//
// head_dim 64 and 16-token blocks either way. Prints the mean time of a call
// and the KV bytes it read per second; compare builds or settings in one
// sitting. The cold time against the warm one shows how much of a call
// waits on memory.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/engine_bench.h"
#include "common/dtype.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/paged_attention.h"

namespace {

using pdserve::DType;
namespace kernels = pdserve::kernels;

constexpr int kHeadDim = 64, kBlock = 16;

int Usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [THREADS] [CONTEXT] [SEQS] "
               "[fp32|bf16|fp16|int8] [in-order|shuffled] [REPS] "
               "[1b|small] [cold|warm] [best|l1|l2]\n"
               "  the last picks where the K and V prefetch puts its lines "
               "(best: the CPU's default)\n",
               argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "-h") || !std::strcmp(argv[i], "--help")) {
      Usage(argv[0]);
      return 0;
    }
  }
  if (argc > 10) return Usage(argv[0]);
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const int context = argc > 2 ? std::atoi(argv[2]) : 256;
  const int num_seqs = argc > 3 ? std::atoi(argv[3]) : 32;
  const std::string dtype_name = argc > 4 ? argv[4] : "fp32";
  const std::string order = argc > 5 ? argv[5] : "in-order";
  const int reps = argc > 6 ? std::atoi(argv[6]) : 30;
  const std::string shape = argc > 7 ? argv[7] : "1b";
  const std::string caches = argc > 8 ? argv[8] : "cold";
  const std::string hint = argc > 9 ? argv[9] : "best";
  DType dtype;
  if (dtype_name == "fp32") {
    dtype = DType::kF32;
  } else if (dtype_name == "bf16") {
    dtype = DType::kBF16;
  } else if (dtype_name == "fp16") {
    dtype = DType::kF16;
  } else if (dtype_name == "int8") {
    dtype = DType::kI8;
  } else {
    return Usage(argv[0]);
  }
  if (threads < 1 || context < 1 || num_seqs < 1 || reps < 1 ||
      (order != "in-order" && order != "shuffled") ||
      (shape != "1b" && shape != "small") ||
      (caches != "cold" && caches != "warm") ||
      (hint != "best" && hint != "l1" && hint != "l2"))
    return Usage(argv[0]);
  kernels::SetKvPrefetchHint(hint == "l1"   ? kernels::KvPrefetchHint::kL1
                             : hint == "l2" ? kernels::KvPrefetchHint::kL2
                                            : kernels::KvPrefetchHint::kBest);
  const int heads = shape == "1b" ? 32 : 8;
  const int kv_heads = heads / 4;
  kernels::SetKernelThreads(threads);

  const int per_seq = (context + kBlock - 1) / kBlock;
  const int num_blocks = per_seq * num_seqs;
  kernels::KvLayerView view{nullptr,  nullptr,  dtype,
                            kv_heads, kHeadDim, kBlock};
  const size_t bytes = static_cast<size_t>(num_blocks) *
                       view.ElementsPerBlock() * pdserve::DTypeBytes(dtype);
  std::vector<uint8_t> pool(bytes);
  std::vector<float> scales(static_cast<size_t>(num_blocks) * 2 * kv_heads,
                            1.0f / 64);
  view.data = pool.data();
  view.scales = scales.data();
  // Values written through WriteKv, so every dtype holds what it would.
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<int32_t> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  if (order == "shuffled") std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<std::vector<int32_t>> tables(num_seqs);
  std::vector<kernels::AttentionSeq> seqs(num_seqs);
  std::vector<float> k(static_cast<size_t>(context) * kv_heads * kHeadDim),
      v(k.size());
  std::vector<int64_t> slots(context);
  for (int s = 0; s < num_seqs; ++s) {
    tables[s].assign(ids.begin() + s * per_seq,
                     ids.begin() + (s + 1) * per_seq);
    for (auto& x : k) x = normal(rng);
    for (auto& x : v) x = normal(rng);
    for (int t = 0; t < context; ++t)
      slots[t] = int64_t{tables[s][t / kBlock]} * kBlock + t % kBlock;
    kernels::WriteKv(k.data(), v.data(), context, slots.data(), view);
    seqs[s] = kernels::AttentionSeq{s, 1, context - 1, tables[s].data()};
  }
  std::vector<float> q(static_cast<size_t>(num_seqs) * heads * kHeadDim),
      out(q.size());
  for (auto& x : q) x = normal(rng);
  const float scale = 0.125f;

  kernels::PagedAttention(q.data(), heads, seqs, view, scale, out.data());
  double total_us = 0;
  for (int r = 0; r < reps; ++r) {
    if (caches == "cold") {
      pdserve::bench::FlushFromCaches(pool.data(), pool.size());
      _mm_mfence();
    }
    const auto start = std::chrono::steady_clock::now();
    kernels::PagedAttention(q.data(), heads, seqs, view, scale, out.data());
    total_us += std::chrono::duration<double, std::micro>(
                    std::chrono::steady_clock::now() - start)
                    .count();
  }
  const double mean_us = total_us / reps;
  std::printf(
      "attention_bench: %s shape, %d threads, %d sequences x %d tokens, %s KV, "
      "blocks %s: %.1f us a call, %.1f GB/s of KV (%.1f MB a call, %s)\n",
      shape.c_str(), threads, num_seqs, context, dtype_name.c_str(),
      order.c_str(), mean_us, static_cast<double>(bytes) / mean_us / 1e3,
      static_cast<double>(bytes) / 1e6,
      caches == "cold" ? "caches flushed" : "caches warm");
  return 0;
}
