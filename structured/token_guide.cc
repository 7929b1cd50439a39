#include "structured/token_guide.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_format.h"

namespace pdserve::structured {

std::shared_ptr<const TokenTrie> TokenTrie::Build(
    const engine::Tokenizer& tokenizer) {
  auto trie = std::make_shared<TokenTrie>();
  trie->vocab_size_ = tokenizer.vocab_size();
  trie->eos_id_ = tokenizer.eos_id();
  trie->bytes_.resize(trie->vocab_size_);
  std::vector<int32_t> order;
  for (int32_t id = 0; id < trie->vocab_size_; ++id) {
    if (tokenizer.IsSpecial(id)) continue;
    trie->bytes_[id] = tokenizer.TokenBytes(id);
    if (!trie->bytes_[id].empty()) order.push_back(id);
  }
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return trie->bytes_[a] != trie->bytes_[b]
               ? trie->bytes_[a] < trie->bytes_[b]
               : a < b;
  });
  // Sorted order is the trie's preorder: insert each token's path, closing
  // the nodes off its path first.
  trie->byte_.push_back(0);
  trie->depth_.push_back(0);
  trie->subtree_end_.push_back(0);
  std::vector<int32_t> path = {0};  // open nodes from the root
  std::vector<int32_t> node_of_token;
  node_of_token.reserve(order.size());
  const std::string* prev = nullptr;
  for (int32_t id : order) {
    const std::string& s = trie->bytes_[id];
    size_t common = 0;
    if (prev != nullptr) {
      while (common < s.size() && common < prev->size() &&
             s[common] == (*prev)[common] && common + 1 < path.size()) {
        ++common;
      }
    }
    while (path.size() > common + 1) {
      trie->subtree_end_[path.back()] =
          static_cast<int32_t>(trie->byte_.size());
      path.pop_back();
    }
    for (size_t d = common; d < s.size(); ++d) {
      trie->byte_.push_back(static_cast<uint8_t>(s[d]));
      trie->depth_.push_back(static_cast<uint16_t>(
          std::min<size_t>(d + 1, std::numeric_limits<uint16_t>::max())));
      trie->subtree_end_.push_back(0);
      path.push_back(static_cast<int32_t>(trie->byte_.size()) - 1);
    }
    trie->max_depth_ = std::max(trie->max_depth_, static_cast<int>(s.size()));
    node_of_token.push_back(path.back());
    prev = &s;
  }
  while (!path.empty()) {
    trie->subtree_end_[path.back()] = static_cast<int32_t>(trie->byte_.size());
    path.pop_back();
  }
  const int n = trie->num_nodes();
  trie->token_offset_.assign(n + 1, 0);
  for (int32_t node : node_of_token) ++trie->token_offset_[node + 1];
  for (int i = 0; i < n; ++i)
    trie->token_offset_[i + 1] += trie->token_offset_[i];
  trie->token_ids_ = order;  // already grouped by node, in node order
  // Children before parents (reverse preorder): a node's set is its
  // children's bytes and their sets.
  trie->subtree_bytes_.assign(static_cast<size_t>(n) * 4, 0);
  for (int i = n - 1; i >= 0; --i) {
    uint64_t* set = &trie->subtree_bytes_[static_cast<size_t>(i) * 4];
    for (int c = i + 1; c < trie->subtree_end_[i]; c = trie->subtree_end_[c]) {
      const uint64_t* kid = &trie->subtree_bytes_[static_cast<size_t>(c) * 4];
      for (int w = 0; w < 4; ++w) set[w] |= kid[w];
      const uint8_t b = trie->byte_[c];
      set[b >> 6] |= uint64_t{1} << (b & 63);
    }
  }
  return trie;
}

namespace {

// Dense masks, 64 logits per mask word: words with every token allowed are
// skipped, words with none are filled, and the rest written without a branch
// per token (AVX-512: four masked stores of -inf; otherwise a select the
// compiler vectorizes).
void ApplyDenseWordsPortable(const uint64_t* bits, int64_t words,
                             float* logits) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  uint32_t neg_inf;
  std::memcpy(&neg_inf, &kNegInf, sizeof(neg_inf));
  for (int64_t w = 0; w < words; ++w) {
    const uint64_t on = bits[w];
    float* row = logits + w * 64;
    if (on == ~uint64_t{0}) continue;
    if (on == 0) {
      std::fill(row, row + 64, kNegInf);
      continue;
    }
    uint32_t v[64];
    std::memcpy(v, row, sizeof(v));
    for (int j = 0; j < 64; ++j) {
      const uint32_t keep = 0u - static_cast<uint32_t>((on >> j) & 1);
      v[j] = (v[j] & keep) | (neg_inf & ~keep);
    }
    std::memcpy(row, v, sizeof(v));
  }
}

