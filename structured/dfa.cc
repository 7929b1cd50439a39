#include "structured/dfa.h"

#include <algorithm>
#include <array>
#include <deque>
#include <functional>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace pdserve::structured {

absl::Status DfaLimits::Validate() const {
  if (max_nfa_states < 2 || max_dfa_states < 1) {
    return absl::InvalidArgumentError("DfaLimits: state caps must be positive");
  }
  if (max_build_time <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("DfaLimits: max_build_time must be > 0");
  }
  return absl::OkStatus();
}

namespace {

// Thompson NFA: a state either moves on a byte set to `next` or has
// epsilon edges.
struct NfaState {
  int set = -1;  // index into Nfa::sets; -1: epsilon-only
  int next = -1;
  std::vector<int> eps;
};

struct Frag {
  int in, out;
};

class NfaBuilder {
 public:
  NfaBuilder(const ByteRegex& re, int max_states)
      : re_(re), max_states_(max_states) {}

  std::vector<NfaState> states;
  std::vector<ByteSet> sets;

  absl::StatusOr<Frag> Build(int node) {
    Frag f = BuildNode(node);
    if (!status_.ok()) return status_;
    return f;
  }

 private:
  int NewState() {
    if (static_cast<int>(states.size()) >= max_states_) {
      if (status_.ok()) {
        status_ = absl::ResourceExhaustedError(absl::StrFormat(
            "constraint too large: more than %d NFA states", max_states_));
      }
      return -1;
    }
    states.emplace_back();
    return static_cast<int>(states.size()) - 1;
  }
  int SetIndex(const ByteSet& s) {
    auto [it, inserted] = set_index_.try_emplace(s, 0);
    if (inserted) {
      it->second = static_cast<int>(sets.size());
      sets.push_back(s);
    }
    return it->second;
  }
  void Eps(int from, int to) {
    if (from >= 0 && to >= 0) states[from].eps.push_back(to);
  }

  Frag BuildNode(int id) {
    if (!status_.ok()) return {-1, -1};
    const ByteRegex::Node& n = re_.node(id);
    switch (n.kind) {
      case ByteRegex::Kind::kNothing: {
        int a = NewState(), b = NewState();
        return {a, b};
      }
      case ByteRegex::Kind::kEmpty: {
        int a = NewState();
        return {a, a};
      }
      case ByteRegex::Kind::kBytes: {
        int a = NewState(), b = NewState();
        if (a < 0 || b < 0) return {-1, -1};
        states[a].set = SetIndex(n.bytes);
        states[a].next = b;
        return {a, b};
      }
      case ByteRegex::Kind::kConcat: {
        Frag f = BuildNode(n.kids[0]);
        for (size_t i = 1; i < n.kids.size() && status_.ok(); ++i) {
          Frag g = BuildNode(n.kids[i]);
          Eps(f.out, g.in);
          f.out = g.out;
        }
        return f;
      }
      case ByteRegex::Kind::kAlt: {
        int a = NewState(), b = NewState();
        for (int kid : n.kids) {
          if (!status_.ok()) break;
          Frag g = BuildNode(kid);
          Eps(a, g.in);
          Eps(g.out, b);
        }
        return {a, b};
      }
      case ByteRegex::Kind::kRepeat: {
        int start = NewState();
        int cur = start;
        for (int i = 0; i < n.min && status_.ok(); ++i) {
          Frag g = BuildNode(n.kids[0]);
          Eps(cur, g.in);
          cur = g.out;
        }
        if (n.max < 0) {
          Frag g = BuildNode(n.kids[0]);
          int end = NewState();
          Eps(cur, g.in);
          Eps(g.out, cur);
          Eps(cur, end);
          return {start, end};
        }
        int end = NewState();
        for (int i = n.min; i < n.max && status_.ok(); ++i) {
          Frag g = BuildNode(n.kids[0]);
          Eps(cur, end);
          Eps(cur, g.in);
          cur = g.out;
        }
        Eps(cur, end);
        return {start, end};
      }
      case ByteRegex::Kind::kAutomaton:
        return BuildAutomaton(re_.automaton(n.automaton));
    }
    return {-1, -1};
  }

