"""What adaptive speculation costs when it should not draft: its host work, and its choices.

Three engines over the same weights on one task at one concurrency, alternated round by
round, greedy (the first round is a warm-up, not reported):
  none           plain decoding (spec "none")
  forced-plain   adaptive n-gram whose controller's every k is overridden to 0: the n-gram
                 lookups, choose_k and the speculative bookkeeping are paid, nothing drafts
  adaptive       adaptive n-gram as it runs
so none vs forced-plain is the host work's price and forced-plain vs adaptive is what the
controller's drafting choices gain or lose. Also prints the seconds spent in choose_k and
in the lookups (adaptive, measured rounds). `--explore-budget` overrides the controller's
exploration budget (both speculative engines), for a sweep.

    .venv/bin/python bench/spec_overhead.py --task chat --concurrency 4 --threads 2
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from adaptive import TASKS  # noqa: E402
from verispec.config import SpecConfig  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402

CONTENDERS = ("none", "forced-plain", "adaptive")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--task", default="chat", choices=list(TASKS))
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="rounds of all contenders (the first is a warm-up)")
    p.add_argument("--explore-budget", type=float, default=None, help="override ControllerConfig.explore_budget")
    common.add_common_args(p, "4")
    args = p.parse_args(argv)
    if len(args.concurrency) != 1:
        p.error("--concurrency: one value")
    if args.rounds < 2:
        p.error("--rounds: at least 2 (the first is a warm-up)")
    return args


def instrument(engine, name: str, timers: dict[str, float], measured: list[bool], budget: float | None) -> None:
    """Time choose_k and the lookups; for forced-plain, override every chosen k to 0."""
    if budget is not None:
        engine.controller.config = dataclasses.replace(engine.controller.config, explore_budget=budget)
    choose, lookup = engine.controller.choose_k, engine._lookup

    def timed_choose(*a, **kw):
        t0 = time.perf_counter()
        ks = choose(*a, **kw)
        if measured[0] and name == "adaptive":
            timers["choose_k"] += time.perf_counter() - t0
        return {rid: 0 for rid in ks} if name == "forced-plain" else ks

    def timed_lookup(*a):
        t0 = time.perf_counter()
        out = lookup(*a)
        if measured[0] and name == "adaptive":
            timers["lookup"] += time.perf_counter() - t0
        return out

    engine.controller.choose_k, engine._lookup = timed_choose, timed_lookup


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    header = common.start_run(args)
    base = common.base_config(args)
    models = common.load_models(replace(base, spec=SpecConfig(method="ngram")))
    c = args.concurrency[0]
    measured_prompts, _, sources = common.pick_prompts(TASKS[args.task], args.num_prompts, 0, seed=args.seed)
    items = common.encode(models.tokenizer, measured_prompts, args.task)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rates = {name: [] for name in CONTENDERS}
    controllers = []  # adaptive's controller after each measured round (k histogram, ledger)
    timers, seconds = {"choose_k": 0.0, "lookup": 0.0}, {"adaptive": 0.0}
    for r in range(args.rounds):
        measured = [r > 0]
        for name in CONTENDERS:
            spec = (SpecConfig(method="none") if name == "none"
                    else SpecConfig(method="ngram", num_spec_tokens=8, adaptive=True))
            engine = common.make_engine(models, replace(base, spec=spec))
            if name != "none":
                instrument(engine, name, timers, measured, args.explore_budget)
            run = common.run_closed_loop(engine, items, c, params, f"{name}-{r}")
            if measured[0]:
                rates[name].append(run.tokens_per_s)
                if name == "adaptive":
                    seconds["adaptive"] += run.seconds
                    snap = engine.controller.snapshot()
                    controllers.append({k: snap[k] for k in ("rounds", "k_counts", "explore_debt_s", "elapsed_s")})
            print(f"[spec_overhead] round {r} {name:12s} {run.tokens_per_s:7.1f} tok/s "
                  f"load={common.load_average():.2f} others={run.others_cpu_share}", file=sys.stderr, flush=True)
    med = {name: statistics.median(v) for name, v in rates.items()}
    budget = engine.controller.config.explore_budget
    print(f"{args.model} {args.task} at {c} in flight, {args.num_prompts} prompts x {args.max_tokens} tokens, "
          f"explore_budget {budget}, median of {args.rounds - 1} rounds (tokens/s):")
    for name in CONTENDERS:
        print(f"  {name:12s} {med[name]:7.1f}  ({med[name] / med['none']:.3f}x none)")
    for snap in controllers:
        print(f"  adaptive's controller: k counts {snap['k_counts']}, exploration debt "
              f"{snap['explore_debt_s']:.3f} s of {snap['elapsed_s']:.2f} s")
    share = {k: v / seconds["adaptive"] for k, v in timers.items()}
    print(f"  adaptive's host time: choose_k {share['choose_k']:.1%}, lookups {share['lookup']:.1%} of its run")
    header = common.finish_run(header, t0)
    common.write_json(args.out or common.RESULTS_DIR / f"spec_overhead-{args.task}-c{c}-budget{budget:g}.json", {
        "benchmark": "spec_overhead", "schema": "verispec.bench.spec-overhead/v1", **header,
        "settings": {"model": args.model, "task": args.task, "datasets": sources, "concurrency": c,
                     "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "rounds": args.rounds,
                     "controller": engine.controller.config.to_dict()},
        "engine_config": common.resolved(models, replace(base, spec=SpecConfig(method="ngram"))).to_dict(),
        "tokens_per_s": rates, "median_tokens_per_s": med, "host_seconds": timers,
        "adaptive_controllers": controllers})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
