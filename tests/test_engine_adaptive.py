"""The engine and the adaptive controller together: what the controller is told and what
the engine then does with its choice.

* n-gram rows are looked up before k is chosen, and the controller is told each row's
  match length (clipped to the request's k and budget), so a row without a match is never
  charged for drafts it cannot have;
* every row drafts exactly the k chosen for it, and the verify cost is reported against
  the draft tokens the pass really verified;
* a request's own k (the server's `speculative.num_tokens`) caps the adaptive choice.
Each is shown to fail on an engine that breaks it.
"""
from __future__ import annotations

import time

import pytest

from tiny import run_all, tiny_engine, tiny_pair
from verispec.engine.engine import SpecOverride, _History
from verispec.spec.ngram import NgramProposer
from verispec.sampling import SamplingParams

VOCAB = 48
PAIR = tiny_pair(vocab=VOCAB, noise=0.1, seed=3)
# Repetitive prompts (n-gram matches) next to one with no repeated token (no match at first).
PROMPTS = [[5, 9, 2, 7, 5, 9, 2, 7, 5, 9], [1, 1, 4, 4, 1, 1, 4, 4, 1], list(range(10, 30))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def record(engine):
    """Wrap the controller: log (available, chosen, found) per choose_k, the match lengths
    it was given and those a fresh lookup finds, each verify cost size, and the match length
    each acceptance report names, by request."""
    log = {"choices": [], "verify_sizes": [], "matches": [], "accepted_matches": []}
    ctl = engine.controller
    choose, observe, accept = ctl.choose_k, ctl.observe_cost, ctl.observe_acceptance

    def choose_k(ids, batch_size, available=None, **kw):
        out = choose(ids, batch_size, available, **kw)
        # What a fresh lookup over each request's history finds, clipped to its budget.
        reqs = [engine.requests[r] for r in ids]
        found = NgramProposer(engine.ngram.max_n, engine.ngram.min_n).lookup_matches(
            [_History(r) for r in reqs], [engine.scheduler.spec_budget(r) for r in reqs])
        log["choices"].append((dict(zip(ids, available)), dict(out),
                               {r: len(f) for r, (f, _) in zip(ids, found)}))
        log["matches"].append((dict(zip(ids, kw.get("matches") or [None] * len(ids))),
                               {r: n or None for r, (_, n) in zip(ids, found)}, dict(out)))
        return out

    def observe_acceptance(rid, drafted, accepted, match=None):
        log["accepted_matches"].append((rid, drafted, match))
        return accept(rid, drafted, accepted, match)

    def observe_cost(kind, batch_size, size, seconds):
        if kind == "verify":
            log["verify_sizes"].append(size)
        if kind == "choice":  # (the fresh lookup above is timed inside it: the test's cost, and
            seconds = 0.0     # on this tiny model's ~1 ms rounds enough to price drafting out)
        return observe(kind, batch_size, size, seconds)

    ctl.choose_k, ctl.observe_cost, ctl.observe_acceptance = choose_k, observe_cost, observe_acceptance
    return log


def drafts_per_step(engine):
    """Log the draft tokens each step verifies and the rows that drafted other than the k
    chosen for them (logged, not raised: the engine turns a step's exception into aborts)."""
    log = {"sizes": [], "mismatches": []}
    propose = engine._propose

    def wrapped(rows, ks, lookups):
        drafts, seconds = propose(rows, ks, lookups)
        log["mismatches"] += [r.request_id for r in rows
                              if len(drafts.get(r.request_id, ([], None))[0]) != ks[r.request_id]]
        log["sizes"].append(sum(len(d[0]) for d in drafts.values()))
        return drafts, seconds

    engine._propose = wrapped
    return log


def test_ngram_availability_reaches_the_controller_and_rows_draft_what_was_chosen():
    engine = tiny_engine(PAIR[0], method="ngram", k=4, adaptive=True)
    log, drafted = record(engine), drafts_per_step(engine)
    out = run_all(engine, PROMPTS, GREEDY)
    assert not any(o.error for o in out) and not drafted["mismatches"]
    assert log["choices"]
    for available, chosen, found in log["choices"]:
        assert available == found                     # exactly what the lookup has
        assert all(0 <= chosen[r] <= available[r] <= 4 for r in chosen)
    assert any(a == 0 for available, _, _ in log["choices"] for a in available.values())
    assert any(k > 0 for _, chosen, _ in log["choices"] for k in chosen.values())
    # Every timed round reports the draft tokens its pass verified (steps with prefill are not timed).
    assert log["verify_sizes"] and set(log["verify_sizes"]) <= set(drafted["sizes"])
    # The controller hears each row's match length with its lookup, and again with its acceptance.
    given_then = []
    for given, found, chosen in log["matches"]:
        assert given == found
        given_then += [(r, given[r]) for r in chosen if chosen[r]]
    assert any(n for n, _, _ in log["matches"] for n in n.values())
    assert [(r, m) for r, d, m in log["accepted_matches"] if d] == given_then


def test_an_engine_that_chooses_k_before_the_lookup_is_caught():
    """Broken: the controller is not told the lookup's result (every row looks available
    up to its budget), so rows are charged for drafts they cannot have and draft fewer
    tokens than chosen: both checks above fail."""
    engine = tiny_engine(PAIR[0], method="ngram", k=4, adaptive=True)
    log = record(engine)
    original = engine._choose_k
    engine._choose_k = lambda rows, drafting, adaptive, lookups: original(rows, drafting, adaptive, {})
    run_all(engine, PROMPTS, GREEDY)
    assert any(available != found for available, _, found in log["choices"])
    broken = tiny_engine(PAIR[0], method="ngram", k=4, adaptive=True)
    drafted = drafts_per_step(broken)
    original2 = broken._choose_k
    broken._choose_k = lambda rows, drafting, adaptive, lookups: original2(rows, drafting, adaptive, {})
    run_all(broken, PROMPTS, GREEDY)
    assert drafted["mismatches"]


def deepest_round(method: str, broken: bool = False) -> int:
    target, draft = PAIR
    engine = tiny_engine(target, draft if method == "draft" else None, method=method, k=8, adaptive=True)
    ctl = engine.controller  # drafting looks free, so the controller drafts all it may
    for b in range(1, 9):  # every batch bucket the run can reach
        for n in range(0, 40):
            ctl.observe_cost("verify", b, n, 1.0)
            ctl.observe_cost("draft", b, n + 1, 0.0)
    ctl.observe_cost = lambda *args: None
    if broken:  # the request's own k ignored: only what is left of max_tokens limits drafting
        engine.scheduler.spec_budget = lambda r: max(0, min(8, r.remaining_tokens - 1))
    out = run_all(engine, PROMPTS, GREEDY, spec=SpecOverride(num_tokens=2, adaptive=True))
    assert any(o.spec.num_draft_tokens for o in out)
    return max(len(o.spec.drafted_per_position) for o in out)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_request_k_caps_the_adaptive_choice(method):
    assert deepest_round(method) <= 2
    assert deepest_round(method, broken=True) > 2


def test_a_resting_controllers_rows_are_neither_looked_up_nor_chosen_for_and_play_plain():
    """While the controller rests (controller docstring "Rest") its rows skip the n-gram
    lookup and choose_k and verify no drafts; a fixed-k row in the same batch still drafts,
    and every output is what plain decoding gives."""
    engine = tiny_engine(PAIR[0], method="ngram", k=4, adaptive=True)
    ctl = engine.controller
    looked_up, chosen = [], []
    lookup, choose = engine.ngram.lookup_matches, ctl.choose_k
    engine.ngram.lookup_matches = lambda histories, ks: (looked_up.extend(h.seq_id for h in histories),
                                                         lookup(histories, ks))[1]
    ctl.choose_k = lambda *a, **kw: (chosen.append(a[0]), choose(*a, **kw))[1]
    ctl.rest = lambda ids, batch_size: True
    fixed = SpecOverride(num_tokens=2, adaptive=False)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"a{i}", prompt, GREEDY)
    engine.add_request("fixed", PROMPTS[0], GREEDY, fixed)
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_integrity()
    assert set(looked_up) == {"fixed"} and not chosen
    assert all(final[f"a{i}"].spec.num_draft_tokens == 0 for i in range(len(PROMPTS)))
    assert final["fixed"].spec.num_draft_tokens > 0
    plain = run_all(tiny_engine(PAIR[0], method="none"), PROMPTS + [PROMPTS[0]], GREEDY)
    assert [final[r].token_ids for r in ("a0", "a1", "a2", "fixed")] == [o.token_ids for o in plain]


