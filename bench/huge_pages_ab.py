"""Weights in huge pages against ordinary 4 KiB pages, alternated in one process (issue 8).

Two engines on the same model, one with `huge_pages` on (the default: the weights copied
into memory the OS backs with 2 MiB pages, verispec/model/memory.py) and one off. Batch 1:
each chat prompt decoded plain and with adaptive n-gram speculation on both, in an order
that flips every prompt; every pair of greedy outputs must be identical (the same weights,
the same kernels), or the script fails. Batch 16: all prompts in flight, plain, decode steps
only, rounds alternated. Records each engine's resolved config and how many bytes of its
weights' mapping the OS really backs with huge pages.

    .venv/bin/python bench/huge_pages_ab.py --threads 2
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

from roofline import chat_prompts, load_average, run_request, wait_for_quiet  # noqa: E402
from verispec.bench.provenance import git_info, machine_info, software_versions  # noqa: E402
from verispec.config import CacheConfig, EngineConfig, SpecConfig  # noqa: E402
from verispec.engine.engine import LLMEngine, SpecOverride  # noqa: E402
from verispec.model.memory import huge_page_bytes  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402

MODES = {"plain": SpecOverride(method="none"), "ngram-adaptive": SpecOverride(method="ngram", adaptive=True)}


def batch_decode_tps(engine: LLMEngine, prompts: list[dict], max_tokens: int) -> float:
    """All prompts in flight; tokens/s of the steps after every prompt has prefilled."""
    for i, p in enumerate(prompts):
        engine.add_request(f"b{time.perf_counter_ns()}-{i}", p["token_ids"],
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    t0, n = None, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        if t0 is not None:
            n += sum(len(o.new_token_ids) for o in outs)
        elif not engine.scheduler.waiting and not any(r.is_prefilling for r in engine.scheduler.running):
            t0 = time.perf_counter()
    return n / (time.perf_counter() - t0)


def pooled_tps(single: dict[str, list]) -> dict[str, float]:
    """Decode tokens/s per contender key, pooled over its requests (tokens after the first)."""
    return {key: sum(r["num_output_tokens"] - 1 for r in rs) / sum(r["decode_s"] for r in rs)
            for key, rs in single.items()}


def print_ab(summary: dict[str, float], names: tuple[str, str], labels: tuple[str, str],
             batch: dict[str, list[float]], batch_size: int) -> None:
    """Batch 1: each mode's two contenders and their ratio; then the batch rounds."""
    for mode in MODES:
        on, off = summary[f"{mode}/{names[0]}"], summary[f"{mode}/{names[1]}"]
        print(f"  {mode:15s} {labels[0]} {on:6.1f}   {labels[1]} {off:6.1f}   ({on / off:.2f}x)")
    if batch_size:
        print(f"batch {batch_size}, plain, decode tokens/s per round:")
        width = max(len(name) for name in batch)
        for name, v in batch.items():
            print(f"  {name:{width}s} " + "  ".join(f"{x:6.1f}" for x in v))


CONTENDERS = ("huge", "4k")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="requests in flight for the batch rounds (0: none)")
    ap.add_argument("--rounds", type=int, default=2, help="batch rounds per contender")
    ap.add_argument("--max-load", type=float, default=1.5, help="wait until the 1-min load average is below this")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "huge_pages_ab.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    engines = {name: LLMEngine.from_config(EngineConfig(
        model=args.model, huge_pages=name == "huge", spec=SpecConfig(method="ngram", adaptive=True),
        cache=CacheConfig(num_kv_tokens=32768))) for name in CONTENDERS}
    backed = {name: huge_page_bytes(e.target.model.embed_tokens.weight) for name, e in engines.items()}
    if not engines["huge"].config.huge_pages:
        raise SystemExit("huge pages are not available here (Linux transparent huge pages are off): "
                         "nothing to compare")
    prompts, warm = chat_prompts(engines["huge"].tokenizer, max(args.prompts, args.batch), 0)
    waited = wait_for_quiet(args.max_load, 600)
    load_before = load_average()

    for w in warm[:2]:
        for e in engines.values():
            for spec in MODES.values():
                run_request(e, w["token_ids"], 32, spec)
    single: dict[str, list] = {}
    for i, p in enumerate(prompts[: args.prompts]):
        for mode, spec in MODES.items():
            for name in (CONTENDERS if i % 2 == 0 else CONTENDERS[::-1]):
                single.setdefault(f"{mode}/{name}", []).append(
                    run_request(engines[name], p["token_ids"], args.max_tokens, spec))
            a, b = (single[f"{mode}/{name}"][-1]["output_token_ids"] for name in CONTENDERS)
            if a != b:
                raise SystemExit(f"prompt {i} ({p['dataset']} {p['prompt_id']}), {mode}: the two engines' "
                                 f"greedy outputs differ: huge pages changed the numbers")
    batch: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    if args.batch:
        for name in CONTENDERS:  # one unmeasured round each
            batch_decode_tps(engines[name], prompts[: args.batch], 32)
        for r in range(args.rounds):
            for name in (CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]):
                batch[name].append(batch_decode_tps(engines[name], prompts[: args.batch], 96))

    summary = pooled_tps(single)
    result = {"script": "bench/huge_pages_ab.py", "argv": sys.argv[1:], "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "config": {name: e.config.to_dict() for name, e in engines.items()},
              "weights_huge_page_backed_bytes": backed, "threads": args.threads, "machine": machine_info(),
              "software": software_versions(), "git": git_info(),
              "load_average": {"before": load_before, "after": load_average(), "waited_s": waited},
              "batch1_decode_tokens_per_s": summary, f"batch{args.batch}_decode_tokens_per_s": batch,
              "records": single}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"weights' mapping backed by huge pages: " +
          ", ".join(f"{name} {(b or 0) / 2**20:.0f} MiB" for name, b in backed.items()))
    print(f"batch 1 ({args.prompts} prompts, {args.max_tokens} tokens), decode tokens/s (greedy outputs identical):")
    print_ab(summary, CONTENDERS, ("huge pages", "4 KiB pages"), batch, args.batch)
    print(f"load {load_before:.2f} -> {result['load_average']['after']:.2f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
