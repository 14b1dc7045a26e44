"""Adaptive draft length vs fixed k in {1, 2, 4, 8} vs plain decoding (issue 6).

One cell = one task at one concurrency. In every cell each contender gets a fresh engine
over the shared weights (own KV pool, prefix cache and policy), runs unmeasured warm-up
prompts of the same task (disjoint from the measured ones), then the measured prompts
closed-loop (exactly C in flight, refilled as they finish), greedy. Contenders run one
after the other in an order rotated from cell to cell. With --repeats R every contender runs
R times per cell (fresh engine each time), the order rotated again each round, and a
contender's rate is the median of its R runs: on a noisy machine one short run per
contender moves by 10-25% and cannot resolve a 0.97 target; a cell's ratios are the medians
of its repeats' ratios (see `_score`). With --lockstep a repeat runs every contender at
once instead: all engines warmed up, then one step of each in turn (the order shuffled
every round) until all are done, each contender's seconds its own steps', so a slow stretch
of the machine lands on every contender alike.

Contenders: plain (spec "none"), fixed k = 1, 2, 4, 8, and adaptive with k_max = 8 (the
same range as the fixed grid; the engine default is k_max = 4). Drafting is n-gram, or
the draft model when --draft-model is given. Plus a control (unless --no-control):
`plain-control`, a second plain engine run exactly like the first. Its rate over plain's is
what the measurement alone makes of two identical contenders in that cell (the same
prompts, the same outputs, the same work), so a ratio of adaptive's that misses 0.97 by
less than the control's own distance from 1.0 is not told apart from noise by that run.
It takes no part in any verdict.

Tasks: chat (MT-bench turn 1), code (HumanEval), rewrite (rewrite-code + rewrite-essay,
interleaved), summarisation (CNN stories), math (GSM8K).

Target (issue 6): adaptive >= 0.97 x the best fixed k and >= 0.97 x plain in every cell.
Each cell is scored twice: on whole-run rates, and on sustained ones (the steps run with
all C requests in flight; `common.ClosedLoop`), which leave out the drain at the end of the
finite closed loop, a tail whose length speculation itself sets by moving rows apart. The
drain's own ratio (adaptive over plain) and its share of each one's seconds are reported
beside them: rows that drafted finish early and their slots stay empty while the longest
ones drain, so a drafted token saves less there than the policy's rate credits it with
(docs/benchmarks.md, "Adaptive draft length"). And each cell reports adaptive's mean request latency
(submission to last token) over plain's: what a request waits, the objective the
policy's per-round rate also serves, where a finite job's whole-run rate is its makespan.
At 1 in flight, where each request runs alone and so is a pair across the contenders, a
cell also carries a paired bootstrap interval over its prompts for both ratios
(`paired_interval`): whether its verdict would survive another draw of prompts.

    .venv/bin/python bench/adaptive.py --quick
    .venv/bin/python bench/adaptive.py                                   # n-gram, default model
    .venv/bin/python bench/adaptive.py --model qwen2.5-coder-1.5b-instruct \\
        --draft-model qwen2.5-coder-0.5b-instruct --num-prompts 4 --max-tokens 64
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from verispec.config import EngineConfig, SpecConfig  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402

TASKS = {
    "chat": ["mtbench"],
    "code": ["humaneval"],
    "rewrite": ["rewrite-code", "rewrite-essay"],
    "summarisation": ["cnn"],
    "math": ["gsm8k"],
}
FIXED_KS = (1, 2, 4, 8)
TARGET = 0.97
CONTROL = "plain-control"  # plain decoding again: the A/A control (module docstring)
INTERVAL = 0.90     # the paired bootstrap interval's coverage (cells at 1 in flight)
RESAMPLES = 2000


def contenders(method: str, adaptive_k_max: int, control: bool = True) -> dict[str, SpecConfig]:
    out = {"plain": SpecConfig(method="none")}
    out.update({f"k={k}": SpecConfig(method=method, num_spec_tokens=k, adaptive=False) for k in FIXED_KS})
    out["adaptive"] = SpecConfig(method=method, num_spec_tokens=adaptive_k_max, adaptive=True)
    if control:
        out[CONTROL] = SpecConfig(method="none")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--draft-model", default=None, help="draft with this model instead of n-gram")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, from {list(TASKS)}")
    p.add_argument("--num-prompts", type=int, default=4,
                   help="measured prompts per cell (raised to --prompts-per-slot x C)")
    p.add_argument("--prompts-per-slot", type=int, default=2,
                   help="at least this many measured prompts per in-flight slot")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-warmup", type=int, default=4, help="warm-up prompts per engine (<= C of them at once)")
    p.add_argument("--warmup-tokens", type=int, default=16)
    p.add_argument("--adaptive-k-max", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per contender per cell, in rotated order; rates are their medians")
    p.add_argument("--lockstep", action="store_true",
                   help="run a repeat's contenders at once, one engine step each in turn, each timed "
                        "on its own steps (paired against the machine's drift; see common.run_lockstep)")
    p.add_argument("--contenders", default=None,
                   help=f"comma-separated subset of plain,k=1,k=2,k=4,k=8,adaptive,{CONTROL} (default all; "
                        "plain and adaptive are required; without a fixed k a cell is judged against plain "
                        "only, and says so)")
    p.add_argument("--no-control", dest="control", action="store_false",
                   help=f"leave out {CONTROL}, the second plain engine that shows the measurement's noise")
    common.add_common_args(p, "1,4,16")
    args = p.parse_args(argv)
    args.tasks = args.tasks.split(",")
    if args.contenders:
        known = list(contenders("ngram", 1))
        unknown = [n for n in args.contenders.split(",") if n not in known]
        if unknown:
            p.error(f"--contenders: unknown {unknown}; choose from {known}")
        missing = [n for n in ("plain", "adaptive") if n not in args.contenders.split(",")]
        if missing:  # (refused before the run: every ratio is adaptive's, over plain at least)
            p.error(f"--contenders: {missing} missing; every cell needs plain and adaptive")
    bad = [t for t in args.tasks if t not in TASKS]
    if bad:
        p.error(f"--tasks: unknown {bad}; choose from {list(TASKS)}")
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.quick:
        args.concurrency = [1, 4] if args.concurrency == [1, 4, 16] else args.concurrency
        args.num_prompts, args.prompts_per_slot = min(args.num_prompts, 2), 1
        args.max_tokens, args.num_warmup, args.warmup_tokens = min(args.max_tokens, 16), 1, 4
    return args


def run_cell(models, configs: dict[str, EngineConfig], task: str, c: int, cell_index: int, args) -> dict:
    """Every contender on one task at one concurrency, each on a fresh engine."""
    n = max(args.num_prompts, args.prompts_per_slot * c)
    measured, warm, sources = common.pick_prompts(TASKS[task], n, args.num_warmup, seed=args.seed, split=args.split)
    items = common.encode(models.tokenizer, measured, task)
    warm_items = common.encode(models.tokenizer, warm, task)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    names = list(configs)
    orders = [names[(cell_index + i) % len(names):] + names[: (cell_index + i) % len(names)]
              for i in range(args.repeats)]
    runs = {name: [] for name in names}
    for repeat, order in enumerate(orders):
        if args.lockstep:  # every contender's engine at once, stepped in turn (common.run_lockstep)
            loops = {}
            for name in order:
                engine = common.make_engine(models, configs[name])
                common.warm_up(engine, warm_items, min(c, len(warm_items)), args.warmup_tokens, f"{name}-{task}-c{c}")
                loops[name] = common.ClosedLoop(engine, items, c, params, f"{name}-{task}-c{c}")
            results = common.run_lockstep(loops, seed=args.seed + repeat)
            del loops
        else:
            results = {}
            for name in order:
                engine = common.make_engine(models, configs[name])
                common.warm_up(engine, warm_items, min(c, len(warm_items)), args.warmup_tokens, f"{name}-{task}-c{c}")
                results[name] = common.run_closed_loop(engine, items, c, params, f"{name}-{task}-c{c}")
                del engine
        for name in order:
            r = results[name]
            runs[name].append(r)
            print(f"[adaptive] {task:13s} C={c:2d} {name:8s} {r.tokens:5d} tok {r.seconds:7.1f} s "
                  f"{r.tokens_per_s:7.2f} tok/s acc={_fmt(r.acceptance)} load={common.load_average():.2f} "
                  f"others={_fmt(r.others_cpu_share)}",
                  file=sys.stderr, flush=True)
    return _cell_result(runs, task, c, measured, warm, sources, orders)


def _contender(runs: list) -> dict:
    """One contender's runs in a cell: the first run's summary, with tokens, seconds, drafts
    and chosen k summed over the runs (tokens and seconds are what `overall` pools), each
    run's rate, and as its rate their median."""
    drafted, accepted = sum(r.drafted for r in runs), sum(r.accepted for r in runs)
    return {**runs[0].summary(), "runs": len(runs), "tokens": sum(r.tokens for r in runs),
            "seconds": sum(r.seconds for r in runs), "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "tokens_per_s": statistics.median(r.tokens_per_s for r in runs),
            "tokens_per_s_runs": [r.tokens_per_s for r in runs],
            "sustained_tokens": sum(r.sustained_tokens for r in runs),
            "sustained_seconds": sum(r.sustained_seconds for r in runs),
            "sustained_tokens_per_s": (statistics.median(r.sustained_tokens_per_s for r in runs)
                                       if all(r.sustained_tokens_per_s for r in runs) else None),
            "sustained_tokens_per_s_runs": [r.sustained_tokens_per_s for r in runs],
            "drain_tokens_per_s": (statistics.median(r.drain_tokens_per_s for r in runs)
                                   if all(r.drain_tokens_per_s for r in runs) else None),
            "mean_latency_s": statistics.median(r.mean_latency_s for r in runs),
            "others_cpu_share": max((r.others_cpu_share for r in runs if r.others_cpu_share is not None), default=None),
            "chosen_k_histogram": [sum(h) for h in zip(*(r.chosen_k for r in runs))],
            **({"policy_snapshots": [r.policy for r in runs]} if runs[0].policy is not None else {})}


