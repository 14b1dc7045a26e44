"""KVCacheManager: unit tests, and a hypothesis state machine with a shadow of the KV slots.

The state machine plays the engine: it opens requests with few-shot style shared prefixes,
prefills in chunks, runs speculative rounds with random draft and accepted lengths (split in
two steps so rounds of different sequences interleave), and preempts, cancels and finishes
requests. A shadow records, for every slot, the context its KV was computed from and whether
all of it was verified (drafts are not until accepted). After every step it checks that

- check_integrity() holds;
- every position the manager calls committed holds the verified KV of the sequence's tokens;
- the KV of a round in flight is still the sequence's own (nobody was handed its blocks);
- every block match_prefix returns holds exactly the verified KV of the queried prefix.

Deliberately broken managers at the bottom show that the search catches what it protects.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

from verispec.cache.kv_pool import BlockPool, OutOfBlocks, RefCountError, slot_of
from verispec.cache.manager import KVCacheManager

# --------------------------------------------------------------------------- unit tests


def prefill(mgr, seq_id, tokens, start=None):
    """Allocate, 'compute' and commit every position of `tokens` from `start` on."""
    start = mgr.num_committed(seq_id) if start is None else start
    slots = mgr.allocate_slots(seq_id, start, len(tokens))
    mgr.commit(seq_id, len(tokens))
    return slots


def test_open_without_cache_hit_returns_zero_and_holds_nothing():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    assert mgr.open_sequence(0, list(range(10))) == 0
    assert mgr.block_table(0) == [] and mgr.num_committed(0) == 0
    mgr.check_integrity()


def test_allocate_slots_maps_positions_through_the_block_table():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    mgr.open_sequence("a", [1] * 6)
    slots = mgr.allocate_slots("a", 0, 6)
    table = mgr.block_table("a")
    assert len(table) == 2
    assert slots == [table[p // 4] * 4 + p % 4 for p in range(6)]
    assert mgr.allocate_slots("a", 6, 8) == [table[1] * 4 + 2, table[1] * 4 + 3]
    assert mgr.block_table("a") == table  # positions 6, 7 were already covered
    assert mgr.blocks_needed("a", 9) == 1 and mgr.blocks_needed("a", 8) == 0
    mgr.check_integrity()


def test_cached_prompt_is_shared_block_aligned_and_leaves_one_token_to_compute():
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(12))
    mgr.open_sequence(0, prompt)
    prefill(mgr, 0, prompt)
    mgr.cache_sequence(0, prompt)
    assert mgr.open_sequence(1, prompt + [99]) == 12
    assert mgr.open_sequence(2, prompt) == 8  # 12 would leave no token to compute
    assert mgr.open_sequence(3, prompt[:6]) == 4
    assert mgr.open_sequence(4, [5] + prompt) == 0
    assert mgr.block_table(1) == mgr.block_table(0)
    assert mgr.block_table(2) == mgr.block_table(0)[:2]
    assert (mgr.hit_tokens, mgr.query_tokens) == (12 + 8 + 4, 12 + 13 + 12 + 6 + 13)
    assert mgr.hit_rate == pytest.approx(24 / 56)
    mgr.check_integrity()


def test_prefix_cache_disabled_never_hits():
    mgr = KVCacheManager(num_blocks=8, block_size=2, prefix_cache=False)
    mgr.open_sequence(0, [1, 2, 3, 4, 5])
    prefill(mgr, 0, [1, 2, 3, 4, 5])
    mgr.close_sequence(0, [1, 2, 3, 4, 5])
    assert mgr.num_free_blocks == 8
    assert mgr.open_sequence(1, [1, 2, 3, 4, 5]) == 0
    mgr.check_integrity()


def test_out_of_blocks_changes_nothing():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    mgr.open_sequence(0, [1, 2, 3])
    prefill(mgr, 0, [1, 2, 3])
    mgr.open_sequence(1, [7])
    before = (mgr.block_table(1), mgr.num_free_blocks, mgr.block_table(0))
    with pytest.raises(OutOfBlocks, match="needs 3 more blocks, only 2 free and 0 evictable"):
        mgr.allocate_slots(1, 0, 6)
    assert (mgr.block_table(1), mgr.num_free_blocks, mgr.block_table(0)) == before
    assert not mgr.can_allocate(3) and mgr.can_allocate(2)
    mgr.check_integrity()


def test_allocation_evicts_unreferenced_cached_blocks_when_short():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    mgr.open_sequence(0, [1, 2, 3, 4, 5])
    prefill(mgr, 0, [1, 2, 3, 4, 5])
    mgr.close_sequence(0, [1, 2, 3, 4])
    assert (mgr.num_free_blocks, mgr.num_evictable_blocks, mgr.usage()) == (2, 2, 0.0)
    mgr.open_sequence(1, [9, 9, 9, 9, 9, 9, 9])
    mgr.allocate_slots(1, 0, 7)
    assert mgr.num_free_blocks == 0 and mgr.num_cached_blocks == 0 and mgr.usage() == 1.0
    mgr.check_integrity()


def test_blocks_in_use_by_a_sequence_are_never_evicted():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    mgr.open_sequence(0, [1, 2, 3, 4, 5])
    prefill(mgr, 0, [1, 2, 3, 4, 5])
    mgr.cache_sequence(0, [1, 2, 3, 4])
    mgr.open_sequence(1, [1, 2, 3, 4, 6])  # shares both cached blocks
    assert mgr.num_evictable_blocks == 0
    with pytest.raises(OutOfBlocks):
        mgr.allocate_slots(1, 4, 9)
    mgr.check_integrity()


def test_shared_blocks_are_read_only():
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    mgr.open_sequence(0, [1, 2, 3])
    prefill(mgr, 0, [1, 2, 3])
    mgr.cache_sequence(0, [1, 2])
    with pytest.raises(ValueError, match="shared through the prefix tree"):
        mgr.allocate_slots(0, 1, 4)


def round_fixture():
    """The module docstring's example: block_size 4, t0..t9 known, 9 committed."""
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(100, 110))
    mgr.open_sequence("s", tokens[:9])
    prefill(mgr, "s", tokens[:9])
    slots = mgr.allocate_slots("s", 9, 15)  # t9 + 5 drafts
    return mgr, slots


