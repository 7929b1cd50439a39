// `pdserve router`, `prefill`, `decode`, `worker --role both`, `up`, and the
// gRPC client behind `generate --router`.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cli/command.h"
#include "cli/flag_table.h"
#include "cli/flags.h"
#include "cli/security_flags.h"
#include "cli/stop_signal.h"
#include "common/json.h"
#include "common/logging.h"
#include "common/metrics_http.h"
#include "kernels/cpu/core_share.h"
#include "model/model_init.h"
#include "pdserve/v1/internal.grpc.pb.h"
#include "pdserve/v1/router.grpc.pb.h"
#include "router/openai/openai_server.h"
#include "router/router_service.h"
#include "wire/enums.h"
#include "wire/sampling_convert.h"
#include "wire/structured_convert.h"
#include "worker/registration.h"
#include "worker/worker_server.h"

ABSL_FLAG(std::string, host, "127.0.0.1",
          "address to listen on (0.0.0.0 in containers)");
ABSL_FLAG(
    int32_t, port, -1,
    "gRPC port (router default 50051; workers default 0 = any free port)");
ABSL_FLAG(int32_t, metrics_port, -1,
          "Prometheus /metrics port (router default 9400; workers 0 = any)");
ABSL_FLAG(int32_t, http_port, -1,
          "router/up: OpenAI-compatible HTTP port (router default 0 = off; up "
          "default 8000); HTTPS with --tls-cert/--tls-key");
ABSL_FLAG(std::string, served_model_name, "",
          "router/up: the model name of the OpenAI API (default: the model "
          "directory's base name)");
ABSL_FLAG(int32_t, http_max_connections, 256,
          "router: HTTP connections served at once (one thread each)");
ABSL_FLAG(int32_t, http_max_queued_connections, 256,
          "router: HTTP connections that may wait for a thread; past them 503 "
          "with Retry-After");
ABSL_FLAG(int32_t, http_keep_alive_timeout_ms, 5000,
          "router: an idle HTTP keep-alive connection is closed after this");
ABSL_FLAG(int64_t, http_max_body_bytes, 4 << 20,
          "router: bytes per HTTP request body (413 past it)");
ABSL_FLAG(std::string, advertise, "",
          "host other processes use to reach this worker (default: --host)");
ABSL_FLAG(std::string, role, "both", "worker role: prefill, decode or both");
ABSL_FLAG(std::string, router, "",
          "router address (workers register there; generate sends there)");
ABSL_FLAG(std::string, kv_transport, "auto",
          "KV transfer backend: grpc; nccl (needs a CUDA+NCCL build and a GPU "
          "per worker); shm (CPU workers on one node: prefill writes into the "
          "decode worker's memfd-backed pool); cuda_ipc (GPU workers on one "
          "node, same or peer GPU; never run on a GPU yet); auto: for `up`, "
          "cuda_ipc with --device cuda and shm on CPU; grpc for a standalone "
          "worker");
ABSL_FLAG(std::string, core_share, "auto",
          "workers on one host lend each other the cores of an idle engine "
          "through this shared-memory file (created if missing; the workers "
          "of one host name the same file): a worker with work runs its "
          "--threads plus the idle workers' threads. off: none; auto: none "
          "for a worker, and for `up` one shared by its workers on CPU");
ABSL_FLAG(int32_t, kv_cuda_device, 0,
          "--kv-transport nccl: the CUDA device this worker's NCCL "
          "communicators use");
ABSL_FLAG(bool, kv_layerwise, true,
          "prefill workers: send each layer's KV as soon as the forward pass "
          "wrote it, overlapping transfer with compute (`up` on CPU, whose "
          "workers share the host's cores: off unless given)");
ABSL_FLAG(int64_t, kv_stream_queue_bytes, int64_t{64} << 20,
          "prefill workers: per request, KV bytes queued for sending at most "
          "(beyond it the rest goes after the prefill)");
ABSL_FLAG(std::string, prefill_workers, "",
          "router: prefill worker addresses (host:port or dns:name:port), "
          "comma-separated");
ABSL_FLAG(std::string, decode_workers, "",
          "router: decode worker addresses, comma-separated");
