"""Conditional acceptance per draft position: is a proposer's acceptance geometric?

The adaptive controller models a round's yield with one per-position acceptance alpha (the
geometric model: position i accepted with probability alpha given positions 1..i-1 were).
This measures, per task, the conditional acceptance at each position, alpha_i = (rounds
that accepted position i) / (rounds that tested it: drafted it, with 1..i-1 accepted), from
every round's (drafted, accepted) as the engine reports it to the controller, with a fixed
k so that every position is offered. A flat profile is the geometric model; a rising one
means deep drafts are worth more than one alpha says (and the first one less). The same per
length of the suffix the n-gram lookup matched (what the controller keys its estimates on,
controller docstring "Match length"): each length's share of the drafting rounds and its
profile.

    .venv/bin/python bench/acceptance_profile.py --k 8 --tasks chat,code,math
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

import common  # noqa: E402
from adaptive import TASKS  # noqa: E402
from verispec.bench.provenance import git_info, machine_info, software_versions  # noqa: E402
from verispec.config import CacheConfig, EngineConfig, SpecConfig  # noqa: E402
from verispec.engine.engine import LLMEngine, SpecOverride  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402


def profile(rounds: list[tuple[int, int]], k: int) -> dict:
    """Per position 1..k: tested and accepted counts, and their ratio (None if never tested).

    A round that drafted d and accepted the first a tested positions 1..min(a + 1, d) and
    accepted 1..a (positions past the first rejection were never tested: censored)."""
    tested, accepted = [0] * k, [0] * k
    for d, a in rounds:
        if not 0 <= a <= d <= k:
            raise ValueError(f"a round must have 0 <= accepted <= drafted <= {k}, got ({d}, {a})")
        for i in range(min(a + 1, d)):
            tested[i] += 1
            accepted[i] += i < a
    return {"tested": tested, "accepted": accepted,
            "alpha": [a / t if t else None for a, t in zip(accepted, tested)],
            "pooled_alpha": sum(accepted) / sum(tested) if sum(tested) else None}


def by_match(rounds: list[tuple[int, int, int]], k: int) -> dict[int, dict]:
    """`profile` per match length of (drafted, accepted, match length) rounds, with each
    length's count and share of the rounds."""
    lengths = sorted({m for _, _, m in rounds})
    return {m: {**profile([(d, a) for d, a, n in rounds if n == m], k),
                "rounds": sum(n == m for _, _, n in rounds),
                "share": sum(n == m for _, _, n in rounds) / len(rounds)} for m in lengths}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--k", type=int, default=8, help="fixed draft length (every position offered)")
    ap.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, from {list(TASKS)}")
    ap.add_argument("--num-prompts", type=int, default=8, help="per task")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "acceptance_profile.json")
    args = ap.parse_args(argv)
    tasks = args.tasks.split(",")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        ap.error(f"--tasks: unknown {unknown}; choose from {list(TASKS)}")
    torch.set_num_threads(args.threads)
    engine = LLMEngine.from_config(EngineConfig(model=args.model, spec=SpecConfig(method="ngram", adaptive=False,
                                                                                  num_spec_tokens=args.k),
                                                cache=CacheConfig(num_kv_tokens=16384)))
    rounds: list[tuple[int, int, int | None]] = []
    real = engine.controller.observe_acceptance

    def record(request_id: str, drafted: int, accepted: int, match: int | None = None) -> None:
        rounds.append((drafted, accepted, match))
        real(request_id, drafted, accepted, match)

    engine.controller.observe_acceptance = record
    results = {}
    for task in tasks:
        prompts, _, sources = common.pick_prompts(TASKS[task], args.num_prompts, 0, seed=args.seed)
        rounds.clear()
        for item in common.encode(engine.tokenizer, prompts, task):
            engine.add_request(item.prompt_id, list(item.token_ids), SamplingParams(temperature=0, max_tokens=args.max_tokens),
                               SpecOverride(method="ngram", num_tokens=args.k, adaptive=False))
            while engine.has_unfinished_requests():
                engine.step()
        drafted = [(d, a) for d, a, _ in rounds if d > 0]
        if not drafted:
            raise SystemExit(f"{task}: no round drafted anything (no n-gram match in {len(rounds)} rounds)")
        if any(m is None for d, _, m in rounds if d > 0):
            raise SystemExit(f"{task}: a drafting round was reported without its match length")
        results[task] = {**profile(drafted, args.k), "rounds": len(rounds), "drafting_rounds": len(drafted),
                         "by_match": by_match([r for r in rounds if r[0] > 0], args.k), "sources": sources}
    out = {"script": "bench/acceptance_profile.py", "argv": sys.argv[1:], "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "config": engine.config.to_dict(), "machine": machine_info(), "software": software_versions(),
           "git": git_info(), "tasks": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"conditional acceptance per draft position (n-gram, fixed k = {args.k}, greedy, "
          f"{args.num_prompts} prompts a task):")
    print(f"{'task':14s} {'rounds':>6s} {'pooled':>6s}  " + " ".join(f"{'a' + str(i + 1):>5s}" for i in range(args.k)))
    for task, r in results.items():
        cells = " ".join(f"{a:5.2f}" if a is not None else "    -" for a in r["alpha"])
        print(f"{task:14s} {r['drafting_rounds']:6d} {r['pooled_alpha']:6.2f}  {cells}")
    print("the same by the length of the suffix the lookup matched (share of the drafting rounds):")
    for task, r in results.items():
        for m, p in r["by_match"].items():
            cells = " ".join(f"{a:5.2f}" if a is not None else "    -" for a in p["alpha"])
            print(f"{task + ' n=' + str(m):14s} {p['rounds']:6d} {p['share']:6.2f}  {cells}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
