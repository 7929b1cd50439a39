// The BPE merge loop of one pre-tokenized piece: initial symbols (bytes, or
// characters for SentencePiece models), then the best-ranked adjacent pair
// merged first until none applies, then byte fallback or the unknown token
// for what is left outside the vocabulary.
#include <algorithm>
#include <functional>

#include "tokenizer/bpe_internal.h"

namespace pdserve::engine {

using bpe_internal::AbslView;
using bpe_internal::Utf8Length;

void BpeTokenizer::EncodePiece(std::string_view piece, Scratch* scratch,
                               std::vector<int32_t>* out) const {
  if (piece.empty()) return;
  if (ignore_merges_) {
    auto it = piece_ids_.find(AbslView(piece));
    if (it != piece_ids_.end()) {
      out->push_back(it->second);
      return;
    }
  }
  using Symbol = Scratch::Symbol;
  using Candidate = Scratch::Candidate;
  auto& symbols = scratch->symbols;
  symbols.clear();
  if (byte_level_) {
    for (size_t i = 0; i < piece.size(); ++i) {
      const int32_t n = static_cast<int32_t>(symbols.size());
      symbols.push_back({byte_ids_[static_cast<unsigned char>(piece[i])], n - 1,
                         n + 1, static_cast<int32_t>(i), 1});
    }
  } else {
    for (size_t i = 0; i < piece.size();) {
      const int len =
          std::min<int>(Utf8Length(static_cast<unsigned char>(piece[i])),
                        static_cast<int>(piece.size() - i));
      auto it = piece_ids_.find(AbslView(piece.substr(i, len)));
      const int32_t n = static_cast<int32_t>(symbols.size());
      symbols.push_back({it == piece_ids_.end() ? -1 : it->second, n - 1, n + 1,
                         static_cast<int32_t>(i), len});
      i += len;
    }
  }
  symbols.back().next = -1;

  // Merge the best-ranked adjacent pair first (leftmost on ties) until none
  // applies, as Hugging Face tokenizers does.
  auto& heap = scratch->heap;
  heap.clear();
  auto lookup = [&](int32_t left, int32_t right, Candidate* c) {
    if (left < 0 || right < 0) return false;
    auto it = merges_.find((static_cast<uint64_t>(left) << 32) |
                           static_cast<uint32_t>(right));
    if (it == merges_.end()) return false;
    c->rank = static_cast<int32_t>(it->second >> 32);
    c->merged = static_cast<int32_t>(it->second & 0xFFFFFFFFu);
    return true;
  };
  const auto cmp = std::greater<Candidate>();
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    Candidate c;
    if (lookup(symbols[i].id, symbols[i + 1].id, &c)) {
      c.pos = static_cast<int32_t>(i);
      heap.push_back(c);
    }
  }
  std::make_heap(heap.begin(), heap.end(), cmp);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), cmp);
    const Candidate top = heap.back();
    heap.pop_back();
    Symbol& left = symbols[top.pos];
    if (left.len == 0 || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    Candidate check;
    if (!lookup(left.id, right.id, &check) || check.merged != top.merged)
      continue;
    left.id = top.merged;
    left.len += right.len;
    left.next = right.next;
    right.len = 0;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    Candidate c;
    if (left.prev >= 0 && lookup(symbols[left.prev].id, left.id, &c)) {
      c.pos = left.prev;
      heap.push_back(c);
      std::push_heap(heap.begin(), heap.end(), cmp);
    }
    if (left.next >= 0 && lookup(left.id, symbols[left.next].id, &c)) {
      c.pos = top.pos;
      heap.push_back(c);
      std::push_heap(heap.begin(), heap.end(), cmp);
    }
  }

  bool last_unk = false;
  for (int32_t i = 0; i >= 0; i = symbols[i].next) {
    const Symbol& s = symbols[i];
    if (s.id >= 0) {
      out->push_back(s.id);
      last_unk = false;
      continue;
    }
    bool bytes_ok = byte_fallback_;
    for (int32_t k = 0; bytes_ok && k < s.len; ++k) {
      bytes_ok =
          byte_fallback_ids_[static_cast<unsigned char>(piece[s.begin + k])] >=
          0;
    }
    if (bytes_ok) {
      for (int32_t k = 0; k < s.len; ++k) {
        out->push_back(
            byte_fallback_ids_[static_cast<unsigned char>(piece[s.begin + k])]);
      }
      last_unk = false;
    } else if (unk_id_ >= 0 && !(fuse_unk_ && last_unk)) {
      out->push_back(unk_id_);
      last_unk = true;
    }
  }
}

}  // namespace pdserve::engine
