"""bench/controller_ab.py: the baseline controller comes from git, whole and on its own."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from bench_scripts import load
from verispec.spec import controller

controller_ab = load("controller_ab", "controller_ab_bench")


def test_the_baseline_is_the_revisions_controller_in_a_module_of_its_own():
    module, commit = controller_ab.load_baseline("HEAD")
    assert len(commit) == 40 and module is not controller
    assert module.AdaptiveController is not controller.AdaptiveController
    ctl = controller_ab.baseline_controller(module, controller.ControllerConfig())
    ctl.start("r", "ngram")
    assert ctl.choose_k(["r"], 1, [4]) == {"r": 0}  # nothing measured yet: plain, as the engine expects


def test_a_baseline_older_than_a_setting_runs_without_it():
    """A setting added after the baseline is the new version's own: the baseline gets the
    settings it knows, with this run's values."""
    @dataclasses.dataclass(frozen=True)
    class OldConfig:
        k_max: int = 4
        explore_budget: float = 0.0

    old = SimpleNamespace(ControllerConfig=OldConfig, AdaptiveController=lambda config: config)
    new = controller.ControllerConfig(k_max=6, explore_budget=0.02, rest_max=3)
    assert controller_ab.baseline_controller(old, new) == OldConfig(k_max=6, explore_budget=0.02)


def test_a_baseline_from_before_the_choice_was_timed_apart_gets_it_inside_verify():
    """The engine reports the choice apart; a baseline that knows no "choice" kind is told it
    inside the round's verify timing (as its engine did), and a choice of a step that
    reported no verify (it prefilled) is not carried into the next round's."""
    seen = []

    class OldController:
        def __init__(self, config):
            pass

        def observe_cost(self, kind, batch_size, size, seconds):
            seen.append((kind, seconds))

        def rest(self, ids, batch_size):
            return False

    old = SimpleNamespace(ControllerConfig=controller.ControllerConfig, AdaptiveController=OldController,
                          COST_KINDS=("verify", "draft", "catch_up"))
    ctl = controller_ab.baseline_controller(old, controller.ControllerConfig())
    ctl.rest(["r"], 1)
    ctl.observe_cost("choice", 1, 1, 0.25)
    ctl.observe_cost("verify", 1, 2, 1.0)
    ctl.rest(["r"], 1)
    ctl.observe_cost("choice", 1, 1, 0.5)  # a step that prefilled: no verify report
    ctl.rest(["r"], 1)
    ctl.observe_cost("verify", 1, 0, 1.0)  # (a resting round: no choice)
    assert seen == [("verify", 1.25), ("verify", 1.0)]
    current = controller_ab.baseline_controller(controller, controller.ControllerConfig())
    current.observe_cost("choice", 1, 1, 0.25)  # (knows the kind: told as is)
    assert current.estimated_cost("choice", 1, 1) == 0.25


@pytest.mark.parametrize("draft_model,method", [(None, "ngram"), ("qwen2.5-coder-0.5b-instruct", "draft")])
def test_both_versions_draft_as_asked_and_plain_runs_no_draft_model(draft_model, method):
    argv = ["--baseline", "HEAD", "--model", "qwen2.5-coder-1.5b-instruct", "--k-max", "6"]
    args = controller_ab.parse_args(argv + (["--draft-model", draft_model] if draft_model else []))
    config, plain = controller_ab.engine_configs(args)
    assert (config.draft_model, config.spec.method, config.spec.num_spec_tokens, config.spec.adaptive) == (
        draft_model, method, 6, True)
    assert (plain.draft_model, plain.spec.method, plain.model) == (None, "none", "qwen2.5-coder-1.5b-instruct")


def test_a_bad_baseline_or_repeats_is_refused_by_name(capsys):
    with pytest.raises(SystemExit, match="--baseline 'no-such-rev'"):
        controller_ab.load_baseline("no-such-rev")
    with pytest.raises(SystemExit):
        controller_ab.parse_args(["--baseline", "HEAD", "--repeats", "0"])
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
        self.controller = SimpleNamespace(snapshot=lambda: {"k_counts": [0]}, config=SimpleNamespace(adaptive=False))

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
    assert controller_ab.parse_args(["--baseline", "HEAD", "--lockstep"]).lockstep
