#include "bench/transfer_bench.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/json.h"
#include "common/metrics.h"
#include "common/status_macros.h"
#include "kv_transfer/grpc/grpc_transport.h"
#include "kv_transfer/ipc/ipc_service.h"
#include "kv_transfer/ipc/ipc_transport.h"
#include "kv_transfer/nccl/grpc_control_channel.h"
#include "kv_transfer/receiver.h"
#include "kv_transfer/transfer_metrics.h"

namespace pdserve::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Raw TCP: each write()/read() moves up to kTcpIoBytes; the sender cycles
// through a pre-filled source of kTcpSourceBytes (larger than a last-level
// cache, like the KV pool the grpc sender reads).
constexpr size_t kTcpIoBytes = size_t{4} << 20;
constexpr size_t kTcpSourceBytes = size_t{64} << 20;

// Wall-clock and process CPU time (all threads, user + system) of one timed
// transfer. CPU seconds per byte is less disturbed than wall time by other
// load on shared cores, and it counts the work of both ends.
struct Timing {
  double wall_s = 0;
  double cpu_s = 0;
};

double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto secs = [](const timeval& t) { return t.tv_sec + t.tv_usec / 1e6; };
  return secs(u.ru_utime) + secs(u.ru_stime);
}

class Stopwatch {
 public:
  Stopwatch() : wall_(Clock::now()), cpu_(ProcessCpuSeconds()) {}
  Timing Elapsed() const {
    return {std::chrono::duration<double>(Clock::now() - wall_).count(),
            ProcessCpuSeconds() - cpu_};
  }

 private:
  Clock::time_point wall_;
  double cpu_;
};

absl::Status Annotate(const absl::Status& s, const std::string& context) {
  return absl::Status(s.code(), absl::StrCat(context, ": ", s.message()));
}

absl::Status Errno(const char* what) {
  return absl::InternalError(
      absl::StrCat("raw TCP: ", what, ": ", std::strerror(errno)));
}

// Deterministic, distinct contents per seed, so a span landing in the wrong
// (layer, block) fails verification.
void FillSpan(uint8_t* dst, size_t bytes, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
  for (size_t i = 0; i < bytes; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(dst + i, &x, std::min<size_t>(8, bytes - i));
  }
}

size_t ScaleBytes(const engine::KvCacheSpec& spec) {
  return DTypeHasScales(spec.dtype) ? 2 * spec.num_kv_heads * sizeof(float) : 0;
}

// The KV of one measurement: a sender pool holding `num_blocks` filled
// blocks (logical i = physical i) and a zeroed receiver pool whose physical
// order is reversed, so a transfer that ignored the block table would fail
// verification.
struct PoolPair {
  std::unique_ptr<engine::KvPool> sender;
  std::unique_ptr<engine::KvPool> receiver;
  // (logical index, sender physical block)
  std::vector<std::pair<int32_t, int32_t>> send_blocks;
  // Receiver physical block by logical index.
  std::vector<int32_t> receive_blocks;

  static absl::StatusOr<PoolPair> Create(const engine::KvCacheSpec& spec,
                                         int64_t num_blocks) {
    PoolPair p;
    ASSIGN_OR_RETURN(p.sender, engine::KvPool::Create(spec, num_blocks));
    // In a memfd, as a decode worker's pool is under --kv-transport shm, so
    // the shm transport can map it; grpc writes into the same memory.
    engine::KvCacheSpec shared = spec;
    shared.host_shared = true;
    ASSIGN_OR_RETURN(p.receiver, engine::KvPool::Create(shared, num_blocks));
    const size_t bytes = static_cast<size_t>(spec.LayerBlockBytes());
    const size_t scale_bytes = ScaleBytes(spec);
    for (int32_t b = 0; b < num_blocks; ++b) {
      p.send_blocks.emplace_back(b, b);
      p.receive_blocks.push_back(static_cast<int32_t>(num_blocks - 1 - b));
      for (int32_t l = 0; l < spec.num_layers; ++l) {
        const uint64_t seed =
            (static_cast<uint64_t>(l) << 32) | static_cast<uint32_t>(b);
        FillSpan(p.sender->LayerBlockData(l, b), bytes, seed);
        if (scale_bytes) {
          FillSpan(reinterpret_cast<uint8_t*>(p.sender->LayerBlockScales(l, b)),
                   scale_bytes, ~seed);
        }
      }
    }
    return p;
  }

