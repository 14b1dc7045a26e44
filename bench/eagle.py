"""The EAGLE-style head against plain decoding and n-gram, per task, greedy, lockstep.

Contenders, each on a fresh engine, stepped in turn (`common.run_lockstep`):
    plain      no speculation
    ngram      prompt lookup, adaptive k (the default)
    ngram-aa   a second n-gram engine: the A/A control (its ratio to ngram is the spread
               another contender's gain over n-gram must exceed)
    eagle      the head, adaptive k
    eagle-k4   the head at fixed k = 4: acceptance per draft position, and the head's
               cost (a head pass, timed around the proposer's draft call / 4 passes)
               against plain's step (seconds per step)
    auto       per row and round the lookup or the head, whichever that row accepts more
               often (SpecConfig.auto_candidates' default: n-gram and the head), adaptive k
    draft      with --draft-model: that draft model, adaptive k (the head's rival)
`--contenders` picks a subset (plain always runs); without eagle-k4 no head cost is taken.
Outputs must equal plain's (greedy). Results: bench/results/eagle_<model>.json.

    .venv/bin/python bench/eagle.py --threads 2 --concurrency 1 --num-prompts 6
    .venv/bin/python bench/eagle.py --model qwen2.5-coder-1.5b-instruct \
        --draft-model qwen2.5-coder-0.5b-instruct --tasks code,chat
    .venv/bin/python bench/eagle.py --model qwen2.5-coder-1.5b-instruct --tasks code,chat \
        --contenders ngram,ngram-aa,auto --num-prompts 12          # is auto worth the default?
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
              "ngram-aa": SpecConfig(method="ngram", num_spec_tokens=8, adaptive=True),
              "eagle": SpecConfig(method="eagle", num_spec_tokens=8, adaptive=True),
              "eagle-k4": SpecConfig(method="eagle", num_spec_tokens=4, adaptive=False),
              "auto": SpecConfig(method="auto", num_spec_tokens=8, adaptive=True)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--draft-head", default=None, help="head folder (default: the model's registered head)")
    p.add_argument("--draft-model", default=None, help="also race this draft model (contender 'draft')")
    p.add_argument("--tasks", default=",".join(proposers.TASKS))
    p.add_argument("--contenders", default=",".join(n for n in CONTENDERS if n not in ("plain", "ngram-aa")),
                   help=f"comma-separated, from {[n for n in CONTENDERS if n != 'plain'] + ['draft']} "
                        "(draft needs --draft-model)")
    p.add_argument("--num-prompts", type=int, default=6, help="measured prompts per task")
    p.add_argument("--num-warmup", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    common.add_common_args(p, "1")
    args = p.parse_args(argv)
    args.tasks = args.tasks.split(",")
    args.contenders = ["plain", *args.contenders.split(",")]
    known = [*CONTENDERS, "draft"]
    unknown = [c for c in args.contenders if c not in known] + [t for t in args.tasks if t not in proposers.TASKS]
    if unknown:
        p.error(f"unknown contenders or tasks: {unknown}; contenders from {known}")
    if args.draft_model and "draft" not in args.contenders:
        args.contenders.append("draft")
    if "draft" in args.contenders and not args.draft_model:
        p.error("contender 'draft' needs --draft-model")
    if len(args.concurrency) != 1:
        p.error(f"--concurrency takes one value here, got {args.concurrency}")
    args.concurrency = args.concurrency[0]
    return args


def engine_configs(args: argparse.Namespace):
    """(the config the weights load by, {contender: engine config}): the draft model, if
    named, loads with the target and only the 'draft' contender runs it."""
    base = replace(common.base_config(args), draft_head=args.draft_head)
    configs = {name: replace(base, spec=spec) for name, spec in CONTENDERS.items() if name in args.contenders}
    if not args.draft_model:
        return base, configs
    configs["draft"] = replace(base, draft_model=args.draft_model,
                               spec=SpecConfig(method="draft", num_spec_tokens=8, adaptive=True))
    return configs["draft"], configs


def run_task(models, configs, task: str, args) -> dict:
    """proposers.run_task, plus each contender over n-gram (`vs_ngram`) and the fixed-k
    head's pass cost (its draft call / 4 passes)."""
    out, results, watches = proposers.run_task(models, configs, task, args)
    out["vs_ngram"] = vs_ngram(results, args.seed)
    if "eagle-k4" not in watches:
        return out
    step_s = out["plain_step_ms"] / 1000
    w, row = watches["eagle-k4"], out["contenders"]["eagle-k4"]
    row["head_pass_ms"] = 1000 * w.draft_s / max(1, 4 * w.draft_calls)
    row["head_cost"] = (w.draft_s / max(1, 4 * w.draft_calls)) / step_s
    return out


