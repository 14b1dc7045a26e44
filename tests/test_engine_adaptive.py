"""The engine and the speculation policy together: what the policy is offered and told,
and what the engine then does with its plan.

* n-gram rows are looked up before k is planned, and the policy is offered exactly what
  each lookup found (clipped to the request's budget) with the matched suffix's length as
  the acceptance key, so a row without a match is never planned drafts it cannot have;
* every row drafts exactly the k planned for it, and the round report names the drafts
  the pass verified and what each row accepted, under the key it was offered;
* a request's own k caps the adaptive plan.
Each is shown to fail on an engine that breaks it.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tiny import run_all, tiny_engine, tiny_pair
from verispec.engine.engine import SpecOverride
from verispec.sampling import SamplingParams
from verispec.spec.costs import TRUSTED_AT, CostCells
from verispec.spec.ngram import NgramProposer

VOCAB = 48
PAIR = tiny_pair(vocab=VOCAB, noise=0.1, seed=3)
# Repetitive prompts (n-gram matches) next to one with no repeated token (no match at first).
PROMPTS = [[5, 9, 2, 7, 5, 9, 2, 7, 5, 9], [1, 1, 4, 4, 1, 1, 4, 4, 1], list(range(10, 30))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def record(engine) -> dict:
    """Log, per round: the offers next to a fresh lookup's result, the plan, and the report."""
    log = {"rounds": [], "reports": []}
    policy = engine.policy
    plan, observe = policy.plan, policy.observe

    def planned(rows):
        reqs = [engine.requests[r.request_id] for r in rows]
        fresh = NgramProposer(engine.config.spec.ngram_max, engine.config.spec.ngram_min).lookup_matches(
            [SimpleNamespace(seq_id=r.request_id, token_ids=r.all_ids) for r in reqs],
            [engine.scheduler.spec_budget(r) for r in reqs])
        ks = plan(rows)
        log["rounds"].append((rows, fresh, ks))
        return ks

    def observed(report):
        log["reports"].append(report)
        observe(report)

    policy.plan, policy.observe = planned, observed
    return log


def drafting_is_free(engine) -> None:
    """Costs that make every draft pay: the policy then drafts all it is offered."""
    for b in range(1, 4):
        for n in range(0, 40):
            for _ in range(TRUSTED_AT):
                engine.policy.verify_costs.observe(b, n, 1.0)
                engine.policy.draft_costs.setdefault("draft", CostCells()).observe(b, n, 0.0)
    engine.policy.observe = lambda report: None


def test_offers_are_the_lookups_and_rows_draft_what_was_planned():
    engine = tiny_engine(PAIR[0], method="ngram", k=4, adaptive=True)
    log = record(engine)
    out = run_all(engine, PROMPTS, GREEDY)
    assert not any(o.error for o in out) and log["rounds"]
    for rows, fresh, ks in log["rounds"]:
        assert [(r.available, r.key) for r in rows] == [(len(t), n) for t, n in fresh]
        assert all(0 <= k <= r.available <= 4 for r, k in zip(rows, ks))
    assert any(r.available == 0 for rows, _, _ in log["rounds"] for r in rows)
    assert any(k > 0 for _, _, ks in log["rounds"] for k in ks)
    # Each report: the rows drafted what was planned, under the key they were offered.
    for (rows, _, ks), report in zip(log["rounds"], log["reports"]):
        assert [(x.request_id, x.key, x.drafted) for x in report.rows] == \
            [(r.request_id, r.key, k) for r, k in zip(rows, ks)]
        assert report.drafted == sum(ks) and all(0 <= x.accepted <= x.drafted for x in report.rows)


def test_an_engine_that_offers_the_budget_instead_of_the_lookup_is_caught(monkeypatch):
    """Broken: every n-gram row is offered its whole budget, found or not: the offers no
    longer equal the lookups, and rows draft fewer tokens than planned."""
    real = NgramProposer.offer
    monkeypatch.setattr(NgramProposer, "offer", lambda self, rows, budgets: [
        o._replace(available=b) for o, b in zip(real(self, rows, budgets), budgets)])
    engine = tiny_engine(PAIR[0], method="ngram", k=4, adaptive=True)
    log = record(engine)
    run_all(engine, PROMPTS, GREEDY)
    assert any([r.available for r in rows] != [len(t) for t, _ in fresh] for rows, fresh, _ in log["rounds"])
    assert any([x.drafted for x in rep.rows] != ks for (_, _, ks), rep in zip(log["rounds"], log["reports"]))


def deepest_round(method: str, broken: bool = False) -> int:
    target, draft = PAIR
    engine = tiny_engine(target, draft if method == "draft" else None, method=method, k=8, adaptive=True)
    drafting_is_free(engine)
    if broken:  # the request's own k ignored: only what is left of max_tokens limits drafting
        engine.scheduler.spec_budget = lambda r: max(0, min(8, r.remaining_tokens - 1))
        real = engine._offers
        engine._offers = lambda rows: [o._replace(k_max=8) for o in real(rows)]
    out = run_all(engine, PROMPTS, GREEDY, spec=SpecOverride(num_tokens=2, adaptive=True))
    assert any(o.spec.num_draft_tokens for o in out)
    return max(len(o.spec.drafted_per_position) for o in out)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_request_k_caps_the_adaptive_plan(method):
    assert deepest_round(method) <= 2
    assert deepest_round(method, broken=True) > 2
