"""The speculation policy against a variant of itself, alternating, same prompts.

A change to the policy moves a cell of bench/adaptive.py by a few percent, while on a
noisy 2-core VM the same contender's runs move by 10-25% within minutes: two grids run at
different times cannot tell the versions apart. This runs, per task and concurrency, the
adaptive contender `--repeats` times with the checked-out policy ("new") and as many with
a variant ("old"): `--baseline same` is the A/A control (the spread that a mechanism's
gain must exceed), `--baseline without-MECHANISM` the policy with one mechanism switched
off (ABLATIONS). The order alternates every repeat; each cell reports the medians and
their ratio. With `--lockstep` each repeat instead steps both versions and plain decoding
in turn, one engine step each (`common.run_lockstep`), so a slow stretch of the machine
lands on all three alike; each cell then also reports both versions over plain.
Prompts come from the evaluation half of each task by default (`--split`).

    .venv/bin/python bench/controller_ab.py --baseline same --concurrency 1,4 \\
        --repeats 3 --threads 2 --lockstep

With `--draft-model` both versions draft with that model (the Qwen2.5-Coder pair:
`--model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct`) instead
of n-gram lookup; plain decoding runs no draft model. `--spec auto --draft-head DIR` runs
method auto with that head (`--baseline without-draft-cost`: the choice by acceptance
alone).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import adaptive  # noqa: E402
import common  # noqa: E402
from verispec.config import SpecConfig  # noqa: E402
from verispec.spec.costs import TRUSTED_AT, WINDOW, CostCells  # noqa: E402
from verispec.spec.costs import _bucket_index as size_bucket_index  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402

VERSIONS = ("new", "old")  # this checkout's policy, the variant


def _without_keys(engine) -> None:
    """Acceptance pooled per proposer only: every offer's key (n-gram match length) is 0."""
    offers = engine._offers
    engine._offers = lambda rows: [o._replace(key=0) for o in offers(rows)]


def _without_allocation(engine) -> None:
    """One k for every adaptive row (drafts handed out level by level), not by marginal gain."""
    gains = engine.policy._gains

    def level_by_level(rows, limit=None):
        level, ordered = {}, []
        for gain, i in gains(rows):
            level[i] = level.get(i, 0) + 1
            ordered.append((level[i], -gain, i))
        return [(-g, i) for _, g, i in sorted(ordered)][:limit]
    engine.policy._gains = level_by_level


def _without_draft_cost(engine) -> None:
    """Method auto picks a row's proposer by acceptance alone, not net of a timed proposer's
    measured cost per drafted token."""
    acceptance = engine.policy.acceptance
    engine.policy._net_acceptance = lambda o: acceptance.alpha(o.request_id, o.proposer, o.key)


class _OwnTimings(CostCells):
    """Cost cells without a level: each cell priced by the median of its own last timings
    (its relative cost is its seconds, every level 1)."""

    def observe(self, rows: int, size: int, seconds: float) -> None:
        cell = (rows, size_bucket_index(size))
        timings = self._relative.setdefault(cell, deque(maxlen=WINDOW))
        timings.append(seconds)
        self._level[rows] = 1.0
        if len(timings) >= TRUSTED_AT:
            self._trusted[cell] = statistics.median(timings)


def _without_level(engine) -> None:
    """Verify cells priced by their own timings, not relative to their row count's level."""
    engine.policy.verify_costs = _OwnTimings()


ABLATIONS = {"same": lambda engine: None, "without-keys": _without_keys, "without-allocation": _without_allocation,
             "without-draft-cost": _without_draft_cost, "without-level": _without_level}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, choices=list(ABLATIONS),
                   help="the 'old' version: the same policy (A/A) or one without a mechanism")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--draft-model", default=None, help="draft with this model instead of n-gram")
    p.add_argument("--spec", default=None, choices=("ngram", "auto", "suffix", "eagle"),
                   help="the method both versions run (default: n-gram, or the draft model if given)")
    p.add_argument("--draft-head", default=None, help="the head folder for --spec eagle or auto")
    p.add_argument("--tasks", default=",".join(adaptive.TASKS), help=f"comma-separated, from {list(adaptive.TASKS)}")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompts-per-slot", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-warmup", type=int, default=4)
    p.add_argument("--warmup-tokens", type=int, default=16)
    p.add_argument("--k-max", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="runs per version per cell (order alternates)")
    p.add_argument("--lockstep", action="store_true",
                   help="step both versions and plain decoding in turn each repeat (common.run_lockstep)")
    common.add_common_args(p, "1,4")
    args = p.parse_args(argv)
    args.tasks = args.tasks.split(",")
    bad = [t for t in args.tasks if t not in adaptive.TASKS]
    if bad:
        p.error(f"--tasks: unknown {bad}; choose from {list(adaptive.TASKS)}")
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


