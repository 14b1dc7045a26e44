"""The pure parts of bench/controller_trace.py and bench/cost_replay.py."""
from __future__ import annotations

import pytest

from bench_scripts import load
from verispec.spec.controller import ControllerConfig

trace = load("controller_trace", "bench_controller_trace")


def test_calibration_groups_drafting_rows_by_their_priced_first_draft():
    """Each drafting row is priced at a first-draft acceptance; rows are grouped by its tenth,
    and each group's realised first-draft acceptance and accepted drafts sit beside what was
    priced (the check that chosen rows are not the ones whose estimates read high)."""
    row = lambda first, k, accepted: {"k": k, "match": 2, "first": first, "cont": 0.5,  # noqa: E731
                                      "expected": first * (1 - 0.5 ** k) / 0.5, "accepted": accepted}
    log = [{"calibration": [row(0.42, 1, 1), row(0.47, 2, 0)]}, {"batch": 4},
           {"calibration": [row(0.95, 2, 2), row(1.0, 1, 1)]}]
    low, high = trace.calibration(log)
    assert low["priced_first"] == "0.4-0.5" and low["rows"] == 2
    assert low["mean_priced_first"] == pytest.approx(0.445)
    assert low["realised_first"] == 0.5 and low["accepted"] == 1 and low["drafted"] == 3
    assert low["expected"] == pytest.approx(0.42 + 0.47 * 1.5)
    assert high["priced_first"] == "0.9-1.0" and high["rows"] == 2 and high["realised_first"] == 1.0


def test_cost_replay_compares_trusted_drafting_rounds_with_their_estimates():
    """Plain rounds at 1.0 s and 1-draft rounds at 1.2 s, then a 1-draft round that takes
    1.5 s: the replay reports each drafting round on a trusted cell as measured / estimated
    (1.2 / 1.2 until the last, 1.5 / 1.2), and a steady machine moves no speed factor."""
    replay = load("cost_replay", "bench_cost_replay")
    steps = [{"batch": 4, "verify_size": 0, "verify_s": 1.0}, {"batch": 4}]  # (a prefill step: untimed)
    for _ in range(20):
        steps += [{"batch": 4, "verify_size": 0, "verify_s": 1.0}, {"batch": 4, "verify_size": 1, "verify_s": 1.2}]
    steps.append({"batch": 4, "verify_size": 1, "verify_s": 1.5})
    trace = {"benchmark": "controller-trace", "controller": {"config": ControllerConfig().to_dict()}, "steps": steps}
    r = replay.replay(trace)
    assert len(r["ratios"]) == 21 - ControllerConfig().cost_min_samples  # (the first ones: not yet trusted)
    assert r["ratios"][:-1] == pytest.approx([1.0] * (len(r["ratios"]) - 1))
    assert r["ratios"][-1] == pytest.approx(1.25)
    assert r["moves"] == [] and r["factor"] == 1.0
