"""What drafting rows cost the others in one forward: 16 decode rows (one query each)
against the same 16 rows with m of them verifying k drafts (k + 1 queries), default model,
in process, the target's forward alone (median of --repeats, the variants interleaved).

    .venv/bin/python bench/experiments/mixed_batch.py --out bench/results/mixed-batch-icl.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from verispec.bench.provenance import machine_info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from verispec.config import EngineConfig, SpecConfig
    from verispec.engine.engine import LLMEngine
    from verispec.engine.runner import RowInput
    from verispec.sampling import SamplingParams

    config = EngineConfig(spec=SpecConfig(method="none")).resolved_for("generate")
    engine = LLMEngine.from_config(config)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i in range(args.rows):
        engine.add_request(str(i), [(7 * i + j) % 5000 + 100 for j in range(args.context)], params)
    while any(not r.output_ids for r in engine.requests.values()):
        engine.step()
    reqs = list(engine.requests.values())

    def rows(drafting: int, k: int) -> list:
        out = []
        for i, r in enumerate(reqs):
            q = 1 + (k if i < drafting else 0)
            start = r.num_computed - 8  # rewrite KV the row already has: only the time matters
            out.append(RowInput(r.all_ids[start:start + q], start, engine.kv.block_table(r.request_id), 0))
        return out
    variants = {"0 drafting": (0, 0), "1 row k=4": (1, 4), "1 row k=8": (1, 8), "4 rows k=4": (4, 4),
                f"{args.rows} rows k=1": (args.rows, 1), f"{args.rows} rows k=4": (args.rows, 4)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, (m, k) in variants.items():
            batch = rows(m, k)
            start = time.perf_counter()
            engine.target.forward(batch)
            times[name].append((time.perf_counter() - start) * 1e3)
    base = statistics.median(times["0 drafting"])
    summary = {name: {"ms_median": statistics.median(v), "vs_no_drafts": statistics.median(v) / base}
               for name, v in times.items()}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "args": vars(args) | {"out": str(args.out)},
                                        "config": engine.config.to_dict(), "machine": machine_info()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
