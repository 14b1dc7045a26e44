"""The int4 kernel's AMX tiles on and off, end to end: engines in lockstep.

Where the int4 kernel has its AMX path (`kernels.int4_amx`: passes of 32 tokens or more on
AMX tiles, the same outputs bit for bit as its AVX-512 path), this runs `--pairs` pairs of
engines (plain decoding, or with `--spec adaptive` adaptive n-gram speculation, whose
policy measures each engine's own costs) over the same weights on one task at one concurrency, closed loop, greedy:
in each pair one engine with the tiles on and one with them off (`kernels.set_int4_amx`,
set before each of its steps). All engines step in lockstep (one step each in turn, the
order shuffled every round, each timed on its own steps; `common.run_lockstep`), so a slow
stretch of the machine lands on both paths alike. Reports each engine's tokens/s, its ratio
to the first engine with the tiles off, and whether its outputs equal that engine's (they
must: the paths compute the same numbers).

    .venv/bin/python bench/experiments/amx_ab.py --task math --concurrency 16 --threads 2
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for common and adaptive
import common  # noqa: E402
from adaptive import TASKS  # noqa: E402
from verispec.config import SpecConfig  # noqa: E402
from verispec.model import kernels  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--task", default="math", choices=list(TASKS))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-warmup", type=int, default=4)
    p.add_argument("--pairs", type=int, default=2, help="engines with the tiles on and off, this many of each")
    p.add_argument("--spec", default="none", choices=("none", "adaptive"),
                   help="plain decoding, or the default speculation (adaptive n-gram, k_max 8)")
    common.add_common_args(p, "16")
    args = p.parse_args(argv)
    if len(args.concurrency) != 1:
        p.error("--concurrency: one value")
    if args.pairs < 1 or args.num_prompts < 1:
        p.error("--pairs and --num-prompts must be at least 1")
    if args.quick:
        args.num_prompts, args.max_tokens, args.num_warmup, args.pairs = 4, 8, 1, 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    header = common.start_run(args)
    ops = kernels.load(required=True)
    if not getattr(ops, "int4_amx", False):
        raise SystemExit("this build of the kernels has no AMX path here (kernels.int4_amx is False): "
                         "nothing to compare")
    spec = SpecConfig(method="none") if args.spec == "none" else SpecConfig(method="ngram", num_spec_tokens=8,
                                                                            adaptive=True)
    config = replace(common.base_config(args), spec=spec)
    models = common.load_models(replace(config, spec=SpecConfig(method="ngram")))
    c = args.concurrency[0]
    measured, warm, sources = common.pick_prompts(TASKS[args.task], args.num_prompts, args.num_warmup,
                                                  seed=args.seed)
    items, warm_items = common.encode(models.tokenizer, measured, args.task), common.encode(models.tokenizer, warm, args.task)
    loops = {}
    for i in range(args.pairs):
        for on in (False, True):
            name = f"{'amx' if on else 'avx512'}-{i + 1}"
            engine = common.make_engine(models, config)
            ops.set_int4_amx(on)
            common.warm_up(engine, warm_items, min(c, len(warm_items)), 16, name)
            step = engine.step

            def stepped(step=step, on=on):
                ops.set_int4_amx(on)
                return step()
            engine.step = stepped
            loops[name] = common.ClosedLoop(engine, items, c, SamplingParams(temperature=0.0,
                                                                               max_tokens=args.max_tokens), name)
    try:
        results = common.run_lockstep(loops)
    finally:
        ops.set_int4_amx(True)
    reference = results["avx512-1"]
    rows = [{"engine": name, "int4_amx": name.startswith("amx"), "tokens": r.tokens, "seconds": r.seconds,
             "tokens_per_s": r.tokens_per_s, "vs_avx512_1": r.tokens_per_s / reference.tokens_per_s,
             "same_outputs_as_avx512_1": common.same_outputs(r, reference), "steps": loops[name].steps}
            for name, r in results.items()]
    differ = [r["engine"] for r in rows
              if r["same_outputs_as_avx512_1"]["identical"] != r["same_outputs_as_avx512_1"]["compared"]]
    on = [r for r in rows if r["int4_amx"]]
    off = [r for r in rows if not r["int4_amx"]]
    pooled = (sum(r["tokens"] for r in on) / sum(r["seconds"] for r in on)) / \
        (sum(r["tokens"] for r in off) / sum(r["seconds"] for r in off))
    table = common.markdown_table(
        ["engine", "tokens", "seconds", "tokens/s", "/ avx512-1", "same outputs as avx512-1"],
        [[r["engine"], r["tokens"], r["seconds"], r["tokens_per_s"], r["vs_avx512_1"],
          f"{r['same_outputs_as_avx512_1']['identical']}/{r['same_outputs_as_avx512_1']['compared']}"] for r in rows])
    print(table)
    print(f"{args.task} at {c} in flight, spec {args.spec}: AMX tiles on / off, pooled over {args.pairs} "
          f"pair(s): {pooled:.3f}")
    header = common.finish_run(header, t0)
    payload = {"benchmark": "amx-ab", "schema": "verispec.bench.amx-ab/v1", **header,
               "settings": {"model": args.model, "task": args.task, "spec": args.spec, "datasets": sources, "concurrency": c,
                            "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
                            "num_warmup": args.num_warmup, "pairs": args.pairs, "temperature": 0.0,
                            "prompt_ids": [f"{p.dataset}:{p.prompt_id}" for p in measured]},
               "engine_config": common.resolved(models, config).to_dict(),
               "engines": rows, "amx_over_avx512_pooled": pooled, "table_markdown": table}
    common.write_json(args.out or common.RESULTS_DIR / f"amx-ab-{args.task}-c{c}-{args.spec}.json", payload)
    if differ:  # (written first: the outputs are the evidence)
        print(f"FAILED: {differ} gave other outputs than avx512-1; the two paths must compute the same numbers",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
