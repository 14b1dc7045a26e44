"""The fused C++ kernels against the PyTorch ops, alternated in one process (issue 8).

Batch 1: each chat prompt decoded plain and with adaptive n-gram speculation, kernels on and
off in an order that flips every prompt. Batch 16: all prompts in flight, plain, decode
steps only (timed once every prompt has prefilled), kernels on, off, and on without the
attention kernel (the other fused ops only). Greedy; tokens/s pooled per contender.

    .venv/bin/python bench/experiments/kernels_ab.py --threads 2
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

import verispec.engine.runner as runner_mod  # noqa: E402
from huge_pages_ab import MODES, batch_decode_tps, pooled_tps, print_ab  # noqa: E402
from roofline import chat_prompts, load_average, run_request  # noqa: E402
from verispec.bench.provenance import git_info, machine_info, software_versions  # noqa: E402
from verispec.config import CacheConfig, EngineConfig, SpecConfig  # noqa: E402
from verispec.engine.engine import LLMEngine  # noqa: E402
from verispec.model.attention import KERNEL_QUERY_LIMIT  # noqa: E402


def set_kernels(engine: LLMEngine, ops, attention: bool = True) -> None:
    engine.target.model.kernels = ops
    runner_mod.KERNEL_QUERY_LIMIT = KERNEL_QUERY_LIMIT if attention else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="batch rounds per contender")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "kernels_ab.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = EngineConfig(kernels="on", spec=SpecConfig(method="ngram", adaptive=True),
                          cache=CacheConfig(num_kv_tokens=32768))
    engine = LLMEngine.from_config(config)
    ops = engine.target.model.kernels
    prompts, warm = chat_prompts(engine.tokenizer, max(args.prompts, args.batch), 0)
    load_before = load_average()

    for w in warm[:2]:
        for k in (ops, None):
            set_kernels(engine, k)
            for spec in MODES.values():
                run_request(engine, w["token_ids"], 32, spec)
    single: dict[str, list] = {}
    for i, p in enumerate(prompts[: args.prompts]):
        for name in (("kernels", "torch") if i % 2 == 0 else ("torch", "kernels")):
            set_kernels(engine, ops if name == "kernels" else None)
            for mode, spec in MODES.items():
                single.setdefault(f"{mode}/{name}", []).append(run_request(engine, p["token_ids"], args.max_tokens, spec))
    batch_sets = {"kernels": (ops, True), "torch": (None, True), "kernels-no-attention": (ops, False)}
    batch: dict[str, list[float]] = {k: [] for k in batch_sets}
    for name, (k, attn) in batch_sets.items():  # one unmeasured round each
        set_kernels(engine, k, attn)
        batch_decode_tps(engine, prompts[: args.batch], 32)
    for r in range(args.rounds):
        for name in (list(batch_sets) if r % 2 == 0 else list(reversed(batch_sets))):
            set_kernels(engine, *batch_sets[name])
            batch[name].append(batch_decode_tps(engine, prompts[: args.batch], 96))
    set_kernels(engine, ops)

    summary = pooled_tps(single)
    result = {"script": "bench/experiments/kernels_ab.py", "argv": sys.argv[1:], "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "config": engine.config.to_dict(), "threads": args.threads, "machine": machine_info(),
              "software": software_versions(), "git": git_info(),
              "load_average": {"before": load_before, "after": load_average()},
              "batch1_decode_tokens_per_s": summary, f"batch{args.batch}_decode_tokens_per_s": batch,
              "records": single}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"batch 1 ({args.prompts} prompts, {args.max_tokens} tokens), decode tokens/s:")
    print_ab(summary, ("kernels", "torch"), ("kernels", "torch ops"), batch, args.batch)
    print(f"load {load_before:.2f} -> {result['load_average']['after']:.2f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
