"""bench/adaptive.py's cell scoring with repeated runs (--repeats): medians, pooled sums."""
from __future__ import annotations

import pytest

from bench_scripts import load

adaptive = load("adaptive", "adaptive_bench")
from common import RequestResult, RunResult  # noqa: E402 (bench/common.py, on the path now)


def _run(seconds: float, tokens: int = 100, drafted: int = 0, accepted: int = 0, k=(), others=0.0) -> RunResult:
    request = RequestResult("p0", 10, list(range(tokens)), "length", 0.1, seconds, drafted, accepted, 1, 1)
    return RunResult(1, seconds, [request], tokens, 1.0, list(k), 0.5, others)


def _cell(runs):
    return adaptive._cell_result(runs, "math", 1, [], [], {}, [list(runs)])


def test_a_contenders_rate_is_the_median_of_its_runs():
    """One slow outlier run (a noisy neighbour) does not decide a cell: adaptive's median
    run beats the best fixed k; with the first run alone (or the mean) it would miss."""
    runs = {"plain": [_run(1.0), _run(1.0), _run(1.0)],             # 100 tok/s
            "k=1": [_run(0.9), _run(0.9), _run(0.9)],               # 111
            "adaptive": [_run(2.0, drafted=10, accepted=4, k=(1, 2)), _run(0.88, drafted=10, accepted=6, k=(0, 3)),
                         _run(0.89, drafted=20, accepted=10, k=(2, 0))]}  # 50, 113.6, 112.4
    cell = _cell(runs)
    assert cell["tokens_per_s"]["adaptive"] == 100 / 0.89  # the median, not the first run's 50
    assert cell["best_fixed"] == "k=1" and cell["meets_target"]
    a = cell["contenders"]["adaptive"]
    assert a["runs"] == 3 and a["tokens"] == 300 and a["seconds"] == 2.0 + 0.88 + 0.89
    assert a["drafted"] == 40 and a["accepted"] == 20 and a["acceptance"] == 0.5
    assert a["chosen_k_histogram"] == [3, 5] and cell["adaptive_mean_k"] == 5 / 8
    assert a["tokens_per_s_runs"] == [50.0, 100 / 0.88, 100 / 0.89]
    single = _cell({name: rs[:1] for name, rs in runs.items()})
    assert not single["meets_target"]  # the check bites: one unlucky run misses


def test_pooled_rows_sum_tokens_and_seconds_over_every_run():
    runs = {"plain": [_run(1.0), _run(3.0)], "k=1": [_run(1.0), _run(1.0)], "adaptive": [_run(2.0), _run(2.0)]}
    (row,) = adaptive.overall([_cell(runs)])
    assert row["tokens_per_s"] == {"plain": 50.0, "k=1": 100.0, "adaptive": 50.0}
    assert row["best_fixed"] == "k=1"


def test_repeats_below_one_is_refused():
    with pytest.raises(SystemExit):
        adaptive.parse_args(["--repeats", "0"])