  // One hub state per DFA state, with one byte state per distinct target
  // (its bytes the ones that lead there), and an epsilon edge from every
  // accepting hub to the fragment's end.
  Frag BuildAutomaton(const Dfa& d) {
    const int n = d.num_states();
    std::vector<int> hub(n);
    for (int s = 0; s < n; ++s) hub[s] = NewState();
    const int out = NewState();
    if (!status_.ok()) return {-1, -1};
    std::vector<std::pair<int, ByteSet>> targets;
    for (int s = 0; s < n && status_.ok(); ++s) {
      targets.clear();
      for (int b = 0; b < 256; ++b) {
        const int t = d.Next(s, static_cast<uint8_t>(b));
        if (t == Dfa::kDead) continue;
        auto it = std::find_if(targets.begin(), targets.end(),
                               [t](const auto& e) { return e.first == t; });
        if (it == targets.end()) {
          targets.emplace_back(t, ByteSet());
          it = targets.end() - 1;
        }
        it->second.set(b);
      }
      for (const auto& [t, set] : targets) {
        const int x = NewState();
        if (x < 0) break;
        states[x].set = SetIndex(set);
        states[x].next = hub[t];
        Eps(hub[s], x);
      }
      if (d.accepting(s)) Eps(hub[s], out);
    }
    return {hub[0], out};
  }

  const ByteRegex& re_;
  int max_states_;
  absl::Status status_;
  absl::flat_hash_map<ByteSet, int, std::hash<ByteSet>> set_index_;
};

// Sorted NFA states reachable from `seeds` by epsilon edges, keeping only
// states with a byte transition and the final state.
void Closure(const std::vector<NfaState>& nfa, int final_state,
             std::vector<int>* seeds, std::vector<int>* out,
             std::vector<uint32_t>* mark, uint32_t epoch) {
  out->clear();
  while (!seeds->empty()) {
    int s = seeds->back();
    seeds->pop_back();
    if ((*mark)[s] == epoch) continue;
    (*mark)[s] = epoch;
    if (nfa[s].set >= 0 || s == final_state) out->push_back(s);
    for (int e : nfa[s].eps) {
      if ((*mark)[e] != epoch) seeds->push_back(e);
    }
  }
  std::sort(out->begin(), out->end());
}

struct VecHash {
  size_t operator()(const std::vector<int>& v) const { return absl::HashOf(v); }
};

}  // namespace

absl::StatusOr<Dfa> Dfa::Build(const ByteRegex& re, int root,
                               const DfaLimits& limits) {
  if (!re.status().ok()) return re.status();
  if (root < 0 || root >= re.size()) {
    return absl::InvalidArgumentError("constraint: no regex root");
  }
  const absl::Time deadline = absl::Now() + limits.max_build_time;
  NfaBuilder builder(re, limits.max_nfa_states);
  auto frag = builder.Build(root);
  if (!frag.ok()) return frag.status();
  const std::vector<NfaState>& nfa = builder.states;
  const int final_state = frag->out;

  Dfa dfa;
  // Byte classes: bytes that every set treats alike share a class.
  {
    std::vector<int> cls(256, 0);
    int num = 1;
    for (const ByteSet& s : builder.sets) {
      absl::flat_hash_map<std::pair<int, bool>, int> remap;
      int next_num = 0;
      for (int b = 0; b < 256; ++b) {
        auto [it, inserted] = remap.try_emplace({cls[b], s[b]}, next_num);
        if (inserted) ++next_num;
        cls[b] = it->second;
      }
      num = next_num;
      if (absl::Now() > deadline) {
        return absl::ResourceExhaustedError(
            absl::StrFormat("constraint compile exceeded %s",
                            absl::FormatDuration(limits.max_build_time)));
      }
    }
    dfa.num_classes_ = num;
    for (int b = 0; b < 256; ++b) dfa.byte_class_[b] = cls[b];
  }
  std::vector<int> rep(dfa.num_classes_, -1);  // a byte of each class
  for (int b = 255; b >= 0; --b) rep[dfa.byte_class_[b]] = b;

  std::vector<uint32_t> mark(nfa.size(), 0);
  uint32_t epoch = 0;
  absl::flat_hash_map<std::vector<int>, int, VecHash> ids;
  std::vector<std::vector<int>> sets;
  std::vector<int> seeds = {frag->in}, closure;
  Closure(nfa, final_state, &seeds, &closure, &mark, ++epoch);
  ids.emplace(closure, 0);
  sets.push_back(closure);
  for (size_t d = 0; d < sets.size(); ++d) {
    if ((d & 63) == 0 && absl::Now() > deadline) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("constraint compile exceeded %s",
                          absl::FormatDuration(limits.max_build_time)));
    }
    const std::vector<int> current = sets[d];
    dfa.accepting_.push_back(
        std::binary_search(current.begin(), current.end(), final_state));
    for (int c = 0; c < dfa.num_classes_; ++c) {
      seeds.clear();
      for (int s : current) {
        if (nfa[s].set >= 0 && builder.sets[nfa[s].set][rep[c]]) {
          seeds.push_back(nfa[s].next);
        }
      }
      if (seeds.empty()) {
        dfa.next_.push_back(kDead);
        continue;
      }
      Closure(nfa, final_state, &seeds, &closure, &mark, ++epoch);
      auto [it, inserted] =
          ids.try_emplace(closure, static_cast<int>(sets.size()));
      if (inserted) {
        if (static_cast<int>(sets.size()) >= limits.max_dfa_states) {
          return absl::ResourceExhaustedError(
              absl::StrFormat("constraint too large: more than %d DFA states",
                              limits.max_dfa_states));
        }
        sets.push_back(closure);
      }
      dfa.next_.push_back(it->second);
    }
  }
  // Trim: keep states from which an accepting state is reachable.
  const int n = static_cast<int>(sets.size());
  std::vector<std::vector<int>> preds(n);
  for (int s = 0; s < n; ++s) {
    for (int c = 0; c < dfa.num_classes_; ++c) {
      int t = dfa.next_[static_cast<size_t>(s) * dfa.num_classes_ + c];
      if (t >= 0) preds[t].push_back(s);
    }
  }
  std::vector<bool> live(n, false);
  std::deque<int> queue;
  for (int s = 0; s < n; ++s) {
    if (dfa.accepting_[s]) {
      live[s] = true;
      queue.push_back(s);
    }
  }
  while (!queue.empty()) {
    int t = queue.front();
    queue.pop_front();
    for (int s : preds[t]) {
      if (!live[s]) {
        live[s] = true;
        queue.push_back(s);
      }
    }
  }
  if (!live[0]) {
    return absl::InvalidArgumentError("constraint matches no string");
  }
  dfa.has_next_.assign(n, false);
  for (int s = 0; s < n; ++s) {
    for (int c = 0; c < dfa.num_classes_; ++c) {
      int32_t& t = dfa.next_[static_cast<size_t>(s) * dfa.num_classes_ + c];
      if (t >= 0 && !live[t]) t = kDead;
      if (t >= 0) dfa.has_next_[s] = true;
    }
  }
  dfa.ComputeSelfLoops();
  return dfa;
}