def _cell_result(runs: dict[str, list], task, c, measured, warm, sources, orders) -> dict:
    """`runs`: each contender's runs in the cell (one per repeat); rates are medians."""
    summaries = {name: _contender(rs) for name, rs in runs.items()}
    rate = {name: v["tokens_per_s"] for name, v in summaries.items()}
    hist = summaries["adaptive"]["chosen_k_histogram"]
    sustained = {name: v["sustained_tokens_per_s"] for name, v in summaries.items()}
    by_run = {name: v["tokens_per_s_runs"] for name, v in summaries.items()}
    sustained_by_run = {name: v["sustained_tokens_per_s_runs"] for name, v in summaries.items()}
    return {
        "task": task, "concurrency": c, "orders": orders,
        "prompt_ids": [it for it in (f"{p.dataset}:{p.prompt_id}" for p in measured)],
        "warmup_prompt_ids": [f"{p.dataset}:{p.prompt_id}" for p in warm], "datasets": sources,
        **_score(rate, by_run),
        "sustained": _score(sustained, sustained_by_run) if all(sustained.values()) else None,
        "drain": _drain(summaries),
        # below 1: adaptive's requests finish sooner (module docstring)
        "latency_vs_plain": summaries["adaptive"]["mean_latency_s"] / summaries["plain"]["mean_latency_s"],
        "paired": paired_interval(runs),
        "max_others_cpu_share": max(v["others_cpu_share"] or 0.0 for v in summaries.values()),
        "adaptive_mean_k": sum(k * n for k, n in enumerate(hist)) / sum(hist) if sum(hist) else None,
        "contenders": {name: {**v, "identical_to_plain": common.same_outputs(runs[name][0], runs["plain"][0])}
                       for name, v in summaries.items()},
    }


