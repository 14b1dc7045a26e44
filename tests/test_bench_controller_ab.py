"""bench/controller_ab.py: each variant switches off what it names and nothing else, and
lockstep runs meet the machine's drift alike."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench_scripts import load
from tiny import run_all, tiny_engine, tiny_pair
from verispec.sampling import SamplingParams
from verispec.spec.policy import RowOffer

controller_ab = load("controller_ab", "controller_ab_bench")
PAIR = tiny_pair(vocab=48, noise=0.1, seed=3)
PROMPTS = [[5, 9, 2, 7, 5, 9, 2, 7, 5, 9], [1, 1, 4, 4, 1, 1, 4, 4, 1], list(range(10, 30))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def planned(baseline: str):
    """Every plan's offers and ks on an adaptive n-gram engine with the variant applied."""
    engine = tiny_engine(PAIR[0], method="ngram", k=4, adaptive=True)
    controller_ab.ABLATIONS[baseline](engine)
    log, plan = [], engine.policy.plan
    engine.policy.plan = lambda rows: (log.append((rows, plan(rows))), log[-1][1])[1]
    outputs = [o.token_ids for o in run_all(engine, PROMPTS, GREEDY)]
    return engine, log, outputs


@pytest.mark.parametrize("baseline", sorted(controller_ab.ABLATIONS))
def test_every_variant_stays_lossless(baseline):
    plain = [o.token_ids for o in run_all(tiny_engine(PAIR[0], method="none"), PROMPTS, GREEDY)]
    assert planned(baseline)[2] == plain


def test_without_keys_offers_key_zero_and_the_same_variant_keeps_match_lengths():
    assert any(r.key for rows, _ in planned("same")[1] for r in rows)
    assert not any(r.key for rows, _ in planned("without-keys")[1] for r in rows)


def test_without_allocation_hands_out_drafts_level_by_level():
    engine, _, _ = planned("without-allocation")
    engine.policy.acceptance.alpha = lambda rid, p, key: {"a": 0.9, "b": 0.2}[rid]
    gains = engine.policy._gains([SimpleNamespace(request_id=r, proposer="ngram", available=3, k_max=3,
                                                  adaptive=True, key=0) for r in "ab"])
    assert [i for _, i in gains] == [0, 1, 0, 1, 0, 1]


@pytest.mark.parametrize("draft_model,method", [(None, "ngram"), ("qwen2.5-coder-0.5b-instruct", "draft")])
def test_both_versions_draft_as_asked_and_plain_runs_no_draft_model(draft_model, method):
    argv = ["--baseline", "same", "--model", "qwen2.5-coder-1.5b-instruct", "--k-max", "6"]
    args = controller_ab.parse_args(argv + (["--draft-model", draft_model] if draft_model else []))
    config, plain = controller_ab.engine_configs(args)
    assert (config.draft_model, config.spec.method, config.spec.num_spec_tokens, config.spec.adaptive) == (
        draft_model, method, 6, True)
    assert (plain.draft_model, plain.spec.method, plain.model) == (None, "none", "qwen2.5-coder-1.5b-instruct")


def test_without_draft_cost_picks_by_acceptance_alone():
    engine, _, _ = planned("without-draft-cost")
    policy = engine.policy
    policy.acceptance.alpha = lambda rid, p, key: {"ngram": 0.5, "eagle": 0.6}[p]
    policy.draft_shares["eagle"] = SimpleNamespace(value=lambda: 0.3)  # measured: 0.3 of a row
    lookup, head = RowOffer("r", "ngram", 3, 4), RowOffer("r", "eagle", 3, 4, timed=True)
    assert policy.better(lookup, head).proposer == "eagle"
    same, _, _ = planned("same")
    same.policy.acceptance.alpha, same.policy.draft_shares = policy.acceptance.alpha, policy.draft_shares
    assert same.policy.better(lookup, head).proposer == "ngram"


@pytest.mark.parametrize("spec,head", [("auto", "/heads/h"), ("eagle", None)])
def test_spec_and_draft_head_reach_both_versions(spec, head):
    argv = ["--baseline", "same", "--spec", spec] + (["--draft-head", head] if head else [])
    config, plain = controller_ab.engine_configs(controller_ab.parse_args(argv))
    assert (config.spec.method, config.draft_head, plain.spec.method) == (spec, head, "none")


def test_a_bad_baseline_or_repeats_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        controller_ab.parse_args(["--baseline", "no-such-variant"])
    assert "--baseline: invalid choice: 'no-such-variant'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        controller_ab.parse_args(["--baseline", "same", "--repeats", "0"])
    assert "--repeats must be at least 1" in capsys.readouterr().err


class _Clock:
    """A fake time.perf_counter whose machine halves its speed at t = 30 (a slow stretch)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def work(self, units: float):
        self.now += units * (1.0 if self.now < 30.0 else 2.0)


class _Engine:
    """One request at a time, each 10 steps of `cost` units of the fake clock, a token a step."""

    def __init__(self, clock, cost):
        self.clock, self.cost, self.live, self.left = clock, cost, None, 0
        self.policy = SimpleNamespace(snapshot=lambda: {"k_counts": [0]})
        self.config = SimpleNamespace(spec=SimpleNamespace(adaptive=False, method="none"))

    def add_request(self, rid, ids, params):
        self.live, self.left = rid, 10

    def step(self):
        self.clock.work(self.cost)
        self.left -= 1
        spec = SimpleNamespace(num_draft_tokens=0, num_accepted_tokens=0, num_drafts=0, target_forwards=10)
        return [SimpleNamespace(request_id=self.live, new_token_ids=[1], token_ids=[1] * 10, finished=self.left == 0,
                                error=None, finish_reason="length", spec=spec)]


@pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "one after the other"])
def test_lockstep_steps_plain_beside_both_versions_against_the_machines_drift(lockstep, monkeypatch):
    """'old' is truly 2x slower than 'new' and plain 1.5x. The machine halves its speed part-way:
    one after the other, the later engines meet the slow stretch alone and the ratios drift;
    with --lockstep every version (plain included) steps in turn and meets it alike."""
    import common
    clock = _Clock()
    monkeypatch.setattr(common, "time", clock)
    monkeypatch.setattr(common, "cpu_sample", lambda: None)
    monkeypatch.setattr(common, "others_cpu_share", lambda a, b: None)
    costs = {"new": 1.0, "old": 2.0, "plain": 1.5}
    items = [common.WorkItem(f"p{i}", "chat", (1, 2, 3)) for i in range(2)]
    results = controller_ab.run_repeat(lambda v: _Engine(clock, costs[v]), ("new", "old", "plain"), items, 1, None,
                                       lockstep, seed=0, tag="t")
    assert list(results) == ["new", "old", "plain"] and {r.tokens for r in results.values()} == {20}
    new_vs_old = results["new"].tokens_per_s / results["old"].tokens_per_s
    new_vs_plain = results["new"].tokens_per_s / results["plain"].tokens_per_s
    assert (abs(new_vs_old - 2.0) < 0.15 and abs(new_vs_plain - 1.5) < 0.15) == lockstep, (new_vs_old, new_vs_plain)
    assert controller_ab.parse_args(["--baseline", "same", "--lockstep"]).lockstep
