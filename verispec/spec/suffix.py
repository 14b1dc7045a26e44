"""Suffix decoding: propose the most frequent continuation of the longest match, looked up
in the row's own history and in the outputs of earlier requests.

After SuffixDecoding (Oliaro et al.) and Arctic Inference's implementation, written anew.
Both sources count every substring of at most MAX_DEPTH tokens (MAX_DEPTH = MAX_MATCH +
MAX_DRAFT, so a matched suffix has room below it for a whole draft):

* per request, its prompt and output so far (committed tokens only: extended from
  `req.all_ids` when the row is offered, never with drafts), as an `OwnHistory`: the end
  positions of its n-grams, from which a lookup reads the counts a suffix trie of the one
  sequence would hold (building that trie cost MAX_DEPTH nodes a token, most of the
  proposer's time on long prompts);
* one global depth-bounded suffix trie over the outputs of finished requests, bounded by
  GLOBAL_NODES nodes: whole outputs are evicted oldest first (their counts replayed off).

A lookup takes the longest suffix of the row of at most MAX_MATCH tokens that has been
followed by something (in the global trie: through a frontier, the trie node of each
suffix length, extended by one step per appended token, so nothing is rebuilt per step),
and follows the most frequent continuation while the path's probability (the product of
count / total of the alternatives) stays at least the run's min_path_prob, for at most
ceil(match_factor * match length) tokens (SpecConfig's suffix_min_token_prob and
suffix_max_spec_factor). The longer match of the two sources is offered
(the own history's on a tie; choosing by the path probabilities instead measured no
different). Drafts are deterministic in the row's history and the global trie's state at
the round's start, so one-hot q is exact for the rejection sampler. A row's global frontier
sees outputs added after it was built only through the suffixes it extends (it catches up
within MAX_MATCH tokens).

The tries and histories live behind one index interface (`PythonIndex` below, or the same
in C++, suffix_index.cpp, where it builds: `make_index`); the proposer keeps the policy
around it (the longer match, counters, eviction).
"""
from __future__ import annotations

import math
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from verispec.config import SpecConfig
from verispec.native import CppExtension
from verispec.spec.ngram import suffix_keys
from verispec.spec.proposer import Offer

MAX_MATCH = 8           # longest suffix matched; longer matches rarely change the continuation
MAX_DRAFT = 16          # longest draft: the policy's k never reaches it at these acceptance rates
MAX_DEPTH = MAX_MATCH + MAX_DRAFT
GLOBAL_NODES = 300_000  # global trie budget (~150 bytes a node: ~45 MB); outputs evicted oldest first
# The run's limits (SpecConfig.suffix_min_token_prob and suffix_max_spec_factor: why there)
MIN_PATH_PROB = SpecConfig.suffix_min_token_prob
MATCH_FACTOR = SpecConfig.suffix_max_spec_factor
GLOBAL_KEY = 100        # acceptance keys: match length, + this for a global-trie match
_TOKEN_BITS = 32        # a trie child's key: node << _TOKEN_BITS | token (token ids below 2^32)
_ID_BITS = 40           # a frontier handle: stamp << _ID_BITS | node
_ID_MASK = (1 << _ID_BITS) - 1


