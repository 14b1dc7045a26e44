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


def test_a_cells_ratios_pair_each_repeats_contenders():
    """Three repeats at the machine's speeds 1.0, 0.8 and 1.2 (plain 100, 80 and 120 tokens/s):
    adaptive reads 0.99 of plain in the first two repeats and 0.80 in the third. The median
    of the repeats' ratios is 0.99 and the cell meets; the ratio of the medians (96 over
    100) sets the third repeat's adaptive against the first's plain, misses, and is kept
    beside the verdict."""
    speeds = (1.0, 0.8, 1.2)
    runs = {"plain": [_run(1.0 / s) for s in speeds],
            "k=1": [_run(1.0 / (0.9 * s)) for s in speeds],
            "adaptive": [_run(1.0 / (r * s)) for r, s in zip((0.99, 0.99, 0.8), speeds)]}
    cell = _cell(runs)
    assert cell["adaptive_vs_plain"] == pytest.approx(0.99) and cell["meets_target"]
    assert cell["adaptive_vs_best_fixed"] == pytest.approx(0.99 / 0.9)
    medians = cell["ratio_of_medians"]
    assert medians["adaptive_vs_plain"] == pytest.approx(96 / 100) and medians["adaptive_vs_plain"] < adaptive.TARGET
    (row,) = adaptive.overall([cell])
    assert "1.07; 0.96" in adaptive.table([cell], [row]) and "ratio_of_medians" not in row


def test_pooled_rows_sum_tokens_and_seconds_over_every_run():
    runs = {"plain": [_run(1.0), _run(3.0)], "k=1": [_run(1.0), _run(1.0)], "adaptive": [_run(2.0), _run(2.0)]}
    (row,) = adaptive.overall([_cell(runs)])
    assert row["tokens_per_s"] == {"plain": 50.0, "k=1": 100.0, "adaptive": 50.0}
    assert row["best_fixed"] == "k=1"


def test_repeats_below_one_is_refused():
    with pytest.raises(SystemExit):
        adaptive.parse_args(["--repeats", "0"])


class _Clock:
    """A fake time.perf_counter whose machine halves its speed at t = 20 (a slow stretch)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def work(self, units: float):
        self.now += units * (1.0 if self.now < 20.0 else 2.0)


def _fake_policy(engine, method: str = "none", adaptive: bool = True) -> None:
    """An engine fake's policy and spec config, as `ClosedLoop.result` reads them (the
    defaults: plain decoding's engine, adaptive in its config but never asked)."""
    from types import SimpleNamespace
    engine.config = SimpleNamespace(spec=SimpleNamespace(method=method, adaptive=adaptive))
    engine.policy = SimpleNamespace(snapshot=lambda: {"k_counts": [0], "rounds": 7})


class _Out:
    def __init__(self, rid, finished):
        from types import SimpleNamespace
        self.request_id, self.new_token_ids, self.token_ids = rid, [1], [1] * 10
        self.finished, self.error, self.finish_reason = finished, None, "length"
        self.spec = SimpleNamespace(num_draft_tokens=0, num_accepted_tokens=0, num_drafts=0, target_forwards=10)


class _Engine:
    """A request is 10 steps of `cost` units each (the fake clock's), one request at a time."""

    def __init__(self, clock, cost):
        from types import SimpleNamespace
        self.clock, self.cost, self.live, self.left = clock, cost, None, 0
        _fake_policy(self)

    def add_request(self, rid, ids, params):
        self.live, self.left = rid, 10

    def step(self):
        self.clock.work(self.cost)
        self.left -= 1
        return [_Out(self.live, self.left == 0)]


@pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "broken: one after the other"])
def test_lockstep_pairs_contenders_against_the_machines_drift(lockstep, monkeypatch):
    """Contender b is truly 2x slower than a. The machine halves its speed part-way through:
    run one after the other, a runs in the fast stretch and b in the slow one, and b reads
    ~3x slower; stepped in turn, each on its own clock, both meet the slow stretch alike
    and the ratio comes out within a few percent of 2."""
    import common
    clock = _Clock()
    monkeypatch.setattr(common, "time", clock)
    monkeypatch.setattr(common, "cpu_sample", lambda: None)
    monkeypatch.setattr(common, "others_cpu_share", lambda a, b: None)
    items = [common.WorkItem(f"p{i}", "chat", (1, 2, 3)) for i in range(2)]
    loops = {name: common.ClosedLoop(_Engine(clock, cost), items, 1, None, name)
             for name, cost in (("a", 1.0), ("b", 2.0))}
    if lockstep:
        results = common.run_lockstep(loops)
    else:
        results = {}
        for name, loop in loops.items():
            while not loop.finished:
                loop.step()
            results[name] = loop.result(None)
    ratio = results["a"].tokens_per_s / results["b"].tokens_per_s
    assert results["a"].tokens == results["b"].tokens == 20
    assert (abs(ratio - 2.0) < 0.15) == lockstep, ratio