def test_round_commits_only_accepted_drafts_and_frees_blocks_of_rejected_ones_at_once():
    mgr, slots = round_fixture()
    b3 = mgr.block_table("s")[3]
    mgr.insert_provisional("s", [1, 2, 3, 4, 5], slots[1:], base_len=10)
    mgr.check_integrity()
    mgr.commit_provisional("s", 2)
    assert mgr.num_committed("s") == 12
    assert mgr.evict_provisional("s") == 1
    assert len(mgr.block_table("s")) == 3 and mgr.pool.ref_count(b3) == 0
    assert mgr.provisional("s") is None
    mgr.check_integrity()


def test_partially_committed_block_stays_after_eviction():
    mgr, slots = round_fixture()
    mgr.insert_provisional("s", [1, 2, 3, 4, 5], slots[1:], base_len=10)
    mgr.commit_provisional("s", 3)  # position 12 committed: b3 stays
    assert mgr.evict_provisional("s") == 0
    assert len(mgr.block_table("s")) == 4 and mgr.num_committed("s") == 13
    mgr.check_integrity()


def test_evict_without_commit_rejects_every_draft():
    mgr, slots = round_fixture()
    mgr.insert_provisional("s", [1, 2, 3, 4, 5], slots[1:], base_len=10)
    assert mgr.evict_provisional("s") == 1
    assert mgr.num_committed("s") == 9 and len(mgr.block_table("s")) == 3
    assert mgr.evict_provisional("s") == 0  # nothing left: idempotent
    mgr.check_integrity()


