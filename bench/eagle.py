"""The EAGLE-style head against plain decoding and n-gram, per task, greedy, lockstep.

Contenders, each on a fresh engine, stepped in turn (`common.run_lockstep`):
    plain      no speculation
    ngram      prompt lookup, adaptive k (the default)
    eagle      the head, adaptive k
    eagle-k4   the head at fixed k = 4: acceptance per draft position, and the head's
               cost (a head pass, timed around the proposer's draft call / 4 passes)
               against plain's step (seconds per step)
    auto       per row and round the lookup or the head, whichever that row accepts more
               often (SpecConfig.auto_candidates' default: n-gram and the head), adaptive k
    draft      with --draft-model: that draft model, adaptive k (the head's rival)
Outputs must equal plain's (greedy). Results: bench/results/eagle_<model>.json.

    .venv/bin/python bench/eagle.py --threads 2 --concurrency 1 --num-prompts 6
    .venv/bin/python bench/eagle.py --model qwen2.5-coder-1.5b-instruct \
        --draft-model qwen2.5-coder-0.5b-instruct --tasks code,chat
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import proposers  # noqa: E402

from verispec.config import SpecConfig  # noqa: E402

CONTENDERS = {"plain": SpecConfig(method="none"),
              "ngram": SpecConfig(method="ngram", num_spec_tokens=8, adaptive=True),
              "eagle": SpecConfig(method="eagle", num_spec_tokens=8, adaptive=True),
              "eagle-k4": SpecConfig(method="eagle", num_spec_tokens=4, adaptive=False),
              "auto": SpecConfig(method="auto", num_spec_tokens=8, adaptive=True)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--draft-head", default=None, help="head folder (default: the model's registered head)")
    p.add_argument("--draft-model", default=None, help="also race this draft model (contender 'draft')")
    p.add_argument("--tasks", default=",".join(proposers.TASKS))
    p.add_argument("--num-prompts", type=int, default=6, help="measured prompts per task")
    p.add_argument("--num-warmup", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    common.add_common_args(p, "1")
    args = p.parse_args(argv)
    args.tasks = args.tasks.split(",")
    if len(args.concurrency) != 1:
        p.error(f"--concurrency takes one value here, got {args.concurrency}")
    args.concurrency = args.concurrency[0]
    return args


def engine_configs(args: argparse.Namespace):
    """(the config the weights load by, {contender: engine config}): the draft model, if
    named, loads with the target and only the 'draft' contender runs it."""
    base = replace(common.base_config(args), draft_head=args.draft_head)
    configs = {name: replace(base, spec=spec) for name, spec in CONTENDERS.items()}
    if not args.draft_model:
        return base, configs
    configs["draft"] = replace(base, draft_model=args.draft_model,
                               spec=SpecConfig(method="draft", num_spec_tokens=8, adaptive=True))
    return configs["draft"], configs


def run_task(models, configs, task: str, args) -> dict:
    """proposers.run_task, plus the fixed-k head's pass cost (its draft call / 4 passes)."""
    out, _, watches = proposers.run_task(models, configs, task, args)
    step_s = out["plain_step_ms"] / 1000
    w, row = watches["eagle-k4"], out["contenders"]["eagle-k4"]
    row["head_pass_ms"] = 1000 * w.draft_s / max(1, 4 * w.draft_calls)
    row["head_cost"] = (w.draft_s / max(1, 4 * w.draft_calls)) / step_s
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    header = common.start_run(args)
    load, configs = engine_configs(args)
    models = common.load_models(load)
    tasks = [run_task(models, configs, task, args) for task in args.tasks]
    rows, speedups = [], [n for n in configs if n != "plain"]
    for t in tasks:
        c = t["contenders"]
        k4 = c["eagle-k4"]
        rows.append([t["task"], f"{c['plain']['tokens_per_s']:.1f}"]
                    + [f"{c[n]['speedup']:.2f}" for n in speedups]
                    + [" / ".join(f"{a:.2f}" for a in k4["acceptance_per_position"] if a is not None),
                       f"{k4['head_cost']:.3f}"])
    geo = {n: common.geomean([t["contenders"][n]["speedup"] for t in tasks]) for n in configs}
    rows.append(["geo. mean", ""] + [f"{geo[n]:.2f}" for n in speedups] + ["", ""])
    text = common.markdown_table(["task", "plain tok/s"] + speedups
                                 + ["acceptance per position (k=4)", "head pass / plain step"], rows)
    print(text)
    common.write_result("eagle", args, header, t0, {
        "engine_configs": {n: common.resolved(models, cfg).to_dict() for n, cfg in configs.items()},
        "tasks": tasks, "geomean_speedup": geo, "table_markdown": text}, common.RESULTS_DIR / f"eagle_{args.model}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
