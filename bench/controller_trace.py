"""One adaptive cell, traced: each decode round's controller estimates next to what it cost.

For finding which estimate is off when adaptive loses to plain decoding (issue 6). Runs
one contender on one task at one concurrency like a cell of bench/adaptive.py (fresh
engine, warm-up prompts, closed loop, greedy) and records, per engine step: the batch,
each row's k and pooled acceptance, the controller's estimates for this round (verify pass
at the chosen draft tokens and at plain, draft pass at its rows and depth, catch-up) and
the measured ones (verify, draft, catch-up and choice seconds as reported to the
controller), the step's wall time, the tokens it committed and the shared speed factor
after it. Steps that also prefill report no verify
time (the engine does not time them). Ends with the controller's snapshot (cost cells,
k histogram) and a per-(batch, draft tokens) summary.

Not a throughput measure. The tracer's own work runs inside an adaptive step (its choose_k
wrapper prices the chosen plan again, its acceptance wrapper logs a calibration entry), so
an adaptive trace's step and choice times read high, and two traces run one after the
other are not paired: math at 1 in flight, an adaptive trace read 0.82x and 0.89x a fixed
k = 2 trace run just after it, its plain steps 0.5-0.7 ms (10-15%) longer in every quarter
of the run, where `bench/adaptive.py --lockstep` puts the cell at 0.975x (session 32).
Compare contenders there; read here what the controller estimated and what it chose.

    .venv/bin/python bench/controller_trace.py --model qwen2.5-coder-1.5b-instruct \\
        --draft-model qwen2.5-coder-0.5b-instruct --task chat --concurrency 4 --threads 2
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from adaptive import TASKS  # noqa: E402
from verispec.config import SpecConfig  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402
from verispec.spec.controller import expected_tokens  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--draft-model", default=None, help="draft with this model instead of n-gram")
    p.add_argument("--task", default="chat", choices=list(TASKS))
    p.add_argument("--num-prompts", type=int, default=0, help="measured prompts (default: the concurrency)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-warmup", type=int, default=2)
    p.add_argument("--warmup-tokens", type=int, default=32)
    p.add_argument("--k-max", type=int, default=8)
    p.add_argument("--fixed-k", type=int, default=None,
                   help="trace a fixed-k contender instead of adaptive (same estimates, for comparison)")
    common.add_common_args(p, "4")
    args = p.parse_args(argv)
    if len(args.concurrency) != 1:
        p.error("--concurrency: one value")
    return args


class Tracer:
    """Wraps an engine's controller and step to record one entry per step."""

    def __init__(self, engine):
        self.engine, self.ctl, self.log, self.cur = engine, engine.controller, [], {}
        self._choose, self._observe, self._step = self.ctl.choose_k, self.ctl.observe_cost, engine.step
        self._engine_choose = engine._choose_k  # noqa: SLF001 (a diagnostic)
        self._parts, self._accept = self.ctl._parts, self.ctl.observe_acceptance  # noqa: SLF001
        self.ctl.choose_k, self.ctl.observe_cost, engine.step = self.choose_k, self.observe_cost, self.step
        self.ctl._parts, self.ctl.observe_acceptance = self.parts, self.observe_acceptance
        engine._choose_k = self.engine_choose_k

    def parts(self, reqs, matches):
        """The (first draft, continuation) acceptance each row is priced at this round."""
        firsts, conts = self._parts(reqs, matches)
        self.cur["priced"] = dict(zip([id(r) for r in reqs], zip(firsts, conts, matches)))
        return firsts, conts

    def observe_acceptance(self, request_id, drafted, accepted, match=None):
        """Per drafting row: what it was priced to accept (the sum of its k gains) and did."""
        priced = self.cur.get("priced", {}).get(id(self.ctl._request(request_id)))  # noqa: SLF001
        if drafted and priced is not None:
            first, cont, m = priced
            expect = first * expected_tokens(cont, drafted - 1)  # first * (1 + cont + ... + cont^(k-1))
            self.cur.setdefault("calibration", []).append(
                {"k": drafted, "match": m, "first": round(first, 4), "cont": round(cont, 4),
                 "expected": round(expect, 4), "accepted": accepted})
        return self._accept(request_id, drafted, accepted, match)

    def engine_choose_k(self, rows, drafting, adaptive, lookups):
        """Every round's batch, k and n-gram availability per row, fixed k included (it
        never asks the controller)."""
        ks = self._engine_choose(rows, drafting, adaptive, lookups)
        ids = [r.request_id for r in rows]
        self.cur.update(batch=len(rows), ks=[ks[r] for r in ids],
                        available=[len(lookups[r]) if r in lookups else None for r in ids])
        return ks

    def choose_k(self, ids, batch_size, available=None, catch_up=None, remaining=None, matches=None):
        ks = self._choose(ids, batch_size, available, catch_up, remaining, matches)
        ctl, k = self.ctl, [ks[r] for r in ids]
        alphas = ctl._pooled_alphas([ctl._request(r) for r in ids])  # noqa: SLF001 (a diagnostic)
        drafts, rows = sum(k), sum(1 for x in k if x)
        behind = sum(c for c, x in zip(catch_up or [0] * len(ids), k) if x)
        per_token = ctl.estimated_cost("catch_up", 1, 1)
        self.cur.update(
            alphas=[round(a, 3) for a in alphas],
            est_tokens=sum(expected_tokens(a, x) for a, x in zip(alphas, k)) + batch_size - len(ids),
            est_verify_s=ctl.estimated_cost("verify", batch_size, drafts),
            est_plain_s=ctl.estimated_cost("verify", batch_size, 0),
            est_draft_s=ctl.estimated_cost("draft", rows, max(k)) if rows else 0.0,
            catch_up_tokens=behind, est_catch_up_s=per_token * behind if per_token is not None else None)
        return ks

    def observe_cost(self, kind, batch_size, size, seconds):
        self.cur[f"{kind}_s"], self.cur[f"{kind}_size"] = seconds, size
        return self._observe(kind, batch_size, size, seconds)

    def step(self):
        self.cur = {}
        t0 = time.perf_counter()
        outputs = self._step()
        self.cur.update(step_s=time.perf_counter() - t0, tokens=sum(len(o.new_token_ids) for o in outputs),
                        speed_factor=self.ctl._speed.factor)  # noqa: SLF001 (a diagnostic)
        self.cur.pop("priced", None)  # (object ids: in "calibration" per drafting row)
        self.log.append(self.cur)
        return outputs


