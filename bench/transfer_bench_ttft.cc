// kv_overlap_ttft: time to first token of disaggregated requests with and
// without layer-wise KV streaming (--kv-layerwise), in one run.
//
// Two prefill/decode worker pairs run in this process on loopback (grpc KV
// transport), identical except for layer-wise streaming. Requests alternate
// between the pairs (and which goes first alternates), so both see the same
// machine load; every prompt is
// distinct (no prefix-cache hits). TTFT is from sending Generate to the
// decode worker (which reserves blocks, asks the prefill worker, waits for
// the KV) until its first token arrives.
//
//   kv_overlap_ttft [--model DIR] [--preset small] [--tokens 3000]
//                   [--requests 5] [--kv-dtype fp32]
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "common/metrics.h"
#include "model/model_init.h"
#include "pdserve/v1/internal.grpc.pb.h"
#include "worker/worker_server.h"

namespace pdserve::bench {
namespace {

struct Args {
  std::string model, preset = "small", dtype = "fp32";
  int tokens = 3000, requests = 5;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int Run(const Args& args) {
  std::string model = args.model;
  if (model.empty()) {
    model = std::filesystem::temp_directory_path() /
            ("pdserve_overlap_ttft_" + std::to_string(::getpid()));
    engine::ModelInitOptions o;
    o.preset = args.preset;
    o.out_dir = model;
    o.seed = 1;
    if (absl::Status s = engine::WriteRandomModel(o); !s.ok()) {
      std::fprintf(stderr, "model init: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  auto dtype = ParseDType(args.dtype);
  if (!dtype) {
    std::fprintf(stderr, "unknown --kv-dtype %s\n", args.dtype.c_str());
    return 1;
  }
  struct Pair {
    bool layerwise;
    metrics::Registry registry;
    std::unique_ptr<worker::WorkerServer> prefill, decode;
    std::vector<double> ttft_s;
  };
  std::vector<std::unique_ptr<Pair>> pairs;
  for (bool layerwise : {false, true}) {
    auto p = std::make_unique<Pair>();
    p->layerwise = layerwise;
    for (v1::WorkerRole role :
         {v1::WORKER_ROLE_PREFILL, v1::WORKER_ROLE_DECODE}) {
      worker::WorkerConfig c;
      c.role = role;
      c.model_dir = model;
      c.engine.kv_dtype = *dtype;
      c.engine.kv_cache_bytes = int64_t{512} << 20;
      c.kv_layerwise = layerwise;
      c.kv_stall_timeout = absl::Seconds(120);
      auto w = worker::WorkerServer::Start(c, &p->registry);
      if (!w.ok()) {
        std::fprintf(stderr, "worker: %s\n", w.status().ToString().c_str());
        return 1;
      }
      (role == v1::WORKER_ROLE_PREFILL ? p->prefill : p->decode) =
          *std::move(w);
    }
    pairs.push_back(std::move(p));
  }
  // One untimed request per pair (warm-up), then alternate.
  for (int i = -1; i < args.requests; ++i) {
    // Which pair goes first alternates too, so neither always follows the
    // other's work.
    std::vector<Pair*> order = {pairs[0].get(), pairs[1].get()};
    if (i % 2 != 0) std::swap(order[0], order[1]);
    for (Pair* p : order) {
      auto stub = v1::Worker::NewStub(grpc::CreateChannel(
          p->decode->address(), grpc::InsecureChannelCredentials()));
      v1::WorkerGenerateRequest req;
      req.set_request_id("r" + std::to_string(i));
      uint64_t x = 0x9E3779B97F4A7C15ull * (i + 7) + (p->layerwise ? 1 : 0);
      for (int t = 0; t < args.tokens; ++t) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        req.add_token_ids(static_cast<uint32_t>(1 + x % 250));
      }
      req.mutable_sampling()->set_max_tokens(1);
      req.mutable_sampling()->set_ignore_eos(true);
      req.set_prefill_address(p->prefill->address());
      grpc::ClientContext ctx;
      const auto start = std::chrono::steady_clock::now();
      auto reader = stub->Generate(&ctx, req);
      v1::WorkerGenerateResponse resp;
      const bool got = reader->Read(&resp);
      const double s = std::chrono::duration<double>(
                           std::chrono::steady_clock::now() - start)
                           .count();
      while (reader->Read(&resp)) {
      }
      const grpc::Status st = reader->Finish();
      if (!got || !st.ok()) {
        std::fprintf(stderr, "generate failed: %s\n",
                     st.error_message().c_str());
        return 1;
      }
      if (i >= 0) p->ttft_s.push_back(s);
    }
  }
  std::printf(
      "kv_overlap_ttft: %s preset, %d-token prompts, kv %s, %d requests each "
      "(alternating), grpc transport on loopback\n",
      args.preset.c_str(), args.tokens, args.dtype.c_str(), args.requests);
  for (auto& p : pairs) {
    std::printf("  layerwise=%-5s TTFT median %.3f s, best %.3f s\n",
                p->layerwise ? "true" : "false", Median(p->ttft_s),
                *std::min_element(p->ttft_s.begin(), p->ttft_s.end()));
  }
  std::printf("  ratio layerwise/whole (median): %.3f\n",
              Median(pairs[1]->ttft_s) / Median(pairs[0]->ttft_s));
  if (args.model.empty()) std::filesystem::remove_all(model);
  return 0;
}

}  // namespace
}  // namespace pdserve::bench

int main(int argc, char** argv) {
  pdserve::bench::Args args;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--model") {
      args.model = value;
    } else if (flag == "--preset") {
      args.preset = value;
    } else if (flag == "--kv-dtype") {
      args.dtype = value;
    } else if (flag == "--tokens") {
      if (!absl::SimpleAtoi(value, &args.tokens)) return 2;
    } else if (flag == "--requests") {
      if (!absl::SimpleAtoi(value, &args.requests)) return 2;
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  return pdserve::bench::Run(args);
}
