"""KVCacheManager: block tables, the prefix cache and the provisional tier, for the engine.

The engine owns the KV tensors (target and draft, one slot space); this class decides which
slots each sequence's positions use. Position p of a sequence lives in slot
block_table[p // block_size] * block_size + p % block_size.

Two tiers of KV:
- committed: positions < num_committed hold the KV of verified tokens. Their full blocks may
  be published in the prefix tree (cache_sequence), where other requests read them.
- provisional: KV written for draft tokens the target has not verified yet. It is tracked
  per sequence and never reaches the tree: match_prefix cannot return it, insert never sees
  it, and cache_sequence refuses tokens past num_committed.

One speculative round, per sequence, in the only safe order:

    allocate_slots -> insert_provisional -> (verify forward) -> commit_provisional
                   -> evict_provisional

(commit(s, base_len), which covers only the round's verified inputs, may come anywhere
between insert_provisional and commit_provisional; a plain decode row with no drafts just
calls allocate_slots and commit.)

Example: block_size 4; before the round the sequence knows 10 tokens t0..t9 and
num_committed = 9 (t9 was just sampled, its KV not yet written). The row feeds t9 plus k = 5
drafts d1..d5 at positions 9..14 (allocate_slots(s, 9, 15), base_len = 10), and the
rejection sampler accepts accepted_len = 2 of them.

    position   0  1  2  3 | 4  5  6  7 | 8  9 10 11 | 12 13 14 15 | 16 ...
    block      b0         | b1         | b2         | b3          |
    token      t0 t1 t2 t3| t4 t5 t6 t7| t8 t9 d1 d2| d3 d4 d5  - |
    range      c  c  c  c | c  c  c  c | c  p  a  a | r  r  r  u  | free

    range  indices                      KV holds            commit_provisional   evict_provisional
    c      [0, num_committed)           verified tokens     committed            kept
    p      [num_committed, base_len)    t9, this round      committed (final)    kept
    a      [base_len, base_len + acc)   accepted drafts     committed            kept
    r      [base_len + acc, base_len+k) rejected drafts     stale, uncommitted   block freed unless
    u      [base_len + k, table end)    nothing yet         stale                it holds c/p/a too
    free   [table end, ...)             not this sequence's -                    -

    (acc = accepted_len; the commit_provisional and evict_provisional columns show each range
    after that call)

After commit_provisional(s, 2), num_committed = 12; evict_provisional frees every block past
the one holding position 11 (here b3) at once. Had 3 drafts been accepted, b3 would stay
(position 12 committed) and its stale tail 13..15 would simply be overwritten later.

Why this order and no other:
1. allocate_slots first: it is the only step that can fail (OutOfBlocks), and it fails
   before any KV is written, with nothing to undo. Every slot the draft and target forwards
   write then belongs to this sequence alone.
2. insert_provisional before the verify forward: from then on the manager knows which
   positions hold unverified KV, so a preemption or cancellation mid-round discards them
   (evict_provisional with nothing accepted) instead of mistaking them for committed KV.
3. commit_provisional after the verify forward: only the rejection sampler knows
   accepted_len. Committing earlier, or committing all k drafts, makes rejected KV look
   verified; cache_sequence would then publish it in the tree and every later request with
   that prefix would silently read wrong keys and values.
4. evict_provisional right after commit_provisional, before any sequence allocates again:
   evicting earlier would free accepted KV, or free blocks the verify forward still reads
   (the allocator could hand them to another sequence mid-forward). Evicting later leaves
   dead blocks counted as used when the scheduler sizes the next step. Eviction truncates
   the block table and drops the references in one step, so a block is never both in a
   table and on the free list: the use-after-free that silently corrupts another sequence.

The draft model's KV shares the target's slots but is filled lazily (when a request first
drafts), so it is tracked apart: open_sequence records how many leading prompt tokens the
cached blocks hold draft KV for (`cached_draft_tokens`), and cache_sequence takes how many
the sequence has written and returns how many stay valid once it switches to the tree's
copies of its blocks.

Block accounting: cached = blocks held by the tree (locked or not), in use = blocks held only
by sequences, free = on the free list; check_integrity() verifies they sum to the total.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Union

from verispec.cache.kv_pool import BlockPool, OutOfBlocks, _ensure, slots_for
from verispec.cache.prefix import NoPrefixCache, PrefixCache
from verispec.cache.radix import RadixCache

SeqId = Union[int, str]

__all__ = ["KVCacheManager", "OutOfBlocks", "ProvisionalRun", "SeqId"]


class ProvisionalRun(NamedTuple):
    """Draft tokens of one speculative round, not yet (or just) verified."""

    base_len: int                # position of the first draft token
    tokens: tuple[int, ...]      # draft token ids, at positions base_len, base_len + 1, ...
    slots: tuple[int, ...]       # their KV slots
    accepted_len: int | None     # None until commit_provisional


@dataclass
class _SequenceState:
    block_table: list[int]
    num_committed: int
    node: object | None          # deepest locked prefix-tree node (None: nothing shared)
    num_shared_blocks: int       # leading blocks of block_table held by the tree
    provisional: ProvisionalRun | None = None
    draft_tokens: int = 0        # leading positions of the shared blocks marked as holding draft KV


class KVCacheManager:
    """Per-sequence block tables over a shared block pool, with prefix sharing."""

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True):
        if not isinstance(prefix_cache, bool):
            raise ValueError(f"prefix_cache must be True or False, got {prefix_cache!r}")
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.prefix_cache: PrefixCache = (RadixCache(self.pool) if prefix_cache
                                          else NoPrefixCache(self.pool))
        self._seqs: dict[SeqId, _SequenceState] = {}
        self.hit_tokens = 0    # prompt tokens served from the prefix cache
        self.query_tokens = 0  # prompt tokens looked up

    # --- sequence lifecycle ---------------------------------------------------------------

    def open_sequence(self, seq_id: SeqId, prompt_ids: Sequence[int]) -> int:
        """Start a sequence; returns how many prompt tokens already have cached KV."""
        if not isinstance(seq_id, (int, str)) or isinstance(seq_id, bool):
            raise ValueError(f"seq_id must be an int or a str, got {seq_id!r}")
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already open")
        if len(prompt_ids) < 1:
            raise ValueError("prompt_ids must hold at least 1 token, got 0")
        # Leave the last prompt token out of the match: the engine needs its logits, so at
        # least one token is always computed.
        match = self.prefix_cache.match_prefix(prompt_ids[:-1])
        self.prefix_cache.lock(match.node)
        for block in match.blocks:
            self.pool.incref(block)
        self._seqs[seq_id] = _SequenceState(list(match.blocks), match.num_tokens, match.node,
                                            len(match.blocks), draft_tokens=match.draft_tokens)
        self.hit_tokens += match.num_tokens
        self.query_tokens += len(prompt_ids)
        return match.num_tokens

    def cached_draft_tokens(self, seq_id: SeqId) -> int:
        """How many leading tokens of the sequence's shared blocks hold draft-model KV (at
        open: of the prefix it matched)."""
        return self._state(seq_id).draft_tokens

    def cache_sequence(self, seq_id: SeqId, token_ids: Sequence[int], draft_tokens: int = 0) -> int:
        """Publish the full blocks of `token_ids` (committed positions only) in the prefix tree.

        The sequence keeps using them. Where the tree already had a block for the same
        tokens, the sequence switches to the tree's and its own duplicate is dropped.
        The sequence's blocks hold draft-model KV for its first `draft_tokens` positions;
        returns how many leading positions still do after the switch (a tree block may
        hold target KV only).
        """
        state = self._state(seq_id)
        self._require_no_round(seq_id, state, "cache_sequence")
        if len(token_ids) > state.num_committed:
            raise ValueError(f"token_ids must cover only committed positions: got "
                             f"{len(token_ids)} tokens, sequence {seq_id!r} has "
                             f"{state.num_committed} committed")
        num_full = len(token_ids) // self.block_size
        own = min(draft_tokens, num_full * self.block_size) // self.block_size * self.block_size
        if num_full <= state.num_shared_blocks and own <= state.draft_tokens:
            return draft_tokens
        prefix = token_ids[:num_full * self.block_size]
        self.prefix_cache.insert(prefix, state.block_table[:num_full], draft_tokens)
        match = self.prefix_cache.match_prefix(prefix)
        for i, cached in enumerate(match.blocks):
            if state.block_table[i] != cached:
                self.pool.incref(cached)
                self.pool.decref(state.block_table[i])
                state.block_table[i] = cached
        self.prefix_cache.lock(match.node)  # lock the new path before letting go of the old
        self.prefix_cache.unlock(state.node)
        state.node, state.num_shared_blocks = match.node, len(match.blocks)
        state.draft_tokens = match.draft_tokens
        # The insert marked every whole block of the sequence's own draft KV; a shorter
        # marked run means a block of it is now the tree's copy, without draft KV.
        return draft_tokens if match.draft_tokens >= own else match.draft_tokens

    def close_sequence(self, seq_id: SeqId, token_ids: Sequence[int] | None = None,
                       draft_tokens: int = 0) -> None:
        """End a sequence: optionally cache its committed full blocks (with draft-model KV
        for the first `draft_tokens`), then release it."""
        state = self._state(seq_id)
        self.evict_provisional(seq_id)
        if token_ids is not None:
            self.cache_sequence(seq_id, token_ids, draft_tokens)
        self._release_sequence(seq_id, state)

    def preempt(self, seq_id: SeqId) -> None:
        """Release a sequence for recompute; its tree-held blocks stay cached."""
        state = self._state(seq_id)
        # Provisional blocks go first: they must be off this sequence's table before any
        # block returns to the allocator, or they could be handed out while still listed.
        self.evict_provisional(seq_id)
        self._release_sequence(seq_id, state)

    def _release_sequence(self, seq_id: SeqId, state: _SequenceState) -> None:
        self._release_blocks(state, keep=0)
        self.prefix_cache.unlock(state.node)
        del self._seqs[seq_id]

    def _release_blocks(self, state: _SequenceState, keep: int) -> int:
        """Drop the sequence's blocks past the first `keep`; returns how many were freed."""
        freed = 0
        for block in state.block_table[keep:]:
            freed += self.pool.decref(block)
        del state.block_table[keep:]
        return freed

    # --- slots and committed KV -----------------------------------------------------------

    def allocate_slots(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Cover positions < end with blocks; returns the slots of positions [start, end).

        Evicts least-recently-used unlocked tree blocks when the free list is short. Raises
        OutOfBlocks, changing nothing, when even that is not enough.
        """
        state = self._state(seq_id)
        self._require_no_round(seq_id, state, "allocate_slots")
        shared = state.num_shared_blocks * self.block_size
        if not (isinstance(start, int) and isinstance(end, int) and shared <= start <= end):
            raise ValueError(f"need {shared} <= start <= end (positions below {shared} are in "
                             f"blocks shared through the prefix tree, read-only), got "
                             f"start={start!r}, end={end!r}")
        needed = self.blocks_needed(seq_id, end)
        if not self.can_allocate(needed):
            raise OutOfBlocks(f"sequence {seq_id!r} needs {needed} more blocks, only "
                              f"{self.num_free_blocks} free and {self.num_evictable_blocks} "
                              f"evictable")
        if needed > self.pool.num_free:
            self.prefix_cache.evict(needed - self.pool.num_free)
        state.block_table.extend(self.pool.allocate(needed))
        return slots_for(state.block_table, start, end, self.block_size)

    def commit(self, seq_id: SeqId, num_tokens: int) -> None:
        """Positions < num_tokens now hold verified KV (prefill chunks, plain decode).

        During an undecided draft round it may cover the round's verified inputs (positions
        below base_len) but never a draft: only commit_provisional commits drafts.
        """
        state = self._state(seq_id)
        run = state.provisional
        if run is not None and run.accepted_len is not None:
            raise ValueError(f"commit after sequence {seq_id!r}'s draft round was decided; "
                             f"call evict_provisional first")
        limit = run.base_len if run is not None else len(state.block_table) * self.block_size
        if not (isinstance(num_tokens, int) and state.num_committed <= num_tokens <= limit):
            raise ValueError(f"num_tokens must be in [{state.num_committed}, {limit}] "
                             f"(committed so far, {'first draft' if run else 'allocated'}), "
                             f"got {num_tokens!r}")
        state.num_committed = num_tokens

    # --- provisional tier -----------------------------------------------------------------

    def insert_provisional(self, seq_id: SeqId, tokens: Sequence[int], slots: Sequence[int],
                           base_len: int) -> None:
        """Record draft tokens at positions base_len.. with their slots, as unverified KV."""
        state = self._state(seq_id)
        self._require_no_round(seq_id, state, "insert_provisional")
        if len(tokens) != len(slots):
            raise ValueError(f"tokens and slots must have the same length, got "
                             f"{len(tokens)} and {len(slots)}")
        limit = len(state.block_table) * self.block_size - len(tokens)
        if not (isinstance(base_len, int) and state.num_committed <= base_len <= limit):
            raise ValueError(f"base_len must be in [{state.num_committed}, {limit}] "
                             f"(committed so far, allocated minus {len(tokens)} drafts), "
                             f"got {base_len!r}")
        expected = slots_for(state.block_table, base_len, base_len + len(tokens),
                             self.block_size)
        if list(slots) != expected:
            raise ValueError(f"slots {list(slots)} are not sequence {seq_id!r}'s slots for "
                             f"positions [{base_len}, {base_len + len(tokens)}): {expected}")
        state.provisional = ProvisionalRun(base_len, tuple(tokens), tuple(slots), None)

    def commit_provisional(self, seq_id: SeqId, accepted_len: int) -> None:
        """The first `accepted_len` drafts were accepted: positions < base_len + accepted_len
        are committed."""
        state = self._state(seq_id)
        run = state.provisional
        if run is None or run.accepted_len is not None:
            raise ValueError(f"sequence {seq_id!r} has no unverified draft round; call "
                             f"insert_provisional first")
        if not (isinstance(accepted_len, int) and 0 <= accepted_len <= len(run.tokens)):
            raise ValueError(f"accepted_len must be in [0, {len(run.tokens)}], "
                             f"got {accepted_len!r}")
        state.num_committed = run.base_len + accepted_len
        state.provisional = run._replace(accepted_len=accepted_len)

    def evict_provisional(self, seq_id: SeqId) -> int:
        """End the round: free at once every block past the one holding the last committed
        position. Without commit_provisional, every draft counts as rejected. Returns the
        number of blocks freed (0 when there is no round)."""
        state = self._state(seq_id)
        if state.provisional is None:
            return 0
        keep = -(-state.num_committed // self.block_size)
        state.provisional = None
        return self._release_blocks(state, keep)

    def provisional(self, seq_id: SeqId) -> ProvisionalRun | None:
        """The sequence's current draft round, if any."""
        return self._state(seq_id).provisional

    # --- queries ----------------------------------------------------------------------------

    def block_table(self, seq_id: SeqId) -> list[int]:
        """A copy of the sequence's block table."""
        return list(self._state(seq_id).block_table)

    def num_committed(self, seq_id: SeqId) -> int:
        """Positions whose KV holds verified tokens."""
        return self._state(seq_id).num_committed

    def blocks_needed(self, seq_id: SeqId, end: int) -> int:
        """New blocks the sequence needs to cover positions < end."""
        state = self._state(seq_id)
        return max(0, -(-end // self.block_size) - len(state.block_table))

    def can_allocate(self, num_new_blocks: int) -> bool:
        """Whether `num_new_blocks` can be had from the free list plus evictable tree blocks."""
        return num_new_blocks <= self.num_free_blocks + self.num_evictable_blocks

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_evictable_blocks(self) -> int:
        return self.prefix_cache.num_evictable_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.prefix_cache.num_cached_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        """Fraction of blocks pinned by open sequences (neither free nor evictable)."""
        return 1.0 - (self.num_free_blocks + self.num_evictable_blocks) / self.num_total_blocks

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens served from the prefix cache."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def _state(self, seq_id: SeqId) -> _SequenceState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"no open sequence {seq_id!r}") from None

    @staticmethod
    def _require_no_round(seq_id: SeqId, state: _SequenceState, what: str) -> None:
        if state.provisional is not None:
            raise ValueError(f"{what} during sequence {seq_id!r}'s draft round; finish it "
                             f"with commit_provisional and evict_provisional first")

    # --- invariants -------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless pool, tree and block tables agree."""
        self.pool.check_integrity()
        self.prefix_cache.check_integrity(locked_nodes=[s.node for s in self._seqs.values()])
        cached = self.prefix_cache.cached_blocks()
        holders = {block: 1 for block in cached}
        for seq_id, state in self._seqs.items():
            self._check_sequence(seq_id, state, cached)
            for block in state.block_table:
                holders[block] = holders.get(block, 0) + 1
        for block in range(self.num_total_blocks):
            _ensure(self.pool.ref_count(block) == holders.get(block, 0),
                    f"block {block} has reference count {self.pool.ref_count(block)} but "
                    f"{holders.get(block, 0)} holders")
        in_use = len(holders.keys() - cached)
        _ensure(self.num_free_blocks + len(cached) + in_use == self.num_total_blocks,
                f"free {self.num_free_blocks} + cached {len(cached)} + in use {in_use} "
                f"!= total {self.num_total_blocks}")

    def _check_sequence(self, seq_id: SeqId, state: _SequenceState, cached: set[int]) -> None:
        table, bs = state.block_table, self.block_size
        _ensure(len(set(table)) == len(table), f"{seq_id!r} lists a block twice")
        shared = self.prefix_cache.path_blocks(state.node)
        _ensure(table[:len(shared)] == shared and len(shared) == state.num_shared_blocks,
                f"{seq_id!r} does not start with its locked tree path")
        _ensure(not cached.intersection(table[len(shared):]),
                f"{seq_id!r} holds tree blocks outside its locked path")
        _ensure(len(shared) * bs <= state.num_committed <= len(table) * bs,
                f"{seq_id!r} commits {state.num_committed} positions with {len(shared)} "
                f"shared and {len(table)} blocks")
        run = state.provisional
        if run is None:
            return
        end = run.base_len + len(run.tokens)
        _ensure(len(run.slots) == len(run.tokens) and end <= len(table) * bs
                and list(run.slots) == slots_for(table, run.base_len, end, bs),
                f"{seq_id!r}'s provisional slots are not its own")
        _ensure(all(table[p // bs] not in cached for p in range(run.base_len, end)),
                f"{seq_id!r} has provisional KV in a cached block")
        committed = run.base_len + (run.accepted_len or 0)
        _ensure(state.num_committed == committed if run.accepted_len is not None
                else state.num_committed <= run.base_len,
                f"{seq_id!r} commits {state.num_committed} positions during its round")