def paired_interval(runs: dict[str, list], seed: int = 0) -> dict | None:
    """At 1 in flight each request runs alone, so its seconds are its own and every prompt
    is a pair across the contenders (the same prompt, the same greedy output). Resampling
    the prompts (with replacement, `RESAMPLES` times, the best fixed k chosen again in each
    resample) gives a `INTERVAL` interval for adaptive over the best fixed k and over plain,
    each contender's rate its tokens over its seconds summed over the resampled prompts and
    the repeats. It says how far the cell's verdict rests on which prompts were drawn: "met"
    when both lower ends reach the target, "missed" when either upper end falls short,
    else "undecided". None above 1 in flight (rows share steps: no request's seconds are
    its own) or without plain, adaptive and a fixed k."""
    fixed = [f"k={k}" for k in FIXED_KS if f"k={k}" in runs]
    if not fixed or not {"plain", "adaptive"} <= set(runs):
        return None
    names = ["plain", "adaptive", *fixed]
    if any(r.concurrency != 1 for n in names for r in runs[n]):
        return None
    vs_best, vs_plain = [], []
    for rate in common.paired_resamples({n: runs[n] for n in names}, RESAMPLES, seed):
        best = max(rate[n] for n in fixed)
        vs_best.append(rate["adaptive"] / best)
        vs_plain.append(rate["adaptive"] / rate["plain"])
    best_ends, plain_ends = common.central_interval(vs_best, INTERVAL), common.central_interval(vs_plain, INTERVAL)
    if min(best_ends[0], plain_ends[0]) >= TARGET:
        verdict = "met"
    elif min(best_ends[1], plain_ends[1]) < TARGET:
        verdict = "missed"
    else:
        verdict = "undecided"
    prompts = {req.prompt_id for run in runs["plain"] for req in run.requests}
    return {"prompts": len(prompts), "level": INTERVAL, "resamples": RESAMPLES,
            "adaptive_vs_best_fixed": best_ends, "adaptive_vs_plain": plain_ends, "verdict": verdict}


