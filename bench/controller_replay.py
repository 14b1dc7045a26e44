"""The controller's host time, replayed: record a real run's controller calls, then time two
versions of `verispec/spec/controller.py` on them, alternated, and check they decide alike.

The controller is pure Python on the decode step's critical path (choose_k before the verify
pass, observe_cost after it), so its time is a cost every adaptive round pays and fixed k
does not. `record` runs one adaptive cell like bench/adaptive.py (fresh engine, warm-up
prompts, closed loop, greedy) and stores every call the engine made to its controller, in
order, with the answers it got. `compare` loads two controller files as separate modules
(the file alone: it imports nothing of verispec), replays each recording on a fresh
controller of each, alternating the two `--reps` times, and prints the best microseconds a
round of each, their ratio, and whether both gave the recorded k in every round (a change
meant to be a pure speed-up must).

    .venv/bin/python bench/controller_replay.py record --task math --concurrency 1 --threads 2 \\
        --out /tmp/rec-math-c1.json
    git show HEAD~1:verispec/spec/controller.py > /tmp/controller-old.py
    .venv/bin/python bench/controller_replay.py compare /tmp/controller-old.py \\
        verispec/spec/controller.py /tmp/rec-math-c1.json

Replayed times are warm-cache times: in the engine each call follows a forward pass that
has evicted the caches, and the same calls took ~2.3x as long there (math at 1 in flight,
session 25).
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

CALLS = ("start", "finish", "rest", "choose_k", "observe_cost", "observe_acceptance")
DECISIONS = ("choose_k", "rest")  # the calls whose answers are the controller's decisions


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run one adaptive cell and store its controller calls")
    rec.add_argument("--model", default="smollm2-135m-instruct")
    rec.add_argument("--task", default="math")
    rec.add_argument("--num-prompts", type=int, default=16)
    rec.add_argument("--max-tokens", type=int, default=128)
    rec.add_argument("--num-warmup", type=int, default=4)
    rec.add_argument("--warmup-tokens", type=int, default=16)
    common.add_common_args(rec, "1")
    cmp = sub.add_parser("compare", help="time two controller files on recordings, alternated")
    cmp.add_argument("old", type=Path, help="a controller.py (e.g. from `git show REV:verispec/spec/controller.py`)")
    cmp.add_argument("new", type=Path)
    cmp.add_argument("recordings", type=Path, nargs="+")
    cmp.add_argument("--reps", type=int, default=15, help="replays of each file per recording; the best counts")
    args = p.parse_args(argv)
    if args.command == "record" and len(args.concurrency) != 1:
        p.error("--concurrency: one value")
    if args.command == "compare" and args.reps < 1:
        p.error("--reps must be at least 1")
    return args


def record(args: argparse.Namespace) -> int:
    from adaptive import TASKS
    from verispec.config import SpecConfig
    from verispec.sampling import SamplingParams

    if args.task not in TASKS:
        raise SystemExit(f"--task: unknown {args.task!r}; choose from {list(TASKS)}")
    t0 = time.perf_counter()
    header = common.start_run(args)
    config = replace(common.base_config(args), spec=SpecConfig(method="ngram", num_spec_tokens=8, adaptive=True))
    models = common.load_models(config)
    c = args.concurrency[0]
    measured, warm, sources = common.pick_prompts(TASKS[args.task], args.num_prompts, args.num_warmup, seed=args.seed)
    items, warm_items = (common.encode(models.tokenizer, p, args.task) for p in (measured, warm))
    engine = common.make_engine(models, config)
    calls = tape(engine.controller)
    common.warm_up(engine, warm_items, min(c, len(warm_items)), args.warmup_tokens, "warm")
    run = common.run_closed_loop(engine, items, c, SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
                                 "replay")
    header = common.finish_run(header, t0)
    payload = {"benchmark": "controller-replay", "schema": "verispec.bench.controller-replay/v1", **header,
               "settings": {"model": args.model, "task": args.task, "datasets": sources, "concurrency": c,
                            "max_tokens": args.max_tokens, "num_warmup": args.num_warmup,
                            "warmup_tokens": args.warmup_tokens},
               "engine_config": common.resolved(models, config).to_dict(),
               "controller_config": engine.controller.config.to_dict(),
               "tokens": run.tokens, "tokens_per_s": run.tokens_per_s, "calls": calls}
    out = args.out or common.RESULTS_DIR / f"controller-replay-{args.task}-c{c}.json"
    common.write_json(out, payload)
    print(f"{len(calls)} controller calls, "
          f"{sum(1 for m, a, *_ in calls if m == 'observe_cost' and a[0] == 'verify')} rounds")
    return 0


def tape(controller) -> list:
    """Record each call to `controller` (of CALLS) as [name, args, kwargs, answer], in order."""
    calls = []
    for name in CALLS:
        method = getattr(controller, name)

        def recorded(*a, _method=method, _name=name, **k):
            answer = _method(*a, **k)
            calls.append([_name, list(a), k, answer])
            return answer
        setattr(controller, name, recorded)
    return calls


def load_controller(path: Path, name: str):
    """A controller.py file as its own module (it imports only the standard library)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up by name)
    spec.loader.exec_module(module)
    return module


