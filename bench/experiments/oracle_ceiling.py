"""How fast could any proposer make the agentic workloads? An oracle against suffix decoding.

The oracle proposer knows each turn's answer (plain decoding's, run first) and always
drafts exactly it, so every draft is accepted: it measures the engine's ceiling on this
machine, set by what a verify pass of k + 1 tokens costs against a plain step, whatever a
real proposer guesses. The workloads are `bench/agentic.py`'s (`edits`, `retries`;
HumanEval evaluation half, greedy), in-process, one engine per contender (each keeps its
own prefix cache and, for suffix, its global trie across turns). `--concurrency C` runs C
chains together, turn by turn (each turn one batch of C requests: C in flight, fewer while
the batch drains). Each turn runs plain first, then the contenders in an order shuffled
per turn; every output must equal plain's. Reports tok/s over the turns' own seconds,
speedups over plain, and tokens per request per target pass.

    .venv/bin/python bench/experiments/oracle_ceiling.py --workload edits --problems 8 --threads 2
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for agentic
from agentic import EDITS, RETRIES, chain_firsts  # noqa: E402
from verispec.bench.provenance import machine_info  # noqa: E402
from verispec.config import SpecConfig  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402
from verispec.spec.proposer import Offer, register_proposer  # noqa: E402

ANSWERS: dict[tuple[int, ...], list[int]] = {}   # prompt ids -> plain decoding's output ids


class OracleProposer:
    """Drafts the rest of the known answer (one-hot q: a deterministic function of the row)."""

    name = "oracle"
    timed = False
    has_probs = False

    def __init__(self, context):
        pass

    def _rest(self, req) -> list[int]:
        answer = ANSWERS.get(tuple(req.prompt_ids), [])
        done = len(req.output_ids)
        return answer[done:] if answer[:done] == list(req.output_ids) else []

    def offer(self, rows, budgets):
        return [Offer(min(b, len(self._rest(r))), 0, 1) for r, b in zip(rows, budgets)]

    def prepare(self, rows) -> int:
        return 0

    def draft(self, rows, ks):
        return [(self._rest(r)[:k], None) for r, k in zip(rows, ks)]

    def rollback(self, req) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


def user_turns(workload: str, first: str) -> list[list[dict] | str]:
    """retries: each turn's whole conversation; edits: each turn's user message (the
    conversation grows by the previous answers)."""
    if workload == "retries":
        return [[{"role": "user", "content": r + first}] for r in RETRIES]
    return [first] + EDITS


def run_group(llms: dict, order_seed: str, workload: str, firsts: list[str], max_tokens: int) -> list[list[dict]]:
    """Chains of `firsts` run together, turn by turn (every chain's turn t in one batch, so
    len(firsts) requests in flight); per chain, per turn, per contender: its share of the
    batch's seconds, tokens, target passes and whether the output equals plain's."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    conversations: list[list[dict]] = [[] for _ in firsts]
    chains: list[list[dict]] = [[] for _ in firsts]
    for step in range(len(user_turns(workload, firsts[0]))):
        for conv, first in zip(conversations, firsts):
            turn = user_turns(workload, first)[step]
            if workload == "retries":
                conv[:] = turn
            else:
                conv.append({"role": "user", "content": turn})
        order = ["none"] + random.Random(f"{order_seed}:{step}").sample(sorted(set(llms) - {"none"}), len(llms) - 1)
        rows: list[dict] = [{} for _ in firsts]
        plain = []
        for name in order:
            t0 = time.perf_counter()
            results = llms[name].chat(conversations, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            for i, result in enumerate(results):
                ids = list(result.outputs[0].token_ids)
                if name == "none":
                    plain.append((ids, result.outputs[0].text))
                    ANSWERS[tuple(result.prompt_token_ids)] = ids
                rows[i][name] = {"seconds": seconds / len(firsts), "tokens": len(ids), "same": ids == plain[i][0],
                                 "forwards": result.spec.target_forwards if result.spec else None}
        for i, conv in enumerate(conversations):
            chains[i].append(rows[i])
            if workload == "edits":
                conv.append({"role": "assistant", "content": plain[i][1]})
    return chains


def add_workload_args(ap: argparse.ArgumentParser, problems: int, concurrency: int) -> None:
    """The workload options this script and `suffix_ab.py` share."""
    ap.add_argument("--workload", choices=("edits", "retries"), default="edits")
    ap.add_argument("--problems", type=int, default=problems)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--split", choices=("eval", "tuning"), default="eval", help="the half measured")
    ap.add_argument("--concurrency", type=int, default=concurrency, help="chains run together, turn by turn")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)


def measure(specs: dict, args, benchmark: str) -> None:
    """One engine per contender (`specs`: name -> SpecConfig, "none" among them), a warm-up
    chain, then the workload's chains C at a time; prints the summary, writes `--out`."""
    from verispec import LLM

    llms = {name: LLM(spec=spec, threads=args.threads) for name, spec in specs.items()}
    firsts, warm = chain_firsts(args.split, args.problems, seed=0)
    run_group(llms, "warm", args.workload, [warm], args.max_tokens)
    C = args.concurrency
    chains = [c for g in range(0, len(firsts), C)
              for c in run_group(llms, str(g), args.workload, firsts[g: g + C], args.max_tokens)]
    summary, by_turn = summarise(chains, list(llms))
    print(json.dumps({"summary": summary, "speedup_by_turn": by_turn}, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"benchmark": benchmark, "args": {**vars(args), "out": str(args.out)},
                                        "configs": {n: llms[n].config.to_dict() for n in llms},
                                        "machine": machine_info(), "summary": summary,
                                        "speedup_by_turn": by_turn, "chains": chains}, indent=1) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap, problems=8, concurrency=1)
    ap.add_argument("--contenders", default="suffix:8,oracle:8,oracle:16",
                    help="method:k_max pairs beside plain, comma-separated")
    args = ap.parse_args(argv)
    register_proposer("oracle", OracleProposer)
    specs = {"none": SpecConfig(method="none")}
    for item in args.contenders.split(","):
        method, k = item.split(":")
        if f"{method}-k{k}" in specs:
            ap.error(f"--contenders names {item} twice")
        specs[f"{method}-k{k}"] = SpecConfig(method=method, num_spec_tokens=int(k))
    measure(specs, args, "oracle-ceiling")
    return 0


def summarise(chains: list[list[dict]], names: list[str]) -> tuple[dict, dict]:
    """Per contender: tok/s, speedup over plain, tokens per request per target pass it took
    part in, outputs equal to plain's; and the speedup of each turn."""
    def total(name, key, turn=None):
        return sum(t[name][key] or 0 for c in chains for s, t in enumerate(c) if turn is None or s == turn)

    summary = {name: {"tok_s": round(total(name, "tokens") / total(name, "seconds"), 1),
                      "speedup": round(total("none", "seconds") / total(name, "seconds"), 3),
                      "tokens_per_row_pass": round(total(name, "tokens") / max(1, total(name, "forwards")), 2),
                      "identical": f"{total(name, 'same')}/{sum(len(c) for c in chains)}"} for name in names}
    by_turn = {name: [round(total("none", "seconds", s) / total(name, "seconds", s), 2) for s in range(len(chains[0]))]
               for name in names}
    return summary, by_turn


if __name__ == "__main__":
    raise SystemExit(main())
