// Suffix decoding's index in C++: the global trie of earlier outputs and every row's own
// history, with the lookups suffix.py's SuffixProposer makes each round.
//
// It computes exactly what the Python classes in suffix.py compute (SuffixTrie, OwnHistory,
// _RowState): the same node ids, free-list order, stamps, insertion-ordered children and
// tie-breaks, and the same double arithmetic for path probabilities, so a lookup returns
// the same tokens (tests/test_suffix_index.py compares the two on random workloads). The
// Python classes stay the reference the tests inject bugs into; this is the one the
// engine runs when it builds (suffix_native.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int kTokenBits = 32;
constexpr int kIdBits = 40;
constexpr int64_t kIdMask = (int64_t(1) << kIdBits) - 1;
constexpr int kMaxMatchCap = 16;  // OwnHistory keys hold at most this many tokens

struct Limits {
  int max_depth, max_match, max_draft;
  double min_path_prob, match_factor;

  int draft_limit(int budget, int depth) const {
    int by_match = static_cast<int>(std::ceil(match_factor * depth));
    return std::min({budget, max_draft, by_match});
  }
};

// ------------------------------------------------------------------ the global trie
class Trie {
 public:
  explicit Trie(int max_depth) : max_depth_(max_depth) {
    count_ = {0}; token_ = {-1}; first_ = {-1}; last_ = {-1}; next_ = {-1}; prev_ = {-1}; stamp_ = {0};
  }

  int64_t num_nodes() const { return num_nodes_; }

  // Bytes held: the per-node arrays' capacity, and the child map's buckets and nodes (an
  // estimate: libstdc++ allocates a node per entry, a next pointer and the pair, 32 bytes
  // after malloc's rounding).
  int64_t bytes() const {
    size_t arrays = count_.capacity() + token_.capacity() + first_.capacity() + last_.capacity() +
                    next_.capacity() + prev_.capacity() + stamp_.capacity() + free_.capacity();
    return static_cast<int64_t>(arrays * sizeof(int64_t) + child_.bucket_count() * sizeof(void*) + child_.size() * 32);
  }

  // SuffixTrie.extend: count (+1) or uncount (-1) every suffix ending at `token`.
  void extend(const std::vector<int64_t>& frontier, int64_t token, int delta, std::vector<int64_t>* out) {
    out->clear();
    out->push_back(0);
    size_t n = std::min(frontier.size(), static_cast<size_t>(max_depth_));
    for (size_t i = 0; i < n; ++i) {
      int64_t node = frontier[i];
      auto it = child_.find(key(node, token));
      int64_t c;
      if (it == child_.end()) {
        if (delta < 0) throw std::invalid_argument("removing a sequence that was not added");
        c = new_node(node, token);
      } else {
        c = it->second;
      }
      count_[c] += delta;
      if (count_[c] == 0) drop(node, c);
      out->push_back(c);
    }
  }

  void add(const std::vector<int64_t>& tokens, int delta) {
    std::vector<int64_t> frontier{0}, next;
    for (int64_t t : tokens) {
      extend(frontier, t, delta, &next);
      std::swap(frontier, next);
    }
  }

  // SuffixTrie.follow: the frontier of handles after `token`, read only.
  void follow(std::vector<int64_t>* handles, int64_t token, int limit) const {
    std::vector<int64_t> next{0};
    size_t n = std::min(handles->size(), static_cast<size_t>(limit));
    for (size_t i = 0; i < n; ++i) {
      int64_t handle = (*handles)[i];
      int64_t node = handle & kIdMask;
      if (stamp_[node] != (handle >> kIdBits)) break;
      auto it = child_.find(key(node, token));
      if (it == child_.end()) break;
      next.push_back((stamp_[it->second] << kIdBits) | it->second);
    }
    handles->swap(next);
  }

  // SuffixTrie.continuation over a frontier of handles.
  std::pair<std::vector<int64_t>, int> continuation(const std::vector<int64_t>& handles, int budget,
                                                    const Limits& lim) const {
    std::vector<int64_t> live;
    size_t n = std::min(handles.size(), static_cast<size_t>(lim.max_match + 1));
    for (size_t i = 0; i < n; ++i) {
      int64_t node = handles[i] & kIdMask;
      if (stamp_[node] != (handles[i] >> kIdBits)) break;
      live.push_back(node);
    }
    for (int depth = static_cast<int>(live.size()) - 1; depth > 0; --depth) {
      if (first_[live[depth]] >= 0) return {walk(live[depth], lim.draft_limit(budget, depth), lim), depth};
    }
    return {{}, 0};
  }

