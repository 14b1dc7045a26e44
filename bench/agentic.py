"""Agentic workloads on HumanEval problems through `verispec serve`, plain decoding against
n-gram and suffix decoding (docs/benchmarks.md, "Suffix decoding"). One chain per problem:

- `edits`: one conversation: the dataset's prompt ("complete this function"), then EDITS
  follow-up turns, each asking for the whole function again with one change, so every
  answer repeats much of the previous one (which is in its prompt);
- `retries`: RETRIES independent one-turn requests for the same problem, worded
  differently, as an agent re-issues a call: an answer repeats earlier answers that are
  not in its prompt (only a proposer that remembers other requests' outputs can draft them).
 C chains run at once (each turn
waits for the previous answer); greedy, `--max-tokens` per turn. A fresh server per
contender and repeat, the order shuffled per repeat; tok/s is completion tokens over the
requests' own seconds at C = 1 and over the wall time otherwise. Greedy answers are compared
with plain decoding's, turn by turn. Problems: the evaluation half of HumanEval by id (the
tuning half warms each server up with one chain; `--split tuning` swaps them, for tuning).

    .venv/bin/python bench/agentic.py --concurrency 1,16 --out bench/results/agentic-<machine>-<commit>.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import common  # noqa: E402
from serving import serve_config  # noqa: E402
from verispec.bench.datasets import load_datasets  # noqa: E402
from verispec.bench.launch import launched_server  # noqa: E402
from verispec.bench.provenance import machine_info, software_versions  # noqa: E402

EDITS = [
    "Add a short comment above every loop and condition. Reply with the whole function in one Python code block.",
    "Rename the local variables to longer, descriptive names. Reply with the whole function in one Python "
    "code block.",
    "Add input validation that raises ValueError for arguments of the wrong type. Reply with the whole "
    "function in one Python code block.",
]
RETRIES = ["", "Solve this task.\n\n", "Please write the code for the following.\n\n"]
CONTENDERS = ("none", "ngram", "suffix")   # "none" (plain) is the reference


async def run_chain(client, model: str, first: str, max_tokens: int, workload: str) -> list[dict]:
    turns = []
    for step in range(len(EDITS) + 1 if workload == "edits" else len(RETRIES)):
        if workload == "retries":
            messages = [{"role": "user", "content": RETRIES[step] + first}]
        elif step == 0:
            messages = [{"role": "user", "content": first}]
        else:
            messages.append({"role": "user", "content": EDITS[step - 1]})
        start = time.perf_counter()
        r = await client.chat.completions.create(model=model, messages=messages, temperature=0,
                                                 max_tokens=max_tokens)
        text = r.choices[0].message.content
        turns.append({"text": text, "completion_tokens": r.usage.completion_tokens,
                      "seconds": time.perf_counter() - start})
        messages.append({"role": "assistant", "content": text})
    return turns


async def run_chains(url: str, firsts: list[str], concurrency: int, max_tokens: int,
                     workload: str) -> tuple[list, float]:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=900)
    model = (await client.models.list()).data[0].id
    queue = list(enumerate(firsts))
    results: dict[int, list[dict]] = {}

    async def worker():
        while queue:
            i, first = queue.pop(0)
            results[i] = await run_chain(client, model, first, max_tokens, workload)
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    return [results[i] for i in range(len(firsts))], wall


def measure(mode: str, firsts, warm, concurrency: int, args) -> dict:
    with launched_server(f"--spec {mode} {args.serve_args}") as url:
        asyncio.run(run_chains(url, warm, 1, args.max_tokens, args.workload))
        chains, wall = asyncio.run(run_chains(url, firsts, concurrency, args.max_tokens, args.workload))
    turns = [t for chain in chains for t in chain]
    tokens = sum(t["completion_tokens"] for t in turns)
    seconds = sum(t["seconds"] for t in turns) if concurrency == 1 else wall
    return {"tokens_per_s": tokens / seconds, "chains": chains}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("edits", "retries"), default="edits")
    ap.add_argument("--problems", type=int, default=8, help="chains measured (evaluation half)")
    ap.add_argument("--serve-args", default="", help="more `verispec serve` flags, the same for every contender")
    ap.add_argument("--concurrency", default="1", help="comma-separated chains in flight")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="--spec values, comma-separated; must include none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", choices=("eval", "tuning"), default="eval",
                    help="the half measured (the other warms up): tune on tuning, report eval")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    contenders = args.contenders.split(",")
    if "none" not in contenders:
        ap.error("--contenders must include none (plain decoding, the reference)")
    firsts, warm_first = chain_firsts(args.split, args.problems, args.seed)
    warm = [warm_first]
    results = {}
    for c in (int(x) for x in args.concurrency.split(",")):
        runs = {m: [] for m in contenders}
        for repeat in range(args.repeats):
            order = list(contenders)
            random.Random(f"{args.seed}:{c}:{repeat}").shuffle(order)
            for mode in order:
                runs[mode].append(measure(mode, firsts, warm, c, args))
                print(f"[agentic] C={c} repeat {repeat} {mode}: {runs[mode][-1]['tokens_per_s']:.1f} tok/s",
                      file=sys.stderr)
        results[c] = {"runs": runs, "summary": summarise(runs)}
        print(json.dumps({c: results[c]["summary"]}, indent=1))
    out = {"benchmark": f"agentic-{args.workload}", "edits": EDITS, "retries": RETRIES, "args": vars(args) | {"out": str(args.out)},
           "configs": {m: serve_config(m, args.serve_args).to_dict() for m in contenders},
           "machine": machine_info(), "software": software_versions(), "results": results}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


def chain_firsts(split: str, problems: int, seed: int) -> tuple[list[str], str]:
    """The first user messages of `problems` chains from HumanEval's `split` half, shuffled
    by `seed`, and the warm-up chain's, from the other half."""
    dataset = load_datasets("humaneval")[0]["humaneval"]
    halves = {h: [p for p in dataset if common.prompt_half("humaneval", p.prompt_id) == h] for h in ("eval", "tuning")}
    other = "tuning" if split == "eval" else "eval"
    random.Random(seed).shuffle(halves[split])
    return [p.messages[0]["content"] for p in halves[split][:problems]], halves[other][0].messages[0]["content"]


def summarise(runs: dict) -> dict:
    """Median tok/s and median per-repeat speedup over plain; answers identical to plain's."""
    plain = runs["none"]
    summary = {}
    for mode, reps in runs.items():
        ratios = [r["tokens_per_s"] / p["tokens_per_s"] for r, p in zip(reps, plain)]
        same = sum(a["text"] == b["text"] for r, p in zip(reps, plain)
                   for ca, cb in zip(r["chains"], p["chains"]) for a, b in zip(ca, cb))
        total = sum(len(chain) for r in reps for chain in r["chains"])
        summary[mode] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in reps),
                         "speedup": statistics.median(ratios), "speedups": ratios,
                         "identical_to_plain": f"{same}/{total}"}
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
