"""Suffix decoding: the global trie counts exactly the substrings it should and evicts whole
outputs; a request's own history proposes exactly what a trie of it would, and holds only
its own committed tokens. Losslessness is G1/G2 (tests/test_gate_lossless.py,
tests/test_gate_greedy.py). The engine tests that read the index's state run the Python
index (`python_index`); tests/test_suffix_index.py shows the C++ one computes the same.
"""
from __future__ import annotations

import gc
import random
from collections import Counter

import pytest

import verispec.spec.suffix as suffix_mod
from tiny import tiny_engine, tiny_pair
from verispec.request import SpecOverride
from verispec.sampling import SamplingParams
from verispec.spec.proposer import DEFAULT_SPEC_TOKENS
from verispec.spec.suffix import MAX_DEPTH, OwnHistory, PythonIndex, SuffixProposer, SuffixTrie

VOCAB = 12


def substring_counts(sequences, depth: int = MAX_DEPTH) -> Counter:
    counts: Counter = Counter()
    for seq in sequences:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + depth) + 1):
                counts[tuple(seq[i:j])] += 1
    return counts


def trie_counts(trie: SuffixTrie) -> Counter:
    counts: Counter = Counter()
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for t, child in trie.children(node):
            counts[path + (t,)] = trie.count(child)
            stack.append((path + (t,), child))
    return counts