def _drain(summaries: dict[str, dict]) -> dict | None:
    """Adaptive's rate over plain's in the drain (the steps after the last request was added,
    with fewer than C in flight; None unless both drained), and the drain's share of each
    one's seconds; None if neither drained. Next to the sustained ratio it says where a
    whole-run loss was made."""
    a, p = summaries["adaptive"], summaries["plain"]
    if not (a["drain_tokens_per_s"] or p["drain_tokens_per_s"]):
        return None
    both = a["drain_tokens_per_s"] and p["drain_tokens_per_s"]
    return {"adaptive_vs_plain": a["drain_tokens_per_s"] / p["drain_tokens_per_s"] if both else None,
            "share": {name: 1.0 - v["sustained_seconds"] / v["seconds"] for name, v in (("plain", p), ("adaptive", a))}}


def _score(rate: dict[str, float], by_run: dict[str, list[float]] | None = None) -> dict:
    """A cell's (or pooled row's) verdict from its contenders' rates; the control's ratio to
    plain (None without one) beside it, in no verdict.

    With `by_run` (each contender's rate in each repeat, in repeat order) a ratio is the
    median over the repeats of that repeat's ratio: a repeat's contenders are a pair (in
    lockstep they ran at once, step by step), and a ratio of medians would set one repeat's
    run against another's, the machine's speed between them included. (The ratios of the
    medians stay beside it, `ratio_of_medians`.) The best fixed k is the one
    of the highest median rate either way."""
    # without a fixed k (--contenders) the cell is judged against plain only: best_fixed and
    # adaptive_vs_best_fixed None, and the verdict says "plain only"
    best = max((f"k={k}" for k in FIXED_KS if f"k={k}" in rate), key=rate.get, default=None)

    def ratios(paired: bool) -> dict:
        def ratio(a: str, b: str) -> float:
            if not paired:
                return rate[a] / rate[b]
            return statistics.median(x / y for x, y in zip(by_run[a], by_run[b], strict=True))
        return {"adaptive_vs_best_fixed": None if best is None else ratio("adaptive", best),
                "adaptive_vs_plain": ratio("adaptive", "plain"),
                "control_vs_plain": ratio(CONTROL, "plain") if CONTROL in rate else None}
    score = ratios(by_run is not None)
    vs_best, vs_plain = score["adaptive_vs_best_fixed"], score["adaptive_vs_plain"]
    return {"tokens_per_s": rate, "best_fixed": best, **score,
            "meets_target": (vs_best is None or vs_best >= TARGET) and vs_plain >= TARGET,
            **({"ratio_of_medians": ratios(False)} if by_run is not None else {})}