class SuffixTrie:
    """Counts of every substring of at most `max_depth` tokens of the sequences added.

    Stored flat, without a Python object per node: node ids index arrays of counts, tokens
    and child lists (0 is the root), and one dict maps (node, token) to the child. The
    collector then has nothing to scan here (a trie of node objects made each full
    collection walk every node, ~80 ms at 300,000 nodes, stalling every request), and a
    node costs about half the memory. A node whose count reaches 0 is freed and its id
    reused, so a frontier kept across removals holds handles (`follow`): an id with the
    stamp it had, which tell a freed id apart.

    A frontier is the list of a sequence's current suffixes' nodes by length (index 0 the
    root): `extend` appends one token to a sequence, returning its next frontier. A child
    list keeps insertion order, so ties in `continuation` go to the child added first.
    """

    root = 0

    def __init__(self, max_depth: int = MAX_DEPTH):
        self.max_depth = max_depth
        self._child: dict[int, int] = {}          # node << _TOKEN_BITS | token -> child
        self._count = array("q", [0])
        self._token = array("q", [-1])
        self._first = array("q", [-1])            # first child, -1: none
        self._last = array("q", [-1])
        self._next = array("q", [-1])             # next sibling, -1: none
        self._prev = array("q", [-1])             # previous sibling, -1: none
        self._stamp = array("q", [0])             # bumped when the id is freed
        self._free = array("q")
        self.num_nodes = 1

    def count(self, node: int) -> int:
        return self._count[node]

    def children(self, node: int) -> list[tuple[int, int]]:
        """(token, child) in insertion order."""
        out, c = [], self._first[node]
        while c >= 0:
            out.append((self._token[c], c))
            c = self._next[c]
        return out

    def extend(self, frontier: list[int], token: int, delta: int = 1) -> list[int]:
        """Count (delta 1) or uncount (-1, a sequence being removed) every suffix ending at
        `token`; nodes whose count reaches 0 are freed. A removal allocates nothing, so a
        node freed during it keeps its id (and its children's entries) until its
        descendants, which occur only inside the removed sequence, reach 0 after it."""
        nxt = [0]
        for node in frontier[: self.max_depth]:
            child = self._child.get(node << _TOKEN_BITS | token)
            if child is None:
                if delta < 0:
                    raise ValueError("removing a sequence that was not added")
                child = self._new(node, token)
            self._count[child] += delta
            if self._count[child] == 0:
                self._drop(node, child)
            nxt.append(child)
        return nxt

    def add(self, tokens: Sequence[int], delta: int = 1) -> None:
        frontier = [0]
        for t in tokens:
            frontier = self.extend(frontier, t, delta)

    def follow(self, frontier: list[int], token: int, limit: int = MAX_MATCH) -> list[int]:
        """The frontier of handles (suffixes of at most `limit` tokens) after `token` for a
        sequence that is not in this trie, read only: the suffixes present form lengths
        0..m, since a present string's suffixes are too, so it stops at the first absent
        or freed one."""
        nxt = [0]
        stamp, child_of = self._stamp, self._child.get
        for handle in frontier[:limit]:
            node = handle & _ID_MASK
            if stamp[node] != handle >> _ID_BITS:
                break
            child = child_of(node << _TOKEN_BITS | token)
            if child is None:
                break
            nxt.append(stamp[child] << _ID_BITS | child)
        return nxt

    def continuation(self, frontier: list[int], budget: int, match_factor: float = MATCH_FACTOR,
                     min_path_prob: float = MIN_PATH_PROB) -> tuple[list[int], int]:
        """(the most frequent continuation of the longest suffix in a frontier of handles,
        of at most MAX_MATCH tokens, that has one; its match length)."""
        live = []
        for handle in frontier[: MAX_MATCH + 1]:
            node = self._live(handle)
            if node is None:
                break
            live.append(node)
        for depth in range(len(live) - 1, 0, -1):
            if self._first[live[depth]] >= 0:
                limit = min(budget, MAX_DRAFT, math.ceil(match_factor * depth))
                return self._walk(live[depth], limit, min_path_prob), depth
        return [], 0

    def _live(self, handle: int) -> int | None:
        node = handle & _ID_MASK
        return node if self._stamp[node] == handle >> _ID_BITS else None

    def _walk(self, node: int, limit: int, min_path_prob: float) -> list[int]:
        tokens: list[int] = []
        prob = 1.0
        count, nxt = self._count, self._next
        while len(tokens) < limit and self._first[node] >= 0:
            best, c, total = -1, self._first[node], 0
            while c >= 0:
                total += count[c]
                if best < 0 or count[c] > count[best]:
                    best = c
                c = nxt[c]
            prob *= count[best] / total
            if prob < min_path_prob:
                break
            tokens.append(self._token[best])
            node = best
        return tokens

    def _new(self, parent: int, token: int) -> int:
        """A child of `parent` for `token`, last in its list (count 0: the caller counts)."""
        last = self._last[parent]
        if self._free:
            node = self._free.pop()
            self._count[node], self._token[node], self._first[node], self._last[node] = 0, token, -1, -1
            self._next[node], self._prev[node] = -1, last
        else:
            node = len(self._count)
            self._count.append(0)
            self._token.append(token)
            self._first.append(-1)
            self._last.append(-1)
            self._next.append(-1)
            self._prev.append(last)
            self._stamp.append(0)
        if last < 0:
            self._first[parent] = node
        else:
            self._next[last] = node
        self._last[parent] = node
        self._child[parent << _TOKEN_BITS | token] = node
        self.num_nodes += 1
        return node

    def _drop(self, parent: int, node: int) -> None:
        """Unlink a node whose count reached 0 and free its id (stale handles now fail)."""
        del self._child[parent << _TOKEN_BITS | self._token[node]]
        prev, nxt = self._prev[node], self._next[node]
        if prev < 0:
            self._first[parent] = nxt
        else:
            self._next[prev] = nxt
        if nxt < 0:
            self._last[parent] = prev
        else:
            self._prev[nxt] = prev
        self._stamp[node] += 1
        self._free.append(node)
        self.num_nodes -= 1


