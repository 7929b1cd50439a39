#include "engine/engine.h"

#include <xxhash.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/status_cause.h"
#include "common/status_macros.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/step_profile.h"
#include "kernels/cpu/task_pool.h"

namespace pdserve::engine {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

}  // namespace

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone:
      return "";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kCancelled:
      return "cancelled";
  }
  return "";
}

absl::Status CheckRequestFieldCaps(std::string_view request_id,
                                   std::string_view cache_salt) {
  if (request_id.size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_id is ", request_id.size(), " bytes; at most ",
                     kMaxRequestIdBytes, " are allowed"));
  }
  if (cache_salt.size() > kMaxCacheSaltBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache_salt is ", cache_salt.size(), " bytes; at most ",
                     kMaxCacheSaltBytes, " are allowed"));
  }
  return absl::OkStatus();
}

absl::Status EngineConfig::Validate() const {
  if (block_size < 1 || block_size > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_size must be in [1, 256], got ", block_size));
  }
  if (matmul == kernels::MatMulMode::kBlas &&
      weight_dtype != WeightDtype::kAuto && weight_dtype != WeightDtype::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat("--matmul blas needs --weight-dtype fp32 or auto, got ",
                     WeightDtypeName(weight_dtype)));
  }
  if (matmul == kernels::MatMulMode::kBf16Dot &&
      weight_dtype != WeightDtype::kAuto &&
      weight_dtype != WeightDtype::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("--matmul bf16dot needs --weight-dtype bf16 or auto, got ",
                     WeightDtypeName(weight_dtype)));
  }
  if (kv_cache_bytes <= 0)
    return absl::InvalidArgumentError("kv cache memory must be positive");
  if (max_num_seqs < 1)
    return absl::InvalidArgumentError("max_num_seqs must be at least 1");
  if (max_num_batched_tokens < 1) {
    return absl::InvalidArgumentError(
        "max_num_batched_tokens must be at least 1");
  }
  if (max_model_len < 0)
    return absl::InvalidArgumentError("max_model_len must not be negative");
  if (long_prefill_chunk < 0) {
    return absl::InvalidArgumentError(
        "long_prefill_chunk must not be negative (0: no limit)");
  }
  if (max_waiting_requests < 1 || max_queued_calls < 1 ||
      max_pending_reservations < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_waiting_requests (", max_waiting_requests, "), max_queued_calls (",
        max_queued_calls, ") and max_pending_reservations (",
        max_pending_reservations, ") must be at least 1"));
  }
  if (!kv_offload.dir.empty() && device != Device::kCpu) {
    return absl::InvalidArgumentError(
        "--kv-offload-dir is a tier for CPU workers; with --device cuda use "
        "--kv-offload-memory");
  }
  RETURN_IF_ERROR(CheckKvDtypeForDevice(device, kv_dtype));
  return kv_offload.Validate();
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(
    std::shared_ptr<const ModelWeights> weights, const EngineConfig& config,
    KvEventSink events) {
  RETURN_IF_ERROR(config.Validate());
  const ModelConfig& mc = weights->config;
  // K/V per head, or MLA latent rows (ModelConfig::KvSpec).
  KvCacheSpec spec = mc.KvSpec(config.block_size, config.kv_dtype);
  spec.host_shared = config.kv_host_shared;
  BackendConfig bc;
  bc.device = config.device;
  bc.kv = spec;
  bc.kv_cache_bytes = config.kv_cache_bytes;
  bc.matmul = config.matmul;
  bc.gpu_memory_utilization = config.gpu_memory_utilization;
  bc.max_num_batched_tokens = config.max_num_batched_tokens;
  bc.gpu_reference_math = config.gpu_reference_math;
  bc.cuda_device = config.cuda_device;
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend,
                   CreateBackend(weights, bc));
  EngineConfig c = config;
  if (c.max_model_len == 0 || c.max_model_len > mc.max_position_embeddings) {
    c.max_model_len = static_cast<int32_t>(
        std::min<int64_t>(mc.max_position_embeddings, 1 << 30));
  }
  std::unique_ptr<Engine> engine(
      new Engine(std::move(weights), c, std::move(backend), std::move(events)));
  if (c.kv_offload.enabled()) {
    ASSIGN_OR_RETURN(engine->tier_,
                     KvTier::Create(c.kv_offload, engine->fingerprint_,
                                    engine->kv_storage()));
    Engine* e = engine.get();
    e->blocks_.set_tier_hooks(
        {e->tier_->kind(),
         [e](int32_t block, const BlockHash& hash) {
           const bool kept = e->tier_->Offer(hash, e->kv_storage(), block);
           e->PublishTierEvents();  // before the pool's event of this block
           return kept;
         },
         [e] { e->tier_->Clear(); }});
  }
  return engine;
}

