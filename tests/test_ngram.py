"""Prompt-lookup proposer: longest, most recent match; the incremental index equals a scan."""
import itertools
import random
from dataclasses import dataclass, field

import pytest
from verispec.spec.ngram import NativeIndex, NgramProposer, PythonIndex, make_index, suffix_keys


@pytest.fixture(scope="module")
def native_built():
    if not isinstance(make_index(1, 4, native=None), NativeIndex):
        pytest.fail("the C++ n-gram index did not build (the log's warning says why)")


@pytest.fixture(params=[False, True], ids=["python", "native"])
def native(request) -> bool:
    """Every behaviour test runs on both indexes (True: the C++ one, required)."""
    if request.param:
        request.getfixturevalue("native_built")
    return request.param


@dataclass
class Seq:
    seq_id: int
    token_ids: list[int] = field(default_factory=list)


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The spec by exhaustive scan: longest suffix first, then latest earlier start."""
    return brute_force_match(tokens, k, min_n, max_n)[0]


def brute_force_match(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """`brute_force` and the length of the suffix it matched (0: none)."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k], n
    return [], 0


def propose_one(proposer: NgramProposer, seq: Seq, k: int) -> list[int]:
    return lookup(proposer, [seq], [k])[0]


def lookup(proposer: NgramProposer, seqs, ks) -> list[list[int]]:
    return [tokens for tokens, _ in proposer.lookup_matches(seqs, ks)]


@dataclass
class Row:
    """A request as the engine hands it to a proposer: an id and its tokens."""
    request_id: str
    all_ids: list[int]


def test_longest_suffix_match_wins_over_a_more_recent_shorter_one(native):
    #          0  1  2  3  4  5  6  7  8  9
    history = [1, 2, 3, 7, 8, 9, 3, 5, 1, 2, 3]
    # suffix (1, 2, 3) occurred at 0 -> followed by 7 8 9; the 1-gram (3,) recurs later at 6.
    assert propose_one(NgramProposer(max_n=3, native=native), Seq(0, history), 3) == [7, 8, 9]
    # Limited to 1-grams, the most recent earlier 3 (position 6) wins: followed by 5 1 2.
    assert propose_one(NgramProposer(max_n=1, native=native), Seq(1, history), 3) == [5, 1, 2]
    # With the length of the suffix each matched (what the adaptive controller keys on).
    assert NgramProposer(max_n=3, native=native).lookup_matches([Seq(2, history)], [3]) == [([7, 8, 9], 3)]
    assert NgramProposer(max_n=1, native=native).lookup_matches([Seq(3, history)], [3]) == [([5, 1, 2], 1)]
    assert NgramProposer(max_n=3, native=native).lookup_matches([Seq(4, [1, 2, 3])], [3]) == [([], 0)]


def test_most_recent_occurrence_and_up_to_k_tokens():
    history = [4, 5, 10, 11, 4, 5, 20, 21, 22, 4, 5]
    proposer = NgramProposer(max_n=2)
    assert propose_one(proposer, Seq(0, history), 2) == [20, 21]
    assert propose_one(proposer, Seq(0, history), 5) == [20, 21, 22, 4, 5]
    # Near the end of the history fewer than k tokens follow: propose what there is.
    assert propose_one(proposer, Seq(1, [6, 7, 6]), 4) == [7, 6]


def test_no_match_proposes_nothing_and_min_n_is_respected():
    proposer = NgramProposer(max_n=3, min_n=2)
    seqs = [Seq(0, [1, 2, 3, 4]), Seq(1, [9, 1, 9]), Seq(2, []), Seq(3, [5])]
    # Row 1: only the 1-gram (9,) recurs, below min_n = 2.
    assert lookup(proposer, seqs, [3] * 4) == [[], [], [], []]


def test_offer_then_draft_hands_out_the_lookup_up_to_each_rows_k():
    proposer = NgramProposer()
    rows = [Row("a", [1, 2, 3, 1, 2]), Row("b", [7, 8, 7]), Row("c", [1, 2, 1, 2, 1, 2])]
    offers = proposer.offer(rows, [1, 0, 5])
    assert [o.available for o in offers] == [1, 0, 2]
    assert [o.key for o in offers] == [2, 0, 4]  # the matched suffix's length
    assert proposer.draft(rows, [1, 0, 1]) == [([3], None), ([], None), ([1], None)]
    assert proposer.name == "ngram" and not proposer.timed and not proposer.has_probs
    with pytest.raises(ValueError, match="ks must be"):
        proposer.offer(rows, [1, 2])
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(min_n=0)
    with pytest.raises(ValueError, match="max_n"):
        NgramProposer(max_n=1, min_n=2)


@pytest.mark.parametrize("min_n,max_n", [(1, 4), (2, 3), (1, 1), (2, 7)])
def test_incremental_index_equals_brute_force_scan_on_random_histories(min_n, max_n, native):
    rng = random.Random(min_n * 10 + max_n)
    proposer = NgramProposer(max_n=max_n, min_n=min_n, native=native)
    seqs = [Seq(i, [rng.randrange(4) for _ in range(rng.randrange(0, 6))]) for i in range(6)]
    for _ in range(60):
        for seq in seqs:  # histories grow by ragged chunks, as accepted tokens do
            seq.token_ids.extend(rng.randrange(4) for _ in range(rng.randrange(0, 4)))
        ks = [rng.randrange(0, 6) for _ in seqs]
        drafts = lookup(proposer, seqs, ks)
        matched = proposer.lookup_matches(seqs, ks)
        for row, (seq, k) in enumerate(zip(seqs, ks)):
            got = drafts[row]
            assert got == brute_force(seq.token_ids, k, min_n, max_n), (seq.token_ids, k)
            if k:  # (k = 0 looks nothing up)
                assert matched[row] == brute_force_match(seq.token_ids, k, min_n, max_n), (seq.token_ids, k)