  // Zeroes every received block (undoing a warm-up).
  void ClearReceived() {
    const engine::KvCacheSpec& spec = receiver->spec();
    for (int32_t block : receive_blocks) {
      for (int32_t l = 0; l < spec.num_layers; ++l) {
        std::memset(receiver->LayerBlockData(l, block), 0,
                    spec.LayerBlockBytes());
        if (ScaleBytes(spec)) {
          std::memset(receiver->LayerBlockScales(l, block), 0,
                      ScaleBytes(spec));
        }
      }
    }
  }

  // OK iff every (layer, logical block) on the receiver equals the sender's.
  absl::Status Verify(const std::string& what) {
    const engine::KvCacheSpec& spec = sender->spec();
    const size_t bytes = static_cast<size_t>(spec.LayerBlockBytes());
    const size_t scale_bytes = ScaleBytes(spec);
    for (const auto& [index, physical] : send_blocks) {
      const int32_t dst = receive_blocks[index];
      for (int32_t l = 0; l < spec.num_layers; ++l) {
        const uint8_t* want = sender->LayerBlockData(l, physical);
        const uint8_t* got = receiver->LayerBlockData(l, dst);
        bool same = std::memcmp(want, got, bytes) == 0;
        if (same && scale_bytes) {
          same =
              std::memcmp(sender->LayerBlockScales(l, physical),
                          receiver->LayerBlockScales(l, dst), scale_bytes) == 0;
        }
        if (!same) {
          size_t at = 0;
          while (at < bytes && want[at] == got[at]) ++at;
          return absl::InternalError(absl::StrCat(
              what, ": received KV differs from the sent KV at layer ", l,
              ", logical block ", index,
              (at < bytes ? absl::StrCat(", byte ", at)
                          : std::string(" (scales)")),
              "; the transfer moved wrong bytes, so its throughput is "
              "meaningless"));
        }
      }
    }
    return absl::OkStatus();
  }
};

// A decode worker's receiving side in this process: KvReceiver on the
// receiver pool (counting into `metrics`, as a worker's does) behind a
// KvTransfer service on 127.0.0.1, port 0 that takes grpc pushes and, on its
// Control stream, shm transfers (as a --kv-transport shm worker's does).
class LoopbackReceiver {
 public:
  static absl::StatusOr<std::unique_ptr<LoopbackReceiver>> Start(
      engine::KvPool* pool, const kv_transfer::KvLayout& layout,
      kv_transfer::TransferMetrics* metrics) {
    std::unique_ptr<LoopbackReceiver> r(
        new LoopbackReceiver(pool, layout, metrics));
    ASSIGN_OR_RETURN(r->endpoint_,
                     kv_transfer::ipc::IpcKvReceiveEndpoint::Create(
                         &r->receiver_, pool, r->shm_.get()));
    r->service_ = std::make_unique<kv_transfer::ipc::IpcKvTransferService>(
        &r->receiver_, r->endpoint_.get());
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &r->port_);
    builder.RegisterService(r->service_.get());
    // As decode_service/worker_server.cc configures it.
    kv_transfer::ConfigureInternalServer(&builder);
    r->server_ = builder.BuildAndStart();
    if (!r->server_ || r->port_ == 0) {
      return absl::UnavailableError(
          "could not start a KvTransfer server on 127.0.0.1");
    }
    return r;
  }
  ~LoopbackReceiver() {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
    if (endpoint_) endpoint_->Shutdown();
  }

  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  kv_transfer::KvReceiver& receiver() { return receiver_; }

 private:
  LoopbackReceiver(engine::KvPool* pool, const kv_transfer::KvLayout& layout,
                   kv_transfer::TransferMetrics* metrics)
      : receiver_(pool, layout, metrics->ForReceiver()),
        shm_(kv_transfer::ipc::NewShmBackend()) {}

  kv_transfer::KvReceiver receiver_;
  std::unique_ptr<kv_transfer::ipc::PeerMemoryBackend> shm_;
  std::unique_ptr<kv_transfer::ipc::IpcKvReceiveEndpoint> endpoint_;
  std::unique_ptr<kv_transfer::ipc::IpcKvTransferService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

