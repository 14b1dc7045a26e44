// Prompt lookup's n-gram index in C++: for every sequence, the latest start of each n-gram
// (min_n <= n <= max_n) that has a following token, and the longest-suffix lookup that
// NgramProposer makes for every row of every round.
//
// It computes exactly what ngram.py's PythonIndex computes (tests/test_ngram.py compares
// the two on random histories); the Python class stays the reference. Why C++: a round's
// lookups run right after the forward pass has streamed the weights through the caches,
// so each probe of a Python dict (its index, its entry, the key's int object) misses the
// cache several times; here a probe is one slot of a flat table, and a round prefetches
// every row's slots before it reads any.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// An n-gram's hash, built newest token first: hash(n) = step(hash(n - 1), token n back).
// A slot is trusted only after its tokens compare equal, so a collision costs a probe,
// never a wrong start.
inline uint64_t step(uint64_t h, int64_t token) {
  h ^= static_cast<uint64_t>(token) + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  return h * 0xBF58476D1CE4E5B9ull;
}

struct Slot {
  uint64_t hash = 0;
  int32_t start = 0;
  int32_t n = 0;  // 0: empty
};

class Seq {
 public:
  std::vector<int64_t> tokens;
  int64_t indexed = 0;  // the history length the index was last extended to

  void reset() {
    tokens.clear();
    indexed = 0;
    slots_.assign(kFirstSize, Slot{});
    used_ = 0;
  }

  // The hashes of the n-grams ending at `end`, n = 1..longest.
  void hashes(int64_t end, int longest, uint64_t* out) const {
    uint64_t h = 0;
    for (int n = 1; n <= longest; ++n) {
      h = step(h, tokens[end - n + 1]);
      out[n - 1] = h;
    }
  }

  void prefetch(uint64_t hash) const { __builtin_prefetch(&slots_[hash & (slots_.size() - 1)]); }

  // Record `start` as the latest occurrence of the n-gram of length n starting there.
  void put(uint64_t hash, int32_t start, int n) {
    size_t mask = slots_.size() - 1;
    for (size_t i = hash & mask;; i = (i + 1) & mask) {
      Slot& s = slots_[i];
      if (s.n == 0) {
        s = Slot{hash, start, n};
        if (++used_ * 2 > slots_.size()) grow();
        return;
      }
      if (s.n == n && s.hash == hash && same(s.start, start, n)) {
        s.start = start;
        return;
      }
    }
  }

  // The latest recorded start of the n-gram of length n starting at `start`; -1 if none.
  int32_t find(uint64_t hash, int32_t start, int n) const {
    size_t mask = slots_.size() - 1;
    for (size_t i = hash & mask;; i = (i + 1) & mask) {
      const Slot& s = slots_[i];
      if (s.n == 0) return -1;
      if (s.n == n && s.hash == hash && same(s.start, start, n)) return s.start;
    }
  }

 private:
  static constexpr size_t kFirstSize = 64;  // a power of two

  bool same(int32_t a, int32_t b, int n) const {
    return std::equal(tokens.begin() + a, tokens.begin() + a + n, tokens.begin() + b);
  }

  void grow() {
    std::vector<Slot> old(2 * slots_.size());
    old.swap(slots_);
    size_t mask = slots_.size() - 1;
    for (const Slot& s : old) {
      if (s.n == 0) continue;
      size_t i = s.hash & mask;
      while (slots_[i].n != 0) i = (i + 1) & mask;
      slots_[i] = s;
    }
  }

  std::vector<Slot> slots_ = std::vector<Slot>(kFirstSize);
  size_t used_ = 0;
};

class NgramIndex {
 public:
  NgramIndex(int min_n, int max_n) : min_n_(min_n), max_n_(max_n) {
    if (min_n < 1 || max_n < min_n) throw std::invalid_argument("need 1 <= min_n <= max_n");
  }

  // A handle for a new sequence (a freed one is reused).
  int64_t add() {
    if (!free_.empty()) {
      int64_t h = free_.back();
      free_.pop_back();
      return h;
    }
    seqs_.emplace_back();
    return static_cast<int64_t>(seqs_.size()) - 1;
  }

  void drop(int64_t handle) {
    seqs_.at(handle).reset();
    free_.push_back(handle);
  }

