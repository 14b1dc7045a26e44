"""The proposer interface: a new proposer is one file (tests/fake_proposer.py) and one
registry line, and the engine drives it through every call of the interface with the same
guarantee as the built-in ones: greedy output equal to plain decoding."""
from __future__ import annotations

import pytest

import bugs
from fake_proposer import CountingProposer
from tiny import run_all, tiny_engine, tiny_pair
from verispec.config import spec_methods
from verispec.request import SpecOverride
from verispec.sampling import SamplingParams
from verispec.spec import proposer as proposer_mod
from verispec.spec.proposer import register_proposer

PAIR = tiny_pair(vocab=48, noise=0.1, seed=3)
PROMPTS = [[5, 9, 2, 7, 5, 9, 2, 7, 5, 9], [1, 2, 3, 4, 5, 6], list(range(10, 30))]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(proposer_mod, "_FACTORIES", dict(proposer_mod._FACTORIES))


def outputs(method: str) -> tuple[list[list[int]], object]:
    engine = tiny_engine(PAIR[0], method=method, k=3, adaptive=False)
    return [o.token_ids for o in run_all(engine, PROMPTS, GREEDY)], engine


@pytest.mark.parametrize("broken", [False, True])
def test_a_new_proposer_is_one_file_and_one_registry_line(registry, monkeypatch, broken):
    register_proposer("counting", CountingProposer)
    assert "counting" in spec_methods()
    plain, _ = outputs("none")
    if broken:  # every draft accepted: only the verification keeps outputs equal to plain
        bugs.inject(monkeypatch, "skip_acceptance_test")
    drafted, engine = outputs("counting")
    calls = engine.proposers["counting"].calls
    assert all(calls[c] > 0 for c in calls), calls
    assert sum(engine.policy.k_counts[1:]) > 0  # it drafted
    assert (drafted == plain) != broken


def test_a_method_that_cannot_be_built_here_says_what_it_needs():
    engine = tiny_engine(PAIR[0], method="ngram")
    with pytest.raises(ValueError, match="needs a draft model"):
        engine.add_request("r", [1, 2, 3], GREEDY, spec=SpecOverride(method="draft"))
    with pytest.raises(ValueError, match="must be one of 'none', 'auto', 'ngram'"):
        engine.add_request("r", [1, 2, 3], GREEDY,
                           spec=SpecOverride(method="nope"))
    with pytest.raises(ValueError, match="identifier other than 'none' and 'auto'"):
        register_proposer("none", CountingProposer)
    with pytest.raises(ValueError, match="identifier other than 'none' and 'auto'"):
        register_proposer("auto", CountingProposer)