def engine_configs(args: argparse.Namespace):
    """(both versions' engine config, plain decoding's): adaptive k up to --k-max, drafting
    with --draft-model if given, else n-gram lookup; plain decoding loads no draft model."""
    method = args.spec or ("draft" if args.draft_model else "ngram")
    config = replace(common.base_config(args, args.draft_model), draft_head=args.draft_head,
                     spec=SpecConfig(method=method, num_spec_tokens=args.k_max, adaptive=True))
    return config, replace(config, draft_model=None, spec=SpecConfig(method="none"))


def run_repeat(engine_for, order: tuple[str, ...], items, concurrency: int, params, lockstep: bool, seed: int,
               tag: str) -> dict:
    """One repeat of every version in `order` ({version: RunResult}, in that order): one after
    the other, each on a fresh engine from `engine_for(version)`, or with `lockstep` all at
    once, stepped in turn (`common.run_lockstep`)."""
    if lockstep:
        loops = {v: common.ClosedLoop(engine_for(v), items, concurrency, params, f"{v}-{tag}") for v in order}
        return common.run_lockstep(loops, seed=seed)
    results = {}
    for version in order:
        results[version] = common.run_closed_loop(engine_for(version), items, concurrency, params, f"{version}-{tag}")
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    header = common.start_run(args)
    config, plain_config = engine_configs(args)
    method = config.spec.method
    models = common.load_models(replace(config, spec=SpecConfig(method=method)))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    cells, rows = [], []
    for task in args.tasks:
        for c in args.concurrency:
            n = max(args.num_prompts, args.prompts_per_slot * c)
            measured, warm, sources = common.pick_prompts(adaptive.TASKS[task], n, args.num_warmup, seed=args.seed,
                                                               split=args.split)
            items = common.encode(models.tokenizer, measured, task)
            warm_items = common.encode(models.tokenizer, warm, task)
            versions = VERSIONS + (("plain",) if args.lockstep else ())
            runs = {version: [] for version in versions}

            def engine_for(version: str):
                engine = common.make_engine(models, plain_config if version == "plain" else config)
                if version == "old":
                    ABLATIONS[args.baseline](engine)
                common.warm_up(engine, warm_items, min(c, len(warm_items)), args.warmup_tokens, f"{version}-{task}")
                return engine

            for r in range(args.repeats):
                results = run_repeat(engine_for, versions if r % 2 == 0 else versions[::-1], items, c, params,
                                     args.lockstep, args.seed + r, f"{task}-c{c}")
                for version, run in results.items():
                    runs[version].append(run.tokens_per_s)
                    print(f"[controller_ab] {args.baseline} {task:13s} C={c:2d} {version} {run.tokens_per_s:7.2f} tok/s "
                          f"load={common.load_average():.2f}", file=sys.stderr, flush=True)
            medians = {version: statistics.median(v) for version, v in runs.items()}
            new, old = medians["new"], medians["old"]
            cell = {"task": task, "concurrency": c, "prompt_ids": [p.prompt_id for p in measured],
                    "datasets": sources, "tokens_per_s_runs": runs, "new_tokens_per_s": new,
                    "old_tokens_per_s": old, "new_vs_old": new / old}
            row = [task, c, new, old, new / old]
            if args.lockstep:
                cell.update(plain_tokens_per_s=medians["plain"], new_vs_plain=new / medians["plain"],
                            old_vs_plain=old / medians["plain"])
                row += [new / medians["plain"], old / medians["plain"]]
            cells.append(cell)
            rows.append(row)
    ratios = [cell["new_vs_old"] for cell in cells]
    head = ["task", "C", "new tok/s (median)", "old tok/s (median)", "new / old"]
    text = common.markdown_table(head + (["new / plain", "old / plain"] if args.lockstep else []), rows)
    print(text)
    print(f"geometric mean new / old over {len(ratios)} cells: {statistics.geometric_mean(ratios):.3f}")
    header = common.finish_run(header, t0)
    payload = {"benchmark": "controller-ab", "schema": "verispec.bench.controller-ab/v3", **header,
               "settings": {"model": args.model, "draft_model": args.draft_model, "method": method,
                            "baseline": args.baseline, "split": args.split,
                            "tasks": {t: adaptive.TASKS[t] for t in args.tasks}, "concurrency": args.concurrency,
                            "num_prompts": args.num_prompts, "prompts_per_slot": args.prompts_per_slot,
                            "max_tokens": args.max_tokens, "num_warmup": args.num_warmup,
                            "warmup_tokens": args.warmup_tokens, "k_max": args.k_max, "repeats": args.repeats,
                            "lockstep": args.lockstep, "temperature": 0.0},
               "engine_config": common.resolved(models, config).to_dict(),
               "cells": cells, "geometric_mean_new_vs_old": statistics.geometric_mean(ratios),
               "table_markdown": text}
    stem = f"controller_ab_{args.baseline}_{args.model}" + (f"_{args.draft_model}" if args.draft_model else "")
    common.write_json(args.out or common.RESULTS_DIR / f"{stem}.json", payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