Engine::Engine(std::shared_ptr<const ModelWeights> weights,
               const EngineConfig& config, std::unique_ptr<Backend> backend,
               KvEventSink events)
    : config_(config),
      weights_(weights),
      backend_(std::move(backend)),
      blocks_(backend_->num_blocks(), std::move(events)) {
  fingerprint_ =
      CacheFingerprint({weights->fingerprint[0], weights->fingerprint[1]},
                       config.block_size, config.kv_dtype);
}

ModelFingerprint Engine::CacheFingerprint(const ModelFingerprint& weights,
                                          int32_t block_size, DType kv_dtype) {
  // The cache identity covers the weights, block size and KV dtype: blocks
  // made under any other of these must never be shared.
  struct {
    uint64_t weights[2];
    int32_t block_size;
    int32_t dtype;
  } id{{weights[0], weights[1]}, block_size, static_cast<int32_t>(kv_dtype)};
  const XXH128_hash_t h = XXH3_128bits(&id, sizeof(id));
  return {h.high64, h.low64};
}

int64_t Engine::BlocksFor(int64_t tokens) const {
  return (tokens + config_.block_size - 1) / config_.block_size;
}

absl::Status Engine::Validate(const EngineRequest& request) const {
  const ModelConfig& mc = weights_->config;
  if (request.prompt.empty())
    return absl::InvalidArgumentError("prompt has no tokens");
  for (int32_t t : request.prompt) {
    if (t < 0 || t >= mc.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt token id ", t, " is outside the vocabulary [0, ",
                       mc.vocab_size, ")"));
    }
  }
  RETURN_IF_ERROR(request.sampling.Validate());
  const int64_t prompt = static_cast<int64_t>(request.prompt.size());
  const int64_t total = prompt + request.sampling.max_tokens;
  if (total > config_.max_model_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt (", prompt, " tokens) + max_tokens (",
                     request.sampling.max_tokens, ") exceeds max_model_len ",
                     config_.max_model_len));
  }
  if (BlocksFor(total) > blocks_.num_blocks()) {
    return WithCause(absl::ResourceExhaustedError(absl::StrCat(
                         "request needs ", BlocksFor(total),
                         " KV blocks but the whole cache has ",
                         blocks_.num_blocks(), "; it can never be scheduled")),
                     StatusCause::kNeverFits);
  }
  if (seqs_.count(request.id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("request id \"", request.id, "\" is in use"));
  }
  if (request.constraint.active()) {
    if (guides_ == nullptr) {
      return absl::FailedPreconditionError(
          "structured output needs the model's tokenizer, which this engine "
          "was not given");
    }
    if (request.constraint_resume_tokens < 0 ||
        request.constraint_resume_tokens >= prompt) {
      return absl::InvalidArgumentError(absl::StrCat(
          "constraint resume_tokens ", request.constraint_resume_tokens,
          " must be below the prompt length ", prompt));
    }
    RETURN_IF_ERROR(guides_->Get(request.constraint).status());
  }
  return absl::OkStatus();
}