class _Rows:
    """Every live request returns one token a step; a step costs one unit of the fake clock
    however many rows it has (so a drained batch is slow per token)."""

    def __init__(self, clock, lengths, method: str = "none", adaptive: bool = True):
        self.clock, self.lengths, self.left = clock, lengths, {}
        _fake_policy(self, method, adaptive)

    def add_request(self, rid, ids, params):
        self.left[rid] = self.lengths[rid.split("/")[1]]

    def step(self):
        self.clock.work(1.0)
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            outs.append(_Out(rid, self.left[rid] == 0))
            if not self.left[rid]:
                del self.left[rid]
        return outs


def test_the_sustained_rate_counts_only_the_steps_with_every_slot_busy(monkeypatch):
    """Two slots, answers of 5 and 15 tokens: 5 steps with both in flight (2 tokens each),
    then a drain of 10 steps with one. The whole run reads 20 / 15 tokens a unit; the
    sustained rate, 10 / 5 = 2, is what 2 requests in flight make."""
    import common
    clock = _Clock()
    monkeypatch.setattr(common, "time", clock)
    items = [common.WorkItem("a", "chat", (1,)), common.WorkItem("b", "chat", (1,))]
    loop = common.ClosedLoop(_Rows(clock, {"a": 5, "b": 15}), items, 2, None, "x")
    while not loop.finished:
        loop.step()
    r = loop.result(None)
    assert r.tokens == 20 and r.seconds == 15.0 and r.steps == 15
    assert (r.sustained_tokens, r.sustained_seconds, r.sustained_tokens_per_s) == (10, 5.0, 2.0)
    assert r.drain_tokens_per_s == 1.0  # the other 10 steps: one row left, 10 tokens


def test_an_adaptive_runs_policy_state_is_kept_and_plain_or_fixed_ks_is_not(monkeypatch):
    """Each adaptive run's policy snapshot lands in its contender's result (one per run,
    so a cell's miss can be read afterwards); plain decoding's engine and a fixed k's, whose
    policies never choose, store none."""
    import common
    clock = _Clock()
    monkeypatch.setattr(common, "time", clock)
    items = [common.WorkItem("a", "chat", (1,))]
    runs = {}
    for name, method, is_adaptive in (("plain", "none", True), ("k=1", "ngram", False), ("adaptive", "ngram", True)):
        loop = common.ClosedLoop(_Rows(clock, {"a": 3}, method, is_adaptive), items, 1, None, name)
        while not loop.finished:
            loop.step()
        runs[name] = [loop.result(None)] * 2
    assert runs["plain"][0].policy is None and runs["k=1"][0].policy is None
    assert runs["adaptive"][0].policy == {"k_counts": [0], "rounds": 7}
    cell = _cell(runs)
    assert cell["contenders"]["adaptive"]["policy_snapshots"] == [{"k_counts": [0], "rounds": 7}] * 2
    assert not {"policy_snapshots"} & (cell["contenders"]["plain"].keys() | cell["contenders"]["k=1"].keys())


def test_a_cell_is_scored_on_sustained_rates_too():
    """The whole-run verdict and the sustained one are separate: here adaptive misses plain
    over the whole run (its drain) and meets it while every slot is busy."""
    from dataclasses import replace

    def run(seconds, sustained_seconds):
        return replace(_run(seconds), sustained_tokens=80, sustained_seconds=sustained_seconds)
    runs = {"plain": [run(1.0, 0.8)], "k=1": [run(1.1, 0.85)], "adaptive": [run(1.1, 0.78)]}
    cell = _cell(runs)
    assert not cell["meets_target"] and cell["adaptive_vs_plain"] == 1.0 / 1.1
    sus = cell["sustained"]
    assert sus["meets_target"] and sus["tokens_per_s"]["adaptive"] == 80 / 0.78 and sus["best_fixed"] == "k=1"
    (row,) = adaptive.overall([cell])
    assert row["sustained"]["tokens_per_s"]["plain"] == 100.0
    assert "sustained: adaptive / plain" in adaptive.table([cell], [row])
    assert _cell({n: [_run(1.0)] for n in runs})["sustained"] is None  # no sustained steps: no verdict


