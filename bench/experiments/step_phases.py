"""Where an engine step's time goes, per phase, for plain and adaptive n-gram side by side.

One task at C in flight (closed loop, evaluation half by default), fresh engines stepped
in lockstep (`common.run_lockstep`): plain, adaptive n-gram (k_max 8), a second plain
engine (the A/A), and adaptive n-gram with its plan forced to k = 0 (plain's shapes, so its
steps cost plain's plus the lookups and the plan) with the C++ and with the Python index. Each engine's phases (`LLMEngine` methods and the policy's `plan`)
are timed by wrappers; a phase's milliseconds per step and share of the run say what
speculation adds to a round beyond the verify pass, and the forward's time per step
against the step count says what drafting bought. Wrapped methods nest (`_compute` holds
`_draft`, `_target_forward`, `_verify`, `_sample_first`), so shares do not add up.

    .venv/bin/python bench/experiments/step_phases.py --task math --concurrency 16 \\
        --out bench/results/step-phases-math-c16-eval-epyc.json
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import adaptive  # noqa: E402
import common  # noqa: E402

from verispec.config import SpecConfig  # noqa: E402
from verispec.engine.engine import LLMEngine  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402
from verispec.spec.ngram import NgramProposer  # noqa: E402

ENGINE_PHASES = ("_offers", "_schedule_prefill", "_compute", "_draft", "_target_forward", "_sample_first",
                 "_verify", "_commit", "_report", "_learn")
ADAPTIVE = SpecConfig(method="ngram", num_spec_tokens=8, adaptive=True)
CONTENDERS = {"plain": SpecConfig(method="none"), "adaptive": ADAPTIVE, "plain-control": SpecConfig(method="none"),
              "adaptive-k0": ADAPTIVE, "adaptive-k0-python-index": ADAPTIVE}


def force_k0(engine: LLMEngine, python_index: bool) -> None:
    """The plan still runs (and is timed) but every row drafts nothing; optionally the n-gram
    lookups use the Python index."""
    plan = engine.policy.plan
    engine.policy.plan = lambda rows: [0 for _ in plan(rows)]
    if python_index:
        spec = engine.config.spec
        engine.proposers["ngram"] = NgramProposer(spec.ngram_max, spec.ngram_min, native=False)


def timed_engine(engine: LLMEngine, seconds: dict[str, float]) -> None:
    """Wrap the engine's phases (and its policy's plan) to add their seconds to `seconds`."""
    def wrap(owner, name: str) -> None:
        real = getattr(owner, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                seconds[name] += time.perf_counter() - t0
        setattr(owner, name, timed)
    for name in ENGINE_PHASES:
        wrap(engine, name)
    wrap(engine.policy, "plan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--task", default="math", choices=list(adaptive.TASKS))
    p.add_argument("--max-tokens", type=int, default=128)
    common.add_common_args(p, "16")
    args = p.parse_args(argv)
    c = args.concurrency[0]
    t0 = time.perf_counter()
    header = common.start_run(args)
    base = common.base_config(args)
    models = common.load_models(base)
    measured, warm, sources = common.pick_prompts(adaptive.TASKS[args.task], 2 * c, 4, seed=args.seed, split=args.split)
    items = common.encode(models.tokenizer, measured, args.task)
    warm_items = common.encode(models.tokenizer, warm, args.task)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    seconds: dict[str, dict[str, float]] = {}
    loops = {}
    for name, spec in CONTENDERS.items():
        engine = common.make_engine(models, replace(base, spec=spec))
        if name.startswith("adaptive-k0"):
            force_k0(engine, python_index=name.endswith("python-index"))
        common.warm_up(engine, warm_items, min(c, len(warm_items)), 16, f"{name}-warm")
        seconds[name] = defaultdict(float)
        timed_engine(engine, seconds[name])
        loops[name] = common.ClosedLoop(engine, items, c, params, name)
    results = common.run_lockstep(loops, seed=args.seed)
    body = {}
    for name, r in results.items():
        steps = loops[name].steps
        phases = {k: {"ms_per_step": 1000 * v / steps, "share": v / r.seconds} for k, v in seconds[name].items()}
        body[name] = {"tokens": r.tokens, "seconds": r.seconds, "steps": steps, "tokens_per_s": r.tokens_per_s,
                      "phases": phases}
        print(f"{name}: {r.tokens_per_s:.1f} tok/s, {steps} steps, x{r.tokens_per_s / results['plain'].tokens_per_s:.3f}")
        for k, v in sorted(phases.items(), key=lambda kv: -kv[1]["share"]):
            print(f"    {k:18s} {v['ms_per_step']:7.3f} ms/step {100 * v['share']:5.1f}%")
    common.write_result("step_phases", args, header, t0, {"task": args.task, "sources": sources, "contenders": body},
                        common.RESULTS_DIR / f"step-phases-{args.task}-c{c}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
