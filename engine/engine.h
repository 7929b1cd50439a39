// The inference engine of one worker: a continuous-batching scheduler over a
// paged, prefix-cached KV pool and a LlamaModel.
//
// Each Step() schedules under a token budget (running sequences first, then
// waiting ones, with long prompts split into chunks), runs one forward pass,
// samples, and reports new tokens. When blocks run out, the most recently
// admitted running sequence is preempted: its blocks are released (full ones
// stay in the prefix cache) and it is recomputed later. A request that could
// never fit in the pool is refused up front with RESOURCE_EXHAUSTED.
//
// Not thread-safe: one engine thread owns the Engine (STYLE.md, threads);
// services hand work to it through a queue.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/sampling.h"
#include "kv_cache/block_manager.h"
#include "kv_cache/kv_cache.h"
#include "kv_cache/kv_tier.h"
#include "model/llama_model.h"
#include "model/weights.h"
#include "structured/token_guide.h"

namespace pdserve::engine {

struct EngineConfig {
  int32_t block_size = 16;
  DType kv_dtype = DType::kF32;
  int64_t kv_cache_bytes = int64_t{256} << 20;
  int32_t max_num_seqs = 64;  // running sequences at once
  int32_t max_num_batched_tokens =
      512;  // token budget per step (chunked prefill)
  // Most prompt tokens one sequence computes in a step (0: up to the step's
  // budget). A long prompt then takes several steps, and prompts that arrive
  // meanwhile are admitted beside its chunks instead of waiting for all of
  // it: their first token comes sooner on a busy prefill worker.
  int32_t long_prefill_chunk = 0;
  int32_t max_model_len = 0;  // 0: the model's max_position_embeddings
  bool enable_prefix_caching = true;
  kernels::MatMulMode matmul = kernels::MatMulMode::kDeterministic;
  // How the caller loads the weights (ModelWeights::Load(dir, weight_dtype,
  // matmul)); kBlas allows only kAuto or kF32.
  WeightDtype weight_dtype = WeightDtype::kAuto;
  // kCuda runs the forward pass on the GPU (engine/cuda_backend.h) with a KV
  // pool sized from gpu_memory_utilization instead of kv_cache_bytes.
  Device device = Device::kCpu;
  double gpu_memory_utilization = 0.9;
  bool gpu_reference_math = false;  // see BackendConfig (equivalence checks)
  int32_t cuda_device = 0;          // see BackendConfig
  // Bounds on work queued ahead of the engine thread, so that a burst of
  // requests costs memory in proportion to these caps, not to the burst.
  // Beyond each cap new work is refused with RESOURCE_EXHAUSTED.
  int32_t max_waiting_requests = 1024;      // admitted, waiting for blocks
  int32_t max_queued_calls = 4096;          // EngineLoop: Submit/Reserve queued
  int32_t max_pending_reservations = 1024;  // EngineLoop: waiting for blocks
  // A tier below the pool (kv_cache/kv_tier.h): local files (CPU only) or
  // host memory (any device; pinned on CUDA). Evicted prefix blocks go there
  // and come back on a prefix hit. Off unless dir or memory_bytes is set.
  KvTierConfig kv_offload;
  // CPU only: the KV pool lives in a memfd that other processes on the node
  // can map (KvCacheSpec::host_shared), for --kv-transport shm decode workers.
  bool kv_host_shared = false;

