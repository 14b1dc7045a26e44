"""Report, paired comparison and bootstrap built from the stored result set in fixtures/bench."""
import json
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest

from verispec.bench import cli, compare
from verispec.bench.compare import (bootstrap_decode_speedup, bootstrap_e2e_speedup,
                                    compare_runs, first_divergence)
from verispec.bench.records import read_run
from verispec.bench.report import build_report, build_sweep_report, summarize

FIXTURES = Path(__file__).parent / "fixtures" / "bench"


@pytest.fixture
def runs(tmp_path):
    """Copies of the stored spec and baseline runs (reports are written next to the evidence)."""
    for name in ("spec_run", "baseline_run"):
        shutil.copytree(FIXTURES / name, tmp_path / name)
    return tmp_path / "spec_run", tmp_path / "baseline_run"


def test_report_builds_from_stored_results(runs):
    spec, base = runs
    path = build_report(spec, base, resamples=500, seed=0)
    text = path.read_text()
    for needle in ("| chat |", "| extract |", "| all |", "decode tok/s speedup", "95% CI",
                   "Output equality at temperature 0", "## Acceptance", "| position |", "Provenance",
                   "JSON valid"):
        assert needle in text, needle
    for png in ("speedup_by_task", "acceptance_per_position", "ttft_distribution",
                "tpot_distribution"):
        assert (spec / "plots" / f"{png}.png").stat().st_size > 1000, png
    assert json.loads((spec / "comparison.json").read_text())["spec_run"]["config_name"] == "spec"


def test_summary_numbers_match_the_records(runs):
    _, records = read_run(runs[0])
    s = summarize(records)["chat"]
    chat = [r for r in records if r["dataset"] == "chat"]
    assert s["requests"] == len(chat) == 8
    assert s["median_ttft_ms"] == pytest.approx(1000 * statistics.median(r["ttft_s"] for r in chat))
    assert s["e2e_tps"] == pytest.approx(sum(r["completion_tokens"] for r in chat)
                                         / sum(r["e2e_s"] for r in chat))


def test_comparison_flags_the_diverging_prompt_and_bad_json(runs):
    cmp = compare_runs(*runs, resamples=200, seed=0)
    diverged = {d["prompt_id"] for d in cmp["equality"]["divergences"]}
    _, spec_records = read_run(runs[0])
    measured = {r["prompt_id"] for r in spec_records}
    assert diverged == ({"c2"} & measured)
    assert cmp["equality"]["compared"] == 16
    assert cmp["self_consistency"]["base"]["varying_across_passes"] == []
    jv = cmp["json_validity"]["spec"]
    assert jv["checked"] == 8
    assert jv["invalid"] == (["extract/j1/turn0"] if "j1" in measured else [])
    assert cmp["json_validity"]["base"]["invalid"] == []
    # the spec fixture server sent 1-3 tokens per chunk at the baseline's chunk rate
    sp = cmp["speedup"]["decode_tps"]
    assert sp["point"] > 1.2 and sp["ci95"][0] <= sp["point"] <= sp["ci95"][1]


def test_first_divergence_catches_same_length_outputs():
    assert first_divergence("abcdef", "abcxef") == 3
    assert first_divergence("same", "same") is None
    assert first_divergence("abc", "abcd") == 3


def _paired(n, factor, rng):
    base = {("d", str(i), 0): float(v) for i, v in enumerate(rng.uniform(20, 60, n))}
    return {k: v * factor for k, v in base.items()}, base


def test_bootstrap_recovers_a_known_speedup_and_is_seeded():
    spec, base = _paired(40, 2.0, np.random.default_rng(1))
    a = bootstrap_decode_speedup(spec, base, 2000, seed=3)
    assert a["point"] == pytest.approx(2.0) and a["ci95"] == pytest.approx([2.0, 2.0])
    keys = sorted(spec)
    noise = np.random.default_rng(7).normal(0, 0.2, len(keys))
    noise -= noise.mean()  # centred: the geometric-mean speedup stays exactly 2
    noisy = {k: spec[k] * float(np.exp(e)) for k, e in zip(keys, noise)}
    b1 = bootstrap_decode_speedup(noisy, base, 2000, seed=3)
    b2 = bootstrap_decode_speedup(noisy, base, 2000, seed=3)
    assert b1 == b2 and b1["ci95"][0] < b1["point"] < b1["ci95"][1]
    assert b1["point"] == pytest.approx(2.0) and b1["n_prompts"] == 40
    assert 1.8 < b1["ci95"][0] < 2.0 < b1["ci95"][1] < 2.2


def test_e2e_speedup_is_a_ratio_of_summed_throughputs():
    spec = {("d", "a", 0): (100.0, 1.0), ("d", "b", 0): (10.0, 1.0)}
    base = {("d", "a", 0): (100.0, 2.0), ("d", "b", 0): (10.0, 1.0)}
    r = bootstrap_e2e_speedup(spec, base, 100, seed=0)
    assert r["point"] == pytest.approx((110 / 2) / (110 / 3))


def test_seeded_bootstrap_check_catches_an_unseeded_rng(monkeypatch):
    real = np.random.default_rng
    monkeypatch.setattr(compare.np.random, "default_rng", lambda seed=None: real())
    with pytest.raises(AssertionError):
        test_bootstrap_recovers_a_known_speedup_and_is_seeded()


def test_report_only_rebuilds_from_disk(runs, capsys):
    spec, base = runs
    args = ["--report-only", "--out", str(spec), "--baseline-dir", str(base),
            "--bootstrap-resamples", "200"]
    assert cli._standalone(args) == 0
    assert "report:" in capsys.readouterr().out
    assert cli._standalone(args + ["--require-identical"]) == 1  # c2 diverges


def test_sweep_report_plots_acceptance_vs_temperature(runs, tmp_path):
    spec, _ = runs
    hot = tmp_path / "sweep" / "temperature-0.8"
    shutil.copytree(spec, hot)
    manifest = json.loads((hot / "run.json").read_text())
    manifest["config"]["temperature"] = 0.8
    manifest["metrics"]["acceptance"]["acceptance_rate"] = 0.3
    (hot / "run.json").write_text(json.dumps(manifest))
    cold = tmp_path / "sweep" / "temperature-0"
    shutil.copytree(spec, cold)
    path = build_sweep_report(tmp_path / "sweep", [cold, hot])
    assert "| temperature-0.8 | 0.80 |" in path.read_text()
    assert (tmp_path / "sweep" / "plots" / "acceptance_vs_temperature.png").exists()