absl::Status Engine::StartMatcher(Sequence* seq) {
  if (!seq->req.constraint.active()) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::shared_ptr<const structured::Guide> guide,
                   guides_->Get(seq->req.constraint));
  seq->matcher.emplace(std::move(guide));
  const auto resumed = std::vector<int32_t>(
      seq->req.prompt.end() - seq->req.constraint_resume_tokens,
      seq->req.prompt.end());
  if (!seq->matcher->AcceptAll(resumed).ok()) {
    return absl::InvalidArgumentError(
        "the resumed output tokens do not match the constraint");
  }
  return absl::OkStatus();
}

absl::Status Engine::AddRequest(EngineRequest request) {
  RETURN_IF_ERROR(Validate(request));
  if (static_cast<int64_t>(waiting_.size()) >= config_.max_waiting_requests) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "engine queue full: ", waiting_.size(),
        " requests already wait for admission (max_waiting_requests)"));
  }
  const int64_t prompt = static_cast<int64_t>(request.prompt.size());
  auto seq = std::make_unique<Sequence>();
  seq->tokens = request.prompt;
  seq->num_prompt = static_cast<int32_t>(prompt);
  seq->req = std::move(request);
  RETURN_IF_ERROR(StartMatcher(seq.get()));
  // The tier's reader thread starts on the blocks this request will load,
  // so that they are read (off this thread) by the time it is admitted.
  if (tier_ && config_.enable_prefix_caching) {
    ExtendBlockHashes(fingerprint_, seq->req.cache_salt, seq->tokens,
                      config_.block_size, &seq->hashes);
    const size_t usable =
        std::min(static_cast<size_t>((prompt - 1) / config_.block_size),
                 seq->hashes.size());
    const std::span<const BlockHash> chain =
        std::span<const BlockHash>(seq->hashes).first(usable);
    tier_->ReadAhead(chain.subspan(blocks_.Lookup(chain).size()),
                     /*make_room=*/false);
  }
  waiting_.push_back(seq.get());
  seqs_.emplace(seq->req.id, std::move(seq));
  return absl::OkStatus();
}

void Engine::Abort(const std::string& id, FinishReason reason) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return;
  Sequence* seq = it->second.get();
  ReleaseSequenceBlocks(seq);
  reserved_.erase(id);
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), seq),
                 waiting_.end());
  running_.erase(std::remove(running_.begin(), running_.end(), seq),
                 running_.end());
  aborted_.emplace_back(id, reason);
  seqs_.erase(it);
}

void Engine::ReleaseBlocks(std::span<const int32_t> blocks) {
  std::vector<int32_t> reversed(blocks.rbegin(), blocks.rend());
  blocks_.Release(reversed);
}

void Engine::ReleaseSequenceBlocks(Sequence* seq) {
  // Tail first, so the LRU evicts a sequence's suffix before its prefix.
  std::vector<int32_t> reversed(seq->blocks.rbegin(), seq->blocks.rend());
  blocks_.Release(reversed);
  seq->blocks.clear();
  seq->num_computed = 0;
  seq->num_committed = 0;
}

void Engine::Preempt(Sequence* seq) {
  ReleaseSequenceBlocks(seq);
  ++preemptions_;
}

void Engine::CommitFullBlocks(Sequence* seq) {
  if (!config_.enable_prefix_caching) return;
  const int32_t full = seq->num_computed / config_.block_size;
  if (full <= seq->num_committed) return;
  ExtendBlockHashes(
      fingerprint_, seq->req.cache_salt,
      std::span<const int32_t>(seq->tokens.data(), full * config_.block_size),
      config_.block_size, &seq->hashes);
  const int32_t first = seq->num_committed;
  const BlockHash parent = first == 0 ? BlockHash{} : seq->hashes[first - 1];
  blocks_.Commit(
      parent,
      std::span<const int32_t>(seq->blocks).subspan(first, full - first),
      std::span<const BlockHash>(seq->hashes).subspan(first, full - first));
  seq->num_committed = full;
}