class OwnHistory:
    """One request's committed tokens with the end positions of every n-gram of at most
    MAX_MATCH tokens, in order: what a depth-bounded suffix trie of the one sequence counts,
    read from the positions when a lookup walks them instead of stored node by node (a trie
    builds up to MAX_DEPTH nodes a token; this, MAX_MATCH short keys). An n-gram's key is
    one int (`ngram.suffix_keys`) and its positions int32s packed in a bytearray, neither of which
    the garbage collector tracks, so, like the global trie, it gives it nothing to scan.

    `continuation` returns exactly what `SuffixTrie.continuation` on that trie's frontier
    returns: a child's count is the number of occurrences followed by it, the children's
    total the number followed by anything, and ties go to the token whose first such
    occurrence ends first (the trie's insertion order)."""

    __slots__ = ("tokens", "ends")

    def __init__(self):
        self.tokens: list[int] = []
        self.ends: dict[int, bytearray] = {}

    def extend(self, token: int) -> None:
        tokens = self.tokens
        tokens.append(token)
        end = len(tokens) - 1
        packed = end.to_bytes(4, sys.byteorder)  # read back as native int32 (positions < 2^31)
        for key in suffix_keys(tokens, end, min(MAX_MATCH, len(tokens))):
            positions = self.ends.get(key)
            if positions is None:
                self.ends[key] = bytearray(packed)
            else:
                positions += packed

    def continuation(self, budget: int, match_factor: float = MATCH_FACTOR,
                     min_path_prob: float = MIN_PATH_PROB) -> tuple[list[int], int]:
        """(the most frequent continuation of the longest suffix of at most MAX_MATCH tokens
        that has one, its match length)."""
        keys = suffix_keys(self.tokens, len(self.tokens) - 1, min(MAX_MATCH, len(self.tokens)))
        for m in range(len(keys), 0, -1):
            # the suffix ends at the last token, whose position `extend` appended last:
            # the occurrences before it are the ones followed by something
            positions = self.ends[keys[m - 1]]
            if len(positions) > 4:
                followed = memoryview(positions).cast("i").tolist()[:-1]
                return self._walk(followed, min(budget, MAX_DRAFT, math.ceil(match_factor * m)), min_path_prob), m
        return [], 0

    def _walk(self, ends: list[int], limit: int, min_path_prob: float) -> list[int]:
        tokens, n = self.tokens, len(self.tokens)
        out: list[int] = []
        prob = 1.0
        while len(out) < limit:
            step = len(out) + 1
            followers: dict[int, int] = {}  # in first-seen order, as the trie's children are
            for p in ends:
                if p + step < n:
                    t = tokens[p + step]
                    followers[t] = followers.get(t, 0) + 1
            if not followers:
                break
            token = max(followers, key=followers.__getitem__)  # the first of the most frequent
            count = followers[token]
            prob *= count / sum(followers.values())
            if prob < min_path_prob:
                break
            out.append(token)
            ends = [p for p in ends if p + step < n and tokens[p + step] == token]
        return out


