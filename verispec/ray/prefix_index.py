"""Which replica probably holds which prompt prefix, and where a request should go.

Pure Python (no Ray, no model code), so the routing rule is unit-testable alone;
`verispec/ray/router.py` feeds it Ray's replica set and queue lengths.

The index is approximate on purpose. A replica's radix cache holds token blocks; the
router sees the request's text before any tokenizer does. So a prompt's text is cut into
chunks of `chunk_chars` characters, and chunk i is keyed by a hash chained over chunks
0..i (a key names a whole prefix, as a radix-tree path does):

    text:   | chunk 0 | chunk 1 | chunk 2 | tail (< chunk_chars, ignored) |
    keys:     h0        h1=H(h0,c1)  h2=H(h1,c2)

A replica "holds" a key once a prompt with that prefix was routed to it. Its keys live in
an LRU of at most `max_chunks` entries, a stand-in for the replica's own LRU eviction; a
replica that leaves (dies, is replaced) takes its keys with it. The match of a replica is
the number of leading keys of the request it holds, in characters.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence

Replica = Hashable


@dataclass(frozen=True)
class RoutingRule:
    """When prefix affinity wins over load balance.

    min_match_chars: a shorter match is no reason to prefer a replica (a chat template's
      first line or a one-line system prompt would otherwise pin everything to one).
    max_imbalance: the preferred replica may run at most this many more requests than the
      least loaded one; past it, the request goes to the least loaded (a hot prefix must
      not turn N replicas into one).
    """

    min_match_chars: int = 256
    max_imbalance: int = 4

    def __post_init__(self):
        if self.min_match_chars < 1:
            raise ValueError(f"min_match_chars must be >= 1, got {self.min_match_chars}")
        if self.max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {self.max_imbalance}")


@dataclass(frozen=True)
class Decision:
    """Replicas in order of preference, and why the first one leads.

    reason: "prefix" (longest match, load within max_imbalance), "short_match" (no
    replica matched min_match_chars: least loaded), "imbalanced" (the best match was too
    busy: least loaded)."""

    ranked: list
    reason: str
    matched_chars: int


class PrefixIndex:
    """Per-replica LRU sets of chained chunk hashes (see the module docstring)."""

    def __init__(self, chunk_chars: int = 64, max_chunks: int = 1 << 16, max_text_chars: int = 1 << 15):
        if chunk_chars < 1 or max_chunks < 1 or max_text_chars < chunk_chars:
            raise ValueError("chunk_chars and max_chunks must be >= 1, max_text_chars >= chunk_chars")
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self.max_text_chars = max_text_chars  # a prompt's later text decides nothing: bounded work
        self._keys: dict[Replica, OrderedDict[int, None]] = {}
        self._routed: dict[Replica, int] = {}

    def keys_of(self, text: str) -> list[int]:
        """The chained hash of every whole chunk of text[:max_text_chars]."""
        keys, h, c = [], 0, self.chunk_chars
        for start in range(0, min(len(text), self.max_text_chars) - c + 1, c):
            h = hash((h, text[start:start + c]))
            keys.append(h)
        return keys

    def insert(self, replica: Replica, keys: Sequence[int]) -> None:
        """Record that `replica` was sent a prompt with these keys (most recent last)."""
        held = self._keys.setdefault(replica, OrderedDict())
        for k in keys:
            held[k] = None
            held.move_to_end(k)
        while len(held) > self.max_chunks:
            held.popitem(last=False)
        self._routed[replica] = self._routed.get(replica, 0) + 1

    def matched_chars(self, replica: Replica, keys: Sequence[int]) -> int:
        """Characters of the request's leading chunks that `replica` holds."""
        held = self._keys.get(replica)
        n = 0
        if held:
            for k in keys:
                if k not in held:
                    break
                n += 1
        return n * self.chunk_chars

    def remove(self, replica: Replica) -> None:
        self._keys.pop(replica, None)
        self._routed.pop(replica, None)

    def retain(self, replicas) -> None:
        """Forget every replica not in `replicas`."""
        for gone in set(self._keys) - set(replicas):
            self.remove(gone)

    def footprint(self, replica: Replica) -> tuple[int, int]:
        """(chunks held, requests routed): the tie-break between equally loaded replicas."""
        return len(self._keys.get(replica, ())), self._routed.get(replica, 0)

    def decide(self, keys: Sequence[int], loads: dict, rule: RoutingRule) -> Decision:
        """Rank the replicas of `loads` (replica -> requests in flight) for a request."""
        if not loads:
            return Decision([], "short_match", 0)
        salt = {r: random.random() for r in loads}
        by_load = sorted(loads, key=lambda r: (loads[r], self.footprint(r), salt[r]))
        matched = {r: self.matched_chars(r, keys) for r in loads}
        best = max(by_load, key=lambda r: matched[r])  # max keeps the least loaded of equals
        if matched[best] < rule.min_match_chars:
            return Decision(by_load, "short_match", matched[best])
        if loads[best] - loads[by_load[0]] > rule.max_imbalance:
            return Decision(by_load, "imbalanced", matched[best])
        return Decision([best] + [r for r in by_load if r != best], "prefix", matched[best])
