"""Speculation methods against plain decoding over the five-task suite, greedy, lockstep.

Contenders (`--contenders`, each on a fresh engine; plain always runs as the reference),
stepped in turn one engine step each (`common.run_lockstep`), so a slow stretch of the
machine lands on all alike:
    ngram     prompt lookup, adaptive k
    ngram-aa  a second n-gram engine: the A/A control (its ratio to ngram is the spread
              a method's gain must exceed)
    suffix    suffix decoding, adaptive k
    suffix-own  the same from each request's own tokens only (`--suffix-max-cached-requests 0`)
    eagle     the EAGLE-style head (needs a trained head)
Each method runs at its own default k_max (`--num-spec-tokens` unset: 16 for suffix, 8 for
the rest) unless `--k-max` sets one for all; a contender `NAME-kN` runs NAME at k_max N
(`suffix-k8` beside `suffix` compares the two in one run).
Outputs must equal plain's (greedy). Evaluation half of each task's prompts by default;
`--concurrency C` keeps C requests in flight on each engine (closed loop; default 1).
Results: bench/results/proposers_<model>.json.

    .venv/bin/python bench/proposers.py --threads 2 --num-prompts 6
"""
from __future__ import annotations

import argparse
import re
import statistics
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
METHODS = {"plain": "none", "ngram": "ngram", "ngram-aa": "ngram", "suffix": "suffix", "suffix-own": "suffix",
           "eagle": "eagle"}