class _RowState:
    """One request's own history index and its frontier in the global trie."""

    __slots__ = ("own", "shared")

    def __init__(self, global_trie: SuffixTrie):
        self.own = OwnHistory()
        self.shared = [global_trie.root]   # handles (SuffixTrie.follow)


class PythonIndex:
    """The global trie and every row's state, in Python: the reference `suffix_index.cpp`
    computes exactly (tests/test_suffix_index.py), and the index where no C++ compiler is.
    Rows are keyed by ints (the proposer numbers its requests)."""

    def __init__(self, min_path_prob: float = MIN_PATH_PROB, match_factor: float = MATCH_FACTOR):
        self.trie = SuffixTrie()
        self.rows: dict[int, _RowState] = {}
        self.min_path_prob, self.match_factor = min_path_prob, match_factor

    def num_nodes(self) -> int:
        return self.trie.num_nodes

    def add_output(self, tokens: list[int]) -> None:
        self.trie.add(tokens)

    def remove_output(self, tokens: list[int]) -> None:
        self.trie.add(tokens, delta=-1)

    def drop_row(self, row: int) -> None:
        self.rows.pop(row, None)

    def extend(self, row: int, tokens: list[int]) -> None:
        """Append committed tokens to a row (made on its first tokens)."""
        state = self.rows.get(row)
        if state is None:
            state = self.rows[row] = _RowState(self.trie)
        for t in tokens:
            state.own.extend(t)
            state.shared = self.trie.follow(state.shared, t)

    def lookup(self, row: int, budget: int) -> tuple[list[int], int, list[int], int]:
        """(own continuation, its match length, the global trie's, its match length)."""
        state, limits = self.rows[row], (self.match_factor, self.min_path_prob)
        own, own_len = state.own.continuation(budget, *limits)
        shared, shared_len = self.trie.continuation(state.shared, budget, *limits)
        return own, own_len, shared, shared_len


_NATIVE = CppExtension("suffix decoding's C++ index", Path(__file__).with_name("suffix_index.cpp"),
                       "verispec_suffix", ["-O2"], fallback="the Python index (the same drafts)")


def make_index(native: bool | None = None, min_path_prob: float = MIN_PATH_PROB,
               match_factor: float = MATCH_FACTOR):
    """The C++ index (suffix_index.cpp, built on first use), or the Python one: native None
    takes the C++ one if it builds, True requires it, False never builds it."""
    if native is not False:
        module = _NATIVE.load(required=bool(native))
        if module is not None:
            return module.SuffixIndex(MAX_DEPTH, MAX_MATCH, MAX_DRAFT, min_path_prob, match_factor)
    return PythonIndex(min_path_prob, match_factor)


class _Request:
    """A request as the proposer tracks it: its row in the index and how many of its tokens
    the index has been given."""

    __slots__ = ("row", "req", "seen")

    def __init__(self, row: int, req):
        self.row, self.req, self.seen = row, req, 0