 private:
  static uint64_t key(int64_t node, int64_t token) {
    return (static_cast<uint64_t>(node) << kTokenBits) | static_cast<uint64_t>(token);
  }

  std::vector<int64_t> walk(int64_t node, int limit, const Limits& lim) const {
    std::vector<int64_t> tokens;
    double prob = 1.0;
    while (static_cast<int>(tokens.size()) < limit && first_[node] >= 0) {
      int64_t best = -1, total = 0;
      for (int64_t c = first_[node]; c >= 0; c = next_[c]) {
        total += count_[c];
        if (best < 0 || count_[c] > count_[best]) best = c;
      }
      prob *= static_cast<double>(count_[best]) / static_cast<double>(total);
      if (prob < lim.min_path_prob) break;
      tokens.push_back(token_[best]);
      node = best;
    }
    return tokens;
  }

  int64_t new_node(int64_t parent, int64_t token) {
    int64_t last = last_[parent];
    int64_t node;
    if (!free_.empty()) {
      node = free_.back();
      free_.pop_back();
      count_[node] = 0; token_[node] = token; first_[node] = -1; last_[node] = -1;
      next_[node] = -1; prev_[node] = last;
    } else {
      node = static_cast<int64_t>(count_.size());
      count_.push_back(0); token_.push_back(token); first_.push_back(-1); last_.push_back(-1);
      next_.push_back(-1); prev_.push_back(last); stamp_.push_back(0);
    }
    if (last < 0) first_[parent] = node; else next_[last] = node;
    last_[parent] = node;
    child_[key(parent, token)] = node;
    ++num_nodes_;
    return node;
  }

  void drop(int64_t parent, int64_t node) {
    child_.erase(key(parent, token_[node]));
    int64_t prev = prev_[node], nxt = next_[node];
    if (prev < 0) first_[parent] = nxt; else next_[prev] = nxt;
    if (nxt < 0) last_[parent] = prev; else prev_[nxt] = prev;
    ++stamp_[node];
    free_.push_back(node);
    --num_nodes_;
  }

  int max_depth_;
  std::unordered_map<uint64_t, int64_t> child_;
  std::vector<int64_t> count_, token_, first_, last_, next_, prev_, stamp_, free_;
  int64_t num_nodes_ = 1;
};

// ------------------------------------------------------------------ one row's own history
struct Gram {
  std::array<uint32_t, kMaxMatchCap> t{};  // newest token first
  uint8_t n = 0;
  bool operator==(const Gram& o) const {
    return n == o.n && std::equal(t.begin(), t.begin() + n, o.t.begin());
  }
};

struct GramHash {
  size_t operator()(const Gram& g) const {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ g.n;
    for (int i = 0; i < g.n; ++i) {
      h ^= g.t[i] + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    }
    return static_cast<size_t>(h);
  }
};

class Own {
 public:
  // OwnHistory.extend: append a token, record its end position for every suffix length.
  void extend(int64_t token, int max_match) {
    tokens_.push_back(token);
    int32_t end = static_cast<int32_t>(tokens_.size() - 1);
    Gram g;
    int m = std::min(max_match, static_cast<int>(tokens_.size()));
    for (int i = 0; i < m; ++i) {
      g.t[i] = static_cast<uint32_t>(tokens_[end - i]);
      g.n = static_cast<uint8_t>(i + 1);
      ends_[g].push_back(end);
    }
  }

  // OwnHistory.continuation.
  std::pair<std::vector<int64_t>, int> continuation(int budget, const Limits& lim) const {
    int m_max = std::min(lim.max_match, static_cast<int>(tokens_.size()));
    Gram g;
    std::vector<Gram> keys;
    int last = static_cast<int>(tokens_.size()) - 1;
    for (int i = 0; i < m_max; ++i) {
      g.t[i] = static_cast<uint32_t>(tokens_[last - i]);
      g.n = static_cast<uint8_t>(i + 1);
      keys.push_back(g);
    }
    for (int m = m_max; m > 0; --m) {
      const std::vector<int32_t>& positions = ends_.at(keys[m - 1]);
      if (positions.size() > 1) {
        std::vector<int32_t> followed(positions.begin(), positions.end() - 1);
        return {walk(std::move(followed), lim.draft_limit(budget, m), lim), m};
      }
    }
    return {{}, 0};
  }