def replay(module, recording: dict) -> tuple[float, list]:
    """Seconds of all the recording's calls on a fresh controller of `module`, and its
    decisions (JSON-normalised, as the recording stores them)."""
    ctl = module.AdaptiveController(module.ControllerConfig(**recording["controller_config"]))
    decisions = []
    known = set(module.COST_KINDS)  # (an older controller knows no "choice" report: skipped)
    calls = [c for c in recording["calls"] if c[0] != "observe_cost" or c[1][0] in known]
    if len(inspect.signature(module.AdaptiveController.finish).parameters) == 2:
        # (an older controller's finish takes the request id alone: no output length)
        calls = [[n, a[:1], {}, r] if n == "finish" else [n, a, k, r] for n, a, k, r in calls]
    gc.disable()  # (a collection inside one replay and not the other is not the code's cost)
    try:
        t0 = time.perf_counter()
        for name, a, k, _ in calls:
            answer = getattr(ctl, name)(*a, **k)
            if name in DECISIONS:
                decisions.append(answer)
        seconds = time.perf_counter() - t0
    finally:
        gc.enable()
    return seconds, json.loads(json.dumps(decisions))


def compare(args: argparse.Namespace) -> int:
    modules = {"old": load_controller(args.old, "_replay_old"), "new": load_controller(args.new, "_replay_new")}
    all_alike = True
    for path in args.recordings:
        recording = json.loads(path.read_text())
        if recording.get("benchmark") != "controller-replay":
            raise SystemExit(f"{path}: not a controller-replay recording")
        recorded = [answer for name, _, _, answer in recording["calls"] if name in DECISIONS]
        rounds = sum(1 for name, a, *_ in recording["calls"] if name == "observe_cost" and a[0] == "verify")
        best, alike = dict.fromkeys(modules, float("inf")), {}
        for rep in range(args.reps):
            for name in (list(modules) if rep % 2 == 0 else list(reversed(modules))):
                seconds, decisions = replay(modules[name], recording)
                best[name] = min(best[name], seconds)
                alike[name] = decisions == recorded
        all_alike &= all(alike.values())
        print(f"{path.name}: {rounds} rounds; us a round: old {best['old'] / rounds * 1e6:.1f}, "
              f"new {best['new'] / rounds * 1e6:.1f} (new / old {best['new'] / best['old']:.3f}); "
              f"recorded decisions: old {'same' if alike['old'] else 'DIFFERENT'}, "
              f"new {'same' if alike['new'] else 'DIFFERENT'}")
    return 0 if all_alike else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    return record(args) if args.command == "record" else compare(args)


if __name__ == "__main__":
    raise SystemExit(main())