bool Engine::TryAdmit(Sequence* seq, int32_t budget,
                      int32_t* scheduled_tokens) {
  const int32_t len = static_cast<int32_t>(seq->tokens.size());
  std::vector<int32_t> hits;
  if (config_.enable_prefix_caching) {
    ExtendBlockHashes(fingerprint_, seq->req.cache_salt, seq->tokens,
                      config_.block_size, &seq->hashes);
    // At least the last token is always computed, to produce logits.
    const size_t usable = static_cast<size_t>((len - 1) / config_.block_size);
    hits = blocks_.Lookup(std::span<const BlockHash>(seq->hashes)
                              .first(std::min(usable, seq->hashes.size())));
  }
  // Blocks after the pool's hits that the tier holds: copied back below
  // instead of recomputed, if the pool has room for them and this chunk. A
  // disk tier's reads run on its reader thread: while one of them is in
  // flight the request waits (its admission is retried when a read ends), so
  // this thread only copies finished, checked reads.
  int32_t from_tier = 0;
  if (tier_ && config_.enable_prefix_caching) {
    const size_t usable = static_cast<size_t>((len - 1) / config_.block_size);
    if (usable > hits.size()) {
      const std::span<const BlockHash> rest =
          std::span<const BlockHash>(seq->hashes)
              .subspan(hits.size(), usable - hits.size());
      tier_->ReadAhead(rest, /*make_room=*/true);
      const int64_t readable = tier_->ReadableAndPin(rest);
      if (readable < 0) return false;
      from_tier = static_cast<int32_t>(readable);
    }
  }
  // Pinned until loaded; what is not loaded is given back here.
  auto unpin = [&](int32_t from, int32_t n) {
    if (n > from)
      tier_->Release(std::span<const BlockHash>(seq->hashes)
                         .subspan(hits.size() + from, n - from));
  };
  int64_t hits_idle = 0;
  for (int32_t b : hits) hits_idle += blocks_.RefCount(b) == 0;
  const int32_t num_hits = static_cast<int32_t>(hits.size());
  auto need_for = [&](int32_t tier_blocks) {
    const int32_t c = (num_hits + tier_blocks) * config_.block_size;
    return BlocksFor(c + std::min(len - c, budget)) - num_hits;
  };
  if (from_tier > 0 && need_for(from_tier) + hits_idle > blocks_.num_free()) {
    unpin(0, from_tier);
    from_tier = 0;
  }
  const int64_t need = need_for(from_tier);
  if (need + hits_idle > blocks_.num_free()) {
    unpin(0, from_tier);
    return false;
  }
  blocks_.Acquire(hits);
  seq->blocks = hits;
  blocks_.Allocate(need, &seq->blocks);
  const int32_t loaded =
      from_tier > 0 ? LoadFromTier(seq, num_hits, from_tier) : 0;
  if (loaded < from_tier) unpin(loaded + 1, from_tier);  // Take gave one back
  const int32_t computed = (num_hits + loaded) * config_.block_size;
  // A failed load leaves fewer tokens computed: the chunk stays within the
  // blocks just allocated.
  const int32_t n =
      std::min({len - computed, budget,
                static_cast<int32_t>(seq->blocks.size()) * config_.block_size -
                    computed});
  seq->num_computed = computed;
  seq->num_committed = num_hits;
  // Loaded blocks join the prefix cache at once (stored events), so that a
  // request admitted next in this step shares them instead of loading again.
  if (loaded > 0) CommitFullBlocks(seq);
  if (seq->cached_prompt_tokens < 0) {
    seq->cached_prompt_tokens = computed;
    prefix_queried_ += seq->num_prompt;
    prefix_hit_ += computed;
  }
  *scheduled_tokens = n;
  return true;
}

int32_t Engine::LoadFromTier(Sequence* seq, int32_t first, int32_t n) {
  int32_t loaded = 0;
  while (loaded < n && tier_
                           ->Take(seq->hashes[first + loaded], kv_storage(),
                                  seq->blocks[first + loaded])
                           .ok()) {
    ++loaded;
  }
  return loaded;
}