  // PythonIndex.spans: per row, bring sequence handles[i] up to histories[i] (a list of
  // token ids; one shorter than what the index holds starts it over), then, where
  // budgets[i] > 0, (start, n) of the latest earlier occurrence of its longest suffix
  // (the continuation begins at start + n); (0, 0) for none.
  std::vector<std::pair<int32_t, int32_t>> spans(const std::vector<int64_t>& handles,
                                                  const std::vector<py::list>& histories,
                                                  const std::vector<int64_t>& budgets) {
    size_t rows = handles.size();
    if (histories.size() != rows || budgets.size() != rows)
      throw std::invalid_argument("handles, histories and budgets must have one entry per row");
    std::vector<Seq*> seqs(rows);
    for (size_t r = 0; r < rows; ++r) {
      seqs[r] = &seqs_.at(handles[r]);
      append(*seqs[r], histories[r]);
    }
    std::vector<uint64_t> keys(rows * max_n_);
    for (size_t r = 0; r < rows; ++r) prefetch_round(*seqs[r], &keys[r * max_n_]);
    std::vector<std::pair<int32_t, int32_t>> out(rows, {0, 0});
    for (size_t r = 0; r < rows; ++r) {
      extend(*seqs[r]);
      if (budgets[r] > 0) out[r] = lookup(*seqs[r], &keys[r * max_n_]);
    }
    return out;
  }

 private:
  static void append(Seq& seq, const py::list& history) {
    int64_t size = static_cast<int64_t>(PyList_GET_SIZE(history.ptr()));
    if (size < static_cast<int64_t>(seq.tokens.size())) seq.reset();
    for (int64_t j = static_cast<int64_t>(seq.tokens.size()); j < size; ++j) {
      int64_t token = PyLong_AsLongLong(PyList_GET_ITEM(history.ptr(), j));
      if (token == -1 && PyErr_Occurred()) throw py::error_already_set();
      seq.tokens.push_back(token);
    }
  }

  int longest_at(int64_t end) const { return static_cast<int>(std::min<int64_t>(max_n_, end + 1)); }

  // The lookup's hashes (into `keys`), and a prefetch of every slot this round probes
  // first: the lookup's, and those of the n-grams that gained a following token.
  void prefetch_round(const Seq& seq, uint64_t* keys) const {
    int64_t size = static_cast<int64_t>(seq.tokens.size());
    for (int64_t end = std::max<int64_t>(seq.indexed - 1, 0); end < size - 1; ++end) {
      uint64_t hash = 0;
      for (int n = 1; n <= longest_at(end); ++n) {
        hash = step(hash, seq.tokens[end - n + 1]);
        if (n >= min_n_) seq.prefetch(hash);
      }
    }
    int longest = static_cast<int>(std::min<int64_t>(max_n_, size - 1));
    if (longest < min_n_) return;
    seq.hashes(size - 1, longest, keys);
    for (int n = min_n_; n <= longest; ++n) seq.prefetch(keys[n - 1]);
  }

  // Index every n-gram that gained a following token since the last call, oldest end
  // first, so later occurrences overwrite earlier ones.
  void extend(Seq& seq) const {
    int64_t size = static_cast<int64_t>(seq.tokens.size());
    for (int64_t end = std::max<int64_t>(seq.indexed - 1, 0); end < size - 1; ++end) {
      int longest = longest_at(end);
      uint64_t hash = 0;
      for (int n = 1; n <= longest; ++n) {
        hash = step(hash, seq.tokens[end - n + 1]);
        if (n >= min_n_) seq.put(hash, static_cast<int32_t>(end - n + 1), n);
      }
    }
    seq.indexed = size;
  }

  std::pair<int32_t, int32_t> lookup(const Seq& seq, const uint64_t* keys) const {
    int64_t size = static_cast<int64_t>(seq.tokens.size());
    int longest = static_cast<int>(std::min<int64_t>(max_n_, size - 1));
    for (int n = longest; n >= min_n_; --n) {
      int32_t start = seq.find(keys[n - 1], static_cast<int32_t>(size - n), n);
      if (start >= 0) return {start, n};
    }
    return {0, 0};
  }

  int min_n_, max_n_;
  std::vector<Seq> seqs_;
  std::vector<int64_t> free_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<NgramIndex>(m, "NgramIndex")
      .def(py::init<int, int>())
      .def("add", &NgramIndex::add)
      .def("drop", &NgramIndex::drop)
      .def("spans", &NgramIndex::spans);
}
