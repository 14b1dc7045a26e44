"""The adaptive controller against an earlier version of itself, alternating, same prompts.

A change to the controller moves a cell of bench/adaptive.py by a few percent, while on a
noisy 2-core VM the same contender's runs move by 10-25% within minutes: two grids run at
different times cannot tell the versions apart. This runs, per task and concurrency, the
adaptive contender `--repeats` times with the checked-out controller ("new") and as many
with `verispec/spec/controller.py` as of `--baseline` ("old", loaded from git into its own
module and swapped into an otherwise identical engine), alternating the order every
repeat, and reports each cell's medians and their ratio. Same prompts, warm-up and
settings as bench/adaptive.py. With `--lockstep` each repeat instead steps both versions and
plain decoding in turn, one engine step each (`common.run_lockstep`), so a slow stretch of
the machine lands on all three alike; each cell then also reports both versions over plain
(at 16 in flight a controller change moves a cell by ~1% and whole runs by 2-3%: session 28).

    .venv/bin/python bench/controller_ab.py --baseline 56908b1^ --concurrency 1,4 \\
        --repeats 3 --threads 2 --max-load 1.5

With `--draft-model` both versions draft with that model (the Qwen2.5-Coder pair:
`--model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct`) instead
of n-gram lookup; plain decoding runs no draft model.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import adaptive  # noqa: E402
import common  # noqa: E402
from verispec.config import SpecConfig  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VERSIONS = ("new", "old")  # this checkout's controller, the baseline's


def baseline_controller(module, config):
    """The baseline's controller with this run's settings, those the baseline knows (a
    setting added since is the new version's own: the baseline runs as it was). A baseline
    from before the engine timed the choice apart (no "choice" cost kind) is told the round's
    choice inside its verify timing, as the engine of its day reported it."""
    known = {f.name for f in dataclasses.fields(module.ControllerConfig)}
    ctl = module.AdaptiveController(module.ControllerConfig(
        **{k: v for k, v in config.to_dict().items() if k in known}))
    if "choice" not in getattr(module, "COST_KINDS", ("choice",)):
        _choice_into_verify(ctl)
    return ctl


def _choice_into_verify(ctl) -> None:
    """Wrap `ctl` so that a round's "choice" report is added to its verify report instead
    (a step that prefills reports no verify: its choice is dropped at the next step's rest)."""
    observe, rest = ctl.observe_cost, ctl.rest
    pending = [0.0]

    def observe_cost(kind, batch_size, size, seconds):
        if kind == "choice":
            pending[0] = seconds
            return None
        if kind == "verify":
            seconds, pending[0] = seconds + pending[0], 0.0
        return observe(kind, batch_size, size, seconds)

    def rest_(request_ids, batch_size):
        pending[0] = 0.0  # (every step with adaptive rows asks first)
        return rest(request_ids, batch_size)

    ctl.observe_cost, ctl.rest = observe_cost, rest_


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="git revision whose controller.py is 'old'")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--draft-model", default=None, help="draft with this model instead of n-gram")
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


def load_baseline(rev: str):
    """verispec/spec/controller.py at `rev` as a module of its own; (module, full commit)."""
    def git(*a: str) -> str:
        out = subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"--baseline {rev!r}: git {' '.join(a)} failed: {out.stderr.strip()}")
        return out.stdout
    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}").strip()
    path = Path(tempfile.mkdtemp()) / "baseline_controller.py"
    path.write_text(git("show", f"{commit}:verispec/spec/controller.py"))
    spec = importlib.util.spec_from_file_location("baseline_controller", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_controller"] = module  # dataclasses need the module registered
    spec.loader.exec_module(module)
    return module, commit


def engine_configs(args: argparse.Namespace):
    """(both versions' engine config, plain decoding's): adaptive k up to --k-max, drafting
    with --draft-model if given, else n-gram lookup; plain decoding loads no draft model."""
    method = "draft" if args.draft_model else "ngram"
    config = replace(common.base_config(args, args.draft_model),
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
    baseline, commit = load_baseline(args.baseline)
    header = common.start_run(args)
    config, plain_config = engine_configs(args)
    method = config.spec.method
    models = common.load_models(replace(config, spec=SpecConfig(method=method)))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    cells, rows = [], []
    for task in args.tasks:
        for c in args.concurrency:
            n = max(args.num_prompts, args.prompts_per_slot * c)
            measured, warm, sources = common.pick_prompts(adaptive.TASKS[task], n, args.num_warmup, seed=args.seed)
            items = common.encode(models.tokenizer, measured, task)
            warm_items = common.encode(models.tokenizer, warm, task)
            versions = VERSIONS + (("plain",) if args.lockstep else ())
            runs = {version: [] for version in versions}

            def engine_for(version: str):
                engine = common.make_engine(models, plain_config if version == "plain" else config)
                if version == "old":
                    engine.controller = baseline_controller(baseline, engine.controller.config)
                common.warm_up(engine, warm_items, min(c, len(warm_items)), args.warmup_tokens, f"{version}-{task}")
                return engine

            for r in range(args.repeats):
                results = run_repeat(engine_for, versions if r % 2 == 0 else versions[::-1], items, c, params,
                                     args.lockstep, args.seed + r, f"{task}-c{c}")
                for version, run in results.items():
                    runs[version].append(run.tokens_per_s)
                    print(f"[controller_ab] {task:13s} C={c:2d} {version} {run.tokens_per_s:7.2f} tok/s "
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
    payload = {"benchmark": "controller-ab", "schema": "verispec.bench.controller-ab/v2", **header,
               "settings": {"model": args.model, "draft_model": args.draft_model, "method": method,
                            "baseline": args.baseline, "baseline_commit": commit,
                            "tasks": {t: adaptive.TASKS[t] for t in args.tasks}, "concurrency": args.concurrency,
                            "num_prompts": args.num_prompts, "prompts_per_slot": args.prompts_per_slot,
                            "max_tokens": args.max_tokens, "num_warmup": args.num_warmup,
                            "warmup_tokens": args.warmup_tokens, "k_max": args.k_max, "repeats": args.repeats,
                            "lockstep": args.lockstep, "temperature": 0.0},
               "engine_config": common.resolved(models, config).to_dict(),
               "cells": cells, "geometric_mean_new_vs_old": statistics.geometric_mean(ratios),
               "table_markdown": text}
    stem = f"controller_ab_{args.model}" + (f"_{args.draft_model}" if args.draft_model else "")
    common.write_json(args.out or common.RESULTS_DIR / f"{stem}.json", payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