void Engine::PublishTierEvents() {
  if (!tier_) return;
  for (KvEvent& e : tier_->TakeEvents()) blocks_.PublishTierEvent(std::move(e));
}

Engine::KvSnapshot Engine::TakeKvSnapshot() {
  KvSnapshot snap;
  if (tier_) {
    std::vector<KvEvent> pending;
    snap.tier = tier_->Snapshot(&pending);
    for (KvEvent& e : pending) blocks_.PublishTierEvent(std::move(e));
    snap.has_tier = true;
    snap.tier_kind = tier_->kind();
  }
  snap.seq = blocks_.last_event_seq();
  snap.pool = blocks_.CachedHashes();
  return snap;
}

absl::StatusOr<std::vector<StepOutput>> Engine::Step() {
  // --profile: scheduling up to the forward pass, then sampling and retiring.
  kernels::PhaseTimer schedule_timer(kernels::Phase::kSchedule);
  PublishTierEvents();
  std::vector<StepOutput> outputs;
  for (auto& [id, reason] : aborted_) {
    StepOutput out;
    out.id = id;
    out.finish = reason;
    outputs.push_back(std::move(out));
  }
  aborted_.clear();

  int32_t budget = config_.max_num_batched_tokens;
  // One sequence's share of the budget: long_prefill_chunk where set (a
  // decode step's one token always fits).
  const int32_t seq_cap = config_.long_prefill_chunk > 0
                              ? config_.long_prefill_chunk
                              : config_.max_num_batched_tokens;
  std::vector<Scheduled> batch;
  bool preempted = false;
  // Running sequences first, oldest first; preempt from the newest end.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Sequence* seq = running_[i];
    const int32_t n = std::min<int32_t>(
        {static_cast<int32_t>(seq->tokens.size()) - seq->num_computed, budget,
         seq_cap});
    const int64_t need = BlocksFor(seq->num_computed + n) -
                         static_cast<int64_t>(seq->blocks.size());
    while (need > blocks_.num_free() && running_.back() != seq) {
      Sequence* victim = running_.back();
      running_.pop_back();
      Preempt(victim);
      waiting_.push_front(victim);
      preempted = true;
    }
    if (need > blocks_.num_free()) {
      running_.pop_back();  // seq itself is the newest
      Preempt(seq);
      waiting_.push_front(seq);
      preempted = true;
      break;
    }
    blocks_.Allocate(need, &seq->blocks);
    batch.push_back({seq, n});
    budget -= n;
    ++i;
  }
  while (!preempted && !waiting_.empty() && budget > 0 &&
         static_cast<int32_t>(running_.size()) < config_.max_num_seqs) {
    Sequence* seq = waiting_.front();
    int32_t n = 0;
    if (!TryAdmit(seq, std::min(budget, seq_cap), &n)) break;
    waiting_.pop_front();
    running_.push_back(seq);
    batch.push_back({seq, n});
    budget -= n;
  }
  if (batch.empty()) return outputs;
  ++steps_;

  std::vector<LlamaModel::SeqInput> inputs;
  for (const Scheduled& s : batch) {
    const bool decode =
        s.num_tokens == 1 && s.seq->num_computed >= s.seq->num_prompt;
    (decode ? decode_tokens_ : prefill_tokens_) += s.num_tokens;
    const bool completes = s.seq->num_computed + s.num_tokens ==
                           static_cast<int32_t>(s.seq->tokens.size());
    inputs.push_back(
        {std::span<const int32_t>(s.seq->tokens)
             .subspan(s.seq->num_computed, s.num_tokens),
         s.seq->num_computed, s.seq->blocks,
         completes ? LlamaModel::Logits::kLast : LlamaModel::Logits::kNone});
  }
  LlamaModel::LayerWrittenFn on_layer_written;
  if (std::any_of(batch.begin(), batch.end(), [](const Scheduled& s) {
        return s.seq->req.on_layer_written != nullptr;
      })) {
    on_layer_written = [&](int32_t layer) {
      for (const Scheduled& s : batch) {
        if (!s.seq->req.on_layer_written) continue;
        s.seq->req.on_layer_written({layer, s.seq->num_computed + s.num_tokens,
                                     s.seq->num_prompt, s.seq->blocks},
                                    blocks_);
      }
    };
  }
  // Forward resizes logits_ to this step's rows; kept between steps, it is
  // not zero-filled again.
  schedule_timer.Stop();
  RETURN_IF_ERROR(backend_->Forward(inputs, &logits_, on_layer_written));
  kernels::PhaseTimer sampling_timer(kernels::Phase::kSampling);

  const ModelConfig& mc = weights_->config;
  // Rows without a constraint are sampled first, over the kernel threads:
  // SampleToken depends only on the row, the request's parameters and the
  // position (the token count before this step's token), so which thread
  // samples a row changes nothing. Constrained rows are masked and sampled
  // in order below.
  std::vector<int32_t>& presampled = presampled_;
  presampled.assign(batch.size(), kNotPresampled);
  {
    std::vector<std::pair<size_t, int64_t>>& rows = presample_rows_;
    rows.clear();
    int64_t r = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      if (inputs[i].logits == LlamaModel::Logits::kNone) continue;
      if (!batch[i].seq->matcher) rows.emplace_back(i, r);
      ++r;
    }
    const int threads = static_cast<int>(
        std::min<int64_t>(kernels::KernelThreads(), rows.size()));
    kernels::RunChunks(
        static_cast<int64_t>(rows.size()), 1, threads,
        [&](int64_t begin, int64_t end, bool) {
          thread_local std::vector<std::pair<float, int32_t>> scratch;
          for (int64_t j = begin; j < end; ++j) {
            const auto [i, row] = rows[j];
            const Sequence& seq = *batch[i].seq;
            presampled[i] = SampleToken(
                &logits_[row * mc.vocab_size], mc.vocab_size, seq.req.sampling,
                static_cast<int64_t>(seq.tokens.size()), &scratch);
          }
        });
  }
  int64_t logit_row = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    Sequence* seq = batch[i].seq;
    seq->num_computed += batch[i].num_tokens;
    CommitFullBlocks(seq);
    if (inputs[i].logits == LlamaModel::Logits::kNone) continue;
    const int64_t position = static_cast<int64_t>(seq->tokens.size());
    float* row = &logits_[logit_row * mc.vocab_size];
    // Constrained rows only: other rows are sampled from untouched logits.
    std::chrono::steady_clock::time_point mask_start;
    if (seq->matcher) {
      mask_start = std::chrono::steady_clock::now();
      seq->matcher->MaskLogits(row, mc.vocab_size);
      constraint_seconds_ += SecondsSince(mask_start);
    }
    const int32_t token =
        presampled[i] != kNotPresampled
            ? presampled[i]
            : SampleToken(row, mc.vocab_size, seq->req.sampling, position,
                          &sample_scratch_);
    // The mask allowed `token`, and a trimmed automaton never leaves a row
    // without an allowed token (a completed match ends the request first).
    if (seq->matcher) {
      mask_start = std::chrono::steady_clock::now();
      seq->matcher->Accept(token).IgnoreError();
      constraint_seconds_ += SecondsSince(mask_start);
      ++constrained_rows_;
    }
    ++logit_row;
    if (token == kInvalidLogitsToken) {
      // No token can come from NaN logits: end this request alone (retired
      // below, blocks freed); the rest of the batch carries on.
      StepOutput out;
      out.id = seq->req.id;
      out.error = absl::InternalError(absl::StrCat(
          "request \"", seq->req.id, "\": the logits for position ", position,
          " hold NaN (corrupt weights or KV cache, or a kernel fault); the "
          "request was ended"));
      outputs.push_back(std::move(out));
      continue;
    }
    seq->tokens.push_back(token);
    StepOutput out;
    out.id = seq->req.id;
    out.new_tokens.push_back(token);
    if (seq->req.sampling.logprobs) {
      out.logprobs.push_back(ComputeLogprobs(row, mc.vocab_size, token,
                                             seq->req.sampling.top_logprobs));
    }
    out.prompt_tokens = seq->num_prompt;
    out.cached_prompt_tokens = std::max(0, seq->cached_prompt_tokens);
    out.completion_tokens =
        static_cast<int32_t>(seq->tokens.size()) - seq->num_prompt;
    out.finish = CheckFinish(*seq);
    outputs.push_back(std::move(out));
  }
  // Retire finished sequences after the loop: `batch` points into seqs_.
  for (StepOutput& out : outputs) {
    const bool failed = !out.error.ok();
    if (!failed &&
        (out.finish == FinishReason::kNone || out.new_tokens.empty()))
      continue;
    auto it = seqs_.find(out.id);
    Sequence* seq = it->second.get();
    if (seq->req.hold_blocks_on_finish && !failed) {
      out.held_blocks = std::move(seq->blocks);
      seq->blocks.clear();
    } else {
      ReleaseSequenceBlocks(seq);
    }
    running_.erase(std::remove(running_.begin(), running_.end(), seq),
                   running_.end());
    seqs_.erase(it);
  }
  return outputs;
}