@pytest.mark.parametrize("resting", [False, True], ids=["choosing", "resting"])
def test_the_choice_is_timed_apart_from_the_verify_round(resting):
    """A round that chooses reports its lookup and choose_k as kind "choice" and leaves them
    out of the verify timing (controller docstring "Rest"): with choose_k made 50 ms slow,
    every choice report holds it and no verify report does (a decode round of this model
    takes a few ms). A resting round reports no choice."""
    engine = tiny_engine(PAIR[0], method="ngram", k=4, adaptive=True)
    ctl = engine.controller
    reports = {"choice": [], "verify": []}
    choose, observe = ctl.choose_k, ctl.observe_cost

    def slow_choose(*a, **kw):
        time.sleep(0.05)
        return choose(*a, **kw)

    def observe_cost(kind, batch_size, size, seconds):
        reports.setdefault(kind, []).append((batch_size, size, seconds))
        return observe(kind, batch_size, size, seconds)

    ctl.choose_k, ctl.observe_cost = slow_choose, observe_cost
    if resting:
        ctl.rest = lambda ids, batch_size: True
    run_all(engine, PROMPTS, GREEDY)
    assert reports["verify"] and all(s < 0.05 for _, _, s in reports["verify"]), reports["verify"]
    if resting:
        assert not reports["choice"]
    else:
        assert reports["choice"] and all(s >= 0.05 and 1 <= n <= b for b, n, s in reports["choice"])


