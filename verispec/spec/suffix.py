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
count / total of the alternatives) stays at least MIN_PATH_PROB, for at most
ceil(MATCH_FACTOR * match length) tokens. The longer match of the two sources is offered
(the own history's on a tie; choosing by the path probabilities instead measured no
different). Drafts are deterministic in the row's history and the global trie's state at
the round's start, so one-hot q is exact for the rejection sampler. A row's global frontier
sees outputs added after it was built only through the suffixes it extends (it catches up
within MAX_MATCH tokens).
"""
from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Sequence

from verispec.spec.proposer import Offer

MAX_MATCH = 8           # longest suffix matched; longer matches rarely change the continuation
MAX_DRAFT = 16          # longest draft: the policy's k never reaches it at these acceptance rates
MAX_DEPTH = MAX_MATCH + MAX_DRAFT
GLOBAL_NODES = 300_000  # global trie budget (~270 bytes a node: ~80 MB); outputs evicted oldest first
MIN_PATH_PROB = 0.1     # stop drafting once the continuation is this unlikely under the counts
MATCH_FACTOR = 2.0      # tokens proposed per matched token: a short match predicts little
GLOBAL_KEY = 100        # acceptance keys: match length, + this for a global-trie match


class _Node:
    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Counts of every substring of at most `max_depth` tokens of the sequences added.

    A frontier is the list of nodes of a sequence's current suffixes by length (index 0 is
    the root): `extend` appends one token to a sequence, returning its next frontier.
    """

    def __init__(self, max_depth: int = MAX_DEPTH):
        self.max_depth = max_depth
        self.root = _Node()
        self.num_nodes = 1

    def extend(self, frontier: list[_Node], token: int, delta: int = 1) -> list[_Node]:
        """Count (delta 1) or uncount (-1, a sequence being removed) every suffix ending at
        `token`; nodes whose count reaches 0 are detached."""
        nxt = [self.root]
        for node in frontier[: self.max_depth]:
            child = node.children.get(token)
            if child is None:
                if delta < 0:
                    raise ValueError("removing a sequence that was not added")
                child = node.children[token] = _Node()
                self.num_nodes += 1
            child.count += delta
            if child.count == 0:
                del node.children[token]
                self.num_nodes -= 1
            nxt.append(child)
        return nxt

    def add(self, tokens: Sequence[int], delta: int = 1) -> None:
        frontier = [self.root]
        for t in tokens:
            frontier = self.extend(frontier, t, delta)

    def follow(self, frontier: list[_Node], token: int, limit: int = MAX_MATCH) -> list[_Node]:
        """The frontier (suffixes of at most `limit` tokens) after `token` for a sequence
        that is not in this trie, read only: the suffixes present form lengths 0..m, since
        a present string's suffixes are too."""
        nxt = [self.root]
        for node in frontier[:limit]:
            child = node.children.get(token)
            if child is None or child.count <= 0:
                break
            nxt.append(child)
        return nxt


def continuation(frontier: list[_Node], budget: int) -> tuple[list[int], int]:
    """(the most frequent continuation of the longest suffix of at most MAX_MATCH tokens that
    has one, its match length)."""
    for depth in range(min(len(frontier) - 1, MAX_MATCH), 0, -1):
        node = frontier[depth]
        if node.children:
            return _walk(node, min(budget, MAX_DRAFT, math.ceil(MATCH_FACTOR * depth))), depth
    return [], 0


def _walk(node: _Node, limit: int) -> list[int]:
    tokens: list[int] = []
    prob = 1.0
    while len(tokens) < limit and node.children:
        token, child = max(node.children.items(), key=lambda kv: kv[1].count)
        prob *= child.count / sum(c.count for c in node.children.values())
        if prob < MIN_PATH_PROB:
            break
        tokens.append(token)
        node = child
    return tokens


class OwnHistory:
    """One request's committed tokens with the end positions of every n-gram of at most
    MAX_MATCH tokens, in order: what a depth-bounded suffix trie of the one sequence counts,
    read from the positions when a lookup walks them instead of stored node by node (a trie
    builds up to MAX_DEPTH nodes a token; this, MAX_MATCH short keys).

    `continuation` returns exactly what `continuation` on that trie's frontier returns: a
    child's count is the number of occurrences followed by it, the children's total the
    number followed by anything, and ties go to the token whose first such occurrence ends
    first (the trie's insertion order)."""

    __slots__ = ("tokens", "ends")

    def __init__(self):
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, token: int) -> None:
        tokens = self.tokens
        tokens.append(token)
        end = len(tokens) - 1
        for n in range(1, min(MAX_MATCH, len(tokens)) + 1):
            self.ends.setdefault(tuple(tokens[end - n + 1:]), []).append(end)

    def continuation(self, budget: int) -> tuple[list[int], int]:
        """(the most frequent continuation of the longest suffix of at most MAX_MATCH tokens
        that has one, its match length)."""
        tokens = self.tokens
        last = len(tokens) - 1
        for m in range(min(MAX_MATCH, len(tokens)), 0, -1):
            followed = [p for p in self.ends.get(tuple(tokens[last - m + 1:]), ()) if p < last]
            if followed:
                return self._walk(followed, min(budget, MAX_DRAFT, math.ceil(MATCH_FACTOR * m))), m
        return [], 0

    def _walk(self, ends: list[int], limit: int) -> list[int]:
        tokens, n = self.tokens, len(self.tokens)
        out: list[int] = []
        prob = 1.0
        while len(out) < limit:
            step = len(out) + 1
            followers = Counter(tokens[p + step] for p in ends if p + step < n)
            if not followers:
                break
            token, count = max(followers.items(), key=lambda kv: kv[1])
            prob *= count / sum(followers.values())
            if prob < MIN_PATH_PROB:
                break
            out.append(token)
            ends = [p for p in ends if p + step < n and tokens[p + step] == token]
        return out