ABSL_FLAG(std::string, both_workers, "",
          "router: colocated (--role both) worker addresses, comma-separated");
ABSL_FLAG(std::string, policy, "cache_aware",
          "router: cache_aware, round_robin, least_loaded or cache_threshold");
ABSL_FLAG(double, w_prefill, 1.0,
          "router: weight of uncached + queued prefill tokens");
ABSL_FLAG(double, w_decode, 64.0, "router: weight of decode load (sequences)");
ABSL_FLAG(
    int64_t, local_prefill_threshold, 32,
    "router: uncached tokens at or below this prefill on the decode worker "
    "(up: 128 unless given, as its workers share one host's cores)");
ABSL_FLAG(int32_t, max_retries, 3,
          "router: retries before the first token / migrations after it");
ABSL_FLAG(bool, peer_pull, false,
          "router: let the chosen prefill worker pull a prompt prefix it "
          "lacks from another worker's KV pool when the estimated transfer "
          "(measured GB/s) beats recomputing it (measured prefill tokens/s)");
ABSL_FLAG(double, peer_pull_min_speedup, 1.0,
          "router, with --peer-pull: pull only when recompute is estimated "
          "this many times slower than the transfer");
ABSL_FLAG(int32_t, worker_heartbeat_ms, 500,
          "router: interval between status polls of each worker");
ABSL_FLAG(int32_t, worker_status_timeout_ms, 1000,
          "router: deadline of one worker status poll");
ABSL_FLAG(int32_t, worker_max_missed_polls, 3,
          "router: status polls in a row a busy worker may answer late before "
          "it is marked down (a refused or failed poll marks it down at once)");
ABSL_FLAG(int32_t, worker_forget_after_ms, 60000,
          "router: a self-registered worker down this long is forgotten");
ABSL_FLAG(int32_t, drain_timeout_ms, 30000,
          "worker: on SIGTERM, finish in-flight requests for up to this long");
ABSL_FLAG(
    int32_t, admission_timeout_ms, 10000,
    "worker: wait this long for free KV blocks before RESOURCE_EXHAUSTED");
ABSL_FLAG(int32_t, prefill, 1,
          "up: number of prefill workers (0 = colocated --role both workers)");
ABSL_FLAG(int32_t, decode, 1, "up: number of decode (or colocated) workers");
ABSL_FLAG(int32_t, timeout_ms, 0,
          "generate --router: request deadline (0 = none)");
ABSL_DECLARE_FLAG(std::string, prompt);
ABSL_DECLARE_FLAG(uint32_t, max_tokens);
ABSL_DECLARE_FLAG(std::string, cache_salt);

