"""Replay a traced run's pass timings through this checkout's cost tables.

Reads a `bench/controller_trace.py` result (each step's verify pass: batch, draft tokens,
seconds) and feeds the timings, in order, to a fresh `AdaptiveController` with the trace's
controller config, the way the engine reported them. Before each drafting round whose cell
is trusted it asks the tables for that pass's estimate, and reports how the measured seconds
compare (median and mean of measured / estimated; an estimate that reads low makes drafting
look cheap), and every move of the shared speed factor (docstring "Drift"), with and without
it (`cost_drift` 0). Acceptance is not replayed: the estimates are the cost side only.

    .venv/bin/python bench/cost_replay.py bench/results/controller-trace-math-c16-t128-intel-c812ca1.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from verispec.spec.controller import AdaptiveController, ControllerConfig, batch_bucket  # noqa: E402


def replay(trace: dict, cost_drift: float | None = None) -> dict:
    """{"ratios": measured / estimated per trusted drafting round, "moves": [(step, f before,
    f after)], "factor": f at the end}."""
    config = ControllerConfig(**trace["controller"]["config"])
    if cost_drift is not None:
        config = replace(config, cost_drift=cost_drift)
    ctl, table = AdaptiveController(config), None
    table = ctl._costs["verify"]  # noqa: SLF001 (a diagnostic: whether the cell is trusted)
    ratios, moves = [], []
    for i, step in enumerate(trace["steps"]):
        if "verify_s" not in step:
            continue  # a step that also prefilled: not timed
        b, n, seconds = step["batch"], step["verify_size"], step["verify_s"]
        if n and table.trusted(batch_bucket(b), n):
            ratios.append(seconds / ctl.estimated_cost("verify", b, n))
        before = ctl.snapshot()["speed_factor"]
        ctl.observe_cost("verify", b, n, seconds)
        after = ctl.snapshot()["speed_factor"]
        if after != before:
            moves.append((i, before, after))
    return {"ratios": ratios, "moves": moves, "factor": ctl.snapshot()["speed_factor"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, help="a bench/controller_trace.py result")
    args = p.parse_args(argv)
    trace = json.loads(args.trace.read_text())
    if trace.get("benchmark") != "controller-trace":
        p.error(f"{args.trace}: not a controller trace (benchmark {trace.get('benchmark')!r})")
    for name, drift in (("speed factor", None), ("none (cost_drift 0)", 0.0)):
        r = replay(trace, drift)
        ratios = r["ratios"]
        summary = (f"median {statistics.median(ratios):.3f}, mean {statistics.mean(ratios):.3f}"
                   if ratios else "none")
        print(f"{name}: {len(ratios)} trusted drafting rounds, measured / estimated {summary}; "
              f"speed factor moved {len(r['moves'])} times, ends at {r['factor']:.3f}")
        for step, before, after in r["moves"]:
            print(f"  step {step}: {before:.3f} -> {after:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
