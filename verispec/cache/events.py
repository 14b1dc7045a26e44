"""Block keys: names for cached prefixes that another process can compute, and the log of
which ones a prefix cache gained and lost.

A block key names a whole prefix, as a radix-tree path does: the key of block j is a hash
chained over the key of block j - 1 and block j's token ids,

    tokens:  | block 0 | block 1 | block 2 | tail (< block_size, never cached) |
    keys:      k0=H(0,b0) k1=H(k0,b1) k2=H(k1,b2)

so two sequences share key j exactly when they share their first j + 1 blocks. A router
that tokenizes a request the way the server does computes the same keys as the cache that
holds it, and the longest run of a request's leading keys a replica's cache holds is the
prefix that replica would serve from its cache.

H is CPython's tuple hash: stable across processes of one CPython version (integers are
not salted by PYTHONHASHSEED), which a Ray cluster requires of its nodes anyway.

`CacheEventLog` is the other half: the cache records every block key it stores or evicts,
folded into the net change since the consumer last drained it. A consumer that applies
each `CacheDelta` in order holds exactly the cache's keys. Pending changes are bounded: past
`max_pending` the log gives up and the next drain is a full snapshot instead (`reset`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple


def block_keys(token_ids: Sequence[int], block_size: int, parent: int = 0) -> list[int]:
    """The chained key of every whole block of `token_ids`; `parent` is the key of the
    block before the first (0: they start the sequence)."""
    keys, key = [], parent
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        key = hash((key, tuple(token_ids[start:start + block_size])))
        keys.append(key)
    return keys


class CacheDelta(NamedTuple):
    """What a cache gained and lost since the last drain. With `reset`, `stored` is its
    whole content and everything the consumer held before is gone."""

    stored: list[int]
    removed: list[int]
    reset: bool = False

    def apply(self, held: set[int]) -> None:
        """Bring `held` (the consumer's copy of the cache's keys) up to date."""
        if self.reset:
            held.clear()
        held.difference_update(self.removed)
        held.update(self.stored)


class CacheEventLog:
    """The net block-key changes of one cache since the last `drain` (see the module doc).

    Folding keeps the log as small as the change: a key stored then evicted before a drain
    is reported removed (the consumer may hold it from before), and evicted then stored
    again, stored. The first drain is always a snapshot: the consumer starts from nothing.
    """

    def __init__(self, max_pending: int = 1 << 16):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self._stored: set[int] = set()
        self._removed: set[int] = set()
        self._overflowed = True

    def stored(self, keys: Iterable[int]) -> None:
        self._record(keys, self._stored, self._removed)

    def removed(self, keys: Iterable[int]) -> None:
        self._record(keys, self._removed, self._stored)

    def _record(self, keys: Iterable[int], into: set[int], out_of: set[int]) -> None:
        """The keys' latest state is `into`'s; past max_pending the log gives up until drained."""
        if self._overflowed:
            return
        for k in keys:
            out_of.discard(k)
            into.add(k)
        if len(self._stored) + len(self._removed) > self.max_pending:
            self._overflowed = True
            self._stored.clear()
            self._removed.clear()

    def drain(self, snapshot: Callable[[], list[int]], reset: bool = False) -> CacheDelta:
        """The changes since the last drain, or `snapshot()` (every key the cache holds) as
        a reset when asked (the consumer lost a delta), or when the log overflowed or was
        never drained; then starts a new log."""
        if reset or self._overflowed:
            delta = CacheDelta(snapshot(), [], reset=True)
        else:
            delta = CacheDelta(list(self._stored), list(self._removed))
        self._overflowed = False
        self._stored, self._removed = set(), set()
        return delta