def _random_sequences(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def test_the_trie_counts_every_substring_and_removal_undoes_it_exactly():
    seqs = _random_sequences(6, 0)
    trie = SuffixTrie(max_depth=5)
    for s in seqs:
        trie.add(s)
    assert trie_counts(trie) == substring_counts(seqs, 5)
    assert trie.num_nodes == len(substring_counts(seqs, 5)) + 1
    trie.add(seqs[2], delta=-1)
    assert trie_counts(trie) == substring_counts(seqs[:2] + seqs[3:], 5)
    for s in seqs[:2] + seqs[3:]:
        trie.add(s, delta=-1)
    assert trie.num_nodes == 1 and not trie.children(trie.root)


def test_continuation_follows_the_most_frequent_child_of_the_longest_match():
    trie = SuffixTrie()
    # after (1, 2): 3 twice, 4 once; after (9, 1, 2): 4 (the longer match wins)
    for s in ([1, 2, 3, 5], [1, 2, 3, 5], [1, 2, 4], [9, 1, 2, 4, 7]):
        trie.add(s)
    frontier = [trie.root]
    for t in [0, 1, 2]:
        frontier = trie.follow(frontier, t)
    assert trie.continuation(frontier, budget=8) == ([3, 5], 2)
    frontier = [trie.root]
    for t in [9, 1, 2]:
        frontier = trie.follow(frontier, t)
    assert trie.continuation(frontier, budget=8) == ([4, 7], 3)
    assert trie.continuation(frontier, budget=1) == ([4], 3)


@pytest.mark.parametrize("broken", [False, True])
def test_a_row_frontier_does_not_read_a_freed_node_whose_id_was_reused(monkeypatch, broken):
    """A row follows an output, the output is evicted and another takes the freed ids: the
    row's handles are stale and must match nothing (as a fresh frontier of its tokens
    does). Broken: handles checked by id alone read the new output's nodes."""
    if broken:
        monkeypatch.setattr(SuffixTrie, "_live", lambda self, handle: handle & suffix_mod._ID_MASK)
    trie = SuffixTrie()
    trie.add([1, 2, 3, 4, 5])
    frontier = [trie.root]
    for t in [1, 2, 3]:
        frontier = trie.follow(frontier, t)
    assert trie.continuation(frontier, budget=4) == ([4, 5], 3)
    trie.add([1, 2, 3, 4, 5], delta=-1)
    trie.add([7, 8, 9, 6, 6, 7, 8, 9])             # reuses the freed ids
    fresh = [trie.root]
    for t in [1, 2, 3]:
        fresh = trie.follow(fresh, t)
    assert trie.continuation(fresh, budget=4) == ([], 0)       # no suffix of (1, 2, 3) is in the trie now
    assert (trie.continuation(frontier, budget=4) == ([], 0)) != broken  # the stale handles: nothing


@pytest.mark.parametrize("broken", [None, "trie", "own history"])
def test_the_tries_give_the_garbage_collector_nothing_to_scan(monkeypatch, broken):
    """Thousands of global-trie nodes and own-history n-grams add no objects the collector
    tracks (each full collection would walk them all). Broken: a Python object kept per
    trie node, or an own history's positions kept in lists."""
    if broken == "trie":
        real_new = SuffixTrie._new
        nodes = []

        def with_objects(self, parent, token):  # the bug: a Python object kept per node
            nodes.append({"token": [token]})
            return real_new(self, parent, token)
        monkeypatch.setattr(SuffixTrie, "_new", with_objects)
    if broken == "own history":  # the bug: each n-gram's positions in a (tracked) list
        monkeypatch.setattr(suffix_mod, "bytearray", lambda packed: list(packed), raising=False)
    gc.collect()
    before = len(gc.get_objects())
    trie, own = SuffixTrie(), OwnHistory()
    for seq in _random_sequences(200, 7):
        trie.add(seq)
        for t in seq:
            own.extend(t)
    gc.collect()
    grown = len(gc.get_objects()) - before
    assert trie.num_nodes > 5000 and len(own.ends) > 5000
    assert (grown < 50) == (broken is None), grown


@pytest.mark.parametrize("broken", [False, True])
def test_own_history_proposes_what_a_trie_of_the_sequence_proposes(monkeypatch, broken):
    """On random sequences over 3 tokens (many ties and repeats), at every length and
    budget, OwnHistory's continuation equals the trie's. Broken: ties going to the token
    seen last instead of first differ somewhere."""
    if broken:
        real = OwnHistory._walk

        def last_wins(self, ends, limit, min_path_prob):  # followers then count in last-seen order
            return real(self, ends[::-1], limit, min_path_prob)
        monkeypatch.setattr(OwnHistory, "_walk", last_wins)
    rng = random.Random(5)
    mismatches = 0
    for _ in range(60):
        seq = [rng.randrange(3) for _ in range(rng.randint(1, 60))]
        trie, frontier, own = SuffixTrie(), None, OwnHistory()
        frontier = [trie.root]  # node ids, which serve as handles while nothing is freed
        for t in seq:
            frontier = trie.extend(frontier, t)
            own.extend(t)
            for budget in (1, 3, 16):
                mismatches += own.continuation(budget) != trie.continuation(frontier, budget)
    assert (mismatches == 0) != broken, mismatches


# ---------------------------------------------------------------------------- in the engine
PAIR = tiny_pair(vocab=VOCAB, noise=0.3, seed=4)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        head = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
        out.append((head * 4)[: rng.randint(6, 20)])
    return out


@pytest.fixture
def python_index(monkeypatch):
    """Engines built meanwhile run the Python index, whose state the checks read."""
    monkeypatch.setattr(suffix_mod, "make_index", lambda native=None, **limits: PythonIndex(**limits))


def own_history_problems(engine) -> list[str]:
    """Each running request's own history must hold exactly its committed tokens seen so
    far, with every n-gram's end positions: nothing of another request, no draft."""
    proposer = engine.proposers["suffix"]
    if not isinstance(proposer.index, PythonIndex):
        return []
    problems = []
    for rid, tracked in proposer._requests.items():
        state = proposer.index.rows[tracked.row]
        want = OwnHistory()
        for t in tracked.req.all_ids[:tracked.seen]:
            want.extend(t)
        if (state.own.tokens, state.own.ends) != (want.tokens, want.ends):
            problems.append(rid)
    return problems


def run_checked(engine, prompts, params) -> list:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    problems, done = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        problems += own_history_problems(engine)
    return problems, [done[f"r{i}"] for i in range(len(prompts))]


def test_own_histories_hold_only_their_own_committed_tokens(python_index):
    engine = tiny_engine(PAIR[0], method="suffix", k=4)
    problems, outs = run_checked(engine, _prompts(6, 1), SAMPLED)
    assert problems == []
    drafted = sum(o.spec.num_draft_tokens for o in outs)
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    assert drafted > 0 and accepted < drafted  # rejections happened: the check covered them


def test_the_check_catches_a_history_shared_between_requests(python_index, monkeypatch):
    shared = OwnHistory()
    real_init = suffix_mod._RowState.__init__

    def leaky(self, global_trie):  # the bug: every request extends one own history
        real_init(self, global_trie)
        self.own = shared
    monkeypatch.setattr(suffix_mod._RowState, "__init__", leaky)
    problems, _ = run_checked(tiny_engine(PAIR[0], method="suffix", k=4), _prompts(6, 1), SAMPLED)
    assert problems


def test_the_check_catches_drafts_left_in_the_history(python_index, monkeypatch):
    real_draft = SuffixProposer.draft

    def stale(self, rows, ks):  # the bug: drafted tokens are counted before verification
        out = real_draft(self, rows, ks)
        for r, (tokens, _) in zip(rows, out):
            state = self.index.rows[self._requests[r.request_id].row]
            for t in tokens:
                state.own.extend(t)
        return out
    monkeypatch.setattr(SuffixProposer, "draft", stale)
    problems, _ = run_checked(tiny_engine(PAIR[0], method="suffix", k=4), _prompts(6, 1), SAMPLED)
    assert problems


def test_finished_outputs_join_the_global_trie_and_leave_it_oldest_first(python_index):
    engine = tiny_engine(PAIR[0], method="suffix", k=4)
    proposer = engine.proposers["suffix"]
    proposer.global_nodes = 600
    _, outs = run_checked(engine, _prompts(8, 2), GREEDY)
    kept = list(proposer._outputs.values())
    assert trie_counts(proposer.index.trie) == substring_counts(kept)
    assert proposer.index.num_nodes() <= 600 and proposer._counts["evicted_outputs"] > 0
    assert kept and all(k in [o.token_ids for o in outs] for k in kept)
    assert list(proposer._outputs) == list(range(proposer._added - len(kept), proposer._added))  # newest stay
    stats = engine.stats().proposer_stats["suffix"]
    assert stats["global_nodes"] == proposer.index.num_nodes() and stats["lookups_total"] > 0


def test_a_repeated_request_is_drafted_from_the_global_trie():
    engine = tiny_engine(PAIR[0], method="suffix", k=8)
    prompt = _prompts(1, 3)[0]
    first = run_checked(engine, [prompt], GREEDY)[1][0]
    engine.proposers["suffix"]._counts["global_hits"] = 0
    second = run_checked(engine, [prompt], GREEDY)[1][0]
    assert second.token_ids == first.token_ids
    assert engine.proposers["suffix"]._counts["global_hits"] > 0
    assert second.spec.num_accepted_tokens > first.spec.num_accepted_tokens


@pytest.mark.parametrize("broken", [False, True])
def test_with_no_cached_requests_no_request_drafts_from_another(monkeypatch, broken):
    """suffix_max_cached_requests 0: a repeated request finds nothing of the first in the
    global trie (it stays at its root), and its output is plain decoding's."""
    if broken:  # the cap left unread: outputs join the trie as without one
        real = SuffixProposer.__init__
        monkeypatch.setattr(SuffixProposer, "__init__",
                            lambda self, *a, **kw: real(self, *a, **{**kw, "max_outputs": None}))
    engine = tiny_engine(PAIR[0], method="suffix", k=8, suffix_max_cached_requests=0)
    prompt = _prompts(1, 3)[0]
    first = run_checked(engine, [prompt], GREEDY)[1][0]
    second = run_checked(engine, [prompt], GREEDY)[1][0]
    assert second.token_ids == first.token_ids
    stats = engine.proposers["suffix"].stats()
    assert (stats["global_hits_total"] == 0 and stats["global_nodes"] == 1) != broken


def test_the_runs_draft_limits_reach_the_index():
    from verispec.config import EngineConfig, SpecConfig
    from verispec.spec.proposer import ProposerContext, build_proposers
    spec = SpecConfig(method="suffix", suffix_max_spec_factor=1.0, suffix_min_token_prob=0.3)
    proposers, _ = build_proposers(ProposerContext(EngineConfig(model="tiny", kernels="off", spec=spec)))
    index = proposers["suffix"].index
    assert (index.match_factor, index.min_path_prob) == (1.0, 0.3)


def test_the_global_trie_keeps_the_newest_cached_requests():
    engine = tiny_engine(PAIR[0], method="suffix", k=8, suffix_max_cached_requests=2)
    run_checked(engine, _prompts(3, 11), GREEDY)
    proposer = engine.proposers["suffix"]
    assert (proposer.stats()["global_outputs"], proposer.stats()["evicted_outputs_total"]) == (2, 1)
    assert list(proposer._outputs) == [1, 2]   # the oldest left


def test_a_suffix_request_runs_at_its_method_s_k_max_unless_one_is_set():
    prompt = _prompts(1, 3)[0]
    engine = tiny_engine(PAIR[0], method="ngram", k=None, adaptive=True)
    engine.add_request("suffix", prompt, GREEDY, SpecOverride(method="suffix"))
    engine.add_request("ngram", prompt, GREEDY)
    engine.add_request("suffix-4", prompt, GREEDY, SpecOverride(method="suffix", num_tokens=4))
    assert {rid: engine.requests[rid].num_spec_tokens for rid in ("suffix", "ngram", "suffix-4")} == \
        {"suffix": 16, "ngram": DEFAULT_SPEC_TOKENS, "suffix-4": 4}
    engine = tiny_engine(PAIR[0], method="ngram", k=5, adaptive=True)   # the run's k_max: every method's
    engine.add_request("suffix", prompt, GREEDY, SpecOverride(method="suffix"))
    assert engine.requests["suffix"].num_spec_tokens == 5


@pytest.mark.parametrize("k", [1, 3, 8, 16])
def test_suffix_greedy_output_equals_plain(k):
    prompts = _prompts(5, 7)
    plain = [o.token_ids for o in run_checked(tiny_engine(PAIR[0], method="none"), prompts, GREEDY)[1]]
    spec = [o.token_ids for o in run_checked(tiny_engine(PAIR[0], method="suffix", k=k), prompts, GREEDY)[1]]
    assert spec == plain


def test_the_suffix_tries_state_is_in_metrics():
    from prometheus_client.parser import text_string_to_metric_families

    from verispec.server.metrics import ServerMetrics
    engine = tiny_engine(PAIR[0], method="suffix", k=4)
    run_checked(engine, _prompts(3, 5), GREEDY)
    metrics = ServerMetrics("tiny", engine.stats)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render()[0].decode())}
    nodes = families["verispec:spec_suffix_global_nodes"]
    assert nodes.type == "gauge" and nodes.samples[0].value == engine.proposers["suffix"].index.num_nodes() > 1
    lookups = families["verispec:spec_suffix_lookups"]
    assert lookups.type == "counter" and lookups.samples[0].value == engine.proposers["suffix"]._counts["lookups"] > 0