def test_the_drain_is_reported_beside_the_sustained_verdict():
    """Adaptive loses overall while meeting plain in the sustained steps: the cell says the
    loss is in the drain (its rate there, 20 tokens in 0.5 s against plain's 20 in 0.2 s,
    and the drain's share of each one's seconds)."""
    from dataclasses import replace

    def run(seconds, sustained_seconds):
        return replace(_run(seconds), sustained_tokens=80, sustained_seconds=sustained_seconds)
    runs = {"plain": [run(1.0, 0.8)], "k=1": [run(1.2, 0.9)], "adaptive": [run(1.2, 0.7)]}
    cell = _cell(runs)
    assert cell["sustained"]["adaptive_vs_plain"] == pytest.approx(0.8 / 0.7)
    assert cell["drain"]["adaptive_vs_plain"] == pytest.approx(0.2 / 0.5)
    assert cell["drain"]["share"] == {"plain": pytest.approx(0.2), "adaptive": pytest.approx(0.5 / 1.2)}
    (row,) = adaptive.overall([cell])
    assert "0.40 (20%, 42%)" in adaptive.table([cell], [row])
    no_drain = {n: [run(1.0, 1.0)] for n in runs}
    assert _cell(no_drain)["drain"] is None
    plain_in_step = _cell({**no_drain, "adaptive": [run(1.2, 0.7)]})  # only adaptive drained
    assert plain_in_step["drain"]["adaptive_vs_plain"] is None
    assert "n/a (0%, 42%)" in adaptive.table([plain_in_step], [row])


def test_a_cell_reports_adaptives_mean_request_latency_over_plains():
    """Requests' own waits, averaged: adaptive's 3 requests of 1, 2 and 6 s (mean 3) against
    plain's 2, 2 and 2; the mean, not the median (2, a ratio of 1) or the run's seconds."""
    def run(latencies):
        reqs = [RequestResult(f"p{i}", 10, list(range(10)), "length", 0.1, s, 0, 0, 1, 1)
                for i, s in enumerate(latencies)]
        return RunResult(3, 9.0, reqs, 30, 3.0, [], 0.5, 0.0)
    cell = _cell({"plain": [run([2.0, 2.0, 2.0])], "k=1": [run([2.0, 2.0, 2.0])], "adaptive": [run([1.0, 2.0, 6.0])]})
    assert cell["latency_vs_plain"] == pytest.approx(1.5)
    (row,) = adaptive.overall([cell])
    assert "mean request latency: adaptive / plain" in adaptive.table([cell], [row])


def test_the_control_is_reported_beside_the_verdict_and_takes_no_part_in_it():
    """plain-control is a second plain engine: its rate over plain's is the noise of the
    measurement, reported per cell, pooled, and as a spread over cells; it is neither the
    best fixed k nor a reference of the target (a control 18% above plain changes nothing:
    taken as the best fixed k or as plain, adaptive would read 0.92x it and miss)."""
    runs = {"plain": [_run(1.0)], "k=1": [_run(0.9)], "adaptive": [_run(0.92)], "plain-control": [_run(0.85)]}
    cell = _cell(runs)
    assert cell["control_vs_plain"] == pytest.approx(1 / 0.85)
    assert cell["best_fixed"] == "k=1" and cell["meets_target"]
    assert cell["contenders"]["plain-control"]["identical_to_plain"]["identical"] == 1
    slow = _cell({**runs, "plain-control": [_run(1.04)]})
    (row,) = adaptive.overall([cell, slow])
    assert row["control_vs_plain"] == pytest.approx(200 / (0.85 + 1.04) / 100)
    spread = adaptive.control_spread([cell, slow])
    assert spread["cells"] == 2 and spread["min"] == pytest.approx(1 / 1.04)
    assert spread["max_deviation"] == pytest.approx(1 / 0.85 - 1)
    assert "control / plain" in adaptive.table([cell, slow], [row])
    assert _cell({n: r for n, r in runs.items() if n != "plain-control"})["control_vs_plain"] is None
    assert adaptive.control_spread([_cell({n: r for n, r in runs.items() if n != "plain-control"})]) is None


def test_unknown_contenders_are_refused_by_name():
    with pytest.raises(SystemExit):
        adaptive.parse_args(["--contenders", "plain,k=3,adaptive"])
    assert "plain-control" not in adaptive.contenders("ngram", 8, control=False)