__attribute__((target("avx512f"))) void ApplyDenseWordsAvx512(
    const uint64_t* bits, int64_t words, float* logits) {
  const __m512 neg_inf =
      _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t w = 0; w < words; ++w) {
    const uint64_t off = ~bits[w];
    if (off == 0) continue;
    float* row = logits + w * 64;
    for (int q = 0; q < 4; ++q) {
      _mm512_mask_storeu_ps(row + 16 * q,
                            static_cast<__mmask16>(off >> (16 * q)), neg_inf);
    }
  }
}

bool HasAvx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

void ApplyDenseWords(const uint64_t* bits, int64_t words, float* logits) {
  if (HasAvx512()) {
    ApplyDenseWordsAvx512(bits, words, logits);
  } else {
    ApplyDenseWordsPortable(bits, words, logits);
  }
}

}  // namespace

void ApplyTokenMaskPortableForTest(const TokenMask& mask, float* logits,
                                   int64_t n) {
  const int64_t words = std::min<int64_t>(mask.bits.size(), n / 64);
  ApplyDenseWordsPortable(mask.bits.data(), words, logits);
}

void ApplyTokenMask(const TokenMask& mask, float* logits, int64_t n) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t mask_vocab = static_cast<int64_t>(mask.bits.size()) * 64;
  if (!mask.sparse.empty() || mask.count == 0) {
    // Few allowed: save them, fill the row, put them back.
    float saved[512];
    std::vector<float> saved_heap;
    float* keep = saved;
    if (mask.sparse.size() > 512) {
      saved_heap.resize(mask.sparse.size());
      keep = saved_heap.data();
    }
    size_t k = 0;
    for (int32_t t : mask.sparse) {
      if (t < n) keep[k++] = logits[t];
    }
    std::fill(logits, logits + n, kNegInf);
    k = 0;
    for (int32_t t : mask.sparse) {
      if (t < n) logits[t] = keep[k++];
    }
    return;
  }
  const int64_t words = std::min<int64_t>(mask.bits.size(), n / 64);
  ApplyDenseWords(mask.bits.data(), words, logits);
  // The last partial word, if the row ends inside one.
  if (words < static_cast<int64_t>(mask.bits.size())) {
    for (int64_t t = words * 64; t < std::min(n, mask_vocab); ++t) {
      if (!((mask.bits[t >> 6] >> (t & 63)) & 1)) logits[t] = kNegInf;
    }
  }
  for (int64_t t = std::max<int64_t>(mask_vocab, 0); t < n; ++t) {
    logits[t] = kNegInf;
  }
}

Guide::Guide(std::shared_ptr<const Dfa> dfa,
             std::shared_ptr<const TokenTrie> trie, size_t max_cached_masks)
    : dfa_(std::move(dfa)),
      trie_(std::move(trie)),
      max_cached_masks_(max_cached_masks == 0 ? 1 : max_cached_masks) {}

size_t Guide::cached_masks() const {
  absl::MutexLock lock(&mu_);
  return masks_.size();
}