FinishReason Engine::CheckFinish(const Sequence& seq) const {
  const int32_t token = seq.tokens.back();
  const int32_t completion =
      static_cast<int32_t>(seq.tokens.size()) - seq.num_prompt;
  if (!seq.req.sampling.ignore_eos && weights_->config.IsEos(token))
    return FinishReason::kEos;
  // The constraint is fully matched: nothing but EOS could follow.
  if (seq.matcher && seq.matcher->Complete()) return FinishReason::kStop;
  if (completion >= static_cast<int32_t>(seq.req.sampling.max_tokens) ||
      static_cast<int32_t>(seq.tokens.size()) >= config_.max_model_len) {
    return FinishReason::kLength;
  }
  return FinishReason::kNone;
}

absl::StatusOr<Reservation> Engine::Reserve(EngineRequest request) {
  RETURN_IF_ERROR(Validate(request));
  auto seq = std::make_unique<Sequence>();
  seq->tokens = request.prompt;
  seq->num_prompt = static_cast<int32_t>(seq->tokens.size());
  seq->req = std::move(request);
  RETURN_IF_ERROR(StartMatcher(seq.get()));
  std::vector<int32_t> hits;
  if (config_.enable_prefix_caching) {
    ExtendBlockHashes(fingerprint_, seq->req.cache_salt, seq->tokens,
                      config_.block_size, &seq->hashes);
    hits = blocks_.Lookup(seq->hashes);
  }
  // Blocks the tier holds after the pool's hits are copied back below and
  // count as this worker's own: the prefill worker skips sending them. As in
  // TryAdmit, this thread copies only finished reads of a disk tier: while
  // one is in flight the reservation waits as for busy blocks (EngineLoop
  // retries it when a read ends).
  std::span<const BlockHash> rest;
  int32_t from_tier = 0;
  if (tier_ && config_.enable_prefix_caching &&
      seq->hashes.size() > hits.size()) {
    rest = std::span<const BlockHash>(seq->hashes).subspan(hits.size());
    tier_->ReadAhead(rest, /*make_room=*/true);
    const int64_t readable = tier_->ReadableAndPin(rest);
    if (readable < 0) {
      return WithCause(
          absl::ResourceExhaustedError(
              "KV tier reads of the prompt's prefix are in flight"),
          StatusCause::kPoolBusy);
    }
    from_tier = static_cast<int32_t>(readable);
  }
  const int64_t need =
      BlocksFor(seq->num_prompt) - static_cast<int64_t>(hits.size());
  int64_t hits_idle = 0;
  for (int32_t b : hits) hits_idle += blocks_.RefCount(b) == 0;
  if (need + hits_idle > blocks_.num_free()) {
    if (from_tier > 0) tier_->Release(rest.first(from_tier));
    return WithCause(absl::ResourceExhaustedError(absl::StrCat(
                         "KV cache full: need ", need + hits_idle,
                         " free blocks, have ", blocks_.num_free())),
                     StatusCause::kPoolBusy);
  }
  blocks_.Acquire(hits);
  seq->blocks = hits;
  blocks_.Allocate(need, &seq->blocks);
  seq->num_committed = static_cast<int32_t>(hits.size());
  int32_t cached_blocks = static_cast<int32_t>(hits.size());
  if (from_tier > 0) {
    const int32_t loaded = LoadFromTier(seq.get(), cached_blocks, from_tier);
    // Take gave back the one that failed.
    if (loaded + 1 < from_tier)
      tier_->Release(rest.subspan(loaded + 1, from_tier - loaded - 1));
    cached_blocks += loaded;
    seq->num_computed = cached_blocks * config_.block_size;
    CommitFullBlocks(seq.get());
  }
  seq->cached_prompt_tokens =
      std::min(seq->num_prompt, cached_blocks * config_.block_size);
  prefix_queried_ += seq->num_prompt;
  prefix_hit_ += seq->cached_prompt_tokens;
  Reservation r{seq->blocks, cached_blocks};
  reserved_[seq->req.id] = seq.get();
  seqs_.emplace(seq->req.id, std::move(seq));
  return r;
}