  absl::Status Validate() const;
};

enum class FinishReason { kNone, kLength, kStop, kEos, kCancelled };
const char* FinishReasonName(
    FinishReason r);  // "", "length", "stop", "eos", "cancelled"

// What one forward pass has just written for one request: its K/V at
// `layer` for every token before `num_computed` (this step's chunk included)
// now lie in `blocks`, the request's block table.
struct LayerWritten {
  int32_t layer = 0;
  int32_t num_computed = 0;  // tokens
  int32_t num_prompt = 0;    // tokens
  std::span<const int32_t> blocks;
};

// Caps on request fields that arrive from the network, in bytes: the salt is
// hashed into every block of the request, the id is kept per sequence.
// Services check them (CheckRequestFieldCaps) before any work.
inline constexpr size_t kMaxRequestIdBytes = 128;
inline constexpr size_t kMaxCacheSaltBytes = 256;
// INVALID_ARGUMENT naming the field when either exceeds its cap.
absl::Status CheckRequestFieldCaps(std::string_view request_id,
                                   std::string_view cache_salt);

struct EngineRequest {
  std::string id;
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  std::string cache_salt;
  // Prefill workers: when the request finishes, keep its blocks referenced
  // and hand them to the caller (StepOutput::held_blocks) so their KV can be
  // sent; the caller returns them with ReleaseBlocks().
  bool hold_blocks_on_finish = false;
  // Layer-wise KV streaming: called on the engine thread during Step, layer
  // by layer, right after the forward pass wrote this request's K/V of that
  // layer. It may take references (BlockManager::Acquire) on blocks it reads
  // later from another thread. Must not block.
  std::function<void(const LayerWritten&, BlockManager&)> on_layer_written;
  // Structured output: logits are masked before sampling so the generated
  // text matches this (needs set_guide_cache). The last
  // `constraint_resume_tokens` prompt tokens are output generated under it
  // before (a migrated stream); the match resumes after them.
  structured::ConstraintSpec constraint;
  int32_t constraint_resume_tokens = 0;
};

struct StepOutput {
  std::string id;
  std::vector<int32_t> new_tokens;
  FinishReason finish = FinishReason::kNone;
  int32_t prompt_tokens = 0;
  int32_t cached_prompt_tokens =
      0;  // prompt tokens served from the prefix cache
  int32_t completion_tokens = 0;
  std::vector<int32_t> held_blocks;  // see EngineRequest::hold_blocks_on_finish
  // With sampling.logprobs: one per new_tokens entry.
  std::vector<TokenLogprobs> logprobs;
  // Not OK when the request ended with an engine error instead of a token
  // (INTERNAL: its logits held a NaN, engine/sampling.h); its blocks are
  // already freed and new_tokens is empty.
  absl::Status error;
};

// Blocks reserved on a decode worker for a prompt whose KV another worker
// computes. Leading `cached_blocks` came from this worker's own prefix cache
// and need no transfer.
struct Reservation {
  std::vector<int32_t> blocks;  // one per ceil(prompt / block_size)
  int32_t cached_blocks = 0;
};

struct EngineStats {
  int64_t num_running = 0;
  int64_t num_waiting = 0;
  int64_t blocks_free = 0;    // never used or evicted
  int64_t blocks_active = 0;  // referenced by a sequence
  int64_t blocks_cached = 0;  // unreferenced but holding a cached prefix
  int64_t prefix_queried_tokens = 0;
  int64_t prefix_hit_tokens = 0;
  int64_t preemptions = 0;
  int64_t steps = 0;
  // Tokens computed by the steps: of prompt passes (prompts, chunks of
  // them, recomputation after preemption) and of one-token decode steps.
  int64_t prefill_tokens = 0;
  int64_t decode_tokens = 0;
  // Wall seconds spent in steps, counted by EngineLoop (0 from Engine).
  double step_seconds = 0;
  int64_t num_reserved = 0;  // awaiting remote KV
  int64_t queued_prefill_tokens =
      0;  // prompt tokens admitted but not yet computed
  bool has_kv_tier = false;
  KvTierStats kv_tier;  // with has_kv_tier; its hits are in prefix_hit_tokens
  // Structured output: logits rows masked, and the engine-thread seconds spent
  // masking them and advancing their matchers.
  int64_t constrained_rows = 0;
  double constraint_seconds = 0;
};

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(
      std::shared_ptr<const ModelWeights> weights, const EngineConfig& config,
      KvEventSink events = nullptr);

  // INVALID_ARGUMENT for bad ids/params or prompt + max_tokens beyond
  // max_model_len; ALREADY_EXISTS for a live duplicate id; RESOURCE_EXHAUSTED
  // when the request could never fit in the whole pool (cause kNeverFits) or
  // max_waiting_requests are already waiting.
  absl::Status AddRequest(EngineRequest request);
  // The checks AddRequest and Reserve make before they take anything.
  absl::Status Validate(const EngineRequest& request) const;
  // Ends a request; its final StepOutput (finish = kCancelled unless another
  // reason is given) comes from the next Step(). Unknown ids are ignored.
  void Abort(const std::string& id,
             FinishReason reason = FinishReason::kCancelled);
  absl::StatusOr<std::vector<StepOutput>> Step();

  // Decode side of disaggregation. Reserve validates like AddRequest and
  // takes blocks for the whole prompt now (reusing cached prefix blocks), or
  // fails with RESOURCE_EXHAUSTED if they are not free at the moment (the
  // caller retries within its deadline; the cause is kPoolBusy, while one
  // that could never fit carries kNeverFits). kPoolBusy also while the disk
  // KV tier's reader thread still reads blocks of the prompt's prefix that
  // this call queued: the retry after they end takes them (this thread never
  // reads a tier file). The sequence is not scheduled
  // until CompleteReservation: the prompt's KV has arrived and `first_token`
  // was sampled by the prefill worker. Returns the finish reason if the first
  // token already ends the request (its blocks are then released).
  absl::StatusOr<Reservation> Reserve(EngineRequest request);
  absl::StatusOr<FinishReason> CompleteReservation(const std::string& id,
                                                   int32_t first_token);
  // Returns blocks handed out through StepOutput::held_blocks.
  void ReleaseBlocks(std::span<const int32_t> blocks);
  bool HasWork() const {
    return !running_.empty() || !waiting_.empty() || !aborted_.empty();
  }
  bool Has(const std::string& id) const { return seqs_.count(id) > 0; }
  // True while `id` waits for admission (not yet holding blocks).
  bool IsWaiting(const std::string& id) const;

  // Compiled constraints over this model's vocabulary, for requests with a
  // constraint (without it they are FAILED_PRECONDITION).
  void set_guide_cache(std::shared_ptr<structured::GuideCache> guides) {
    guides_ = std::move(guides);
  }

