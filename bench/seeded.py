"""Seeded (coupled) vs unseeded (rejection sampling) requests under speculation.

A seeded request is sampled by the exponential race with noise keyed by (seed, output
position, token), and its drafts are verified by the same rule, so its output equals
seeded plain decoding (docs/correctness.md, "Seeded requests"); an unseeded request keeps
exact rejection sampling. This measures what that costs or gains: per contender the
acceptance rate (accepted / drafted), the mean accepted length per verify round and
decode tokens/s, and counts seeded speculative outputs identical to seeded plain ones.

Prompts: the evaluation half of each dataset by id (common.pick_prompts), chat template,
one request at a time; each prompt runs with --seeds seeds, the four contenders (seeded /
unseeded, speculative / plain) in a shuffled order per prompt and seed.

    .venv/bin/python bench/seeded.py                                    # n-gram, default model
    .venv/bin/python bench/seeded.py --model qwen2.5-coder-1.5b-instruct \\
        --draft-model qwen2.5-coder-0.5b-instruct --datasets humaneval,rewrite-code
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from verispec.engine.engine import LLMEngine, SpecOverride  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402

CONTENDERS = ("seeded", "unseeded", "seeded_plain", "unseeded_plain")


def run_one(engine: LLMEngine, rid: str, prompt: tuple[int, ...], params: SamplingParams, spec) -> dict:
    """One request alone: its tokens, spec stats and decode timing (after the first token)."""
    engine.add_request(rid, list(prompt), params, spec)
    first, out = None, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if first is None and o.token_ids:
                first = time.perf_counter()
            if o.finished:
                out = o
    return {"tokens": out.token_ids, "drafted": out.spec.num_draft_tokens,
            "accepted": out.spec.num_accepted_tokens, "rounds": out.spec.num_drafts,
            "decode_tokens": len(out.token_ids) - 1, "decode_s": time.perf_counter() - first}


def summarise(runs: list[dict]) -> dict:
    drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
    rounds, tokens = sum(r["rounds"] for r in runs), sum(r["decode_tokens"] for r in runs)
    seconds = sum(r["decode_s"] for r in runs)
    return {"acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": accepted / rounds if rounds else None,
            "decode_tokens_per_s": tokens / seconds if seconds else None, "decode_tokens": tokens}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--draft-model", default=None, help="draft with this model instead of n-gram")
    p.add_argument("--datasets", default="rewrite-essay,rewrite-code,mtbench")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8)
    common.add_common_args(p, "1")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    header = common.start_run(args)
    config = common.base_config(args, args.draft_model).resolved_for("generate")
    engine = LLMEngine.from_config(config)
    measured, _, sources = common.pick_prompts(args.datasets.split(","), args.num_prompts, 0,
                                               seed=args.seed, split=args.split)
    items = common.encode(engine.tokenizer, measured)
    spec = SpecOverride(method="draft" if args.draft_model else "ngram", adaptive=True)
    runs: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
    order_rng = random.Random(args.seed)
    for i, item in enumerate(items):
        for s in range(args.seeds):
            seed = 1000 * s + i
            plans = {"seeded": (seed, spec), "unseeded": (None, spec),
                     "seeded_plain": (seed, SpecOverride(method="none")),
                     "unseeded_plain": (None, SpecOverride(method="none"))}
            for name in order_rng.sample(CONTENDERS, len(CONTENDERS)):
                seed_, override = plans[name]
                params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=seed_)
                runs[name].append(run_one(engine, f"{name}-{i}-{s}", item.token_ids, params, override))
    same = [a["tokens"] == b["tokens"] for a, b in zip(runs["seeded"], runs["seeded_plain"])]
    summary = {name: summarise(r) for name, r in runs.items()}
    report = {"run": common.finish_run(header, t0), "config": engine.config.to_dict(), "sources": sources,
              "temperature": args.temperature, "max_tokens": args.max_tokens, "requests": len(same),
              **summary, "seeded_spec_identical_to_seeded_plain": f"{sum(same)}/{len(same)}",
              "speedup_seeded": summary["seeded"]["decode_tokens_per_s"] / summary["seeded_plain"]["decode_tokens_per_s"],
              "speedup_unseeded": summary["unseeded"]["decode_tokens_per_s"]
              / summary["unseeded_plain"]["decode_tokens_per_s"]}
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("run", "config", "sources")}, indent=1))


if __name__ == "__main__":
    main()