def test_index_is_incremental_not_a_rescan():
    proposer = NgramProposer(max_n=4, native=False)
    seq = Seq(0, list(range(1000)) * 2)
    lookup(proposer, [seq], [3])
    index = proposer.index._seqs[0]
    size = len(index.latest_start)
    seq.token_ids.append(5)
    lookup(proposer, [seq], [3])
    assert index.num_tokens == len(seq.token_ids)
    assert len(index.latest_start) - size <= 4  # at most one new n-gram per n


def test_forget_and_a_shrunk_history_rebuild_the_index(native):
    proposer = NgramProposer(max_n=2, native=native)
    seq = Seq(7, [1, 2, 3, 1, 2])
    assert propose_one(proposer, seq, 1) == [3]
    proposer.forget(7)
    proposer.forget(12345)  # unknown ids are ignored
    assert 7 not in proposer.index
    # Same id, different (shorter) history: a stale index would still propose 3.
    seq.token_ids = [1, 2, 9, 1]
    assert propose_one(proposer, seq, 2) == [2, 9]
    seq.token_ids = [5, 1]
    assert propose_one(proposer, seq, 2) == []


def _first_occurrence_extend(self, tokens, min_n, max_n):
    # Injected bug: keeps the earliest occurrence instead of the most recent.
    for end in range(max(self.num_tokens - 1, 0), len(tokens) - 1):
        for n in range(min_n, min(max_n, end + 1) + 1):
            self.latest_start.setdefault(suffix_keys(tokens, end, n)[-1], end - n + 1)
    self.num_tokens = len(tokens)


def _skips_boundary_extend(self, tokens, min_n, max_n):
    # Injected bug: off by one, never indexes the n-grams ending at the old last token.
    for end in range(self.num_tokens, len(tokens) - 1):
        for n in range(min_n, min(max_n, end + 1) + 1):
            self.latest_start[suffix_keys(tokens, end, n)[-1]] = end - n + 1
    self.num_tokens = len(tokens)


@pytest.mark.parametrize("buggy_extend", [_first_occurrence_extend, _skips_boundary_extend])
def test_brute_force_comparison_catches_a_broken_index(buggy_extend, monkeypatch):
    import verispec.spec.ngram as ngram
    monkeypatch.setattr(ngram._SeqIndex, "extend", buggy_extend)
    with pytest.raises(AssertionError):
        test_incremental_index_equals_brute_force_scan_on_random_histories(1, 4, native=False)


def _distinct_keys(key) -> bool:
    grams = [g for n in range(1, 5) for g in itertools.product((0, 1, 2), repeat=n)]
    return len({key(g) for g in grams}) == len(grams)


def test_ngram_keys_are_distinct_across_lengths_and_catch_a_zero_digit():
    """[0, x] and [x] must differ: every token is stored + 1, so no digit is 0."""
    assert _distinct_keys(lambda g: suffix_keys(g, len(g) - 1, len(g))[-1])
    assert not _distinct_keys(lambda g: sum(t << (32 * i) for i, t in enumerate(reversed(g))))


def _disagreeing_spans(reference, other, seed: int, steps: int = 300) -> int:
    """Rows whose spans differ over a random workload: histories grow by ragged chunks, some
    come back shorter (the id reused for another sequence: both start over), some are
    forgotten."""
    rng, histories, differ = random.Random(seed), {i: [] for i in range(5)}, 0
    for _ in range(steps):
        ids = rng.sample(sorted(histories), rng.randrange(1, 6))
        for i in ids:
            if histories[i] and rng.random() < 0.03:
                histories[i] = [rng.randrange(5) for _ in range(rng.randrange(0, len(histories[i])))]
            else:
                histories[i].extend(rng.randrange(5) for _ in range(rng.randrange(0, 4)))
        budgets = [rng.randrange(0, 4) for _ in ids]
        spans = [index.spans(ids, [histories[i] for i in ids], budgets) for index in (reference, other)]
        differ += sum(a != b for a, b in zip(*spans))
        if rng.random() < 0.05:
            gone = rng.choice(ids)
            reference.forget(gone)
            other.forget(gone)
    return differ


@pytest.mark.parametrize("min_n,max_n", [(1, 4), (2, 6)])
def test_the_cpp_index_returns_what_the_python_index_does(native_built, min_n, max_n):
    for seed in range(3):
        assert _disagreeing_spans(PythonIndex(min_n, max_n), make_index(min_n, max_n, native=True), seed) == 0


def test_the_comparison_catches_an_index_keeping_the_first_occurrence(native_built, monkeypatch):
    import verispec.spec.ngram as ngram
    monkeypatch.setattr(ngram._SeqIndex, "extend", _first_occurrence_extend)
    assert _disagreeing_spans(PythonIndex(1, 4), make_index(1, 4, native=True), 0) > 0


@pytest.mark.parametrize("kernels,python", [("off", True), ("auto", False), ("on", False)])
def test_the_index_follows_the_engines_kernels_setting(native_built, kernels, python):
    from verispec.config import EngineConfig
    from verispec.spec.proposer import ProposerContext, build_proposers
    proposers, _ = build_proposers(ProposerContext(EngineConfig(model="tiny", kernels=kernels)))
    assert isinstance(proposers["ngram"].index, PythonIndex) == python  # built with the engine


def test_a_history_of_non_integers_is_refused(native):
    with pytest.raises(TypeError):
        NgramProposer(native=native).lookup_matches([Seq(0, [1, "x", 2, 1])], [2])