def test_round_inputs_below_base_len_may_be_committed_but_drafts_may_not():
    mgr, slots = round_fixture()
    mgr.insert_provisional("s", [1, 2, 3, 4, 5], slots[1:], base_len=10)
    mgr.commit("s", 10)  # the pending token t9 (the engine does this before accepting)
    with pytest.raises(ValueError, match=r"num_tokens must be in \[10, 10\]"):
        mgr.commit("s", 11)
    mgr.commit_provisional("s", 0)
    with pytest.raises(ValueError, match="call evict_provisional first"):
        mgr.commit("s", 10)
    mgr.evict_provisional("s")
    assert mgr.num_committed("s") == 10
    mgr.check_integrity()


def test_provisional_tokens_cannot_be_cached():
    mgr, slots = round_fixture()
    tokens = list(range(100, 110)) + [1, 2, 3, 4, 5]
    mgr.insert_provisional("s", [1, 2, 3, 4, 5], slots[1:], base_len=10)
    with pytest.raises(ValueError, match="during sequence 's'"):
        mgr.cache_sequence("s", tokens[:9])
    mgr.commit_provisional("s", 2)
    mgr.evict_provisional("s")
    with pytest.raises(ValueError, match="only committed positions: got 13 tokens"):
        mgr.cache_sequence("s", tokens[:13])
    mgr.cache_sequence("s", tokens[:12])
    assert mgr.num_cached_blocks == 3
    mgr.check_integrity()


def test_round_steps_out_of_order_are_refused():
    mgr, slots = round_fixture()
    with pytest.raises(ValueError, match="insert_provisional first"):
        mgr.commit_provisional("s", 0)
    with pytest.raises(ValueError, match="not sequence 's'"):
        mgr.insert_provisional("s", [1, 2], [slots[2], slots[1]], base_len=10)
    with pytest.raises(ValueError, match="base_len must be in"):
        mgr.insert_provisional("s", [1, 2], slots[:2], base_len=8)
    mgr.insert_provisional("s", [1], slots[1:2], base_len=10)
    with pytest.raises(ValueError, match="allocate_slots during"):
        mgr.allocate_slots("s", 9, 16)
    with pytest.raises(ValueError, match="insert_provisional during"):
        mgr.insert_provisional("s", [1], slots[1:2], base_len=10)
    with pytest.raises(ValueError, match=r"accepted_len must be in \[0, 1\]"):
        mgr.commit_provisional("s", 2)
    mgr.check_integrity()


def test_preempt_mid_round_releases_everything_but_keeps_the_tree():
    mgr, slots = round_fixture()
    mgr.cache_sequence("s", list(range(100, 108)))
    mgr.insert_provisional("s", [1, 2, 3, 4, 5], slots[1:], base_len=10)
    mgr.preempt("s")
    assert "s" not in mgr
    assert mgr.num_free_blocks == 6 and mgr.num_evictable_blocks == 2
    mgr.check_integrity()
    assert mgr.open_sequence("s", list(range(100, 110))) == 8


def test_close_with_tokens_caches_committed_blocks_and_cancel_does_not():
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    for seq_id, keep in ((0, True), (1, False)):
        prompt = [seq_id] * 5
        mgr.open_sequence(seq_id, prompt)
        prefill(mgr, seq_id, prompt)
        mgr.close_sequence(seq_id, prompt if keep else None)
    assert mgr.num_cached_blocks == 2 and mgr.num_free_blocks == 6
    assert mgr.open_sequence(2, [0] * 6) == 4 and mgr.open_sequence(3, [1] * 6) == 0
    mgr.check_integrity()


def test_duplicate_blocks_are_swapped_for_the_trees_and_freed():
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    for seq_id in (0, 1):  # both prefill before either caches: no hit for the second
        mgr.open_sequence(seq_id, prompt)
        prefill(mgr, seq_id, prompt)
    mgr.cache_sequence(0, prompt[:4])
    own = mgr.block_table(1)
    mgr.cache_sequence(1, prompt[:4])
    assert mgr.block_table(1)[:2] == mgr.block_table(0)[:2]
    assert mgr.block_table(1)[2] == own[2]
    assert mgr.pool.ref_count(own[0]) == 0 and mgr.num_free_blocks == 8 - 4
    mgr.check_integrity()