namespace pdserve::cli {

engine::SamplingParams SamplingParamsFromFlags();
absl::StatusOr<structured::ConstraintSpec> ConstraintFromFlags();

namespace {

void WaitForSignal() { WaitForStopSignal(); }

std::vector<std::string> SplitList(const std::string& s) {
  return absl::StrSplit(s, ',', absl::SkipWhitespace());
}

absl::StatusOr<std::unique_ptr<metrics::MetricsHttpServer>> StartMetrics(
    int port) {
  return metrics::MetricsHttpServer::Start(
      &metrics::Registry::Default(),
      absl::GetFlag(FLAGS_host) == "127.0.0.1" ? "127.0.0.1" : "0.0.0.0", port);
}

// `command`: the CommandBit it was started as (its flags are reported).
int RunWorkerWithRole(const std::string& role_name, uint32_t command) {
  if (absl::Status s = InstallStopSignalHandlers(); !s.ok())
    return ReportError(s);
  // mTLS (or an explicit --insecure) before any server or channel exists.
  if (absl::Status s = InstallTlsFromFlags(); !s.ok()) return ReportError(s);
  const std::optional<v1::WorkerRole> role = wire::ParseRole(role_name);
  if (!role) {
    return ReportError(absl::InvalidArgumentError(absl::StrCat(
        "--role must be prefill, decode or both, got \"", role_name, "\"")));
  }
  worker::WorkerConfig config;
  config.role = *role;
  config.model_dir = absl::GetFlag(FLAGS_model);
  auto engine = EngineConfigFromFlags(*role == v1::WORKER_ROLE_PREFILL);
  if (!engine.ok()) return ReportError(engine.status());
  config.engine = *engine;
  config.listen_host = absl::GetFlag(FLAGS_host);
  config.port = std::max(0, absl::GetFlag(FLAGS_port));
  config.advertise_host = absl::GetFlag(FLAGS_advertise);
  // auto: grpc for a standalone worker (its peers may be on other nodes).
  const std::string transport_name = absl::GetFlag(FLAGS_kv_transport);
  auto transport = kv_transfer::ParseKvTransport(
      transport_name == "auto" ? "grpc" : transport_name);
  if (!transport.ok()) return ReportError(transport.status());
  config.kv_transport = *transport;
  config.kv_cuda_device = absl::GetFlag(FLAGS_kv_cuda_device);
  config.kv_layerwise = absl::GetFlag(FLAGS_kv_layerwise);
  config.kv_stream_queue_bytes = absl::GetFlag(FLAGS_kv_stream_queue_bytes);
  config.admission_timeout =
      absl::Milliseconds(absl::GetFlag(FLAGS_admission_timeout_ms));
  if (const std::string share = absl::GetFlag(FLAGS_core_share);
      share != "auto" && share != "off" && !share.empty()) {
    auto joined = kernels::CoreShare::Join(share, kernels::KernelThreads());
    if (!joined.ok()) return ReportError(joined.status());
    // The kernels may ask it for threads until the process exits.
    kernels::CoreShare* core_share = joined->release();
    kernels::SetKernelThreadSource(core_share);
    config.on_engine_busy = [core_share](bool busy) {
      core_share->SetBusy(busy);
    };
    PDSERVE_LOG(INFO) << "core share " << share << ": slot "
                      << core_share->slot() << ", " << core_share->own_threads()
                      << " own kernel threads";
  }
  auto server =
      worker::WorkerServer::Start(config, &metrics::Registry::Default());
  RegisterConfigInfo(metrics::Registry::Default(), "pdserve_worker", command);
  if (!server.ok()) return ReportError(server.status());
  auto http = StartMetrics(std::max(0, absl::GetFlag(FLAGS_metrics_port)));
  if (!http.ok()) return ReportError(http.status());
  // One parseable line for `pdserve up` and scripts.
  std::printf("pdserve worker %s listening on %s metrics %d\n",
              (*server)->id().c_str(), (*server)->address().c_str(),
              (*http)->port());
  std::fflush(stdout);
  std::unique_ptr<worker::RouterRegistration> registration;
  if (const std::string router = absl::GetFlag(FLAGS_router); !router.empty()) {
    worker::RegistrationConfig rc;
    rc.router = router;
    rc.address = (*server)->address();
    rc.role = *role;
    auto r = worker::RouterRegistration::Start(
        rc, tls::InternalChannelCredentials());
    if (!r.ok()) return ReportError(r.status());
    registration = *std::move(r);
  }
  WaitForSignal();
  (*server)->Drain(absl::Milliseconds(absl::GetFlag(FLAGS_drain_timeout_ms)));
  // The drain is over: the rest of the shutdown must not hang the process
  // (a pod's termination grace, a supervisor's SIGKILL). If it takes longer
  // than this, exit without it; in-flight requests were already cut off and
  // migrate, and KV blocks die with the process.
  std::thread([] {
    absl::SleepFor(absl::Seconds(10));
    PDSERVE_LOG(ERROR) << "shutdown did not finish 10 s after the drain; "
                          "exiting without it";
    std::fflush(nullptr);
    _exit(0);
  }).detach();
  if (registration) registration->Stop();
  (*server)->Shutdown();
  return 0;
}

}  // namespace

int RunPrefillWorker(const std::vector<std::string>&) {
  return RunWorkerWithRole("prefill", kPrefill);
}
int RunDecodeWorker(const std::vector<std::string>&) {
  return RunWorkerWithRole("decode", kDecode);
}
int RunWorker(const std::vector<std::string>&) {
  return RunWorkerWithRole(absl::GetFlag(FLAGS_role), kWorker);
}

namespace {

// The OpenAI front's model name: --served-model-name, else the base name of
// the model directory ("models/small/" -> "small").
std::string ServedModelName(const std::string& model_dir) {
  if (const std::string name = absl::GetFlag(FLAGS_served_model_name);
      !name.empty())
    return name;
  std::filesystem::path p = std::filesystem::path(model_dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p.filename().string();
}

// The HTTP front on the router's in-process channel (0: none).
absl::StatusOr<std::unique_ptr<router::openai::OpenAiServer>> StartOpenAi(
    router::RouterServer* server, const router::RouterConfig& config,
    int port) {
  if (port <= 0) return nullptr;
  router::openai::OpenAiServerConfig hc;
  hc.host = absl::GetFlag(FLAGS_host);
  hc.port = port;
  hc.model_dir = config.model_dir;
  hc.served_model_name = ServedModelName(config.model_dir);
  hc.max_connections = absl::GetFlag(FLAGS_http_max_connections);
  hc.max_queued_connections = absl::GetFlag(FLAGS_http_max_queued_connections);
  hc.keep_alive_idle_timeout =
      absl::Milliseconds(absl::GetFlag(FLAGS_http_keep_alive_timeout_ms));
  hc.max_body_bytes = absl::GetFlag(FLAGS_http_max_body_bytes);
  if (!config.tls.insecure) {
    hc.tls_cert_file = config.tls.cert_file;
    hc.tls_key_file = config.tls.key_file;
  }
  router::openai::RouterHooks hooks;
  hooks.channel = server->InProcessChannel();
  hooks.authenticate = [server](absl::string_view authorization) {
    return server->CheckAuthorization(authorization);
  };
  hooks.healthy = [server] {
    for (const router::WorkerView& w : server->workers().UpWorkers()) {
      if (w.role != v1::WORKER_ROLE_PREFILL && !w.status.draining())
        return true;
    }
    return false;
  };
  return router::openai::OpenAiServer::Start(hc, std::move(hooks),
                                             &metrics::Registry::Default());
}

}  // namespace

int RunRouter(const std::vector<std::string>&) {
  if (absl::Status s = InstallStopSignalHandlers(); !s.ok())
    return ReportError(s);
  if (absl::Status s = InstallTlsFromFlags(); !s.ok()) return ReportError(s);
  router::RouterConfig config;
  config.model_dir = absl::GetFlag(FLAGS_model);
  RouterSecurityFromFlags(&config);
  config.workers.prefill = SplitList(absl::GetFlag(FLAGS_prefill_workers));
  config.workers.decode = SplitList(absl::GetFlag(FLAGS_decode_workers));
  config.workers.both = SplitList(absl::GetFlag(FLAGS_both_workers));
  config.policy = absl::GetFlag(FLAGS_policy);
  config.policy_config.w_prefill = absl::GetFlag(FLAGS_w_prefill);
  config.policy_config.w_decode = absl::GetFlag(FLAGS_w_decode);
  config.policy_config.local_prefill_threshold =
      absl::GetFlag(FLAGS_local_prefill_threshold);
  config.max_retries = absl::GetFlag(FLAGS_max_retries);
  config.workers.heartbeat =
      absl::Milliseconds(absl::GetFlag(FLAGS_worker_heartbeat_ms));
  config.workers.status_timeout =
      absl::Milliseconds(absl::GetFlag(FLAGS_worker_status_timeout_ms));
  config.workers.max_missed_polls =
      absl::GetFlag(FLAGS_worker_max_missed_polls);
  config.workers.forget_registered_after =
      absl::Milliseconds(absl::GetFlag(FLAGS_worker_forget_after_ms));
  config.peer_pull.enabled = absl::GetFlag(FLAGS_peer_pull);
  config.peer_pull.min_speedup = absl::GetFlag(FLAGS_peer_pull_min_speedup);
  auto server =
      router::RouterServer::Create(config, &metrics::Registry::Default());
  RegisterConfigInfo(metrics::Registry::Default(), "pdserve_router", kRouter);
  if (!server.ok()) return ReportError(server.status());
  const int want =
      absl::GetFlag(FLAGS_port) < 0 ? 50051 : absl::GetFlag(FLAGS_port);
  auto port = (*server)->Serve(absl::GetFlag(FLAGS_host), want);
  if (!port.ok()) return ReportError(port.status());
  auto http = StartMetrics(absl::GetFlag(FLAGS_metrics_port) < 0
                               ? 9400
                               : absl::GetFlag(FLAGS_metrics_port));
  if (!http.ok()) return ReportError(http.status());
  auto openai = StartOpenAi(server->get(), config,
                            std::max(0, absl::GetFlag(FLAGS_http_port)));
  if (!openai.ok()) return ReportError(openai.status());
  std::printf("pdserve router listening on %s:%d metrics %d",
              absl::GetFlag(FLAGS_host).c_str(), *port, (*http)->port());
  if (*openai) std::printf(" http %d", (*openai)->port());
  std::printf("\n");
  std::fflush(stdout);
  WaitForSignal();
  // gRPC first: its shutdown deadline cancels the streams the HTTP front's
  // threads are reading, which lets Stop() join them.
  (*server)->Shutdown();
  if (*openai) (*openai)->Stop();
  return 0;
}

namespace {

struct Child {
  pid_t pid = -1;
  std::string name;
  std::string address;
  int metrics_port = 0;
};

// Starts `pdserve ARGS...` and reads its "listening on ADDR metrics PORT" line.
absl::StatusOr<Child> Spawn(const std::string& name,
                            std::vector<std::string> args) {
  int fds[2];
  if (pipe(fds) != 0) return absl::InternalError("pipe failed");
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    close(fds[1]);
    std::vector<char*> argv;
    static std::string self = "/proc/self/exe";
    argv.push_back(self.data());
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv("/proc/self/exe", argv.data());
    _exit(127);
  }
  close(fds[1]);
  FILE* in = fdopen(fds[0], "r");
  char line[512];
  Child child{pid, name, "", 0};
  while (fgets(line, sizeof(line), in) != nullptr) {
    std::string s(line);
    const size_t at = s.find("listening on ");
    if (at == std::string::npos) continue;
    std::vector<std::string> parts =
        absl::StrSplit(s.substr(at + 13), ' ', absl::SkipWhitespace());
    child.address = parts[0];
    if (parts.size() >= 3) child.metrics_port = std::atoi(parts[2].c_str());
    break;
  }
  // Keep draining the child's stdout so it never blocks on a full pipe.
  std::thread([in] {
    char buf[512];
    while (fgets(buf, sizeof(buf), in) != nullptr) std::fputs(buf, stdout);
    fclose(in);
  }).detach();
  if (child.address.empty()) {
    int status = 0;
    waitpid(pid, &status, 0);
    return absl::InternalError(
        absl::StrCat(name, " exited before listening (see its error above)"));
  }
  return child;
}

}  // namespace

int RunUp(const std::vector<std::string>&) {
  if (absl::Status s = InstallStopSignalHandlers(); !s.ok())
    return ReportError(s);
  std::string model = absl::GetFlag(FLAGS_model);
  if (model.empty()) {
    model = DefaultModelDir();
    if (!std::filesystem::exists(model + "/config.json")) {
      std::fprintf(
          stderr,
          "pdserve up: creating the default model (small preset) in %s\n",
          model.c_str());
      engine::ModelInitOptions opts;
      opts.preset = "small";
      opts.out_dir = model;
      if (auto s = engine::WriteRandomModel(opts); !s.ok())
        return ReportError(s);
    }
  }
  const int n_prefill = absl::GetFlag(FLAGS_prefill),
            n_decode = absl::GetFlag(FLAGS_decode);
  if (n_prefill < 0 || n_decode < 1) {
    return ReportError(absl::InvalidArgumentError(
        "--decode must be at least 1 and --prefill at least 0"));
  }
  // Plaintext unless TLS files are given: `up` is for local use.
  const bool insecure = TlsArgsFromFlags().front() == "--insecure";
  if (insecure) {
    std::fprintf(stderr,
                 "pdserve up: plaintext gRPC (--insecure), no authentication "
                 "between processes: for local use only (pass --tls-cert, "
                 "--tls-key and --tls-ca for mTLS)\n");
  }
  // CPU workers of one host lend each other idle cores (kernels::CoreShare)
  // through a memfd they inherit; the router does not touch it.
  std::string core_share = absl::GetFlag(FLAGS_core_share);
  int core_share_fd = -1;
  if (core_share == "auto") {
    core_share = "off";
    if (absl::GetFlag(FLAGS_device) == "cpu" && n_prefill + n_decode > 1) {
      auto fd = kernels::CoreShare::CreateInheritable();
      if (!fd.ok()) return ReportError(fd.status());
      core_share_fd = *fd;
      core_share = absl::StrCat("/proc/self/fd/", core_share_fd);
    }
  }
  std::vector<Child> children;
  auto stop_all = [&] {
    for (auto& c : children) kill(c.pid, SIGTERM);
    for (auto& c : children) waitpid(c.pid, nullptr, 0);
  };
  std::vector<std::string> prefill_addrs, decode_addrs;
  for (int i = 0; i < n_prefill + n_decode; ++i) {
    const bool is_prefill = i < n_prefill;
    const std::string role =
        is_prefill ? "prefill" : (n_prefill == 0 ? "both" : "decode");
    // Every flag the table forwards to workers (cli/flag_table.cc), then
    // the ones up decides per child.
    UpChild up_child{false, role,      i,         n_prefill + n_decode,
                     model, n_prefill, core_share};
    std::vector<std::string> args = {"worker"};
    for (std::string& a : UpChildArgs(up_child)) args.push_back(std::move(a));
    args.insert(args.end(), {"--role=" + role, "--port=0", "--metrics-port=0"});
    auto child = Spawn(absl::StrCat(role, "-", i), args);
    if (!child.ok()) {
      stop_all();
      return ReportError(child.status());
    }
    (is_prefill ? prefill_addrs : decode_addrs).push_back(child->address);
    children.push_back(*child);
  }
  UpChild up_router{true, "", 0, n_prefill + n_decode, model, n_prefill};
  std::vector<std::string> router_args = {"router"};
  for (std::string& a : UpChildArgs(up_router))
    router_args.push_back(std::move(a));
  const int http_port = absl::GetFlag(FLAGS_http_port) < 0
                            ? 8000
                            : absl::GetFlag(FLAGS_http_port);
  if (n_prefill > 0) {
    router_args.push_back("--prefill-workers=" +
                          absl::StrJoin(prefill_addrs, ","));
    router_args.push_back("--decode-workers=" +
                          absl::StrJoin(decode_addrs, ","));
  } else {
    router_args.push_back("--both-workers=" + absl::StrJoin(decode_addrs, ","));
  }
  auto router = Spawn("router", router_args);
  if (!router.ok()) {
    stop_all();
    return ReportError(router.status());
  }
  children.push_back(*router);
  std::printf("\npdserve is up (%s): model %s\n",
              insecure ? "INSECURE: plaintext, no authentication; local use"
                       : "mutual TLS",
              model.c_str());
  for (const auto& c : children) {
    std::printf("  %-10s grpc %-22s metrics http://127.0.0.1:%d/metrics\n",
                c.name.c_str(), c.address.c_str(), c.metrics_port);
  }
  if (http_port > 0) {
    std::printf("  %-10s %s://127.0.0.1:%d/v1 (model \"%s\")\n", "openai",
                insecure ? "http" : "https", http_port,
                ServedModelName(model).c_str());
  }
  std::printf(
      "\nTry:\n  %s generate --router %s --prompt \"hello\" "
      "--max-tokens 32\n",
      "build/bin/pdserve", router->address.c_str());
  if (http_port > 0) {
    std::printf(
        "  curl %s://127.0.0.1:%d/v1/completions -H 'Content-Type: "
        "application/json' -d '{\"model\": \"%s\", \"prompt\": \"hello\", "
        "\"max_tokens\": 32}'\n",
        insecure ? "http" : "https", http_port, ServedModelName(model).c_str());
  }
  std::printf("Ctrl-C stops everything.\n");
  std::fflush(stdout);
  // Stop on Ctrl-C, or when any child dies unexpectedly.
  while (!WaitForStopSignal(absl::Milliseconds(200))) {
    int status;
    const pid_t dead = waitpid(-1, &status, WNOHANG);
    if (dead > 0) {
      for (auto& c : children) {
        if (c.pid == dead) {
          std::fprintf(stderr, "pdserve up: %s exited; stopping the cluster\n",
                       c.name.c_str());
          c.pid = -1;
        }
      }
      break;
    }
  }
  for (auto& c : children) {
    if (c.pid > 0) kill(c.pid, SIGTERM);
  }
  for (auto& c : children) {
    if (c.pid > 0) waitpid(c.pid, nullptr, 0);
  }
  if (core_share_fd >= 0) close(core_share_fd);
  return 0;
}

int RunGenerateRemote() {
  v1::GenerateRequest req;
  req.set_prompt(absl::GetFlag(FLAGS_prompt));
  *req.mutable_sampling() = SamplingToProto(SamplingParamsFromFlags());
  auto constraint = ConstraintFromFlags();
  if (!constraint.ok()) return ReportError(constraint.status());
  ConstraintToProto(*constraint, req.mutable_sampling());
  req.set_cache_salt(absl::GetFlag(FLAGS_cache_salt));
  auto channel = RouterChannelFromFlags(absl::GetFlag(FLAGS_router));
  if (!channel.ok()) return ReportError(channel.status());
  auto stub = v1::Router::NewStub(*channel);
  grpc::ClientContext ctx;
  if (const std::string token = AuthTokenFromFlags(); !token.empty())
    ctx.AddMetadata("authorization", "Bearer " + token);
  if (absl::GetFlag(FLAGS_timeout_ms) > 0) {
    ctx.set_deadline(
        std::chrono::system_clock::now() +
        std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms)));
  }
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse resp;
  std::vector<uint32_t> ids;
  std::string text, finish, request_id, pw, dw;
  v1::Usage usage;
  json::OrderedValue logprobs = json::OrderedValue::array();
  const bool as_json = absl::GetFlag(FLAGS_json);
  while (reader->Read(&resp)) {
    ids.insert(ids.end(), resp.token_ids().begin(), resp.token_ids().end());
    for (const v1::TokenLogprobs& lp : resp.logprobs()) {
      json::OrderedValue top = json::OrderedValue::array();
      for (const v1::TopLogprob& t : lp.top())
        top.push_back({{"token_id", t.token_id()}, {"logprob", t.logprob()}});
      logprobs.push_back({{"token_id", lp.token_id()},
                          {"logprob", lp.logprob()},
                          {"top", std::move(top)}});
    }
    text += resp.text();
    request_id = resp.request_id();
    if (!as_json && !resp.text().empty()) {
      std::fwrite(resp.text().data(), 1, resp.text().size(), stdout);
      std::fflush(stdout);
    }
    if (!resp.finish_reason().empty()) {
      finish = resp.finish_reason();
      usage = resp.usage();
      pw = resp.prefill_worker();
      dw = resp.decode_worker();
    }
  }
  const grpc::Status st = reader->Finish();
  if (!st.ok()) {
    std::fprintf(
        stderr, "pdserve: error: %s: %s\n",
        absl::StatusCodeToString(static_cast<absl::StatusCode>(st.error_code()))
            .c_str(),
        st.error_message().c_str());
    return st.error_code() == grpc::StatusCode::INVALID_ARGUMENT ? 2 : 1;
  }
  if (as_json) {
    // finish_reason comes from the server: escaped like every other string.
    json::OrderedValue out = {
        {"request_id", request_id},
        {"token_ids", ids},
        {"text", text},
        {"finish_reason", finish},
        {"usage",
         {{"prompt_tokens", usage.prompt_tokens()},
          {"completion_tokens", usage.completion_tokens()},
          {"cached_prompt_tokens", usage.cached_prompt_tokens()}}},
        {"prefill_worker", pw},
        {"decode_worker", dw}};
    // The same form as `generate --model --logprobs --json`.
    if (req.sampling().logprobs()) out["logprobs"] = std::move(logprobs);
    std::printf("%s\n", json::Dump(out, json::ArraySpacing::kCompact).c_str());
  }
  return 0;
}

}  // namespace pdserve::cli