  EngineStats Stats() const;
  const EngineConfig& config() const { return config_; }
  const KvCacheSpec& kv_spec() const { return backend_->kv_spec(); }
  int32_t max_model_len() const { return config_.max_model_len; }
  const ModelConfig& model_config() const { return weights_->config; }
  // Identity of this engine's cached blocks: weights, block size, KV dtype.
  const ModelFingerprint& cache_fingerprint() const { return fingerprint_; }
  // That identity from its parts: any difference (int8 vs fp8 KV included)
  // gives another fingerprint, so such blocks never share prefix hashes.
  static ModelFingerprint CacheFingerprint(const ModelFingerprint& weights,
                                           int32_t block_size, DType kv_dtype);
  BlockManager& block_manager() { return blocks_; }
  // The backend's KV storage (host memory on CPU, device memory on CUDA),
  // for transfer code: spans of pinned or reserved blocks only.
  KvStorage& kv_storage() { return *backend_->kv_storage(); }
  const Backend& backend() const { return *backend_; }
  // The tier below the pool, or null when EngineConfig::kv_offload is off.
  KvTier* kv_tier() { return tier_.get(); }
  // Publishes the tier's queued changes (blocks stored in / dropped from the
  // tier) into the worker's KV event stream. Step() does it first; the
  // engine loop also calls it when idle, so that events arrive without
  // traffic.
  void PublishTierEvents();
  // Every hash the pool and the tier hold, as of `seq`, for a subscriber's
  // resync; the tier's pending events are published first, so the lists
  // and the sequence number agree.
  struct KvSnapshot {
    uint64_t seq = 0;
    std::vector<BlockHash> pool;
    bool has_tier = false;
    KvTierKind tier_kind = KvTierKind::kPool;
    std::vector<BlockHash> tier;
  };
  KvSnapshot TakeKvSnapshot();

 private:
  struct Sequence {
    EngineRequest req;
    std::vector<int32_t> tokens;  // prompt then generated
    int32_t num_prompt = 0;
    int32_t num_computed = 0;   // tokens whose K/V are in the blocks
    int32_t num_committed = 0;  // leading blocks registered in the prefix cache
    int32_t cached_prompt_tokens = -1;  // set at first admission
    std::vector<int32_t> blocks;
    std::vector<BlockHash> hashes;  // of full blocks of `tokens`
    // With req.constraint: the match so far (every generated token).
    std::optional<structured::TokenMatcher> matcher;
  };
  struct Scheduled {
    Sequence* seq;
    int32_t num_tokens;
  };

  Engine(std::shared_ptr<const ModelWeights> weights,
         const EngineConfig& config, std::unique_ptr<Backend> backend,
         KvEventSink events);
  int64_t BlocksFor(int64_t tokens) const;
  bool TryAdmit(Sequence* seq, int32_t budget, int32_t* scheduled_tokens);
  void Preempt(Sequence* seq);
  void ReleaseSequenceBlocks(Sequence* seq);
  void CommitFullBlocks(Sequence* seq);
  // Copies up to `n` readable tier blocks (KvTier::ReadableAndPin: no file
  // I/O here) after the first `first` of seq->hashes into
  // seq->blocks[first...]; returns how many loaded (stops at the first
  // failure: the rest is recomputed).
  int32_t LoadFromTier(Sequence* seq, int32_t first, int32_t n);

  EngineConfig config_;
  std::shared_ptr<const ModelWeights> weights_;
  // One path for every device: the backend runs the forward pass over the
  // KV storage it owns (CPU: LlamaModel over a host KvPool; CUDA: the GPU).
  std::unique_ptr<Backend> backend_;
  BlockManager blocks_;
  ModelFingerprint fingerprint_;
  std::unique_ptr<KvTier> tier_;  // blocks_'s tier hooks call it
  FinishReason CheckFinish(const Sequence& seq) const;
  // Starts seq->matcher for a constrained request, past the resumed tokens.
  absl::Status StartMatcher(Sequence* seq);
  std::shared_ptr<structured::GuideCache> guides_;

  absl::flat_hash_map<std::string, std::unique_ptr<Sequence>> seqs_;
  absl::flat_hash_map<std::string, Sequence*> reserved_;
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;  // in admission order
  std::vector<std::pair<std::string, FinishReason>> aborted_;
  std::vector<float> logits_;
  std::vector<std::pair<float, int32_t>> sample_scratch_;
  // Step's tokens sampled ahead of the in-order loop (kNotPresampled: a
  // constrained row, or no logits), and the (batch index, logit row) pairs
  // they came from.
  static constexpr int32_t kNotPresampled = -2;
  std::vector<int32_t> presampled_;
  std::vector<std::pair<size_t, int64_t>> presample_rows_;
  int64_t prefix_queried_ = 0, prefix_hit_ = 0, preemptions_ = 0, steps_ = 0;
  int64_t prefill_tokens_ = 0, decode_tokens_ = 0;
  int64_t constrained_rows_ = 0;
  double constraint_seconds_ = 0;
};

}  // namespace pdserve::engine
