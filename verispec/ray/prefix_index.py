"""Which replica holds which prompt prefix in its KV cache, and where a request should go.

Pure Python (no Ray, no model code), so the routing rule is unit-testable alone;
`verispec/ray/router.py` feeds it Ray's replica set, queue lengths and routing stats.

Prefixes are named by block keys (`verispec/cache/events.py`): a hash chained over the
token ids of every whole KV block, so key j names the first j + 1 blocks. The front door
tokenizes each request as the replicas will and sends its keys with it. Each replica's
radix cache logs the keys it stores and evicts; the replica keeps the set they add up to
and publishes it as its Ray Serve routing stats (`ReplicaServer.record_routing_stats`),
which reach the router about once a second. A replica's match for a request is the run of
the request's leading keys it holds, in tokens: the prefix its cache would serve.

Between two reports the router also counts the prompts it has just sent to a replica
(`note_routed`): their blocks are cached there a step or two later, and a burst of
requests sharing a new prefix should not scatter before the next report says so. Such a
note lasts `routed_ttl_s`; a replica's own report is the truth about everything else,
evictions included.
"""
from __future__ import annotations

import random
import time
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

Replica = Hashable


@dataclass(frozen=True)
class RoutingRule:
    """When prefix affinity wins over load balance.

    min_match_tokens: a shorter match is no reason to prefer a replica (a chat template's
      header or a one-line system prompt would otherwise pin everything to one).
    max_imbalance: the preferred replica may run at most this many more requests than the
      least loaded one; past it, the request goes to the least loaded (a hot prefix must
      not turn N replicas into one).
    """

    min_match_tokens: int = 64
    max_imbalance: int = 4

    def __post_init__(self):
        if self.min_match_tokens < 1:
            raise ValueError(f"min_match_tokens must be >= 1, got {self.min_match_tokens}")
        if self.max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {self.max_imbalance}")


@dataclass(frozen=True)
class Decision:
    """Replicas in order of preference, and why the first one leads.

    reason: "prefix" (longest match, load within max_imbalance), "short_match" (no
    replica matched min_match_tokens: least loaded), "imbalanced" (the best match was too
    busy: least loaded)."""

    ranked: list
    reason: str
    matched_tokens: int


class PrefixIndex:
    """Per replica: the block keys its cache reported, and those of prompts just sent."""

    def __init__(self, routed_ttl_s: float = 10.0, max_routed_keys: int = 1 << 16):
        if routed_ttl_s <= 0 or max_routed_keys < 1:
            raise ValueError("routed_ttl_s must be > 0 and max_routed_keys >= 1")
        self.routed_ttl_s = routed_ttl_s
        self.max_routed_keys = max_routed_keys
        self._cached: dict[Replica, frozenset[int]] = {}
        self._versions: dict[Replica, object] = {}
        self._routed: dict[Replica, OrderedDict[int, float]] = {}   # key -> when, oldest first
        self._requests: Counter = Counter()

    def version(self, replica: Replica):
        """The version of the last report applied for `replica` (None: none yet)."""
        return self._versions.get(replica)

    def update_cached(self, replica: Replica, version, keys: Iterable[int]) -> None:
        """Replace what `replica` holds with its report `keys`, tagged `version`."""
        self._cached[replica] = frozenset(keys)
        self._versions[replica] = version

    def note_routed(self, replica: Replica, keys: Sequence[int], now: float | None = None) -> None:
        """`replica` was just sent a prompt with these keys."""
        now = time.monotonic() if now is None else now
        routed = self._routed.setdefault(replica, OrderedDict())
        for k in keys:
            routed[k] = now
            routed.move_to_end(k)
        while len(routed) > self.max_routed_keys:
            routed.popitem(last=False)
        self._requests[replica] += 1

    def _expire(self, replica: Replica, now: float) -> OrderedDict:
        routed = self._routed.get(replica, OrderedDict())
        while routed and now - next(iter(routed.values())) > self.routed_ttl_s:
            routed.popitem(last=False)
        return routed

    def matched_blocks(self, replica: Replica, keys: Sequence[int], now: float | None = None) -> int:
        """How many of the request's leading blocks `replica` holds or was just sent."""
        routed = self._expire(replica, time.monotonic() if now is None else now)
        cached = self._cached.get(replica, frozenset())
        n = 0
        for k in keys:
            if k not in cached and k not in routed:
                break
            n += 1
        return n

    def remove(self, replica: Replica) -> None:
        for table in (self._cached, self._versions, self._routed, self._requests):
            table.pop(replica, None)

    def retain(self, replicas) -> None:
        """Forget every replica not in `replicas`."""
        for gone in (set(self._cached) | set(self._routed)) - set(replicas):
            self.remove(gone)

    def footprint(self, replica: Replica) -> tuple[int, int]:
        """(blocks known held, requests routed): the tie-break between equally loaded replicas."""
        return len(self._cached.get(replica, ())) + len(self._routed.get(replica, ())), self._requests[replica]

    def decide(self, keys: Sequence[int], block_size: int, loads: dict, rule: RoutingRule,
               now: float | None = None) -> Decision:
        """Rank the replicas of `loads` (replica -> requests in flight) for a request whose
        prompt has these block keys."""
        if not loads:
            return Decision([], "short_match", 0)
        now = time.monotonic() if now is None else now
        matched = {r: self.matched_blocks(r, keys, now) * block_size for r in loads}  # expires old notes first
        salt = {r: random.random() for r in loads}
        by_load = sorted(loads, key=lambda r: (loads[r], self.footprint(r), salt[r]))
        best = max(by_load, key=lambda r: matched[r])  # max keeps the least loaded of equals
        if matched[best] < rule.min_match_tokens:
            return Decision(by_load, "short_match", matched[best])
        if loads[best] - loads[by_load[0]] > rule.max_imbalance:
            return Decision(by_load, "imbalanced", matched[best])
        return Decision([best] + [r for r in by_load if r != best], "prefix", matched[best])


# A replica's routing stats (Ray Serve `record_routing_stats`): {STATS_KEY: {"version": n,
# "keys": packed}}; the version changes whenever the key set does, so the router unpacks
# each report once.
STATS_KEY = "verispec_prefix_cache"


def pack_keys(keys: Iterable[int]) -> bytes:
    return array("q", keys).tobytes()


def unpack_keys(packed: bytes) -> list[int]:
    keys = array("q")
    keys.frombytes(packed)
    return keys.tolist()


class CacheReport:
    """A replica's copy of its prefix cache's block keys, kept from the cache's drained
    events, and the routing stats that report it (packed once per change).

    A drain whose answer never arrived (a timed-out call the core still ran) lost a delta:
    `lost()` makes the next drain a snapshot (`resync`)."""

    def __init__(self):
        self.keys: set[int] = set()
        self.version = 0               # bumped whenever `keys` changes
        self.resync = False            # the next drain must be a snapshot
        self._packed = pack_keys(())

    def lost(self) -> None:
        self.resync = True

    def apply(self, delta) -> None:
        """Take in a drained CacheDelta (verispec/cache/events.py)."""
        before = set(self.keys)
        delta.apply(self.keys)
        self.resync = False
        if self.keys != before:
            self.version += 1
            self._packed = pack_keys(self.keys)

    def stats(self, replica: str) -> dict:
        return {STATS_KEY: {"replica": replica, "version": self.version, "keys": self._packed}}
