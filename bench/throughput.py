"""Throughput at 1, 4 and 16 concurrent requests: plain vs speculative decoding (issue 4).

In-process: one LLMEngine per contender over shared weights, requests added and stepped
closed-loop (exactly C in flight, refilled as they finish), greedy, over real prompts:
MT-bench first turns interleaved with an edit task (rewrite-essay: "edit this paragraph").

Contenders (the default engine config differs only in its spec part):
  plain            spec method "none"
  ngram-adaptive   the engine default: n-gram drafting, adaptive k in [0, 4]
  ngram-k4         n-gram, fixed k = 4 (optional)

Alternation: at each concurrency the prompts are cut into blocks; every contender runs
every block, in an order rotated per block, so slow drift on a shared machine hits all
contenders alike. Each engine first runs unmeasured warm-up prompts (disjoint from the
measured ones) at the same concurrency. tokens/s = generated tokens / wall seconds over
all blocks, from the first request added to the last one finished (the drain at the end
of a block is included; `mean_in_flight` says how close to C the run stayed).

    .venv/bin/python bench/throughput.py --quick          # a few minutes, checks the script
    .venv/bin/python bench/throughput.py                  # the measurement
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from verispec.config import EngineConfig, SpecConfig  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402

DATASETS = ["mtbench", "rewrite-essay"]
CONTENDERS = {
    "plain": SpecConfig(method="none"),
    "ngram-adaptive": SpecConfig(),
    "ngram-k4": SpecConfig(method="ngram", num_spec_tokens=4, adaptive=False),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--contenders", default="plain,ngram-adaptive",
                   help=f"comma-separated, from {list(CONTENDERS)}; the first is the baseline")
    p.add_argument("--num-prompts", type=common.parse_int_list, default=None,
                   help="measured prompts per concurrency: one value, or one per --concurrency "
                        "(default max(8, 4C))")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--blocks", type=int, default=2, help="alternation blocks per concurrency")
    p.add_argument("--warmup-tokens", type=int, default=16)
    common.add_common_args(p, "1,4,16")
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency = [1, 4] if args.concurrency == [1, 4, 16] else args.concurrency
        args.num_prompts = args.num_prompts or [2 * c for c in args.concurrency]
        args.max_tokens, args.blocks, args.warmup_tokens = min(args.max_tokens, 24), 2, 4
    names = args.contenders.split(",")
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown or len(names) < 2:
        p.error(f"--contenders needs at least two of {list(CONTENDERS)}, got {args.contenders!r}")
    args.contenders = names
    if args.num_prompts is None:
        args.num_prompts = [max(8, 4 * c) for c in args.concurrency]
    elif len(args.num_prompts) == 1:
        args.num_prompts = args.num_prompts * len(args.concurrency)
    if len(args.num_prompts) != len(args.concurrency):
        p.error("--num-prompts needs one value or one per --concurrency value")
    for n, c in zip(args.num_prompts, args.concurrency):
        if n < c * args.blocks:
            p.error(f"--num-prompts {n} at concurrency {c}: need >= concurrency x --blocks "
                    f"= {c * args.blocks} so every block can fill the batch")
    return args


def run_concurrency(models, configs: dict[str, EngineConfig], c: int, n_prompts: int,
                    args) -> dict:
    """All contenders at one concurrency, alternating block by block."""
    measured, warm, sources = common.pick_prompts(DATASETS, n_prompts, max(2, c), seed=args.seed + c, split=args.split)
    items, warm_items = common.encode(models.tokenizer, measured), common.encode(models.tokenizer, warm)
    engines = {name: common.make_engine(models, cfg) for name, cfg in configs.items()}
    warm_s = {name: common.warm_up(eng, warm_items, c, args.warmup_tokens, f"{name}-c{c}")
              for name, eng in engines.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    size = -(-len(items) // args.blocks)
    blocks = [items[i: i + size] for i in range(0, len(items), size)]
    runs: dict[str, list] = {name: [] for name in engines}
    names = list(engines)
    for b, block in enumerate(blocks):
        order = names[b % len(names):] + names[: b % len(names)]
        for name in order:
            run = common.run_closed_loop(engines[name], block, c, params, f"{name}-c{c}-b{b}")
            runs[name].append(run)
            print(f"[throughput] C={c} block {b} {name:15s} {run.tokens:5d} tok {run.seconds:7.1f} s "
                  f"{run.tokens_per_s:6.2f} tok/s acc={_fmt(run.acceptance)} load={common.load_average():.2f} "
                  f"others={_fmt(run.others_cpu_share)}",
                  file=sys.stderr, flush=True)
    del engines
    return _summarise(runs, names[0], warm_s, measured, warm, sources, c)


def _summarise(runs, baseline: str, warm_s, measured, warm, sources, c: int) -> dict:
    out = {"concurrency": c, "prompt_ids": [f"{p.dataset}:{p.prompt_id}" for p in measured],
           "warmup_prompt_ids": [f"{p.dataset}:{p.prompt_id}" for p in warm], "datasets": sources,
           "contenders": {}}
    base_rate = None
    for name, blocks in runs.items():
        tokens = sum(r.tokens for r in blocks)
        seconds = sum(r.seconds for r in blocks)
        drafted, accepted = sum(r.drafted for r in blocks), sum(r.accepted for r in blocks)
        rate = tokens / seconds
        base_rate = rate if name == baseline else base_rate
        equal = [common.same_outputs(a, b) for a, b in zip(blocks, runs[baseline])]
        out["contenders"][name] = {
            "tokens": tokens, "seconds": seconds, "tokens_per_s": rate,
            "speedup_vs_" + baseline: rate / base_rate,
            "acceptance": accepted / drafted if drafted else None, "drafted": drafted, "accepted": accepted,
            "mean_in_flight": sum(r.mean_in_flight * r.seconds for r in blocks) / seconds,
            "block_tokens_per_s": [r.tokens_per_s for r in blocks],
            "max_others_cpu_share": max(r.others_cpu_share or 0.0 for r in blocks),
            "identical_to_" + baseline: {"identical": sum(e["identical"] for e in equal),
                                         "compared": sum(e["compared"] for e in equal)},
            "warmup_s": warm_s[name],
            "blocks": [r.summary() for r in blocks],
            "completion_tokens": [len(q.token_ids) for r in blocks for q in r.requests],
        }
    return out


def table(results: list[dict], baseline: str) -> str:
    rows = []
    for res in results:
        for name, r in res["contenders"].items():
            same = r["identical_to_" + baseline]
            rows.append([res["concurrency"], name, r["tokens"], round(r["seconds"], 1), r["tokens_per_s"],
                         r["acceptance"], r["speedup_vs_" + baseline], round(r["mean_in_flight"], 1),
                         f"{same['identical']}/{same['compared']}", r["max_others_cpu_share"]])
    return common.markdown_table(["C", "contender", "tokens", "seconds", "tok/s", "acceptance",
                                  f"speedup vs {baseline}", "mean in flight", f"same as {baseline}",
                                  "others' CPU share (max)"], rows)


def _fmt(x):
    return "n/a" if x is None else f"{x:.2f}"


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    header = common.start_run(args)
    base = common.base_config(args)
    models = common.load_models(base)
    configs = {name: replace(base, spec=CONTENDERS[name]) for name in args.contenders}
    results = [run_concurrency(models, configs, c, n, args) for c, n in zip(args.concurrency, args.num_prompts)]
    text = table(results, args.contenders[0])
    print(text)
    header = common.finish_run(header, t0)
    payload = {"benchmark": "throughput", "schema": "verispec.bench.engine-throughput/v1", **header,
               "settings": {"model": args.model, "dtype": args.dtype, "temperature": 0.0,
                            "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                            "num_prompts": args.num_prompts, "blocks": args.blocks,
                            "warmup_tokens": args.warmup_tokens, "datasets": DATASETS, "quick": args.quick, "split": args.split,
                            "model_load_s": models.load_seconds},
               "engine_configs": {name: common.resolved(models, cfg).to_dict() for name, cfg in configs.items()},
               "results": results, "table_markdown": text}
    name = "throughput_quick" if args.quick else "throughput"
    common.write_json(args.out or common.RESULTS_DIR / f"{name}.json", payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
