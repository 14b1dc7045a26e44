"""RadixCache: a radix tree over token ids whose edges are whole KV blocks.

Each node holds a run of full blocks: `key` is their token ids (len(blocks) * block_size of
them) and `blocks` their block ids, so a path from the root spells a cached prefix. Children
are keyed by the token ids of their first block, which makes lookup one dict probe per node.

    root
     └─ [A B | C D] blocks (7, 3)        a shared few-shot prefix, 2 blocks of 2 tokens
         ├─ [E F]   blocks (9,)          request 1 continued with E F
         └─ [E G | H I] blocks (4, 5)    request 2 continued with E G H I

Matching [A B C D E G] walks the root's child, then the [E G ...] child, and stops after one
of its two blocks: that node is split at the block boundary ([E G] above [H I]) so the match
ends exactly on a node, the handle a sequence locks. A split keeps the deeper half in the
original node object, so handles held by running sequences stay valid.

Only the KV manager inserts, and only full blocks of committed positions: unverified draft
tokens live in the manager's per-sequence provisional tier (see manager.py) and can never
reach this tree, whose contents every other request trusts.

A node also records whether its blocks hold the DRAFT model's KV for its tokens (`draft`):
the draft model shares the target's slots but fills them lazily, only when a request first
drafts, so a cached block may hold target KV alone. `match_prefix` reports how many leading
tokens of the match have draft KV too; the rest the draft model recomputes (into the same
shared slots: the same tokens at the same positions give the same KV, so a rewrite never
changes what another reader of the block trusts).

Eviction takes least-recently-used unlocked leaves and trims them from the tail, block by
block, so it frees exactly what is asked when enough is evictable. Recency is a counter
bumped by every match and insert, which keeps eviction order deterministic.

Every block also carries its block key (`verispec/cache/events.py`: a hash chained over the
path's token ids), and the tree logs the keys it stores and evicts in `events`: how a
replica tells a request router which prefixes it holds (`drain_events`).
"""
from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

from verispec.cache.events import CacheDelta, CacheEventLog, block_keys
from verispec.cache.kv_pool import BlockPool, _ensure
from verispec.cache.prefix import PrefixCache, PrefixMatch


class RadixNode:
    """One run of full blocks in the tree; also the handle that lock/unlock take."""

    __slots__ = ("key", "blocks", "hashes", "children", "parent", "lock_ref", "last_access", "draft")

    def __init__(self, key: tuple[int, ...], blocks: list[int], parent: RadixNode | None,
                 last_access: int, hashes: list[int] | None = None):
        self.key = key
        self.blocks = blocks
        self.hashes = hashes if hashes is not None else []  # the block key of each block
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0  # locks held on this node or any descendant
        self.last_access = last_access
        self.draft = False  # its blocks hold the draft model's KV too

    def __repr__(self) -> str:
        return (f"RadixNode(blocks={self.blocks}, lock_ref={self.lock_ref}, "
                f"children={len(self.children)})")