def control_spread(cells: list[dict]) -> dict | None:
    """The control's ratios to plain over the cells (whole runs): their range and the
    largest distance from 1.0, the size of a difference one run makes by itself."""
    ratios = [c["control_vs_plain"] for c in cells if c.get("control_vs_plain") is not None]
    if not ratios:
        return None
    return {"cells": len(ratios), "min": min(ratios), "max": max(ratios),
            "max_deviation": max(abs(r - 1.0) for r in ratios)}


def overall(cells: list[dict]) -> list[dict]:
    """Per concurrency, all tasks pooled: total tokens / total seconds per contender (and
    the same over the sustained steps, where every cell has them)."""
    rows = []
    for c in sorted({cell["concurrency"] for cell in cells}):
        group = [cell for cell in cells if cell["concurrency"] == c]
        names = list(group[0]["contenders"])
        pooled = {}
        for prefix in ("", "sustained_"):
            seconds = {n: sum(g["contenders"][n][f"{prefix}seconds"] for g in group) for n in names}
            if all(seconds.values()):
                pooled[prefix] = _score({n: sum(g["contenders"][n][f"{prefix}tokens"] for g in group) / seconds[n]
                                         for n in names})
        rows.append({"task": "all", "concurrency": c, **pooled[""], "sustained": pooled.get("sustained_")})
    return rows


def _verdict(score: dict | None) -> str:
    if score is None:
        return "n/a"
    vs_best = score["adaptive_vs_best_fixed"]
    miss = [] if vs_best is None or vs_best >= TARGET else ["best-k"]
    miss += [] if score["adaptive_vs_plain"] >= TARGET else ["plain"]
    verdict = "MISS " + ", ".join(miss) if miss else "ok"
    return verdict + (" (plain only: no fixed k run)" if vs_best is None else "")


def table(cells: list[dict], pooled: list[dict]) -> str:
    """Whole-run rates and verdict, then the sustained ones (all C requests in flight)."""
    names = list(cells[0]["tokens_per_s"])
    rows = []
    for cell in cells + pooled:
        acc = cell.get("contenders", {}).get("adaptive", {}).get("acceptance")
        sus = cell.get("sustained")
        rows.append([cell["task"], cell["concurrency"], *[cell["tokens_per_s"][n] for n in names],
                     cell["best_fixed"], cell["adaptive_vs_best_fixed"], cell["adaptive_vs_plain"],
                     acc, cell.get("adaptive_mean_k"), _verdict(cell), _medians_text(cell.get("ratio_of_medians")),
                     cell.get("control_vs_plain"),
                     sus and sus["best_fixed"], sus and sus["adaptive_vs_best_fixed"],
                     sus and sus["adaptive_vs_plain"], _verdict(sus), _paired_text(cell.get("paired")),
                     _drain_text(cell.get("drain")),
                     cell.get("latency_vs_plain"), cell.get("max_others_cpu_share")])
    headers = ["task", "C", *[f"{n} tok/s" for n in names], "best fixed", "adaptive / best fixed",
               "adaptive / plain", "adaptive acceptance", "adaptive mean k", "target 0.97",
               "ratio of medians: adaptive / best fixed; / plain", "control / plain",
               "sustained: best fixed", "sustained: adaptive / best fixed", "sustained: adaptive / plain",
               "sustained: target 0.97",
               f"1 in flight, paired {INTERVAL:.0%} interval over prompts: adaptive / best fixed; / plain",
               "drain: adaptive / plain (share of seconds: plain, adaptive)",
               "mean request latency: adaptive / plain", "others' CPU (max)"]
    return common.markdown_table(headers, rows)


def _medians_text(ratios: dict | None) -> str:
    if ratios is None:
        return "n/a"
    return f"{_fmt(ratios['adaptive_vs_best_fixed'])}; {_fmt(ratios['adaptive_vs_plain'])}"


