"""The prefix-cache interface, and the trivial cache that shares nothing.

A prefix cache maps token-id prefixes to KV blocks that already hold their keys and values,
so a new request skips recomputing them. Sharing is at block granularity: only full blocks
of committed (verified) tokens are ever inserted, and a shared block is read-only, so no two
sequences ever write the same block.

Holding rules, which `KVCacheManager` relies on:
- `insert` takes one pool reference on every block the cache newly holds; `evict` drops it.
- A node returned by `match_prefix` is a handle: `lock(node)` pins the node and its
  ancestors (in use by a running sequence, not evictable) until `unlock(node)`. Handles stay
  valid while locked, even when later matches split the tree around them.
- Only unlocked blocks are evictable, and each holds exactly the cache's one reference, so
  evicting it frees it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from verispec.cache.events import CacheDelta
from verispec.cache.kv_pool import BlockPool


class PrefixMatch(NamedTuple):
    """The longest cached block-aligned prefix of a query.

    blocks: the cached blocks, one per `block_size` tokens of the prefix.
    num_tokens: len(blocks) * block_size.
    node: handle for lock/unlock (None when nothing matched in a cache without nodes).
    draft_tokens: leading tokens of the prefix whose blocks hold the draft model's KV too.
    """

    blocks: list[int]
    num_tokens: int
    node: object | None
    draft_tokens: int = 0


class PrefixCache(ABC):
    """A cache of committed KV blocks keyed by token-id prefixes."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of `token_ids`, in whole blocks (marks it recently used)."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], blocks: Sequence[int], draft_tokens: int = 0) -> int:
        """Cache `blocks` as the KV of `token_ids` (full blocks only); the blocks hold the
        draft model's KV for their first `draft_tokens` tokens.

        Returns how many leading tokens were already cached: for those the cache keeps its
        own blocks and the caller's are duplicates, which the caller drops.
        """

    @abstractmethod
    def lock(self, node: object | None) -> None:
        """Pin `node` and its ancestors: in use, not evictable."""

    @abstractmethod
    def unlock(self, node: object | None) -> None:
        """Undo one `lock(node)`."""

    @abstractmethod
    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` unlocked blocks, least recently used leaves first."""

    @abstractmethod
    def path_blocks(self, node: object | None) -> list[int]:
        """The blocks from the root down to `node`, in position order."""

    @abstractmethod
    def cached_blocks(self) -> set[int]:
        """Every block the cache holds a reference on."""

    @abstractmethod
    def drain_events(self, reset: bool = False) -> CacheDelta:
        """The block keys (verispec/cache/events.py) stored and evicted since the last call;
        with `reset`, all the keys held, as a snapshot."""

    @property
    @abstractmethod
    def num_cached_blocks(self) -> int:
        """Blocks the cache holds a reference on."""

    @property
    @abstractmethod
    def num_evictable_blocks(self) -> int:
        """Cached blocks no running sequence has locked."""

    @abstractmethod
    def check_integrity(self, locked_nodes: Iterable[object] | None = None) -> None:
        """Raise AssertionError unless the cache is consistent.

        locked_nodes: when given, one entry per outstanding lock() call, and the lock counts
        must match them exactly.
        """


class NoPrefixCache(PrefixCache):
    """A prefix cache that caches nothing: every request computes its whole prompt."""

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        return PrefixMatch([], 0, None)

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int], draft_tokens: int = 0) -> int:
        if len(token_ids) != len(blocks) * self.block_size:
            raise ValueError(f"token_ids must be exactly len(blocks) * block_size = "
                             f"{len(blocks) * self.block_size} long, got {len(token_ids)}")
        return 0

    def lock(self, node: object | None) -> None:
        pass

    def unlock(self, node: object | None) -> None:
        pass

    def evict(self, num_blocks: int) -> int:
        return 0

    def path_blocks(self, node: object | None) -> list[int]:
        return []

    def cached_blocks(self) -> set[int]:
        return set()

    def drain_events(self, reset: bool = False) -> CacheDelta:
        return CacheDelta([], [], reset=True)

    @property
    def num_cached_blocks(self) -> int:
        return 0

    @property
    def num_evictable_blocks(self) -> int:
        return 0

    def check_integrity(self, locked_nodes: Iterable[object] | None = None) -> None:
        if locked_nodes is not None and any(n is not None for n in locked_nodes):
            raise AssertionError("NoPrefixCache hands out no nodes, yet one is locked")