std::shared_ptr<TokenMask> Guide::Compute(int state) const {
  const TokenTrie& t = *trie_;
  auto mask = std::make_shared<TokenMask>();
  mask->bits.assign((t.vocab_size_ + 63) / 64, 0);
  // Bits only; the count is taken once at the end.
  uint64_t* bits = mask->bits.data();
  auto set = [bits](int32_t id) { bits[id >> 6] |= uint64_t{1} << (id & 63); };
  if (state >= 0) {
    // states[d]: the DFA state after the first d bytes of the current path.
    std::vector<int> states(t.max_depth_ + 1);
    states[0] = state;
    const int n = t.num_nodes();
    for (int i = 1; i < n;) {
      const int d = t.depth_[i];
      const int next = dfa_->Next(states[d - 1], t.byte_[i]);
      if (next == Dfa::kDead) {
        i = t.subtree_end_[i];
        continue;
      }
      states[d] = next;
      const int end = t.subtree_end_[i];
      // Every byte below loops on `next`: the whole subtree is allowed.
      const bool whole =
          end > i + 1 &&
          dfa_->LoopsOn(next, &t.subtree_bytes_[static_cast<size_t>(i) * 4]);
      const int32_t last =
          whole ? t.token_offset_[end] : t.token_offset_[i + 1];
      for (int32_t k = t.token_offset_[i]; k < last; ++k) {
        set(t.token_ids_[k]);
      }
      i = whole ? end : i + 1;
    }
  }
  if (CanEnd(state) && t.eos_id_ >= 0 && t.eos_id_ < t.vocab_size_) {
    set(t.eos_id_);
  }
  for (uint64_t w : mask->bits) mask->count += __builtin_popcountll(w);
  if (mask->count <= t.vocab_size_ / 32) {
    mask->sparse.reserve(mask->count);
    for (size_t w = 0; w < mask->bits.size(); ++w) {
      uint64_t on = mask->bits[w];
      while (on != 0) {
        mask->sparse.push_back(
            static_cast<int32_t>(w * 64 + __builtin_ctzll(on)));
        on &= on - 1;
      }
    }
  }
  return mask;
}

std::shared_ptr<const TokenMask> Guide::Mask(int state) const {
  {
    absl::MutexLock lock(&mu_);
    auto it = masks_.find(state);
    if (it != masks_.end()) return it->second;
  }
  std::shared_ptr<const TokenMask> mask = Compute(state);
  absl::MutexLock lock(&mu_);
  if (masks_.size() >= max_cached_masks_) masks_.clear();
  return masks_.try_emplace(state, std::move(mask)).first->second;
}

int Guide::Advance(int state, int32_t token) const {
  if (state < 0) return kRejected;  // nothing follows EOS
  if (token == trie_->eos_id_)
    return dfa_->accepting(state) ? kEnded : kRejected;
  if (token < 0 || token >= trie_->vocab_size_) return kRejected;
  const std::string& bytes = trie_->bytes_[token];
  if (bytes.empty()) return kRejected;
  for (char c : bytes) {
    state = dfa_->Next(state, static_cast<uint8_t>(c));
    if (state == Dfa::kDead) return kRejected;
  }
  return state;
}

absl::Status TokenMatcher::Accept(int32_t token) {
  const int next = guide_->Advance(state_, token);
  if (next == Guide::kRejected) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "token %d is not allowed by the constraint here", token));
  }
  state_ = next;
  return absl::OkStatus();
}

absl::Status TokenMatcher::AcceptAll(const std::vector<int32_t>& tokens) {
  for (int32_t t : tokens) {
    absl::Status s = Accept(t);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status GuideCacheConfig::Validate() const {
  if (max_guides == 0 || mask_bytes_per_guide == 0) {
    return absl::InvalidArgumentError(
        "GuideCacheConfig: max_guides and mask_bytes_per_guide must be "
        "positive");
  }
  return constraint.Validate();
}

GuideCache::GuideCache(GuideCacheConfig config,
                       std::shared_ptr<const TokenTrie> trie)
    : config_(std::move(config)),
      trie_(std::move(trie)),
      dfas_(config_.constraint, config_.max_guides),
      guides_(config_.max_guides) {}

absl::StatusOr<std::shared_ptr<const Guide>> GuideCache::Get(
    const ConstraintSpec& spec) {
  const std::string key = spec.Key();
  if (auto hit = guides_.Find(key)) return hit;
  auto dfa = dfas_.Get(spec);
  if (!dfa.ok()) return dfa.status();
  // Worst case per mask: the bits plus a sparse list of up to vocab/32 ids.
  const size_t vocab = static_cast<size_t>(trie_->vocab_size());
  const size_t mask_bytes = vocab / 8 + vocab / 8 + 64;
  const size_t max_masks =
      std::max<size_t>(16, config_.mask_bytes_per_guide / mask_bytes);
  return guides_.Insert(
      key, std::make_shared<const Guide>(*std::move(dfa), trie_, max_masks));
}

}  // namespace pdserve::structured