def _paired_text(paired: dict | None) -> str:
    if paired is None:
        return "n/a"
    (b0, b1), (p0, p1) = paired["adaptive_vs_best_fixed"], paired["adaptive_vs_plain"]
    return f"{b0:.2f}-{b1:.2f}; {p0:.2f}-{p1:.2f} ({paired['verdict']}, {paired['prompts']} prompts)"


def _drain_text(drain: dict | None) -> str:
    if drain is None:
        return "n/a"
    share = drain["share"]
    return f"{_fmt(drain['adaptive_vs_plain'])} ({share['plain']:.0%}, {share['adaptive']:.0%})"


def _fmt(x):
    return "n/a" if x is None else f"{x:.2f}"


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    header = common.start_run(args)
    method = "draft" if args.draft_model else "ngram"
    models = common.load_models(replace(common.base_config(args, args.draft_model),
                                        spec=SpecConfig(method=method)))
    base = common.base_config(args)
    configs = {}
    chosen = contenders(method, args.adaptive_k_max, args.control)
    if args.contenders:
        chosen = {n: chosen[n] for n in args.contenders.split(",")}
    for name, spec in chosen.items():
        draft = args.draft_model if spec.method == "draft" else None  # plain runs no draft model
        configs[name] = replace(base, draft_model=draft, spec=spec)
    cells, i = [], 0
    for task in args.tasks:
        for c in args.concurrency:
            cells.append(run_cell(models, configs, task, c, i, args))
            i += 1
    pooled = overall(cells)
    text = table(cells, pooled)
    print(text)
    misses = [f"{c['task']}/C={c['concurrency']}" for c in cells if not c["meets_target"]]
    sustained_misses = [f"{c['task']}/C={c['concurrency']}" for c in cells
                        if not (c["sustained"] or {}).get("meets_target")]
    print(f"cells missing the target: {misses or 'none'}")
    print(f"cells missing the target on sustained rates: {sustained_misses or 'none'}")
    paired = {v: [f"{c['task']}/C={c['concurrency']}" for c in cells if (c.get("paired") or {}).get("verdict") == v]
              for v in ("met", "undecided", "missed")}
    if any(paired.values()):
        print(f"1 in flight, paired {INTERVAL:.0%} intervals over prompts: "
              + "; ".join(f"{v}: {names or 'none'}" for v, names in paired.items()))
    spread = control_spread(cells)
    if spread:
        print(f"control ({CONTROL} / plain, whole runs): {spread['min']:.3f} - {spread['max']:.3f} over "
              f"{spread['cells']} cells, at most {spread['max_deviation']:.1%} from 1.0")
    header = common.finish_run(header, t0)
    payload = {"benchmark": "adaptive", "schema": "verispec.bench.engine-adaptive/v8", **header,
               "settings": {"model": args.model, "draft_model": args.draft_model, "method": method,
                            "dtype": args.dtype, "temperature": 0.0, "tasks": {t: TASKS[t] for t in args.tasks},
                            "concurrency": args.concurrency, "num_prompts": args.num_prompts,
                            "prompts_per_slot": args.prompts_per_slot, "max_tokens": args.max_tokens,
                            "num_warmup": args.num_warmup, "warmup_tokens": args.warmup_tokens,
                            "adaptive_k_max": args.adaptive_k_max, "repeats": args.repeats,
                            "lockstep": args.lockstep, "target": TARGET, "control": args.control,
                            "quick": args.quick, "split": args.split,
                            "model_load_s": models.load_seconds},
               "engine_configs": {name: common.resolved(models, cfg).to_dict() for name, cfg in configs.items()},
               "cells": cells, "pooled": pooled, "cells_missing_target": misses,
               "cells_missing_target_sustained": sustained_misses, "control_spread": spread,
               "table_markdown": text}
    stem = f"adaptive_{'draft' if args.draft_model else 'ngram'}_{args.model}"
    common.write_json(args.out or common.RESULTS_DIR / f"{stem}{'_quick' if args.quick else ''}.json", payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