// One transfer of every layer of `plan.blocks`, driven as a prefill worker
// would: Expect on the receiver, Open, SendLayers over all layers, Finish,
// Wait. Times from Open to the receiver's completion.
absl::StatusOr<Timing> TimeTransfer(kv_transfer::KvTransport& transport,
                                    LoopbackReceiver& end,
                                    engine::KvPool* sender_pool,
                                    kv_transfer::SendPlan plan,
                                    const std::vector<int32_t>& receive_blocks,
                                    int64_t expected_bytes,
                                    absl::Duration timeout) {
  kv_transfer::KvReceiver& receiver = end.receiver();
  const int32_t num_layers = sender_pool->spec().num_layers;
  plan.reservation_id =
      receiver.Expect(plan.request_id, receive_blocks, /*skip_blocks=*/0);
  // The receiver's own account of a failure is usually the more useful one.
  auto fail = [&](const absl::Status& s) {
    const absl::Status r = receiver.Wait(plan.reservation_id, absl::Seconds(1),
                                         absl::Now() + absl::Seconds(2));
    return r.ok()
               ? s
               : absl::Status(s.code(),
                              absl::StrCat(s.message(),
                                           " (receiver: ", r.message(), ")"));
  };

  const Stopwatch stopwatch;
  absl::StatusOr<std::unique_ptr<kv_transfer::KvSendSession>> session =
      transport.Open(plan, sender_pool);
  if (!session.ok()) {
    receiver.Cancel(plan.reservation_id);
    return session.status();
  }
  if (absl::Status s = (*session)->SendLayers(0, num_layers); !s.ok()) {
    (*session)->Cancel();
    return fail(s);
  }
  absl::StatusOr<kv_transfer::SendStats> stats = (*session)->Finish();
  if (!stats.ok()) return fail(stats.status());
  RETURN_IF_ERROR(
      receiver.Wait(plan.reservation_id, timeout, absl::Now() + timeout));
  const Timing timing = stopwatch.Elapsed();
  if (static_cast<int64_t>(stats->bytes) != expected_bytes) {
    return absl::InternalError(
        absl::StrCat("the session reports ", stats->bytes,
                     " bytes sent, expected ", expected_bytes));
  }
  return timing;
}