absl::StatusOr<FinishReason> Engine::CompleteReservation(const std::string& id,
                                                         int32_t first_token) {
  auto it = reserved_.find(id);
  if (it == reserved_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no reservation for request \"", id, "\""));
  }
  Sequence* seq = it->second;
  reserved_.erase(it);
  if (first_token < 0 || first_token >= weights_->config.vocab_size) {
    Abort(id);
    return absl::InvalidArgumentError(absl::StrCat(
        "first token ", first_token, " is outside the vocabulary"));
  }
  // The decode side resumes the match after the prefill worker's token.
  if (seq->matcher && !seq->matcher->Accept(first_token).ok()) {
    Abort(id);
    return absl::InvalidArgumentError(absl::StrCat(
        "first token ", first_token, " is not allowed by the constraint"));
  }
  seq->num_computed = seq->num_prompt;
  CommitFullBlocks(seq);
  seq->tokens.push_back(first_token);
  const FinishReason finish = CheckFinish(*seq);
  if (finish != FinishReason::kNone) {
    ReleaseSequenceBlocks(seq);
    seqs_.erase(id);
    return finish;
  }
  running_.push_back(seq);
  return FinishReason::kNone;
}

bool Engine::IsWaiting(const std::string& id) const {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return false;
  return std::find(waiting_.begin(), waiting_.end(), it->second.get()) !=
             waiting_.end() &&
         it->second->cached_prompt_tokens < 0;
}