def test_draft_kv_is_tracked_through_caching_and_switches_to_the_trees_blocks():
    mgr = KVCacheManager(num_blocks=16, block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    for seq_id in (0, 1):  # both prefill before either caches
        mgr.open_sequence(seq_id, prompt)
        prefill(mgr, seq_id, prompt)
    assert mgr.cache_sequence(0, prompt[:6]) == 0          # target KV only
    # Sequence 1 has draft KV for 5 positions, but its first 3 blocks become the tree's
    # copies, which lack it: nothing of its draft KV survives the switch.
    assert mgr.cache_sequence(1, prompt[:6], draft_tokens=5) == 0
    mgr.open_sequence(2, prompt)
    assert mgr.num_committed(2) == 6 and mgr.cached_draft_tokens(2) == 0
    prefill(mgr, 2, prompt + [8, 9])
    # Sequence 2 shares those blocks and computed draft KV into them: the tree learns it.
    assert mgr.cache_sequence(2, prompt + [8, 9], draft_tokens=7) == 7
    mgr.open_sequence(3, prompt + [8, 9, 10])
    assert mgr.num_committed(3) == 8 and mgr.cached_draft_tokens(3) == 6
    mgr.check_integrity()


@pytest.mark.parametrize("call, error, message", [
    (lambda m: m.open_sequence(1.5, [1]), ValueError, "seq_id must be an int or a str"),
    (lambda m: m.open_sequence(True, [1]), ValueError, "seq_id must be an int or a str"),
    (lambda m: m.open_sequence("x", []), ValueError, "prompt_ids must hold at least 1"),
    (lambda m: m.open_sequence(0, [1]), ValueError, "already open"),
    (lambda m: m.allocate_slots(9, 0, 1), KeyError, "no open sequence 9"),
    (lambda m: m.allocate_slots(0, 3, 2), ValueError, "start <= end"),
    (lambda m: m.commit(0, 1), ValueError, r"num_tokens must be in \[0, 0\]"),
    (lambda m: KVCacheManager(4, 2, prefix_cache=1), ValueError, "prefix_cache must be"),
])
def test_bad_arguments_are_rejected_with_a_clear_message(call, error, message):
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    mgr.open_sequence(0, [1])
    with pytest.raises(error, match=message):
        call(mgr)


def test_integrity_check_catches_a_reference_count_without_holder():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    mgr.open_sequence(0, [1, 2, 3])
    prefill(mgr, 0, [1, 2, 3])
    mgr.pool.incref(mgr.block_table(0)[0])  # a reference nobody owns: a leak
    with pytest.raises(AssertionError, match="reference count 2 but 1 holders"):
        mgr.check_integrity()


# --------------------------------------------------------------------------- state machine

ALPHABET = 4  # tail and draft tokens are 0..3: collisions make sharing and aliasing likely
PREFIXES = (  # few-shot style system prompts that requests share
    (10, 11, 12, 13, 14, 15, 16, 17),
    (10, 11, 12, 13, 20, 21, 22, 23, 24),
    (30, 31, 32),
    (),
)
MAX_OPEN = 4
MAX_LEN = 32


@dataclass
class Round:
    start: int                 # position of the pending token
    drafts: list[int]
    slots: list[int]           # slots of positions [start, start + 1 + len(drafts))


@dataclass
class SeqModel:
    seq_id: int | str
    tokens: list[int]          # every token known: prompt + generated
    computed: int              # positions whose KV holds final tokens (the truth)
    prefill_to: int            # prefill runs until computed == prefill_to, then samples
    round: Round | None = None

    def can_begin_round(self) -> bool:
        # Decoding: prefill done, only the last sampled (pending) token lacks KV.
        return (self.round is None and self.prefill_to <= self.computed == len(self.tokens) - 1
                and len(self.tokens) < MAX_LEN)

    def context(self, position: int) -> tuple[int, ...]:
        return tuple(self.tokens[:position + 1])


def _pick(items, index):
    return items[index % len(items)]


class CacheMachine(RuleBasedStateMachine):
    """Plays the engine against a KVCacheManager while shadowing every KV slot."""

    manager_cls = KVCacheManager
    integrity_checks = True    # off: only the shadow properties judge the manager
    bookkeeping_checks = True  # off: no direct comparison of the manager's counters
    sequence_kv_checks = True  # off: only prefix matches are checked against the shadow

    def __init__(self):
        super().__init__()
        self.mgr: KVCacheManager | None = None
        self.open: dict[int | str, SeqModel] = {}
        self.preempted: list[SeqModel] = []
        self.finished: list[tuple[int, ...]] = []
        # slot -> (tokens its KV was computed from, all of them verified)
        self.shadow: dict[int, tuple[tuple[int, ...], bool]] = {}
        self.next_id = 0

    @initialize(block_size=st.sampled_from([1, 2, 4]), capacity=st.integers(24, 96),
                prefix_cache=st.sampled_from([True, True, True, False]))
    def setup(self, block_size, capacity, prefix_cache):
        # Sized in tokens so that every block size sees both plenty and scarcity.
        num_blocks = max(4, capacity // block_size)
        self.mgr = self.manager_cls(num_blocks, block_size, prefix_cache=prefix_cache)
        self.bs = block_size

    # --- helpers ----------------------------------------------------------------------------

    def _ids(self, pred):
        return [s for s in self.open.values() if pred(s)]

    def _allocate(self, seq: SeqModel, start: int, end: int) -> list[int] | None:
        before = (self.mgr.block_table(seq.seq_id), self.mgr.num_free_blocks,
                  self.mgr.num_cached_blocks, self.mgr.num_evictable_blocks)
        try:
            return self.mgr.allocate_slots(seq.seq_id, start, end)
        except OutOfBlocks:
            after = (self.mgr.block_table(seq.seq_id), self.mgr.num_free_blocks,
                     self.mgr.num_cached_blocks, self.mgr.num_evictable_blocks)
            assert after == before, "OutOfBlocks changed the manager's state"
            return None

    def _open(self, seq: SeqModel) -> None:
        cached = self.mgr.open_sequence(seq.seq_id, seq.tokens)
        assert cached % self.bs == 0 and 0 <= cached <= len(seq.tokens) - 1
        seq.computed, seq.prefill_to, seq.round = cached, len(seq.tokens), None
        self.open[seq.seq_id] = seq

    def _committed_tokens(self, seq: SeqModel) -> list[int]:
        # As the engine does: ask the manager how far the verified KV goes.
        return seq.tokens[:self.mgr.num_committed(seq.seq_id)]

    # --- rules ------------------------------------------------------------------------------

    @precondition(lambda self: len(self.open) < MAX_OPEN)
    @rule(prefix=st.integers(0, len(PREFIXES) - 1),
          tail=st.lists(st.integers(0, ALPHABET - 1), max_size=6))
    def open_request(self, prefix, tail):
        tokens = list(PREFIXES[prefix]) + tail or [0]
        seq_id = self.next_id if self.next_id % 2 else f"req-{self.next_id}"
        self.next_id += 1
        self._open(SeqModel(seq_id, tokens, 0, len(tokens)))

    @precondition(lambda self: self.preempted and len(self.open) < MAX_OPEN)
    @rule(index=st.integers(0, 63))
    def resume_preempted(self, index):
        seq = self.preempted.pop(index % len(self.preempted))
        self._open(seq)  # recompute: the whole history is the new prompt

    @precondition(lambda self: any(s.computed < s.prefill_to for s in self.open.values()))
    @rule(index=st.integers(0, 63), chunk=st.integers(1, 16), cache=st.booleans())
    def prefill_chunk(self, index, chunk, cache):
        seq = _pick(self._ids(lambda s: s.computed < s.prefill_to), index)
        start, end = seq.computed, min(seq.prefill_to, seq.computed + chunk)
        slots = self._allocate(seq, start, end)
        if slots is None:
            return
        for pos, slot in zip(range(start, end), slots):
            self.shadow[slot] = (seq.context(pos), True)
        self.mgr.commit(seq.seq_id, end)
        seq.computed = end
        if end == seq.prefill_to:
            seq.tokens.append(len(seq.tokens) % ALPHABET)  # the token sampled from the last logits
            if cache:
                self.mgr.cache_sequence(seq.seq_id, self._committed_tokens(seq))

    @precondition(lambda self: any(map(SeqModel.can_begin_round, self.open.values())))
    @rule(index=st.integers(0, 63), drafts=st.lists(st.integers(0, ALPHABET - 1), max_size=6),
          spare=st.integers(0, 2))
    def begin_round(self, index, drafts, spare):
        """Allocate [pending token, drafts, spare], write their KV, register the drafts.

        `spare` slots model a budget reserved for more drafts than the proposer produced.
        """
        seq = _pick(self._ids(SeqModel.can_begin_round), index)
        start = seq.computed
        slots = self._allocate(seq, start, start + 1 + len(drafts) + spare)
        if slots is None:
            return
        self.shadow[slots[0]] = (seq.context(start), True)
        for i, slot in enumerate(slots[1:1 + len(drafts)]):
            self.shadow[slot] = (tuple(seq.tokens) + tuple(drafts[:i + 1]), False)
        if drafts:
            self.mgr.insert_provisional(seq.seq_id, drafts, slots[1:1 + len(drafts)], start + 1)
        seq.round = Round(start, drafts, slots[:1 + len(drafts)])

    @precondition(lambda self: any(s.round for s in self.open.values()))
    @rule(index=st.integers(0, 63), accepted=st.integers(0, 6), token=st.integers(0, 63),
          commit_pending_first=st.booleans(), cache_after=st.booleans())
    def finish_round(self, index, accepted, token, commit_pending_first, cache_after):
        """Verify: accept a prefix of the drafts, then commit and evict in the safe order."""
        seq = _pick(self._ids(lambda s: s.round), index)
        rnd, seq.round = seq.round, None
        k = len(rnd.drafts)
        accepted %= k + 1
        if commit_pending_first or not k:
            self.mgr.commit(seq.seq_id, rnd.start + 1)
        if k:
            self.mgr.commit_provisional(seq.seq_id, accepted)
            self.mgr.evict_provisional(seq.seq_id)
        for i, slot in enumerate(rnd.slots[1:1 + accepted]):
            expected = (tuple(seq.tokens) + tuple(rnd.drafts[:i + 1]), False)
            if self.shadow.get(slot) == expected:  # else someone overwrote it: invariants say so
                self.shadow[slot] = (expected[0], True)
        if accepted < k:  # the recovered token always differs from the rejected draft
            new = (rnd.drafts[accepted] + 1 + token % (ALPHABET - 1)) % ALPHABET
        else:             # all accepted (or plain decode): a bonus token
            new = token % ALPHABET
        seq.tokens.extend(rnd.drafts[:accepted] + [new])
        seq.computed = rnd.start + 1 + accepted
        if cache_after:  # the engine may publish committed blocks between any two rounds
            self.mgr.cache_sequence(seq.seq_id, self._committed_tokens(seq))
        if self.bookkeeping_checks:
            assert self.mgr.num_committed(seq.seq_id) == seq.computed
            if k:
                table_len = len(self.mgr.block_table(seq.seq_id))
                assert table_len == -(-seq.computed // self.bs), "rejected blocks kept"

    @precondition(lambda self: self.open)
    @rule(index=st.integers(0, 63), how=st.sampled_from(["preempt", "cancel", "finish"]))
    def end_request(self, index, how):
        """Preempt (recompute later), cancel (drop all) or finish (cache committed blocks)."""
        seq = _pick(list(self.open.values()), index)
        del self.open[seq.seq_id]
        if how == "preempt":
            self.mgr.preempt(seq.seq_id)
            self.preempted.append(seq)
        elif how == "cancel":
            self.mgr.close_sequence(seq.seq_id)
        else:
            self.mgr.close_sequence(seq.seq_id, self._committed_tokens(seq))
            self.finished = (self.finished + [tuple(seq.tokens)])[-6:]

    # --- properties -------------------------------------------------------------------------

    @invariant()
    def integrity_holds(self):
        if self.mgr is not None and self.integrity_checks:
            self.mgr.check_integrity()

    @invariant()
    def committed_positions_hold_verified_kv_of_the_sequence(self):
        if not self.sequence_kv_checks:
            return
        for seq in self.open.values():
            committed = self.mgr.num_committed(seq.seq_id)
            assert committed <= len(seq.tokens), (
                f"KV shadow: {seq.seq_id!r} claims {committed} committed positions, "
                f"only {len(seq.tokens)} tokens exist")
            table = self.mgr.block_table(seq.seq_id)
            for pos in range(committed):
                got = self.shadow.get(slot_of(table, pos, self.bs))
                assert got == (seq.context(pos), True), (
                    f"KV shadow: {seq.seq_id!r} position {pos} is committed but holds {got}")

    @invariant()
    def kv_of_rounds_in_flight_is_untouched(self):
        if not self.sequence_kv_checks:
            return
        for seq in self.open.values():
            if seq.round is None:
                continue
            rnd = seq.round
            for i, slot in enumerate(rnd.slots):
                pos = rnd.start + i
                expected = (tuple(seq.tokens) + tuple(rnd.drafts[:i]), i == 0)
                assert self.shadow.get(slot) == expected, (
                    f"in-flight KV: {seq.seq_id!r} position {pos} was overwritten")
                if self.bookkeeping_checks:
                    table = self.mgr.block_table(seq.seq_id)
                    assert slot_of(table, pos, self.bs) == slot

    @invariant()
    def prefix_matches_return_only_verified_kv_of_the_query(self):
        if self.mgr is None:
            return
        queries = [*PREFIXES, *self.finished, *(tuple(s.tokens) for s in self.open.values()),
                   *(tuple(s.tokens) for s in self.preempted)]
        for query in queries:
            match = self.mgr.prefix_cache.match_prefix(query)
            assert match.num_tokens == len(match.blocks) * self.bs <= len(query)
            for pos in range(match.num_tokens):
                got = self.shadow.get(slot_of(match.blocks, pos, self.bs))
                assert got == (query[:pos + 1], True), (
                    f"prefix match: position {pos} of {query} is served from KV {got}")


FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                  HealthCheck.filter_too_much])


def test_manager_keeps_provisional_kv_out_of_the_tree_under_random_interleavings():
    run_state_machine_as_test(
        CacheMachine, settings=settings(max_examples=200, stateful_step_count=50, **FAST))


# --------------------------------------------------------------------------- broken managers


class CommitsUnverifiedDrafts(KVCacheManager):
    """(a) Commits the whole draft round, ignoring how many drafts were accepted."""

    def commit_provisional(self, seq_id, accepted_len):
        super().commit_provisional(seq_id, len(self.provisional(seq_id).tokens))


class DoubleReleasesRejectedBlocks(KVCacheManager):
    """(b) Drops the references of rejected blocks but leaves them in the block table, so the
    sequence keeps writing them after the pool handed them to someone else, and releases
    them a second time when it closes."""

    def _release_blocks(self, state, keep):
        freed = 0
        for block in state.block_table[keep:]:
            freed += self.pool.decref(block)
        if keep == 0:  # a full release does drop the table, as the real one does
            del state.block_table[:]
        return freed


class _SilentPool(BlockPool):
    """A naive allocator without the real pool's defences: a double free or a reference on a
    free block passes silently (a block may then sit on the free list twice)."""

    def incref(self, block):
        self._ref_counts[block] += 1

    def decref(self, block):
        self._ref_counts[block] = max(0, self._ref_counts[block] - 1)
        if self._ref_counts[block] == 0:
            self._free.append(block)
            return True
        return False


class _UncountedPool(BlockPool):
    def decref(self, block):
        # Frees on any release, whoever else still holds the block.
        if self._ref_counts[block] == 0:
            raise RefCountError(f"decref of free block {block}: double free")
        self._ref_counts[block] = 0
        self._free.append(block)
        return True


class _UncountedSilentPool(_SilentPool):
    def decref(self, block):
        self._ref_counts[block] = 0
        self._free.append(block)
        return True


def with_pool(manager_cls, pool_cls):
    """`manager_cls` running on a `pool_cls` pool."""
    def __init__(self, num_blocks, block_size, prefix_cache=True):
        manager_cls.__init__(self, num_blocks, block_size, prefix_cache)
        self.pool = pool_cls(num_blocks, block_size)
        self.prefix_cache.pool = self.pool
    return type(f"{manager_cls.__name__}On{pool_cls.__name__}", (manager_cls,),
                {"__init__": __init__, "__doc__": manager_cls.__doc__})


# (b') Frees a block on any release, even while the tree or another sequence holds it.
FreesWithoutCheckingRefCount = with_pool(KVCacheManager, _UncountedPool)


def search_for_failure(manager_cls, **checks):
    """Run the property search against `manager_cls`; returns the failure it finds, or None.

    checks: CacheMachine switches (integrity_checks, ...) to turn some properties off.
    """
    machine = type(f"{manager_cls.__name__}Machine", (CacheMachine,),
                   {"manager_cls": manager_cls, **checks})
    try:
        run_state_machine_as_test(machine, settings=settings(
            max_examples=200, stateful_step_count=50, database=None, derandomize=True,
            phases=[Phase.generate], report_multiple_bugs=False, print_blob=False, **FAST))
    except (AssertionError, RefCountError) as failure:
        return failure
    return None


@pytest.mark.parametrize("manager_cls", [
    CommitsUnverifiedDrafts, DoubleReleasesRejectedBlocks, FreesWithoutCheckingRefCount,
], ids=lambda c: c.__name__)
def test_property_search_catches_broken_manager(manager_cls):
    assert search_for_failure(manager_cls) is not None


@pytest.mark.parametrize("manager_cls", [
    CommitsUnverifiedDrafts,
    with_pool(DoubleReleasesRejectedBlocks, _SilentPool),
    with_pool(KVCacheManager, _UncountedSilentPool),
], ids=lambda c: c.__name__)
def test_kv_shadow_alone_catches_broken_manager(manager_cls):
    # No check_integrity(), no counter comparisons, a pool that never complains: the shadow
    # of the KV slots must still see the corruption.
    failure = search_for_failure(manager_cls, integrity_checks=False, bookkeeping_checks=False)
    assert isinstance(failure, AssertionError)
    assert str(failure).startswith(("KV shadow:", "in-flight KV:", "prefix match:")), failure


def test_prefix_match_property_alone_catches_committing_unverified_drafts():
    # The tree-facing property by itself: rejected-draft KV that was committed gets published
    # by cache_sequence, and some later match_prefix serves it.
    failure = search_for_failure(CommitsUnverifiedDrafts, integrity_checks=False,
                                 bookkeeping_checks=False, sequence_kv_checks=False)
    assert isinstance(failure, AssertionError)
    assert str(failure).startswith("prefix match:"), failure


def test_property_search_passes_on_the_real_manager():
    assert search_for_failure(KVCacheManager) is None