void Dfa::ComputeSelfLoops() {
  std::vector<std::array<uint64_t, 4>> class_bytes(num_classes_);
  for (auto& c : class_bytes) c.fill(0);
  for (int b = 0; b < 256; ++b) {
    class_bytes[byte_class_[b]][b >> 6] |= uint64_t{1} << (b & 63);
  }
  const int n = num_states();
  self_loops_.assign(static_cast<size_t>(n) * 4, 0);
  for (int s = 0; s < n; ++s) {
    for (int c = 0; c < num_classes_; ++c) {
      if (next_[static_cast<size_t>(s) * num_classes_ + c] != s) continue;
      for (int w = 0; w < 4; ++w) {
        self_loops_[static_cast<size_t>(s) * 4 + w] |= class_bytes[c][w];
      }
    }
  }
}

absl::StatusOr<Dfa> Dfa::Minimized(absl::Time deadline) const {
  // Hopcroft's partition refinement over the states plus an explicit sink
  // (state n, for kDead), O(n * classes * log n): split blocks by which of
  // their states reach a splitter block on a class, queueing the smaller
  // half of every split.
  const int n = num_states();
  const int c = num_classes_;
  const int total = n + 1;
  const int sink = n;
  auto target = [&](int s, int k) {
    if (s == sink) return sink;
    const int t = next_[static_cast<size_t>(s) * c + k];
    return t == kDead ? sink : t;
  };
  // Inverse transitions per class, as CSR: sources of (class k, target t).
  std::vector<int> inv_start(static_cast<size_t>(c) * total + 1, 0);
  for (int s = 0; s < total; ++s) {
    for (int k = 0; k < c; ++k) {
      ++inv_start[static_cast<size_t>(k) * total + target(s, k) + 1];
    }
  }
  for (size_t i = 1; i < inv_start.size(); ++i)
    inv_start[i] += inv_start[i - 1];
  std::vector<int> inv(inv_start.back());
  {
    std::vector<int> fill(inv_start.begin(), inv_start.end() - 1);
    for (int s = 0; s < total; ++s) {
      for (int k = 0; k < c; ++k) {
        inv[fill[static_cast<size_t>(k) * total + target(s, k)]++] = s;
      }
    }
  }
  // Refinable partition: elems holds each block's states contiguously.
  std::vector<int> elems(total), loc(total), block_of(total);
  std::vector<int> first, end, marked;
  {
    int pos = 0;
    for (int pass = 0; pass < 2; ++pass) {
      const int begin = pos;
      for (int s = 0; s < total; ++s) {
        const bool acc = s != sink && accepting_[s];
        if (acc != (pass == 0)) continue;
        elems[pos] = s;
        loc[s] = pos++;
        block_of[s] = static_cast<int>(first.size());
      }
      if (pos > begin) {
        first.push_back(begin);
        end.push_back(pos);
        marked.push_back(0);
      }
    }
  }
  std::vector<std::pair<int, int>> work;  // (block, class)
  std::vector<bool> queued;
  auto enqueue = [&](int b, int k) {
    const size_t i = static_cast<size_t>(b) * c + k;
    if (queued.size() <= i) queued.resize((b + 1) * static_cast<size_t>(c));
    if (!queued[i]) {
      queued[i] = true;
      work.emplace_back(b, k);
    }
  };
  for (int b = 0; b < static_cast<int>(first.size()); ++b) {
    for (int k = 0; k < c; ++k) enqueue(b, k);
  }
  std::vector<int> splitter, touched;
  int64_t steps = 0;
  while (!work.empty()) {
    if ((++steps & 1023) == 0 && absl::Now() > deadline) {
      return absl::ResourceExhaustedError(
          "constraint compile exceeded its time limit while minimizing");
    }
    const auto [a, k] = work.back();
    work.pop_back();
    queued[static_cast<size_t>(a) * c + k] = false;
    // The states that reach block a on class k.
    splitter.clear();
    for (int i = first[a]; i < end[a]; ++i) {
      const int t = elems[i];
      const size_t key = static_cast<size_t>(k) * total + t;
      for (int j = inv_start[key]; j < inv_start[key + 1]; ++j)
        splitter.push_back(inv[j]);
    }
    touched.clear();
    for (int s : splitter) {
      const int b = block_of[s];
      const int m = first[b] + marked[b];
      if (loc[s] >= m) {  // not yet marked: swap it into the marked prefix
        const int other = elems[m];
        std::swap(elems[loc[s]], elems[m]);
        loc[other] = loc[s];
        loc[s] = m;
        if (marked[b]++ == 0) touched.push_back(b);
      }
    }
    for (int b : touched) {
      const int count = marked[b];
      marked[b] = 0;
      if (count == end[b] - first[b]) continue;  // all of it: no split
      // The marked prefix becomes a new block.
      const int nb = static_cast<int>(first.size());
      first.push_back(first[b]);
      end.push_back(first[b] + count);
      marked.push_back(0);
      first[b] += count;
      for (int i = first[nb]; i < end[nb]; ++i) block_of[elems[i]] = nb;
      const bool smaller_new = count <= end[b] - first[b];
      for (int d = 0; d < c; ++d) {
        const size_t i = static_cast<size_t>(b) * c + d;
        if (i < queued.size() && queued[i]) {
          enqueue(nb, d);
        } else {
          enqueue(smaller_new ? nb : b, d);
        }
      }
    }
  }
  // Blocks numbered in order of their first state, so the start state (0)
  // stays 0; the sink's block is kDead.
  std::vector<int> id(first.size(), -1);
  int num_blocks = 0;
  const int sink_block = block_of[sink];
  for (int s = 0; s < n; ++s) {
    const int b = block_of[s];
    if (b != sink_block && id[b] < 0) id[b] = num_blocks++;
  }
  std::vector<int> block(n);
  for (int s = 0; s < n; ++s) {
    block[s] = block_of[s] == sink_block ? kDead : id[block_of[s]];
  }
  if (n == 0 || block[0] == kDead) {
    return absl::InvalidArgumentError("constraint matches no string");
  }
  Dfa out;
  out.num_classes_ = c;
  std::copy(std::begin(byte_class_), std::end(byte_class_),
            std::begin(out.byte_class_));
  out.next_.assign(static_cast<size_t>(num_blocks) * c, kDead);
  out.accepting_.assign(num_blocks, false);
  out.has_next_.assign(num_blocks, false);
  std::vector<bool> done(num_blocks, false);
  for (int s = 0; s < n; ++s) {
    const int b = block[s];
    if (b == kDead || done[b]) continue;
    done[b] = true;
    out.accepting_[b] = accepting_[s];
    out.has_next_[b] = has_next_[s];
    for (int k = 0; k < c; ++k) {
      const int t = next_[static_cast<size_t>(s) * c + k];
      out.next_[static_cast<size_t>(b) * c + k] = t == kDead ? kDead : block[t];
    }
  }
  out.ComputeSelfLoops();
  return out;
}

}  // namespace pdserve::structured
