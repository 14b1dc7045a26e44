"""bench/draft_cost.py: forced draft totals, their price per drafted token, the break-even."""
from __future__ import annotations

import json

import pytest

from bench_scripts import load

draft_cost = load("draft_cost", "bench_draft_cost")


def test_a_total_is_spread_over_the_rows_round_robin():
    assert draft_cost.spread(0, 3) == [0, 0, 0]
    assert draft_cost.spread(5, 4) == [2, 1, 1, 1]
    assert draft_cost.spread(12, 4) == [3, 3, 3, 3]


def test_the_break_even_is_a_drafts_excess_over_plains_seconds_a_token():
    """Plain steps take 10 ms and commit 4 tokens (2.5 ms a token); 8 drafts take 26 ms, 2 ms a
    draft: a draft pays only when accepted more than 2 / 2.5 = 0.8 of the time."""
    rows = draft_cost.summarise({0: [0.010, 0.010, 0.011], 8: [0.026, 0.026, 0.030]}, plain_tokens=12, batch=4)
    plain, drafting = rows
    assert plain["excess_per_draft_s"] is None and plain["break_even_acceptance"] is None
    assert drafting["excess_s"] == pytest.approx(0.016)
    assert drafting["excess_per_draft_s"] == pytest.approx(0.002)
    assert drafting["plain_s_per_token"] == pytest.approx(0.031 / 12)
    assert drafting["break_even_acceptance"] == pytest.approx(0.002 / (0.031 / 12))


def test_bad_settings_are_refused_by_name(capsys):
    for argv, message in ((["--batch", "0"], "--batch must be at least 1"),
                          (["--batch", "2", "--totals", "17"], "at most 8 drafts a row, 16 at --batch 2"),
                          (["--rounds", "0"], "--rounds must be >= 1")):
        with pytest.raises(SystemExit):
            draft_cost.parse_args(argv)
        assert message in capsys.readouterr().err


def test_a_quick_run_times_every_total_on_the_engines_own_verify_pass(tmp_path, monkeypatch):
    """Two rows of the default model: every forced total is verified as forced (the script
    stops otherwise) and timed once a round; the result records the resolved config."""
    monkeypatch.setattr(draft_cost.common, "wait_for_quiet", lambda *a, **k: {"quiet": True})  # (no 10 s of sampling)
    out = tmp_path / "cost.json"
    assert draft_cost.main(["--batch", "2", "--quick", "--totals", "1,3", "--threads", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["schema"] == "verispec.bench.draft-cost/v1"
    assert [p["draft_tokens"] for p in result["passes"]] == [0, 1, 3]
    assert all(p["steps"] == 3 and p["median_step_s"] > 0 for p in result["passes"])
    assert result["passes"][0]["plain_s_per_token"] > 0
    assert result["engine_config"]["spec"]["method"] == "ngram"
