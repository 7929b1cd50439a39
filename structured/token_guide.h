// Per-step allowed-token sets over a tokenizer's vocabulary for a compiled
// constraint.
//
//  - TokenTrie: the raw bytes of every token of a vocabulary in a trie laid
//    out in preorder, built once per tokenizer. A byte-level BPE token that
//    spans several grammar symbols, or half a UTF-8 character, is just a path
//    of bytes here.
//  - Guide: one constraint's DFA over one TokenTrie. Mask(state) walks the
//    trie against the DFA, skipping every subtree whose prefix the DFA
//    rejects and taking whole every subtree whose bytes all loop on the
//    current DFA state (text inside a string literal), and caches the
//    result per DFA state, so a state seen before
//    (by this or any other request with the same constraint) costs a lookup.
//    EOS is allowed exactly in accepting states; other special tokens never.
//  - TokenMatcher: one request's position in a Guide.
//  - GuideCache: Guides by constraint text for one tokenizer.
//
// TokenTrie and Guide are thread-safe (Guide's mask cache is internally
// locked); TokenMatcher is thread-compatible; GuideCache is thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "structured/constraint.h"
#include "structured/dfa.h"
#include "structured/lru_map.h"
#include "tokenizer/tokenizer.h"

namespace pdserve::structured {

class TokenTrie {
 public:
  // Every non-special token with bytes becomes a path; EOS is remembered.
  static std::shared_ptr<const TokenTrie> Build(
      const engine::Tokenizer& tokenizer);

  int64_t vocab_size() const { return vocab_size_; }
  int32_t eos_id() const { return eos_id_; }
  const std::string& token_bytes(int32_t id) const { return bytes_[id]; }
  int num_nodes() const { return static_cast<int>(byte_.size()); }

 private:
  friend class Guide;
  int64_t vocab_size_ = 0;
  int32_t eos_id_ = -1;
  int max_depth_ = 0;
  std::vector<std::string> bytes_;  // id -> bytes ("" for special tokens)
  // Preorder nodes; node 0 is the root (the empty prefix).
  std::vector<uint8_t> byte_;          // byte on the edge into the node
  std::vector<uint16_t> depth_;        // root 0
  std::vector<int32_t> subtree_end_;   // first node after the subtree
  std::vector<int32_t> token_offset_;  // [node, node+1) in token_ids_
  std::vector<int32_t> token_ids_;     // tokens whose bytes end at the node
  // [node][4]: the bytes on the edges below the node (a 256-bit set), so a
  // subtree whose bytes all loop on the DFA state is taken whole.
  std::vector<uint64_t> subtree_bytes_;
};

// Tokens allowed at one step: bit t of `bits` is token t.
struct TokenMask {
  std::vector<uint64_t> bits;
  int64_t count = 0;
  // The allowed ids in increasing order when count <= vocab / 32 (a sparse
  // mask is applied by saving these logits and filling the rest), else empty.
  std::vector<int32_t> sparse;
  bool allowed(int32_t t) const {
    return t >= 0 && static_cast<size_t>(t >> 6) < bits.size() &&
           ((bits[t >> 6] >> (t & 63)) & 1);
  }
};

// Sets logits[t] to -inf for every token the mask disallows, for t < n
// (ids at or past the mask's vocabulary are disallowed).
void ApplyTokenMask(const TokenMask& mask, float* logits, int64_t n);
// The portable dense path alone, on the whole 64-token words below n (the
// dense path's other kernel is picked at run time): for tests.
void ApplyTokenMaskPortableForTest(const TokenMask& mask, float* logits,
                                   int64_t n);

class Guide {
 public:
  static constexpr int kRejected = -1;
  // The state after EOS: the constraint is satisfied and ended.
  static constexpr int kEnded = -2;

  Guide(std::shared_ptr<const Dfa> dfa, std::shared_ptr<const TokenTrie> trie,
        size_t max_cached_masks);

  int start() const { return dfa_->start(); }
  // The tokens allowed in `state` (kEnded: EOS only).
  std::shared_ptr<const TokenMask> Mask(int state) const;
  // The state after `token`, or kRejected.
  int Advance(int state, int32_t token) const;
  bool CanEnd(int state) const {
    return state == kEnded || (state >= 0 && dfa_->accepting(state));
  }
  // Whether some byte can still follow (false once the match is complete).
  bool CanContinue(int state) const {
    return state >= 0 && dfa_->has_next(state);
  }
  const Dfa& dfa() const { return *dfa_; }
  const TokenTrie& trie() const { return *trie_; }
  size_t cached_masks() const;

 private:
  std::shared_ptr<TokenMask> Compute(int state) const;

  const std::shared_ptr<const Dfa> dfa_;
  const std::shared_ptr<const TokenTrie> trie_;
  const size_t max_cached_masks_;
  mutable absl::Mutex mu_;
  mutable absl::flat_hash_map<int, std::shared_ptr<const TokenMask>> masks_
      ABSL_GUARDED_BY(mu_);
};

// One request's progress through a constraint.
class TokenMatcher {
 public:
  explicit TokenMatcher(std::shared_ptr<const Guide> guide)
      : guide_(std::move(guide)), state_(guide_->start()) {}

  // Masks one row of logits (n entries) to the tokens allowed now.
  void MaskLogits(float* logits, int64_t n) const {
    ApplyTokenMask(*guide_->Mask(state_), logits, n);
  }
  // Consumes a generated token; FAILED_PRECONDITION when the constraint does
  // not allow it (the matcher is then unchanged).
  absl::Status Accept(int32_t token);
  // Consumes tokens produced before (a decode worker resuming after the
  // prefill worker's first token, or a migrated stream).
  absl::Status AcceptAll(const std::vector<int32_t>& tokens);
  // Whether no token but EOS can follow: the output is complete.
  bool Complete() const { return !guide_->CanContinue(state_); }
  bool CanEnd() const { return guide_->CanEnd(state_); }
  int state() const { return state_; }
  const Guide& guide() const { return *guide_; }

 private:
  std::shared_ptr<const Guide> guide_;
  int state_;
};

struct GuideCacheConfig {
  ConstraintConfig constraint;
  size_t max_guides = 16;
  // Memory for each guide's cached masks; past it that cache starts over. A
  // mask of a 128k vocabulary is 16 KiB (32 KiB with its sparse list), so
  // the default holds about 1000-2000 states per constraint, and the whole
  // cache at most max_guides times this.
  size_t mask_bytes_per_guide = size_t{32} << 20;
  absl::Status Validate() const;
};

// Guides by constraint for one vocabulary.
class GuideCache {
 public:
  GuideCache(GuideCacheConfig config, std::shared_ptr<const TokenTrie> trie);
  absl::StatusOr<std::shared_ptr<const Guide>> Get(const ConstraintSpec& spec);
  const TokenTrie& trie() const { return *trie_; }

 private:
  const GuideCacheConfig config_;
  const std::shared_ptr<const TokenTrie> trie_;
  ConstraintCache dfas_;
  LruMap<const Guide> guides_;
};

}  // namespace pdserve::structured
