"""bench/controller_trace.py's pure parts."""
from __future__ import annotations

import pytest

from bench_scripts import load

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