// Moves `bytes` over a fresh loopback TCP connection: a listener thread reads
// and discards into `sink`, this thread writes from `source` in writes of up
// to kTcpIoBytes. Times from the first write until the listener has read the
// last byte.
absl::StatusOr<Timing> TimeRawTcp(int64_t bytes,
                                  const std::vector<uint8_t>& source,
                                  std::vector<uint8_t>& sink) {
  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener < 0) return Errno("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t addr_len = sizeof(addr);
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &addr_len) !=
          0) {
    const absl::Status s = Errno("bind/listen on 127.0.0.1");
    close(listener);
    return s;
  }

  // Written by the listener thread, read after join().
  absl::Status sink_status;
  std::thread reader([&] {
    const int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      sink_status = Errno("accept");
      return;
    }
    int64_t received = 0;
    while (received < bytes) {
      const size_t want =
          static_cast<size_t>(std::min<int64_t>(sink.size(), bytes - received));
      const ssize_t n = read(fd, sink.data(), want);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        sink_status = n < 0 ? Errno("read")
                            : absl::InternalError(absl::StrCat(
                                  "raw TCP: the sender closed after ", received,
                                  " of ", bytes, " bytes"));
        break;
      }
      received += n;
    }
    close(fd);
  });

  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  absl::Status send_status;
  Timing timing;
  if (fd < 0 ||
      connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    send_status = Errno("connect");
    shutdown(listener, SHUT_RDWR);  // wakes accept()
  } else {
    const Stopwatch stopwatch;
    int64_t sent = 0;
    while (sent < bytes) {
      const size_t offset = static_cast<size_t>(sent) % source.size();
      const size_t want = static_cast<size_t>(std::min<int64_t>(
          {static_cast<int64_t>(kTcpIoBytes),
           static_cast<int64_t>(source.size() - offset), bytes - sent}));
      const ssize_t n = send(fd, source.data() + offset, want, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        send_status = Errno("send");
        break;
      }
      sent += n;
    }
    if (send_status.ok()) {
      reader.join();
      timing = stopwatch.Elapsed();
    }
  }
  if (fd >= 0) close(fd);  // on a send error this ends the reader with EOF
  if (reader.joinable()) reader.join();
  close(listener);
  RETURN_IF_ERROR(send_status);
  RETURN_IF_ERROR(sink_status);
  return timing;
}

// Fills the figure's throughput (best and median GB/s) and CPU cost (least
// CPU seconds per GB) of one path from its repetitions.
void Summarize(std::vector<Timing> timings, int64_t bytes,
               double* best_gb_per_s, double* median_gb_per_s,
               double* cpu_s_per_gb) {
  const double gb = bytes / 1e9;
  double cpu = timings.front().cpu_s;
  for (const Timing& t : timings) cpu = std::min(cpu, t.cpu_s);
  *cpu_s_per_gb = cpu / gb;
  std::sort(
      timings.begin(), timings.end(),
      [](const Timing& a, const Timing& b) { return a.wall_s < b.wall_s; });
  const size_t n = timings.size();
  const double median =
      n % 2 ? timings[n / 2].wall_s
            : (timings[n / 2 - 1].wall_s + timings[n / 2].wall_s) / 2;
  *best_gb_per_s = gb / timings.front().wall_s;
  *median_gb_per_s = gb / median;
}