class RadixCache(PrefixCache):
    """Block-granular radix prefix cache with locking and LRU eviction."""

    def __init__(self, pool: BlockPool):
        super().__init__(pool)
        self.root = RadixNode((), [], None, 0)
        self._held: set[int] = set()
        self._num_evictable = 0
        self._clock = 0
        self.events = CacheEventLog()

    # --- lookup and insertion -------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of `token_ids`, in whole blocks (marks it recently used)."""
        bs = self.block_size
        tokens = tuple(token_ids[:len(token_ids) - len(token_ids) % bs])
        now = self._tick()
        node, pos, blocks, draft_tokens = self.root, 0, [], 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos:pos + bs])
            if child is None:
                break
            matched = self._common_blocks(child.key, tokens, pos)
            if matched < len(child.blocks):
                child = self._split(child, matched)
            child.last_access = now
            blocks.extend(child.blocks)
            if child.draft and draft_tokens == pos:
                draft_tokens += matched * bs
            pos += matched * bs
            node = child
        return PrefixMatch(blocks, pos, None if node is self.root else node, draft_tokens)

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int], draft_tokens: int = 0) -> int:
        """Cache `blocks` as the KV of `token_ids`; returns how many tokens were cached already.

        The caller's blocks hold the draft model's KV for their first `draft_tokens` tokens:
        the whole blocks among those are marked so, on new nodes and on nodes that already
        hold these very blocks (the caller's shared prefix, whose draft KV it computed).
        """
        bs = self.block_size
        if len(token_ids) != len(blocks) * bs:
            raise ValueError(f"token_ids must be exactly len(blocks) * block_size = "
                             f"{len(blocks) * bs} long (full blocks only), got {len(token_ids)}")
        tokens = tuple(token_ids)
        draft_blocks = min(draft_tokens // bs, len(blocks))
        now = self._tick()
        node, done = self.root, 0  # done: blocks of the path already in the tree
        while done < len(blocks):
            child = node.children.get(tokens[done * bs:(done + 1) * bs])
            if child is None:
                self._add_leaf(node, tokens[done * bs:], list(blocks[done:]), now, draft_blocks - done)
                break
            matched = self._common_blocks(child.key, tokens, done * bs)
            if matched < len(child.blocks):
                child = self._split(child, matched)
            if not child.draft and done < draft_blocks and child.blocks == list(blocks[done:done + matched]):
                if done + matched > draft_blocks:
                    matched = draft_blocks - done
                    child = self._split(child, matched)
                child.draft = True
            child.last_access = now
            node, done = child, done + matched
        return done * bs

    def _common_blocks(self, key: tuple[int, ...], tokens: tuple[int, ...], pos: int) -> int:
        """How many whole blocks of `key` equal tokens[pos:] (at least 1 for a found child)."""
        bs = self.block_size
        n = 0
        while ((n + 1) * bs <= len(key) and pos + (n + 1) * bs <= len(tokens)
               and key[n * bs:(n + 1) * bs] == tokens[pos + n * bs:pos + (n + 1) * bs]):
            n += 1
        return n

    def _split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Cut `node` after `num_blocks` blocks; returns the new upper half."""
        bs = self.block_size
        upper = RadixNode(node.key[:num_blocks * bs], node.blocks[:num_blocks], node.parent,
                          node.last_access, node.hashes[:num_blocks])
        # Every lock below or on `node` also pins the new upper half.
        upper.lock_ref = node.lock_ref
        upper.draft = node.draft
        node.parent.children[upper.key[:bs]] = upper
        node.key = node.key[num_blocks * bs:]
        node.blocks = node.blocks[num_blocks:]
        node.hashes = node.hashes[num_blocks:]
        node.parent = upper
        upper.children[node.key[:bs]] = node
        return upper

    def _add_leaf(self, parent: RadixNode, key: tuple[int, ...], blocks: list[int],
                  now: int, draft_blocks: int) -> None:
        """A new leaf; its first `draft_blocks` blocks (if any) marked as holding draft KV."""
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks {blocks} repeat a block id")
        for block in blocks:
            if block in self._held:
                raise ValueError(f"block {block} is already cached under another prefix")
        for block in blocks:
            self.pool.incref(block)
        self._held.update(blocks)
        self._num_evictable += len(blocks)
        hashes = block_keys(key, self.block_size, parent.hashes[-1] if parent.hashes else 0)
        leaf = RadixNode(key, blocks, parent, now, hashes)
        self.events.stored(hashes)
        parent.children[key[:self.block_size]] = leaf
        if draft_blocks > 0:
            (self._split(leaf, draft_blocks) if draft_blocks < len(blocks) else leaf).draft = True

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # --- locking and eviction -------------------------------------------------------------

    def lock(self, node: RadixNode | None) -> None:
        """Pin `node` and its ancestors: in use, not evictable."""
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._num_evictable -= len(node.blocks)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode | None) -> None:
        """Undo one `lock(node)`."""
        if node is not None and node is not self.root and node.lock_ref < 1:
            raise ValueError(f"unlock of {node!r}, which is not locked")
        while node is not None and node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_evictable += len(node.blocks)
            node = node.parent

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` unlocked blocks, least recently used leaves first."""
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an integer >= 0, got {num_blocks!r}")
        order = itertools.count()
        heap = [(leaf.last_access, next(order), leaf) for leaf in self._unlocked_leaves()]
        heapq.heapify(heap)
        freed = 0
        while freed < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            first_block_key = leaf.key[:self.block_size]
            take = min(len(leaf.blocks), num_blocks - freed)
            dropped = leaf.blocks[len(leaf.blocks) - take:]
            self.events.removed(leaf.hashes[len(leaf.blocks) - take:])
            leaf.blocks = leaf.blocks[:len(leaf.blocks) - take]
            leaf.hashes = leaf.hashes[:len(leaf.blocks)]
            leaf.key = leaf.key[:len(leaf.blocks) * self.block_size]
            self._num_evictable -= take
            for block in dropped:
                self._held.discard(block)
                freed += self.pool.decref(block)
            if not leaf.blocks:
                parent = leaf.parent
                del parent.children[first_block_key]
                leaf.parent = None
                if parent is not self.root and not parent.children and parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access, next(order), parent))
        return freed

    def _unlocked_leaves(self) -> Iterator[RadixNode]:
        for node in self._nodes():
            if not node.children and node.lock_ref == 0:
                yield node

    def _nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # --- accounting -----------------------------------------------------------------------

    def path_blocks(self, node: RadixNode | None) -> list[int]:
        """The blocks from the root down to `node`, in position order."""
        runs = []
        while node is not None and node is not self.root:
            runs.append(node.blocks)
            node = node.parent
        return [block for run in reversed(runs) for block in run]

    def cached_blocks(self) -> set[int]:
        """Every block the tree holds a reference on."""
        return set(self._held)

    def all_block_keys(self) -> list[int]:
        """The block key of every cached block."""
        return [h for node in self._nodes() for h in node.hashes]

    def drain_events(self, reset: bool = False) -> CacheDelta:
        return self.events.drain(self.all_block_keys, reset)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._held)

    @property
    def num_evictable_blocks(self) -> int:
        return self._num_evictable

    def check_integrity(self, locked_nodes: Iterable[RadixNode | None] | None = None) -> None:
        """Raise AssertionError unless keys, blocks, links and lock counts are consistent."""
        bs = self.block_size
        _ensure(not self.root.key and not self.root.blocks and self.root.lock_ref == 0,
                "the root holds tokens, blocks or locks")
        seen: set[int] = set()
        evictable = 0
        for node in [self.root, *self._nodes()]:
            for first, child in node.children.items():
                _ensure(child.parent is node, f"{child!r} does not point back to its parent")
                _ensure(len(first) == bs and child.key[:bs] == first,
                        f"{child!r} is filed under the wrong first block")
            if node is self.root:
                continue  # the root is never locked nor evicted
            _ensure(node.lock_ref >= sum(c.lock_ref for c in node.children.values()),
                    f"{node!r} has fewer locks than its children")
            _ensure(len(node.blocks) >= 1 and len(node.key) == len(node.blocks) * bs,
                    f"{node!r} has {len(node.key)} tokens for {len(node.blocks)} blocks")
            parent_key = node.parent.hashes[-1] if node.parent.hashes else 0
            _ensure(node.hashes == block_keys(node.key, bs, parent_key),
                    f"{node!r} has block keys that do not chain its path's tokens")
            for block in node.blocks:
                _ensure(block not in seen, f"block {block} appears twice in the tree")
                _ensure(self.pool.ref_count(block) >= 1, f"cached block {block} is free")
                seen.add(block)
            if node.lock_ref == 0:
                evictable += len(node.blocks)
        _ensure(seen == self._held, "the held-block set disagrees with the tree")
        _ensure(evictable == self._num_evictable,
                f"evictable count {self._num_evictable} != {evictable} unlocked blocks")
        if locked_nodes is not None:
            self._check_locks(locked_nodes)

    def _check_locks(self, locked_nodes: Iterable[RadixNode | None]) -> None:
        expected: Counter[int] = Counter()
        for node in locked_nodes:
            while node is not None and node is not self.root:
                expected[id(node)] += 1
                _ensure(node.parent is not None, f"locked {node!r} is no longer in the tree")
                node = node.parent
        for node in self._nodes():
            _ensure(node.lock_ref == expected.pop(id(node), 0),
                    f"{node!r} lock count disagrees with the holders' locks")
        _ensure(not expected, "a locked node is no longer in the tree")