EngineStats Engine::Stats() const {
  EngineStats s;
  s.num_running = static_cast<int64_t>(running_.size());
  s.num_waiting = static_cast<int64_t>(waiting_.size());
  s.blocks_cached = blocks_.num_cached();
  s.blocks_free = blocks_.num_free() - s.blocks_cached;
  s.blocks_active = blocks_.num_active();
  s.prefix_queried_tokens = prefix_queried_;
  s.prefix_hit_tokens = prefix_hit_;
  s.preemptions = preemptions_;
  s.constrained_rows = constrained_rows_;
  s.constraint_seconds = constraint_seconds_;
  s.steps = steps_;
  s.prefill_tokens = prefill_tokens_;
  s.decode_tokens = decode_tokens_;
  s.num_reserved = static_cast<int64_t>(reserved_.size());
  if (tier_) {
    s.has_kv_tier = true;
    s.kv_tier = tier_->Stats();
  }
  for (const Sequence* seq : waiting_)
    s.queued_prefill_tokens +=
        seq->num_prompt - std::min(seq->num_prompt, seq->num_computed);
  for (const Sequence* seq : running_)
    s.queued_prefill_tokens +=
        seq->num_prompt - std::min(seq->num_prompt, seq->num_computed);
  return s;
}

}  // namespace pdserve::engine
