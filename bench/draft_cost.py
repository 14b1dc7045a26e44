"""What a drafted token costs in a verify pass of B rows: steps forced to set draft counts.

Whether speculation can pay at a batch size comes down to one price: the seconds a drafted
token adds to a verify pass against the seconds plain decoding spends per committed token. A
draft pays only when it is accepted more often than the ratio of the two. This measures both
on one engine: B requests decode (the same prompt, greedy, EOS ignored) and every round runs
one step per draft total in `--totals`, in turn, so every total meets the same contexts and
the same moments of a drifting machine. A total is spread over the rows round-robin; the
drafts are each row's own last token repeated (the verify pass costs the same whatever is
accepted) and reach the engine as an n-gram lookup with the controller's choice fixed to them,
so the pass is the engine's own (lookup, verify forward, acceptance, KV rollback, timing).
Reports each total's median step, its excess over plain, that excess per drafted token, and
plain's seconds per committed token; it stops if a pass verified other than the drafts forced.
The rows' contexts grow as they decode (by up to (1 + drafts a row) tokens a step), alike for
every total since the totals take turns: read the numbers as those of the contexts reached.

    .venv/bin/python bench/draft_cost.py --batch 16 --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from verispec.config import SpecConfig  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402

PROMPT = "Write a long story about a cat who learns to fly. Repeat 'the cat flies' often."
K_MAX = 8


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=16, help="rows decoding together")
    p.add_argument("--totals", type=common.parse_int_list, default=None,
                   help="draft tokens per step to time, comma-separated (default 1, B/2, B, 2B, 3B); "
                        "plain (0) is always timed")
    p.add_argument("--rounds", type=int, default=40, help="steps timed per total (one each per round)")
    p.add_argument("--warmup-rounds", type=int, default=3, help="rounds run first, not timed")
    common.add_common_args(p, "1")
    args = p.parse_args(argv)
    if args.batch < 1:
        p.error(f"--batch must be at least 1, got {args.batch}")
    if args.rounds < 1 or args.warmup_rounds < 0:
        p.error(f"--rounds must be >= 1 and --warmup-rounds >= 0, got {args.rounds}, {args.warmup_rounds}")
    if args.quick:
        args.rounds, args.warmup_rounds = min(args.rounds, 3), min(args.warmup_rounds, 1)
    if args.totals is None:
        args.totals = sorted({1, max(1, args.batch // 2), args.batch, 2 * args.batch, 3 * args.batch})
    too_many = [t for t in args.totals if t > K_MAX * args.batch]
    if too_many:
        p.error(f"--totals: at most {K_MAX} drafts a row, {K_MAX * args.batch} at --batch {args.batch}; "
                f"got {too_many}")
    return args


def spread(total: int, rows: int) -> list[int]:
    """`total` drafts over `rows` rows round-robin (the first rows get one more)."""
    return [total // rows + (1 if i < total % rows else 0) for i in range(rows)]


def summarise(times: dict[int, list[float]], plain_tokens: int, batch: int) -> list[dict]:
    """Per total: median step seconds, excess over plain, per drafted token; plain's seconds per
    committed token (`plain_tokens` committed by the timed plain steps) beside each."""
    plain = statistics.median(times[0])
    per_token = sum(times[0]) / max(plain_tokens, 1)
    rows = []
    for total, ts in sorted(times.items()):
        step = statistics.median(ts)
        rows.append({"draft_tokens": total, "rows": batch, "steps": len(ts), "median_step_s": step,
                     "excess_s": step - plain, "excess_per_draft_s": (step - plain) / total if total else None,
                     "plain_s_per_token": per_token,
                     "break_even_acceptance": (step - plain) / total / per_token if total else None})
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    header = common.start_run(args)
    config = replace(common.base_config(args), spec=SpecConfig(method="ngram", num_spec_tokens=K_MAX, adaptive=True))
    models = common.load_models(config)
    engine = common.make_engine(models, config)
    prompt = models.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    totals = [0] + [t for t in args.totals if t]
    # the most a row can commit: every step of every round accepts all its drafts
    most = (args.warmup_rounds + args.rounds) * sum(1 + -(-t // args.batch) for t in totals)
    room = engine.max_model_len - len(prompt) - K_MAX - 1
    if most > room:
        raise SystemExit(f"--rounds {args.rounds}: a row may commit {most} tokens, the context leaves "
                         f"{room}; ask for fewer rounds or totals")
    params = SamplingParams(temperature=0.0, max_tokens=most, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", list(prompt), params)
    pattern: list[int] = []
    engine.controller.rest = lambda *a, **k: False  # every round chooses, and the choice is the pattern
    engine.controller.choose_k = lambda ids, *a, **k: dict(zip(ids, pattern))

    def lookup(rows):
        engine._matches = {}  # noqa: SLF001 (no match lengths: the controller is bypassed)
        return {r.request_id: [r.all_ids[-1]] * K_MAX for r in rows}
    engine._lookup = lookup  # noqa: SLF001
    verified: list[int] = []  # the draft tokens each verify pass reported (must be the pattern's)
    observe = engine.controller.observe_cost
    engine.controller.observe_cost = lambda kind, b, size, s: (verified.append(size) if kind == "verify" else None,
                                                               observe(kind, b, size, s))
    while engine.scheduler.waiting or any(r.is_prefilling for r in engine.scheduler.running):
        pattern[:] = [0] * args.batch
        engine.step()
    times: dict[int, list[float]] = {t: [] for t in totals}
    plain_tokens = 0
    for rnd in range(args.warmup_rounds + args.rounds):
        for total in totals:
            pattern[:] = spread(total, args.batch)
            start = time.perf_counter()
            outputs = engine.step()
            seconds = time.perf_counter() - start
            if len(outputs) != args.batch or any(o.error for o in outputs):
                raise SystemExit(f"a step of {total} drafts returned {len(outputs)} of {args.batch} rows: "
                                 f"{[o.error for o in outputs if o.error]}")
            if not verified or verified[-1] != total:
                raise SystemExit(f"a step forced to {total} drafts verified {verified[-1:] or 'none'}")
            if rnd >= args.warmup_rounds:
                times[total].append(seconds)
                if total == 0:
                    plain_tokens += sum(len(o.new_token_ids) for o in outputs)
    rows = summarise(times, plain_tokens, args.batch)
    table = common.markdown_table(
        ["rows", "draft tokens", "median step ms", "excess ms", "excess ms a draft", "plain ms a token",
         "a draft pays if accepted above"],
        [[r["rows"], r["draft_tokens"], 1e3 * r["median_step_s"], 1e3 * r["excess_s"],
          None if r["excess_per_draft_s"] is None else 1e3 * r["excess_per_draft_s"], 1e3 * r["plain_s_per_token"],
          r["break_even_acceptance"]] for r in rows])
    print(table)
    header = common.finish_run(header, t0)
    common.write_json(args.out or common.RESULTS_DIR / f"draft_cost-{args.model}-b{args.batch}.json", {
        "benchmark": "draft_cost", "schema": "verispec.bench.draft-cost/v1", **header,
        "settings": {"model": args.model, "batch": args.batch, "totals": totals, "rounds": args.rounds,
                     "warmup_rounds": args.warmup_rounds, "prompt": PROMPT},
        "engine_config": common.resolved(models, config).to_dict(), "passes": rows, "table_markdown": table})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