def test_the_controller_hears_each_finished_requests_length_and_whether_it_ended_early():
    """The controller prices a draft model's catch-up over the tokens a request is expected
    still to make, from how finished ones ended (controller docstring "Catch-ups"): each
    finish reports the request's output tokens and whether it stopped before its budget
    (EOS), and an abort reports no length."""
    target, draft = PAIR
    probe = run_all(tiny_engine(target, draft, method="draft", k=4, adaptive=True), PROMPTS[:1], GREEDY)
    eos = probe[0].token_ids[3]  # greedy reaches it after a few tokens, so the request stops there
    engine = tiny_engine(target, draft, method="draft", k=4, adaptive=True, eos=eos)
    finished = []
    ctl_finish = engine.controller.finish
    engine.controller.finish = lambda rid, *a, **kw: (finished.append((rid, a, kw)), ctl_finish(rid, *a, **kw))[1]
    engine.add_request("aborted", PROMPTS[2], GREEDY)
    engine.step()
    engine.abort_request("aborted")
    stops_at_eos = SamplingParams(temperature=0, max_tokens=12)
    out = run_all(engine, PROMPTS, [stops_at_eos, GREEDY, GREEDY])  # the others ignore EOS
    reasons = {o.request_id: o.finish_reason for o in out}
    assert sorted(reasons.values()) == ["length", "length", "stop"], reasons
    told = {rid: (a, kw) for rid, a, kw in finished}
    assert told.pop("aborted") == ((None,), {"ended_early": False})
    assert told == {o.request_id: ((len(o.token_ids),), {"ended_early": o.finish_reason == "stop"}) for o in out}
