// Disk throughput of the KV file tier (kv_cache/kv_tier.h), a tool, not a test:
// offers N pool blocks (of the `small` preset's geometry, fp32) to a tier in
// DIR and times until every file is written, then times loading them all
// back, on the caller's thread (Load) and then as the engine does (the
// tier's reader thread reads ahead, the caller copies: Take). Prints JSON.
// Compare with `dd` on the same directory. DIR `mem` times the host-memory tier
// instead (--kv-offload-memory).
//   kv_tier_throughput DIR|mem [BLOCKS=2048]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

#include "common/json.h"
#include "kv_cache/kv_cache.h"
#include "kv_cache/kv_tier.h"

int main(int argc, char** argv) {
  using namespace pdserve::engine;
  if (argc < 2 || argv[1][0] == '-') {
    // --help (or any flag): usage, never a directory named after the flag.
    std::fprintf(
        argc < 2 ? stderr : stdout,
        "usage: %s DIR|mem [BLOCKS]\n"
        "Writes BLOCKS (default 2048) small-preset KV blocks into a "
        "disk tier in DIR (mem: the host-memory tier), reads them back, and "
        "prints JSON with the "
        "GB/s of each.\n",
        argv[0]);
    return argc < 2 ? 2 : 0;
  }
  const int64_t n = argc > 2 ? std::atoll(argv[2]) : 2048;
  const KvCacheSpec spec{8, 2, 64, 16, pdserve::DType::kF32};  // `small`
  auto pool = KvPool::Create(spec, n);
  if (!pool.ok()) return 1;
  for (int32_t l = 0; l < spec.num_layers; ++l)
    for (int64_t b = 0; b < n; ++b) {
      KvSpan s = (*pool)->Span(l, b);
      std::memset(s.data, static_cast<int>((l * 31 + b) & 0xff), s.data_bytes);
    }
  KvTierConfig cfg;
  if (std::strcmp(argv[1], "mem") == 0) {
    cfg.memory_bytes = n * (int64_t{64} + spec.LayerBlockBytes() * 8);
  } else {
    cfg.dir = argv[1];
  }
  cfg.capacity_bytes = int64_t{1} << 40;
  cfg.max_pending_bytes = int64_t{1} << 40;
  cfg.max_read_ahead_bytes = int64_t{1} << 40;
  auto tier = KvTier::Create(cfg, {1, 2}, **pool);
  if (!tier.ok()) {
    std::fprintf(stderr, "%s\n", std::string(tier.status().message()).c_str());
    return 1;
  }
  using Clock = std::chrono::steady_clock;
  auto t0 = Clock::now();
  for (int64_t b = 0; b < n; ++b)
    (*tier)->Offer(BlockHash{0, static_cast<uint64_t>(b + 1)}, **pool, b);
  const double offer_s =
      std::chrono::duration<double>(Clock::now() - t0).count();
  if (!(*tier)->WaitForWrites(absl::Seconds(600))) return 1;
  const double write_s =
      std::chrono::duration<double>(Clock::now() - t0).count();
  auto t1 = Clock::now();
  int64_t ok = 0;
  for (int64_t b = 0; b < n; ++b)
    ok += (*tier)
              ->Load(BlockHash{0, static_cast<uint64_t>(b + 1)}, **pool, b)
              .ok();
  const double read_s =
      std::chrono::duration<double>(Clock::now() - t1).count();
  // The engine's path: the tier's reader thread reads every record ahead
  // (disk; nothing to read for memory), then the caller only copies them in
  // (Take). take_s is the part left on the engine thread.
  std::vector<BlockHash> hashes;
  for (int64_t b = 0; b < n; ++b)
    hashes.push_back(BlockHash{0, static_cast<uint64_t>(b + 1)});
  // Two passes: the first allocates the reader's buffers (first-touch page
  // faults), the second, timed, reuses them as a running worker does.
  double read_ahead_s = 0, take_s = 0;
  int64_t taken = 0;
  for (int pass = 0; pass < 2; ++pass) {
    auto t2 = Clock::now();
    (*tier)->ReadAhead(hashes, /*make_room=*/true);
    if (!(*tier)->WaitForReads(absl::Seconds(600))) return 1;
    read_ahead_s = std::chrono::duration<double>(Clock::now() - t2).count();
    auto t3 = Clock::now();
    taken = 0;
    for (int64_t b = 0; b < n; ++b)
      taken += (*tier)->Take(hashes[b], **pool, b).ok();
    take_s = std::chrono::duration<double>(Clock::now() - t3).count();
  }
  const double bytes = static_cast<double>(n * (*tier)->record_bytes());
  pdserve::json::OrderedValue out;
  out["blocks"] = n;
  out["file_bytes"] = (*tier)->record_bytes();
  out["total_bytes"] = bytes;
  out["offer_s"] = offer_s;
  out["write_s"] = write_s;
  out["write_gbps"] = bytes / write_s / 1e9;
  out["read_s"] = read_s;
  out["read_gbps"] = bytes / read_s / 1e9;
  out["loaded"] = ok;
  out["read_ahead_s"] = read_ahead_s;
  out["take_s"] = take_s;
  out["take_over_read"] = take_s / read_s;
  out["taken"] = taken;
  std::printf("%s\n", pdserve::json::Dump(out).c_str());
  return ok == n && taken == n ? 0 : 1;
}
