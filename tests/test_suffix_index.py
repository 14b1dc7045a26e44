"""suffix_index.cpp computes what suffix.py's Python index computes.

The Python classes are the reference (the engine tests inject their bugs there); the
engine drafts with the C++ index where it builds. On random workloads over a 3-token
vocabulary (ties and repeats everywhere), with outputs added to and evicted from the
global trie (ids freed and reused, so stale frontier handles occur), rows growing by
ragged chunks and some rebuilt after their history shrank, every lookup and the trie's
size must be equal. A Python index with ties going to the last-seen follower shows the
comparison can fail.
"""
from __future__ import annotations

import random

import pytest

from verispec.spec import suffix as suffix_mod
from verispec.spec.suffix import PythonIndex, make_index


def mismatches(native, reference, seed: int, steps: int = 400) -> int:
    rng = random.Random(seed)
    histories: dict[int, list[int]] = {}
    outputs: list[list[int]] = []
    bad = 0
    for _ in range(steps):
        action = rng.random()
        if action < 0.15:  # an output joins the global trie
            out = [rng.randrange(3) for _ in range(rng.randint(1, 30))]
            outputs.append(out)
            for index in (native, reference):
                index.add_output(out)
        elif action < 0.22 and outputs:  # the oldest leaves it
            out = outputs.pop(0)
            for index in (native, reference):
                index.remove_output(out)
        elif action < 0.25 and histories:  # a row ends
            row = rng.choice(list(histories))
            del histories[row]
            for index in (native, reference):
                index.drop_row(row)
        else:  # a row grows (or, rarely, is rebuilt shorter: preempted) and is looked up
            row = rng.randrange(6)
            tokens = histories.setdefault(row, [])
            new = [rng.randrange(3) for _ in range(rng.randint(1, 4))]
            if tokens and rng.random() < 0.05:
                del tokens[rng.randrange(len(tokens)):]
                new = tokens + new
                tokens.clear()
                for index in (native, reference):
                    index.drop_row(row)
            tokens += new
            budget = rng.choice((1, 3, 8, 16))
            for index in (native, reference):
                index.extend(row, new)
            bad += native.lookup(row, budget) != reference.lookup(row, budget)
        bad += native.num_nodes() != reference.num_nodes()
    return bad


@pytest.fixture(scope="module")
def native_index():
    index = make_index(native=None)
    if isinstance(index, PythonIndex):
        pytest.fail("the C++ suffix index did not build (the log's warning says why)")
    return lambda **limits: make_index(native=True, **limits)


@pytest.mark.parametrize("seed", range(6))
def test_the_cpp_index_looks_up_what_the_python_index_does(native_index, seed):
    assert mismatches(native_index(), PythonIndex(), seed) == 0


def test_the_comparison_catches_an_index_breaking_ties_the_other_way(native_index, monkeypatch):
    real = suffix_mod.OwnHistory._walk
    monkeypatch.setattr(suffix_mod.OwnHistory, "_walk",
                        lambda self, ends, limit, prob: real(self, ends[::-1], limit, prob))
    assert sum(mismatches(native_index(), PythonIndex(), seed) for seed in range(3)) > 0


LIMITS = {"match_factor": 1.0, "min_path_prob": 0.3}   # a run's limits other than the defaults (2.0, 0.1)


@pytest.mark.parametrize("broken", [False, True])
def test_both_indexes_draft_within_the_runs_limits(native_index, broken):
    """A run's own factor and probability floor reach both indexes alike (a Python index left
    at the defaults drafts longer and is caught)."""
    def reference():
        return PythonIndex() if broken else PythonIndex(**LIMITS)
    assert (sum(mismatches(native_index(**LIMITS), reference(), seed) for seed in range(3)) > 0) == broken


@pytest.mark.parametrize("kernels,python", [("off", True), ("auto", False), ("on", False)])
def test_the_index_follows_the_engines_kernels_setting(native_index, kernels, python):
    from verispec.config import EngineConfig
    from verispec.spec.proposer import ProposerContext, build_proposers
    proposers, _ = build_proposers(ProposerContext(EngineConfig(model="tiny", kernels=kernels)))
    suffix = proposers["suffix"]
    assert suffix._index is None  # nothing is built before the first lookup
    assert isinstance(suffix.index, PythonIndex) == python
