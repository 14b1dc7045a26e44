"""What could tree verification gain on this CPU? An upper bound, measured without building it.

Cost: the target's forward at batch 1 for one row of w query tokens (w = 1..2k+1) after a
context of about 300 tokens, median of `--reps` timings. A chain of k drafts is verified at
w = k + 1; a two-branch tree of k drafts each at w = 2k + 1, with no cost for the tree's
attention mask (that is what makes the result a bound).
Benefit: on each task's tuning prompts the target's greedy answer is known in advance. At
every round the chain drafts prompt lookup's continuation (the latest earlier occurrence of
the longest matching suffix, n <= 4, as NgramProposer); the tree adds a second branch, the
latest earlier occurrence (of that or a shorter suffix) whose next token differs. A round
emits the longest prefix of a branch that equals the answer, plus one token.
Reported per task and k: tokens per round and the time of the whole answer, plain (w = 1 per
token), chain and tree, from the measured costs; tree / chain is the bound on the gain.

    .venv/bin/python bench/experiments/tree_potential.py --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
import proposers  # noqa: E402

from verispec.config import SpecConfig  # noqa: E402
from verispec.engine.runner import RowInput  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402


def branches(history: list[int], k: int, max_n: int = 4) -> list[list[int]]:
    """Up to two continuations of k tokens: the latest occurrence of the longest matching
    suffix, then the latest other occurrence (same or shorter suffix) with another first token."""
    found: list[list[int]] = []
    for n in range(min(max_n, len(history) - 1), 0, -1):
        suffix = history[len(history) - n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == suffix:
                cont = history[start + n:start + n + k]
                if cont and all(cont[0] != f[0] for f in found):
                    found.append(cont)
                    if len(found) == 2:
                        return found
    return found


def simulate(prompt: list[int], answer: list[int], k: int, tree: bool) -> tuple[int, list[int]]:
    """(rounds, verify width of each round) to emit `answer` with lookup drafts."""
    t, widths = 0, []
    while t < len(answer):
        history = prompt + answer[:t]
        cands = branches(history, k)[:2 if tree else 1]
        accepted = 0
        for cand in cands:
            n = 0
            while n < len(cand) and t + n < len(answer) and cand[n] == answer[t + n]:
                n += 1
            accepted = max(accepted, n)
        widths.append(1 + sum(len(c) for c in cands))
        t += accepted + 1
    return len(widths), widths


def width_costs(engine, max_width: int, reps: int) -> dict[int, float]:
    """Seconds of one batch-1 forward of w = 1..max_width query tokens after ~300 tokens of
    context: per width the median of `reps` timings, the widths taken in turn each rep (a
    slow spell of the machine lands on all of them)."""
    context = list(range(1000, 1300))
    engine.add_request("ctx", context, SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    cached = engine.kv.open_sequence("probe", context + [5])   # the context's KV from the prefix cache
    engine.kv.allocate_slots("probe", cached, len(context) + 1 + max_width)
    table = engine.kv.block_table("probe")
    times: dict[int, list[float]] = {w: [] for w in range(1, max_width + 1)}
    for _ in range(reps):
        for w in times:
            row = RowInput(list(range(2000, 2000 + w)), len(context), table, 0)
            t0 = time.perf_counter()
            engine.target.forward([row])
            times[w].append(time.perf_counter() - t0)
    return {w: statistics.median(t) for w, t in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ks", default="2,4,8")
    p.add_argument("--reps", type=int, default=15)
    common.add_common_args(p, "1")
    args = p.parse_args(argv)
    args.split = "tuning"   # an experiment to decide on: never the evaluation half
    ks = [int(k) for k in args.ks.split(",")]
    t0 = time.perf_counter()
    header = common.start_run(args)
    base = common.base_config(args)
    models = common.load_models(base)
    engine = common.make_engine(models, replace(base, spec=SpecConfig(method="none")))
    costs = width_costs(engine, 2 * max(ks) + 1, args.reps)
    print("width costs ms:", {w: round(1000 * c, 2) for w, c in costs.items()}, file=sys.stderr)
    rows, tasks = [], {}
    for task, datasets in proposers.TASKS.items():
        measured, _, _ = common.pick_prompts(datasets, args.num_prompts, 0, seed=args.seed, split="tuning")
        items = common.encode(models.tokenizer, measured, task)
        answers = []
        for i, item in enumerate(items):
            engine.add_request(f"{task}{i}", list(item.token_ids), SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
            final = None
            while engine.has_unfinished_requests():
                for out in engine.step():
                    final = out
            answers.append((list(item.token_ids), final.token_ids))
        tasks[task] = {}
        for k in ks:
            res = {}
            for mode in ("chain", "tree"):
                rounds = tokens = 0
                seconds = 0.0
                for prompt, answer in answers:
                    r, widths = simulate(prompt, answer, k, mode == "tree")
                    rounds, tokens, seconds = rounds + r, tokens + len(answer), seconds + sum(costs[w] for w in widths)
                res[mode] = {"tokens_per_round": tokens / rounds, "seconds": seconds}
            plain_s = sum(len(a) for _, a in answers) * costs[1]
            res["chain_over_plain"] = plain_s / res["chain"]["seconds"]
            res["tree_over_plain"] = plain_s / res["tree"]["seconds"]
            res["tree_over_chain"] = res["chain"]["seconds"] / res["tree"]["seconds"]
            tasks[task][k] = res
            rows.append([task, k, f"{res['chain']['tokens_per_round']:.2f}", f"{res['tree']['tokens_per_round']:.2f}",
                         f"{res['chain_over_plain']:.2f}", f"{res['tree_over_plain']:.2f}", f"{res['tree_over_chain']:.3f}"])
    text = common.markdown_table(["task", "k", "tokens/round chain", "tokens/round tree", "chain / plain",
                                  "tree / plain", "tree / chain"], rows)
    print(text)
    common.write_result("tree-potential", args, header, t0, {
        "width_costs_s": costs, "tasks": tasks, "table_markdown": text},
        common.RESULTS_DIR / "tree-potential-icl.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