def test_contenders_without_plain_or_adaptive_are_refused_before_the_run():
    for subset in ("k=1,adaptive", "plain,k=1"):
        with pytest.raises(SystemExit):
            adaptive.parse_args(["--contenders", subset])
    assert adaptive.parse_args(["--contenders", "plain,adaptive"]).contenders == "plain,adaptive"


def test_a_cell_without_a_fixed_k_is_judged_against_plain_only_and_says_so():
    """--contenders plain,adaptive (where every fixed k is known to lose, to save the time):
    the cell is scored, tabled and written like any other (a run of such cells once printed
    its rates and wrote nothing), its verdict on plain alone and marked as such."""
    runs = {"plain": [_run(1.0)], "adaptive": [_run(1.02)], "plain-control": [_run(1.01)]}
    cell = _cell(runs)
    assert cell["best_fixed"] is None and cell["adaptive_vs_best_fixed"] is None
    assert cell["adaptive_vs_plain"] == pytest.approx(1 / 1.02) and cell["meets_target"]
    assert not _cell({**runs, "adaptive": [_run(1.1)]})["meets_target"]  # (the check bites: 0.91x plain)
    (row,) = adaptive.overall([cell])
    assert row["best_fixed"] is None and row["meets_target"]
    text = adaptive.table([cell], [row])
    assert "ok (plain only: no fixed k run)" in text


def _paired_runs(rates: dict[str, list[float]], concurrency: int = 1) -> dict[str, list]:
    """One run per contender of 100-token requests, prompt i at rates[name][i] tokens/s."""
    def run(rs):
        reqs = [RequestResult(f"p{i}", 10, list(range(100)), "length", 0.1, 100 / r, 0, 0, 1, 1)
                for i, r in enumerate(rs)]
        return RunResult(concurrency, sum(100 / r for r in rs), reqs, 100 * len(rs), 1.0, [], 0.5, 0.0)
    return {name: [run(rs)] for name, rs in rates.items()}


def test_a_cell_at_one_in_flight_carries_a_paired_interval_over_its_prompts():
    """Adaptive 5% behind k=1 on every prompt is a miss whatever prompts are drawn; a 3%
    point miss made of one bad prompt among good ones is undecided, and 1-2% ahead on
    every prompt is met. With k=1 swapped for one 5% faster (an injected bug that would
    score against the wrong contender) the met cell reads missed."""
    plain = [100.0, 80.0, 120.0, 90.0, 110.0, 100.0, 95.0, 105.0]
    k1 = [1.2 * r for r in plain]
    behind = adaptive.paired_interval(_paired_runs({"plain": plain, "k=1": k1, "adaptive": [0.95 * r for r in k1]}))
    assert behind["verdict"] == "missed" and behind["prompts"] == 8
    assert behind["adaptive_vs_best_fixed"][1] < 0.97
    assert behind["adaptive_vs_plain"][0] > 1.1
    one_bad = [r * (0.80 if i == 0 else 1.0) for i, r in enumerate(k1)]
    undecided = adaptive.paired_interval(_paired_runs({"plain": plain, "k=1": k1, "adaptive": one_bad}))
    lo, hi = undecided["adaptive_vs_best_fixed"]
    assert undecided["verdict"] == "undecided" and lo < 0.97 <= hi
    ahead = [r * (1.01 + 0.01 * (i % 2)) for i, r in enumerate(k1)]
    runs = _paired_runs({"plain": plain, "k=1": k1, "k=2": [0.9 * r for r in k1], "adaptive": ahead})
    assert adaptive.paired_interval(runs)["verdict"] == "met"
    faster = _paired_runs({"k=1": [1.05 * r for r in ahead]})
    assert adaptive.paired_interval({**runs, **faster})["verdict"] == "missed"
    cell = _cell(runs)
    assert cell["paired"]["verdict"] == "met"
    (row,) = adaptive.overall([cell])
    assert "(met, 8 prompts)" in adaptive.table([cell], [row])


def test_no_paired_interval_above_one_in_flight_or_over_different_prompts():
    rates = {"plain": [100.0, 90.0], "k=1": [110.0, 99.0], "adaptive": [112.0, 100.0]}
    assert adaptive.paired_interval(_paired_runs(rates, concurrency=4)) is None
    assert adaptive.paired_interval({n: r for n, r in _paired_runs(rates).items() if n != "k=1"}) is None
    runs = _paired_runs(rates)
    other = _paired_runs({"adaptive": [112.0, 100.0, 50.0]})
    with pytest.raises(ValueError, match="different prompts"):
        adaptive.paired_interval({**runs, **other})