 private:
  std::vector<int64_t> walk(std::vector<int32_t> ends, int limit, const Limits& lim) const {
    const int64_t n = static_cast<int64_t>(tokens_.size());
    std::vector<int64_t> out;
    std::vector<std::pair<int64_t, int64_t>> followers;  // (token, count), first-seen order
    double prob = 1.0;
    while (static_cast<int>(out.size()) < limit) {
      int64_t step = static_cast<int64_t>(out.size()) + 1;
      followers.clear();
      int64_t total = 0;
      for (int32_t p : ends) {
        if (p + step >= n) continue;
        int64_t t = tokens_[p + step];
        auto it = std::find_if(followers.begin(), followers.end(), [t](const auto& f) { return f.first == t; });
        if (it == followers.end()) followers.emplace_back(t, 1); else ++it->second;
        ++total;
      }
      if (followers.empty()) break;
      auto best = followers.begin();
      for (auto it = followers.begin(); it != followers.end(); ++it) {
        if (it->second > best->second) best = it;
      }
      prob *= static_cast<double>(best->second) / static_cast<double>(total);
      if (prob < lim.min_path_prob) break;
      int64_t token = best->first;
      out.push_back(token);
      std::vector<int32_t> kept;
      for (int32_t p : ends) {
        if (p + step < n && tokens_[p + step] == token) kept.push_back(p);
      }
      ends.swap(kept);
    }
    return out;
  }

  std::vector<int64_t> tokens_;
  std::unordered_map<Gram, std::vector<int32_t>, GramHash> ends_;
};

struct Row {
  Own own;
  std::vector<int64_t> shared{0};  // handles into the global trie
};

// ------------------------------------------------------------------ the index
class SuffixIndex {
 public:
  SuffixIndex(int max_depth, int max_match, int max_draft, double min_path_prob, double match_factor)
      : lim_{max_depth, max_match, max_draft, min_path_prob, match_factor}, trie_(max_depth) {
    if (max_match < 1 || max_match > kMaxMatchCap) throw std::invalid_argument("max_match must be in [1, 16]");
  }

  void add_output(const std::vector<int64_t>& tokens) { trie_.add(tokens, 1); }
  void remove_output(const std::vector<int64_t>& tokens) { trie_.add(tokens, -1); }
  int64_t num_nodes() const { return trie_.num_nodes(); }
  int64_t trie_bytes() const { return trie_.bytes(); }
  int64_t num_rows() const { return static_cast<int64_t>(rows_.size()); }
  void drop_row(int64_t row) { rows_.erase(row); }

  // PythonIndex.extend: append committed tokens to a row (made on its first tokens).
  void extend(int64_t row, const std::vector<int64_t>& tokens) {
    Row& r = rows_[row];
    for (int64_t t : tokens) {
      r.own.extend(t, lim_.max_match);
      trie_.follow(&r.shared, t, lim_.max_match);
    }
  }

  // (own tokens, own match length, global tokens, global match length) of a row.
  std::tuple<std::vector<int64_t>, int, std::vector<int64_t>, int> lookup(int64_t row, int budget) const {
    const Row& r = rows_.at(row);
    auto own = r.own.continuation(budget, lim_);
    auto shared = trie_.continuation(r.shared, budget, lim_);
    return {std::move(own.first), own.second, std::move(shared.first), shared.second};
  }

 private:
  Limits lim_;
  Trie trie_;
  std::unordered_map<int64_t, Row> rows_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<SuffixIndex>(m, "SuffixIndex")
      .def(py::init<int, int, int, double, double>())
      .def("add_output", &SuffixIndex::add_output)
      .def("remove_output", &SuffixIndex::remove_output)
      .def("num_nodes", &SuffixIndex::num_nodes)
      .def("trie_bytes", &SuffixIndex::trie_bytes)
      .def("num_rows", &SuffixIndex::num_rows)
      .def("drop_row", &SuffixIndex::drop_row)
      .def("extend", &SuffixIndex::extend)
      .def("lookup", &SuffixIndex::lookup);
}
