"""Speculation methods against plain decoding over the five-task suite, greedy, lockstep.

Contenders (`--contenders`, each on a fresh engine; plain always runs as the reference),
stepped in turn one engine step each (`common.run_lockstep`), so a slow stretch of the
machine lands on all alike:
    ngram     prompt lookup, adaptive k
    ngram-aa  a second n-gram engine: the A/A control (its ratio to ngram is the spread
              a method's gain must exceed)
    suffix    suffix decoding, adaptive k
    eagle     the EAGLE-style head (needs a trained head)
Outputs must equal plain's (greedy). Evaluation half of each task's prompts by default.
Results: bench/results/proposers_<model>.json.

    .venv/bin/python bench/proposers.py --threads 2 --num-prompts 6
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from verispec.config import SpecConfig  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402

TASKS = {"chat": ["mtbench"], "code": ["humaneval"], "rewrite": ["rewrite-code", "rewrite-essay"],
         "summarisation": ["cnn"], "math": ["gsm8k"]}
METHODS = {"plain": "none", "ngram": "ngram", "ngram-aa": "ngram", "suffix": "suffix", "eagle": "eagle"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--contenders", default="ngram,ngram-aa,suffix",
                   help=f"comma-separated, from {[m for m in METHODS if m != 'plain']}")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--num-prompts", type=int, default=6, help="measured prompts per task")
    p.add_argument("--num-warmup", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k-max", type=int, default=8)
    common.add_common_args(p, "1")
    args = p.parse_args(argv)
    args.tasks, args.contenders = args.tasks.split(","), ["plain", *args.contenders.split(",")]
    unknown = [c for c in args.contenders if c not in METHODS] + [t for t in args.tasks if t not in TASKS]
    if unknown:
        p.error(f"unknown contenders or tasks: {unknown}")
    return args


def run_task(models, configs, task: str, args, watch=None) -> tuple[dict, dict]:
    """(the task's summary, each contender's RunResult); `watch(name, engine)` is called on
    each engine after its warm-up (to instrument it)."""
    measured, warm, sources = common.pick_prompts(TASKS[task], args.num_prompts, args.num_warmup,
                                                  seed=args.seed, split=args.split)
    items, warm_items = common.encode(models.tokenizer, measured, task), common.encode(models.tokenizer, warm, task)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    loops = {}
    for name, cfg in configs.items():
        engine = common.make_engine(models, cfg)
        common.warm_up(engine, warm_items, 1, 16, f"{name}-{task}")
        if watch is not None:
            watch(name, engine)
        loops[name] = common.ClosedLoop(engine, items, 1, params, f"{name}-{task}")
    results = common.run_lockstep(loops, seed=args.seed)
    plain = results["plain"]
    out = {"task": task, "sources": sources, "contenders": {}}
    for name, r in results.items():
        row = {**r.summary(), "speedup": r.tokens_per_s / plain.tokens_per_s,
               "identical_to_plain": common.same_outputs(r, plain)}
        out["contenders"][name] = row
        print(f"[proposers] {task:13s} {name:9s} {r.tokens_per_s:7.2f} tok/s x{row['speedup']:.2f} "
              f"acc={r.acceptance if r.acceptance is None else round(r.acceptance, 3)}", file=sys.stderr, flush=True)
    return out, results


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    header = common.start_run(args)
    base = replace(common.base_config(args), model=args.model)
    models = common.load_models(base)
    configs = {name: replace(base, spec=SpecConfig(method=METHODS[name], num_spec_tokens=args.k_max, adaptive=True))
               for name in args.contenders}
    tasks = [run_task(models, configs, task, args)[0] for task in args.tasks]
    names = args.contenders[1:]
    rows = [[t["task"], f"{t['contenders']['plain']['tokens_per_s']:.1f}",
             *[f"{t['contenders'][n]['speedup']:.2f}" for n in names]] for t in tasks]
    geo = {n: common.geomean([t["contenders"][n]["speedup"] for t in tasks]) for n in names}
    rows.append(["geo. mean", "", *[f"{geo[n]:.2f}" for n in names]])
    text = common.markdown_table(["task", "plain tok/s", *names], rows)
    print(text)
    common.write_result("proposers", args, header, t0, {
        "engine_configs": {n: common.resolved(models, cfg).to_dict() for n, cfg in configs.items()},
        "tasks": tasks, "geomean_speedup": geo, "table_markdown": text},
        common.RESULTS_DIR / f"proposers_{args.model}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