class _RowState:
    """One request's own history index, its frontier in the global trie, and how many of
    its tokens both have seen."""

    __slots__ = ("req", "own", "shared", "seen")

    def __init__(self, req, global_trie: SuffixTrie):
        self.req = req
        self.own = OwnHistory()
        self.shared = [global_trie.root]
        self.seen = 0


class SuffixProposer:
    """Suffix decoding (a `Proposer`): the own trie and the global trie, the longer match wins."""

    name = "suffix"
    timed = False       # trie walks: tens of microseconds per row, not a model pass
    has_probs = False   # deterministic drafts: one-hot q

    def __init__(self, global_nodes: int = GLOBAL_NODES):
        self.global_trie = SuffixTrie()
        self.global_nodes = global_nodes
        self._outputs: OrderedDict[int, list[int]] = OrderedDict()  # in the global trie, oldest first
        self._added = 0
        self._rows: dict[str, _RowState] = {}
        self._offered: dict[str, list[int]] = {}
        self._counts = {"lookups": 0, "global_hits": 0, "own_hits": 0, "evicted_outputs": 0}

    def stats(self) -> dict[str, int]:
        """For /metrics: the global trie's size now, and counters since start ("_total")."""
        return {"global_nodes": self.global_trie.num_nodes, "global_outputs": len(self._outputs),
                **{f"{name}_total": n for name, n in self._counts.items()}}

    def offer(self, rows: Sequence, budgets: Sequence[int]) -> list[Offer]:
        offers, self._offered = [], {}
        for req, budget in zip(rows, budgets):
            tokens, key = self._lookup(self._state(req), budget)
            self._offered[req.request_id] = tokens
            offers.append(Offer(len(tokens), 0, key))
        return offers

    def prepare(self, rows: Sequence) -> int:
        return 0

    def draft(self, rows: Sequence, ks: Sequence[int]) -> list[tuple[list[int], None]]:
        return [(self._offered.get(r.request_id, [])[:k], None) for r, k in zip(rows, ks)]

    def rollback(self, req) -> None:
        """Nothing to undo: the tries only ever hold committed tokens."""

    def forget(self, request_id: str) -> None:
        """The request's output joins the global trie (then the oldest outputs leave it
        while it is over budget); its own trie is dropped."""
        state = self._rows.pop(request_id, None)
        self._offered.pop(request_id, None)
        if state is None or not state.req.output_ids:
            return
        output = list(state.req.output_ids)
        self.global_trie.add(output)
        self._outputs[self._added] = output
        self._added += 1
        while self.global_trie.num_nodes > self.global_nodes and self._outputs:
            _, old = self._outputs.popitem(last=False)
            self.global_trie.add(old, delta=-1)
            self._counts["evicted_outputs"] += 1

    def _state(self, req) -> _RowState:
        """The row's state, extended with the tokens committed since its last offer."""
        state = self._rows.get(req.request_id)
        tokens = req.all_ids
        if state is None or len(tokens) < state.seen:  # new, or its history shrank: rebuild
            state = self._rows[req.request_id] = _RowState(req, self.global_trie)
        for t in tokens[state.seen:]:
            state.own.extend(t)
            state.shared = self.global_trie.follow(state.shared, t)
        state.seen = len(tokens)
        return state

    def _lookup(self, state: _RowState, budget: int) -> tuple[list[int], int]:
        if budget <= 0:
            return [], 0
        self._counts["lookups"] += 1
        own, own_len = state.own.continuation(budget)
        shared_frontier = [n for n in state.shared if n is self.global_trie.root or n.count > 0]
        shared, shared_len = continuation(shared_frontier, budget)
        if shared_len > own_len and shared:
            self._counts["global_hits"] += 1
            return shared, GLOBAL_KEY + shared_len
        if own:
            self._counts["own_hits"] += 1
        return own, own_len