def summary(log: list[dict]) -> list[dict]:
    """Decode rounds grouped by (batch, draft tokens): count, mean step seconds, tokens/s."""
    groups = defaultdict(list)
    for e in log:
        if "verify_s" in e:
            groups[(e.get("batch", 0), e["verify_size"])].append(e)
    return [{"batch": b, "draft_tokens": d, "rounds": len(es),
             "mean_step_s": sum(e["step_s"] for e in es) / len(es),
             "tokens_per_s": sum(e["tokens"] for e in es) / sum(e["step_s"] for e in es)}
            for (b, d), es in sorted(groups.items())]


def calibration(log: list[dict]) -> list[dict]:
    """Drafting rows grouped by the first-draft acceptance they were priced at (tenths):
    rows, mean priced and realised first-draft acceptance, expected and accepted drafts."""
    groups = defaultdict(list)
    for e in log:
        for c in e.get("calibration", ()):
            groups[min(int(c["first"] * 10), 9)].append(c)
    return [{"priced_first": f"{b / 10:.1f}-{(b + 1) / 10:.1f}", "rows": len(cs),
             "mean_priced_first": sum(c["first"] for c in cs) / len(cs),
             "realised_first": sum(min(c["accepted"], 1) for c in cs) / len(cs),
             "expected": sum(c["expected"] for c in cs), "accepted": sum(c["accepted"] for c in cs),
             "drafted": sum(c["k"] for c in cs)}
            for b, cs in sorted(groups.items())]


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    header = common.start_run(args)
    method = "draft" if args.draft_model else "ngram"
    models = common.load_models(replace(common.base_config(args, args.draft_model), spec=SpecConfig(method=method)))
    if args.fixed_k is None:
        spec = SpecConfig(method=method, num_spec_tokens=args.k_max, adaptive=True)
    else:
        spec = SpecConfig(method=method, num_spec_tokens=args.fixed_k, adaptive=False)
    config = replace(common.base_config(args), draft_model=args.draft_model, spec=spec)
    c = args.concurrency[0]
    measured, warm, sources = common.pick_prompts(TASKS[args.task], args.num_prompts or c, args.num_warmup,
                                                  seed=args.seed)
    items, warm_items = common.encode(models.tokenizer, measured, args.task), common.encode(models.tokenizer, warm, args.task)
    engine = common.make_engine(models, config)
    common.warm_up(engine, warm_items, min(c, len(warm_items)), args.warmup_tokens, "warm")
    tracer = Tracer(engine)
    run = common.run_closed_loop(engine, items, c, SamplingParams(temperature=0.0, max_tokens=args.max_tokens), "trace")
    rounds = summary(tracer.log)
    print(f"{args.task} C={c}: {run.tokens} tokens in {run.seconds:.1f} s = {run.tokens_per_s:.2f} tokens/s, "
          f"{len(tracer.log)} steps")
    print(common.markdown_table(["batch", "draft tokens", "rounds", "mean step s", "tokens/s"],
                                [[r["batch"], r["draft_tokens"], r["rounds"], f"{r['mean_step_s']:.3f}",
                                  f"{r['tokens_per_s']:.2f}"] for r in rounds]))
    calib = calibration(tracer.log)
    print(common.markdown_table(
        ["priced first", "rows", "mean priced first", "realised first", "expected", "accepted", "drafted"],
        [[c["priced_first"], c["rows"], f"{c['mean_priced_first']:.3f}", f"{c['realised_first']:.3f}",
          f"{c['expected']:.1f}", c["accepted"], c["drafted"]] for c in calib]))
    header = common.finish_run(header, t0)
    payload = {"benchmark": "controller-trace", "schema": "verispec.bench.controller-trace/v1", **header,
               "settings": {"model": args.model, "draft_model": args.draft_model, "task": args.task,
                            "datasets": sources, "concurrency": c, "max_tokens": args.max_tokens,
                            "num_warmup": args.num_warmup, "warmup_tokens": args.warmup_tokens},
               "engine_config": common.resolved(models, config).to_dict(),
               "tokens": run.tokens, "seconds": run.seconds, "tokens_per_s": run.tokens_per_s,
               "rounds": rounds, "calibration": calib, "steps": tracer.log, "controller": engine.controller.snapshot()}
    stem = f"controller-trace-{args.task}-c{c}-{args.draft_model or 'ngram'}"
    stem += "" if args.fixed_k is None else f"-k{args.fixed_k}"
    common.write_json(args.out or common.RESULTS_DIR / f"{stem}.json", payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