class SuffixProposer:
    """Suffix decoding (a `Proposer`): the own history and the global trie, the longer match
    wins. The global trie holds finished outputs while it is within `global_nodes` nodes and
    `max_outputs` outputs (None: no count limit; 0: it stays empty, so a request drafts from
    its own tokens only). `native`: as `make_index`, called on the first use (every engine
    builds every proposer; one that never runs suffix decoding compiles and loads nothing)."""

    name = "suffix"
    timed = False       # trie walks: tens of microseconds per row, not a model pass
    has_probs = False   # deterministic drafts: one-hot q

    def __init__(self, global_nodes: int = GLOBAL_NODES, max_outputs: int | None = None,
                 native: bool | None = None, min_path_prob: float = MIN_PATH_PROB,
                 match_factor: float = MATCH_FACTOR):
        self._native = native
        self._limits = {"min_path_prob": min_path_prob, "match_factor": match_factor}
        self._index = None
        self.global_nodes = global_nodes
        self.max_outputs = max_outputs
        self._outputs: OrderedDict[int, list[int]] = OrderedDict()  # in the global trie, oldest first
        self._added = 0
        self._requests: dict[str, _Request] = {}
        self._next_row = 0
        self._offered: dict[str, list[int]] = {}
        self._counts = {"lookups": 0, "global_hits": 0, "own_hits": 0, "evicted_outputs": 0}

    @property
    def index(self):
        if self._index is None:
            self._index = make_index(self._native, **self._limits)
        return self._index

    def stats(self) -> dict[str, int]:
        """For /metrics: the global trie's size now, and counters since start ("_total")."""
        nodes = self._index.num_nodes() if self._index is not None else 1  # the root
        return {"global_nodes": nodes, "global_outputs": len(self._outputs),
                **{f"{name}_total": n for name, n in self._counts.items()}}

    def offer(self, rows: Sequence, budgets: Sequence[int]) -> list[Offer]:
        offers, self._offered = [], {}
        for req, budget in zip(rows, budgets):
            tokens, key = self._lookup(self._row(req), budget)
            self._offered[req.request_id] = tokens
            offers.append(Offer(len(tokens), 0, key))
        return offers

    def prepare(self, rows: Sequence) -> int:
        return 0

    def draft(self, rows: Sequence, ks: Sequence[int]) -> list[tuple[list[int], None]]:
        return [(self._offered.get(r.request_id, [])[:k], None) for r, k in zip(rows, ks)]

    def rollback(self, req) -> None:
        """Nothing to undo: the index only ever holds committed tokens."""

    def forget(self, request_id: str) -> None:
        """The request's output joins the global trie (then the oldest outputs leave it
        while it is over either budget); its own history is dropped."""
        tracked = self._requests.pop(request_id, None)
        self._offered.pop(request_id, None)
        if tracked is None:
            return
        self.index.drop_row(tracked.row)
        output = list(tracked.req.output_ids)
        if not output or self.max_outputs == 0:
            return
        self.index.add_output(output)
        self._outputs[self._added] = output
        self._added += 1
        while self._outputs and (self.index.num_nodes() > self.global_nodes
                                 or self.max_outputs is not None and len(self._outputs) > self.max_outputs):
            _, old = self._outputs.popitem(last=False)
            self.index.remove_output(old)
            self._counts["evicted_outputs"] += 1

    def _row(self, req) -> int:
        """The request's row, extended with the tokens committed since its last offer (only
        those cross into the index); a history that shrank (a preempted request's,
        recomputed) gets a new row."""
        tracked = self._requests.get(req.request_id)
        tokens = req.all_ids
        if tracked is not None and len(tokens) < tracked.seen:
            self.index.drop_row(tracked.row)
            tracked = None
        if tracked is None:
            tracked = self._requests[req.request_id] = _Request(self._next_row, req)
            self._next_row += 1
        if len(tokens) > tracked.seen:
            self.index.extend(tracked.row, tokens[tracked.seen:])
            tracked.seen = len(tokens)
        return tracked.row

    def _lookup(self, row: int, budget: int) -> tuple[list[int], int]:
        if budget <= 0:
            return [], 0
        self._counts["lookups"] += 1
        own, own_len, shared, shared_len = self.index.lookup(row, budget)
        if shared_len > own_len and shared:
            self._counts["global_hits"] += 1
            return shared, GLOBAL_KEY + shared_len
        if own:
            self._counts["own_hits"] += 1
        return own, own_len
