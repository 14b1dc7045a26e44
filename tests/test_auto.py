"""Method "auto": per row and round, the candidate proposer whose drafts that row accepts
more often (`SpeculationPolicy.better`), then k as for any proposer.

Its losslessness is the gates' (G1 and G2 run it with the n-gram lookup and a head as
candidates); here: the rule itself, and that an engine under "auto" really drafts with
both candidates, each row with the one chosen for it, keeping greedy output identical to
plain decoding. Each is shown to fail on a broken twin.
"""
from __future__ import annotations

import pytest

from eagle_heads import trained_head_dir
from tiny import run_all, tiny_engine, tiny_pair
from verispec.config import SpecConfig
from verispec.outputs import SpecStats
from verispec.request import SpecOverride
from verispec.sampling import SamplingParams
from verispec.spec.policy import RoundReport, RowOffer, SpeculationPolicy

PAIR = tiny_pair(vocab=48, noise=0.1, seed=3)
# Repetitive prompts (lookups match) and one without a repeated token (only the head offers).
PROMPTS = [[5, 9, 2, 7, 5, 9, 2, 7, 5, 9], [1, 1, 4, 4, 1, 1, 4, 4, 1], list(range(10, 30))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def offer(proposer: str, available: int, key: int = 0) -> RowOffer:
    return RowOffer("r", proposer, available, 4, key=key)


def learned(policy: SpeculationPolicy, proposer: str, key: int, accepted: int, drafted: int = 4) -> None:
    for _ in range(5):
        policy.acceptance.observe("r", proposer, key, drafted, accepted)


@pytest.mark.parametrize("broken", [False, True])
def test_better_keeps_the_offer_the_row_accepts_more_often_then_the_longer(monkeypatch, broken):
    if broken:  # keeps whichever came first
        monkeypatch.setattr(SpeculationPolicy, "better", lambda self, current, other: current)
    policy = SpeculationPolicy(16)
    learned(policy, "ngram", 2, accepted=1)
    learned(policy, "eagle", 0, accepted=3)
    checks = [
        policy.better(offer("ngram", 3, 2), offer("eagle", 4)).proposer == "eagle",   # accepted more often
        policy.better(offer("ngram", 0), offer("eagle", 4)).proposer == "eagle",      # the lookup has nothing
        policy.better(offer("eagle", 0), offer("ngram", 2, 2)).proposer == "ngram",
        policy.better(offer("ngram", 2, 9), offer("suffix", 3, 9)).proposer == "suffix",  # equal estimates: longer
    ]
    assert all(checks) != broken, checks


@pytest.mark.parametrize("broken", [False, True])
def test_better_charges_a_timed_proposers_measured_draft_cost(monkeypatch, broken):
    """A head the row accepts more often than the lookup, but whose drafted token costs 0.3
    of a row (measured), loses the row to the free lookup; before any pass is timed its cost
    is taken as none, as an unmeasured cost cell's."""
    if broken:  # acceptance alone
        monkeypatch.setattr(SpeculationPolicy, "_net_acceptance",
                            lambda self, o: self.acceptance.alpha(o.request_id, o.proposer, o.key))
    policy = SpeculationPolicy(16)
    learned(policy, "ngram", 2, accepted=2)
    learned(policy, "eagle", 0, accepted=3)
    lookup, head = offer("ngram", 3, 2), RowOffer("r", "eagle", 4, 4, timed=True)
    assert policy.acceptance.alpha("r", "eagle", 0) > policy.acceptance.alpha("r", "ngram", 2)
    unmeasured = policy.better(lookup, head).proposer == "eagle"
    for _ in range(3):  # a depth-1 pass for one row: 3 ms against a 10 ms verify pass of one row
        policy.observe(RoundReport(1, [], 0.010, 1, {"eagle": (1, 1, 0.003)}))
    measured = policy.better(lookup, head).proposer == "ngram"
    assert (unmeasured and measured) != broken, (unmeasured, measured)
    assert policy.snapshot()["draft_shares"] == {"eagle": 0.3}  # reported with the policy's state


def test_auto_candidates_must_be_proposers_auto_may_pick():
    with pytest.raises(ValueError, match="auto_candidates"):
        SpecConfig(auto_candidates=("draft",))
    with pytest.raises(ValueError, match="auto_candidates"):
        SpecConfig(auto_candidates=())
    assert SpecConfig(auto_candidates=["ngram", "suffix"]).auto_candidates == ("ngram", "suffix")


def test_auto_without_an_available_candidate_is_refused_by_name():
    engine = tiny_engine(PAIR[0], method="ngram", auto_candidates=("eagle",))  # no head here
    with pytest.raises(ValueError, match="'auto' has no candidate here: none of \\['eagle'\\]"):
        engine.add_request("r", [1, 2, 3], GREEDY, spec=SpecOverride(method="auto"))


def drafting_rows(engine) -> dict[str, list[str]]:
    """Proposer name -> the request ids it drafted for, round by round."""
    seen: dict[str, list[str]] = {}
    for name, proposer in engine.proposers.items():
        real = proposer.draft

        def draft(reqs, ks, real=real, name=name):
            seen.setdefault(name, []).extend(r.request_id for r in reqs)
            assert all(r.drafter == name for r in reqs)  # each row drafts with the one chosen for it
            return real(reqs, ks)
        proposer.draft = draft
    return seen


@pytest.mark.parametrize("broken", [False, True])
def test_auto_drafts_with_both_candidates_and_keeps_greedy_output(monkeypatch, broken):
    target = PAIR[0]
    head = trained_head_dir(target, 32)
    plain = [o.token_ids for o in run_all(tiny_engine(target, method="none"), PROMPTS, GREEDY)]
    if broken:  # the first candidate's offer always wins, even an empty one
        monkeypatch.setattr(SpeculationPolicy, "better", lambda self, current, other: current)
    engine = tiny_engine(target, method="auto", k=4, adaptive=True, draft_head=head)
    seen = drafting_rows(engine)
    outs = run_all(engine, PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert ("eagle" in seen and "ngram" in seen) != broken, {n: len(v) for n, v in seen.items()}
    by_proposer = SpecStats.summed([o.spec for o in outs]).proposers_dict()
    assert set(by_proposer) == set(seen)  # each output says which proposers drafted for it
    assert sum(p["drafted"] for p in by_proposer.values()) == sum(o.spec.num_draft_tokens for o in outs)