absl::StatusOr<TransferFigure> MeasureOne(
    const TransferBenchConfig& config, const TransferLayout& layout,
    int32_t tokens, const std::vector<uint8_t>& tcp_source,
    std::vector<uint8_t>& tcp_sink) {
  const engine::KvCacheSpec& spec = layout.spec;
  TransferFigure f;
  f.layout = layout.name;
  f.blocks = (int64_t{tokens} + spec.block_size - 1) / spec.block_size;
  f.tokens = static_cast<int32_t>(f.blocks * spec.block_size);
  f.bytes = f.blocks * spec.num_layers *
            (spec.LayerBlockBytes() + static_cast<int64_t>(ScaleBytes(spec)));
  const std::string what = absl::StrCat(layout.name, " ", f.tokens, " tokens");
  std::fprintf(
      stderr, "[bench] transfer %s (%lld blocks, %.1f MB, %d repetitions)...\n",
      what.c_str(), static_cast<long long>(f.blocks), f.bytes / 1e6,
      config.repetitions);

  ASSIGN_OR_RETURN(PoolPair pools, PoolPair::Create(spec, f.blocks));
  const kv_transfer::KvLayout kv_layout =
      kv_transfer::KvLayout::FromSpec(spec, "bench-transfer");
  // Both ends count into metrics, as the workers' do.
  metrics::Registry registry;
  kv_transfer::TransferMetrics transfer_metrics(registry);
  ASSIGN_OR_RETURN(std::unique_ptr<LoopbackReceiver> end,
                   LoopbackReceiver::Start(pools.receiver.get(), kv_layout,
                                           &transfer_metrics));
  kv_transfer::GrpcKvTransport transport(&transfer_metrics,
                                         config.transfer_timeout);
  // shm: the sender maps the receiver pool's memfd and memcpys into it; its
  // control stream is the KvTransfer.Control stream of the same server.
  kv_transfer::nccl::GrpcControlChannelFactory control;
  std::unique_ptr<kv_transfer::ipc::PeerMemoryBackend> shm_backend =
      kv_transfer::ipc::NewShmBackend();
  kv_transfer::ipc::IpcTransportConfig shm_config;
  shm_config.timeout = config.transfer_timeout;
  kv_transfer::ipc::IpcKvTransport shm(&control, shm_backend.get(),
                                       &transfer_metrics, shm_config);
  kv_transfer::SendPlan plan;
  plan.destination = end->address();
  plan.sender_id = "bench-transfer";
  plan.layout = kv_layout;

  // Warm-up, untimed: one whole transfer, so the channel is connected and
  // gRPC's and libc's allocators have grown to this transfer's working set,
  // as in a long-running worker (malloc's thresholds adapt to past frees, so
  // a cold first transfer pays extra page faults). Then the receiver is
  // cleared so verification sees only the bytes of a timed transfer.
  plan.blocks = pools.send_blocks;
  plan.request_id = "warm-up";
  if (auto w =
          TimeTransfer(transport, *end, pools.sender.get(), plan,
                       pools.receive_blocks, f.bytes, config.transfer_timeout);
      !w.ok()) {
    return Annotate(w.status(), absl::StrCat(what, ": grpc warm-up"));
  }
  pools.ClearReceived();
  plan.request_id = "warm-up-shm";  // maps the receiver pool once
  if (auto w =
          TimeTransfer(shm, *end, pools.sender.get(), plan,
                       pools.receive_blocks, f.bytes, config.transfer_timeout);
      !w.ok()) {
    return Annotate(w.status(), absl::StrCat(what, ": shm warm-up"));
  }
  pools.ClearReceived();

  std::vector<Timing> grpc_timings, tcp_timings, shm_timings;
  // grpc and raw TCP alternate so that noise from other load on the machine
  // affects both alike.
  for (int32_t rep = 0; rep < config.repetitions; ++rep) {
    plan.request_id = absl::StrCat("bench-", rep);
    auto g =
        TimeTransfer(transport, *end, pools.sender.get(), plan,
                     pools.receive_blocks, f.bytes, config.transfer_timeout);
    if (!g.ok()) {
      return Annotate(g.status(), absl::StrCat(what, ": grpc transfer"));
    }
    grpc_timings.push_back(*g);
    if (rep == 0) {
      RETURN_IF_ERROR(pools.Verify(absl::StrCat(what, " over grpc")));
    }
    auto t = TimeRawTcp(f.bytes, tcp_source, tcp_sink);
    if (!t.ok()) return Annotate(t.status(), what);
    tcp_timings.push_back(*t);
    if (rep == 0) pools.ClearReceived();
    plan.request_id = absl::StrCat("bench-shm-", rep);
    auto m =
        TimeTransfer(shm, *end, pools.sender.get(), plan, pools.receive_blocks,
                     f.bytes, config.transfer_timeout);
    if (!m.ok()) {
      return Annotate(m.status(), absl::StrCat(what, ": shm transfer"));
    }
    shm_timings.push_back(*m);
    if (rep == 0) {
      RETURN_IF_ERROR(pools.Verify(absl::StrCat(what, " over shm")));
    }
  }
  Summarize(grpc_timings, f.bytes, &f.grpc_gb_per_s, &f.grpc_median_gb_per_s,
            &f.grpc_cpu_s_per_gb);
  Summarize(tcp_timings, f.bytes, &f.tcp_gb_per_s, &f.tcp_median_gb_per_s,
            &f.tcp_cpu_s_per_gb);
  Summarize(shm_timings, f.bytes, &f.shm_gb_per_s, &f.shm_median_gb_per_s,
            &f.shm_cpu_s_per_gb);
  f.ratio = f.grpc_gb_per_s / f.tcp_gb_per_s;
  f.shm_over_grpc = f.shm_gb_per_s / f.grpc_gb_per_s;
  std::fprintf(stderr,
               "[bench] transfer %s: grpc %.3f GB/s, raw TCP %.3f GB/s, ratio "
               "%.2f; shm %.3f GB/s (%.2fx grpc); CPU s/GB grpc %.2f, raw TCP "
               "%.2f, shm %.2f\n",
               what.c_str(), f.grpc_gb_per_s, f.tcp_gb_per_s, f.ratio,
               f.shm_gb_per_s, f.shm_over_grpc, f.grpc_cpu_s_per_gb,
               f.tcp_cpu_s_per_gb, f.shm_cpu_s_per_gb);
  return f;
}

}  // namespace