def vs_ngram(results: dict, seed: int = 0, resamples: int = 2000, level: float = 0.9) -> dict:
    """Each contender's rate over n-gram's, with a paired bootstrap interval over the prompts
    at 1 in flight (`common.paired_resamples`). {} without n-gram; no interval above 1 in
    flight."""
    if "ngram" not in results:
        return {}
    ngram, out = results["ngram"], {}
    for name, r in results.items():
        if name in ("plain", "ngram"):
            continue
        entry = {"ratio": r.tokens_per_s / ngram.tokens_per_s}
        if r.concurrency == 1:
            ratios = [rate["a"] / rate["b"] for rate in common.paired_resamples({"a": [r], "b": [ngram]}, resamples, seed)]
            entry["interval"] = common.central_interval(ratios, level)
        out[name] = entry
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    header = common.start_run(args)
    load, configs = engine_configs(args)
    models = common.load_models(load)
    tasks = [run_task(models, configs, task, args) for task in args.tasks]
    text = table(tasks, [n for n in configs if n != "plain"])
    print(text)
    geo = {n: common.geomean([t["contenders"][n]["speedup"] for t in tasks]) for n in configs}
    common.write_result("eagle", args, header, t0, {
        "engine_configs": {n: common.resolved(models, cfg).to_dict() for n, cfg in configs.items()},
        "tasks": tasks, "geomean_speedup": geo, "table_markdown": text}, common.RESULTS_DIR / f"eagle_{args.model}.json")
    return 0


def table(tasks: list[dict], speedups: list[str]) -> str:
    """Speedups over plain per task, each contender over n-gram with its paired interval,
    and the fixed-k head's acceptance and pass cost where it ran."""
    head = "eagle-k4" in speedups
    over = [n for n in speedups if n != "ngram"] if "ngram" in speedups else []
    rows = []
    for t in tasks:
        c = t["contenders"]
        row = [t["task"], f"{c['plain']['tokens_per_s']:.1f}"] + [f"{c[n]['speedup']:.2f}" for n in speedups]
        row += [_over_text(t["vs_ngram"][n]) for n in over]
        if head:
            k4 = c["eagle-k4"]
            row += [" / ".join(f"{a:.2f}" for a in k4["acceptance_per_position"] if a is not None),
                    f"{k4['head_cost']:.3f}"]
        rows.append(row)
    geo = [f"{common.geomean([t['contenders'][n]['speedup'] for t in tasks]):.2f}" for n in speedups]
    rows.append(["geo. mean", "", *geo] + [""] * (len(over) + 2 * head))
    headers = ["task", "plain tok/s", *speedups, *[f"{n} / ngram (90%)" for n in over]]
    headers += ["acceptance per position (k=4)", "head pass / plain step"] if head else []
    return common.markdown_table(headers, rows)


def _over_text(entry: dict) -> str:
    ends = entry.get("interval")
    return f"{entry['ratio']:.3f}" + (f" ({ends[0]:.3f}-{ends[1]:.3f})" if ends else "")


if __name__ == "__main__":
    raise SystemExit(main())