# Contenders that are a method with other settings: suffix decoding from each request's own
# tokens only (no outputs shared between requests).
SETTINGS = {"suffix-own": {"suffix_max_cached_requests": 0}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--contenders", default="ngram,ngram-aa,suffix",
                   help=f"comma-separated, from {[m for m in METHODS if m != 'plain']}")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--num-prompts", type=int, default=6, help="measured prompts per task")
    p.add_argument("--num-warmup", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k-max", type=int, default=None, help="k_max of every contender (default: each method's)")
    common.add_common_args(p, "1")
    args = p.parse_args(argv)
    args.tasks, args.contenders = args.tasks.split(","), ["plain", *args.contenders.split(",")]
    unknown = [c for c in args.contenders if _name_and_k(c) is None] + [t for t in args.tasks if t not in TASKS]
    if unknown:
        p.error(f"unknown contenders or tasks: {unknown}")
    if len(args.concurrency) != 1:
        p.error(f"--concurrency takes one value here (one run per concurrency), got {args.concurrency}")
    args.concurrency = args.concurrency[0]
    return args


def _name_and_k(contender: str) -> tuple[str, int | None] | None:
    """(its METHODS name, k_max or None) of a contender (`NAME` or `NAME-kN`); None if unknown."""
    name, _, k = contender.rpartition("-k") if re.fullmatch(r".+-k\d+", contender) else (contender, "", "")
    return (name, int(k) if k else None) if name in METHODS else None


class Watch:
    """One engine's finished requests' drafts and acceptances per position, and the seconds
    spent in its proposers' offer and draft calls (lookups, or a model's passes)."""

    def __init__(self, engine):
        self.drafted, self.accepted, self.draft_s, self.draft_calls, self.proposer_s = [], [], 0.0, 0, 0.0
        step = engine.step

        def watched_step():
            outs = step()
            for o in outs:
                if o.finished:
                    for mine, theirs in ((self.drafted, o.spec.drafted_per_position),
                                         (self.accepted, o.spec.accepted_per_position)):
                        mine.extend([0] * (len(theirs) - len(mine)))
                        for i, n in enumerate(theirs):
                            mine[i] += n
            return outs
        engine.step = watched_step
        for proposer in engine.proposers.values():
            proposer.offer, proposer.draft = self._timed(proposer.offer, False), self._timed(proposer.draft, True)

    def _timed(self, call, is_draft: bool):
        def timed(*a):
            t0 = time.perf_counter()
            out = call(*a)
            seconds = time.perf_counter() - t0
            self.proposer_s += seconds
            if is_draft:
                self.draft_s += seconds
                self.draft_calls += 1
            return out
        return timed

    def acceptance_per_position(self) -> list[float | None]:
        return [a / d if d else None for a, d in zip(self.accepted, self.drafted)]


def run_task(models, configs, task: str, args) -> tuple[dict, dict, dict]:
    """(the task's summary, each contender's RunResult, each contender's Watch)."""
    measured, warm, sources = common.pick_prompts(TASKS[task], args.num_prompts, args.num_warmup,
                                                  seed=args.seed, split=args.split)
    items, warm_items = common.encode(models.tokenizer, measured, task), common.encode(models.tokenizer, warm, task)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    loops, watches = {}, {}
    for name, cfg in configs.items():
        engine = common.make_engine(models, cfg)
        common.warm_up(engine, warm_items, args.concurrency, 16, f"{name}-{task}")
        watches[name] = Watch(engine)
        loops[name] = common.ClosedLoop(engine, items, args.concurrency, params, f"{name}-{task}")
    results = common.run_lockstep(loops, seed=args.seed)
    plain = results["plain"]
    step_s = plain.seconds / plain.steps
    out = {"task": task, "sources": sources, "plain_step_ms": 1000 * step_s, "contenders": {}}
    for name, r in results.items():
        w = watches[name]
        row = {**r.summary(), "speedup": r.tokens_per_s / plain.tokens_per_s,
               "identical_to_plain": common.same_outputs(r, plain),
               "acceptance_per_position": w.acceptance_per_position(),
               "drafted_per_position": w.drafted, "accepted_per_position": w.accepted,
               "proposer_ms_per_step": 1000 * w.proposer_s / r.steps,
               "proposer_cost": w.proposer_s / r.steps / step_s}   # of a plain step
        out["contenders"][name] = row
        print(f"[proposers] {task:13s} {name:9s} {r.tokens_per_s:7.2f} tok/s x{row['speedup']:.2f} "
              f"acc={r.acceptance if r.acceptance is None else round(r.acceptance, 3)}", file=sys.stderr, flush=True)
    return out, results, watches


def _positions(tasks: list[dict], name: str, n: int = 4) -> str:
    """Acceptance at positions 1..n, pooled over the tasks' requests (drafted-weighted)."""
    pooled = []
    for j in range(n):
        drafted = sum(t["contenders"][name]["drafted_per_position"][j] for t in tasks
                      if len(t["contenders"][name]["drafted_per_position"]) > j)
        accepted = sum(t["contenders"][name]["accepted_per_position"][j] for t in tasks
                       if len(t["contenders"][name]["accepted_per_position"]) > j)
        pooled.append(f"{accepted / drafted:.2f}" if drafted else "n/a")
    return " / ".join(pooled)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    header = common.start_run(args)
    base = common.base_config(args)
    models = common.load_models(base)
    configs = {}
    for name in args.contenders:
        kind, k = _name_and_k(name)
        configs[name] = replace(base, spec=SpecConfig(method=METHODS[kind], num_spec_tokens=k or args.k_max,
                                                      adaptive=True, **SETTINGS.get(kind, {})))
    tasks = [run_task(models, configs, task, args)[0] for task in args.tasks]
    names = args.contenders[1:]
    rows = [[t["task"], f"{t['contenders']['plain']['tokens_per_s']:.1f}",
             *[f"{t['contenders'][n]['speedup']:.2f}" for n in names]] for t in tasks]
    geo = {n: common.geomean([t["contenders"][n]["speedup"] for t in tasks]) for n in names}
    rows.append(["geo. mean", "", *[f"{geo[n]:.2f}" for n in names]])
    rows.append(["acceptance at positions 1-4", "", *[_positions(tasks, n) for n in names]])
    rows.append(["proposer time / plain step", "",
                 *[f"{statistics.median(t['contenders'][n]['proposer_cost'] for t in tasks):.3f}" for n in names]])
    text = common.markdown_table(["task", "plain tok/s", *names], rows)
    print(text)
    common.write_result("proposers", args, header, t0, {
        "engine_configs": {n: common.resolved(models, cfg).to_dict() for n, cfg in configs.items()},
        "tasks": tasks, "geomean_speedup": geo, "table_markdown": text},
        common.RESULTS_DIR / f"proposers_{args.model}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