std::vector<TransferLayout> DefaultTransferLayouts(DType small_dtype,
                                                   int32_t block_size) {
  return {
      {absl::StrCat("small-", DTypeName(small_dtype)),
       {8, 2, 64, block_size, small_dtype}},
      {"8b-bf16", {32, 8, 128, block_size, DType::kBF16}},
  };
}

absl::Status TransferBenchConfig::Validate() const {
  if (layouts.empty()) {
    return absl::InvalidArgumentError("bench transfer: no layout to measure");
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(
        "bench transfer: no sequence length to measure");
  }
  for (int32_t t : tokens) {
    if (t < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("bench transfer: tokens must be positive, got ", t));
    }
  }
  if (repetitions < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bench transfer: repetitions must be at least 1, got ", repetitions));
  }
  if (transfer_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "bench transfer: the transfer timeout must be positive");
  }
  for (const TransferLayout& l : layouts) {
    if (absl::Status s = l.spec.Validate(); !s.ok()) {
      return Annotate(s, absl::StrCat("layout ", l.name));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TransferBenchResult> RunTransferBench(
    const TransferBenchConfig& config) {
  RETURN_IF_ERROR(config.Validate());
  // Fail before measuring anything if some measurement cannot fit: its two
  // pools plus the raw TCP buffers must leave a quarter of physical memory.
  const int64_t physical = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) *
                           static_cast<int64_t>(sysconf(_SC_PAGESIZE));
  int64_t max_bytes = 0;
  for (const TransferLayout& l : config.layouts) {
    for (int32_t t : config.tokens) {
      const int64_t blocks =
          (int64_t{t} + l.spec.block_size - 1) / l.spec.block_size;
      const int64_t pool_bytes = blocks * l.spec.BytesPerBlock();
      if (physical > 0 && 2 * pool_bytes > physical / 4 * 3) {
        return absl::ResourceExhaustedError(absl::StrFormat(
            "bench transfer: %s at %d tokens needs two KV pools of %.2f GiB "
            "each, more than this machine's %.1f GiB of memory allows",
            l.name, t, pool_bytes / double{1 << 30},
            physical / double{1 << 30}));
      }
      max_bytes = std::max(max_bytes, pool_bytes);
    }
  }
  // Pre-filled (and so faulted-in) before any timing.
  std::vector<uint8_t> tcp_source(
      std::min<size_t>(kTcpSourceBytes, static_cast<size_t>(max_bytes)));
  FillSpan(tcp_source.data(), tcp_source.size(), 7);
  std::vector<uint8_t> tcp_sink(kTcpIoBytes, 1);

  TransferBenchResult result;
  result.repetitions = config.repetitions;
  for (const TransferLayout& layout : config.layouts) {
    for (int32_t tokens : config.tokens) {
      ASSIGN_OR_RETURN(TransferFigure f, MeasureOne(config, layout, tokens,
                                                    tcp_source, tcp_sink));
      result.figures.push_back(std::move(f));
    }
  }
  return result;
}

bool TransferBenchResult::MeetsGoal() const {
  for (const TransferFigure& f : figures) {
    if (f.tokens >= kTransferGoalMinTokens && f.ratio < kTransferGoalRatio)
      return false;
  }
  return true;
}

std::string TransferBenchResult::ToJson() const {
  json::OrderedValue out;
  out["repetitions"] = repetitions;
  out["statistic"] = "best";
  out["goal_ratio"] = kTransferGoalRatio;
  out["goal_min_tokens"] = kTransferGoalMinTokens;
  out["meets_goal"] = MeetsGoal();
  out["figures"] = json::OrderedValue::array();
  for (const TransferFigure& f : figures) {
    json::OrderedValue v;
    v["layout"] = f.layout;
    v["tokens"] = f.tokens;
    v["blocks"] = f.blocks;
    v["bytes"] = f.bytes;
    v["grpc_gb_per_s"] = f.grpc_gb_per_s;
    v["grpc_median_gb_per_s"] = f.grpc_median_gb_per_s;
    v["tcp_gb_per_s"] = f.tcp_gb_per_s;
    v["tcp_median_gb_per_s"] = f.tcp_median_gb_per_s;
    v["ratio"] = f.ratio;
    v["grpc_cpu_s_per_gb"] = f.grpc_cpu_s_per_gb;
    v["tcp_cpu_s_per_gb"] = f.tcp_cpu_s_per_gb;
    v["shm_gb_per_s"] = f.shm_gb_per_s;
    v["shm_median_gb_per_s"] = f.shm_median_gb_per_s;
    v["shm_cpu_s_per_gb"] = f.shm_cpu_s_per_gb;
    v["shm_over_grpc"] = f.shm_over_grpc;
    out["figures"].push_back(std::move(v));
  }
  return json::Dump(out);
}

std::string TransferBenchResult::ToTable() const {
  std::string out = absl::StrFormat(
      "%-12s %7s %7s %9s %17s %17s %8s %14s %17s %8s\n", "layout", "tokens",
      "blocks", "MB", "grpc GB/s (med)", "raw GB/s (med)", "grpc/raw",
      "CPU s/GB g|raw", "shm GB/s (med)", "shm/grpc");
  for (const TransferFigure& f : figures) {
    absl::StrAppendFormat(
        &out,
        "%-12s %7d %7d %9.1f %7.3f (%7.3f) %7.3f (%7.3f) %8.2f %6.2f|%-6.2f "
        "%7.3f (%7.3f) %8.2f\n",
        f.layout, f.tokens, f.blocks, f.bytes / 1e6, f.grpc_gb_per_s,
        f.grpc_median_gb_per_s, f.tcp_gb_per_s, f.tcp_median_gb_per_s, f.ratio,
        f.grpc_cpu_s_per_gb, f.tcp_cpu_s_per_gb, f.shm_gb_per_s,
        f.shm_median_gb_per_s, f.shm_over_grpc);
  }
  absl::StrAppendFormat(
      &out,
      "\nGB/s: best of %d repetitions (median in parentheses), GB = 1e9 bytes, "
      "loopback, both ends in one process; grpc/raw compares the best runs.\n"
      "shm: the same-node transport (memcpy into the receiver's mapped "
      "memfd pool, control over gRPC); shm/grpc compares the best runs.\n"
      "CPU s/GB: process CPU (all threads, user + system) per GB moved, least "
      "of the repetitions.\n"
      "goal grpc/raw >= %.2f at >= %d tokens: %s\n",
      repetitions, kTransferGoalRatio, kTransferGoalMinTokens,
      MeetsGoal() ? "met" : "NOT met");
  return out;
}

}  // namespace pdserve::bench
