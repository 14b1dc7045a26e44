"""CPU time of one `LLMEngine.step()`: plain decoding and a k=4 n-gram verify pass.

Thread CPU time (not wall time) of the engine thread, with ONE torch thread: on a machine
other processes share, wall time swings with their load, CPU time much less, so this is
the number to rank code changes by. `--stub-kernels` replaces the int4 linear kernels by
cached outputs, leaving the cost outside the GEMMs. `--tree DIR` runs the verispec package
found in DIR instead of this checkout (e.g. an older commit: `git archive <rev> verispec |
tar -x -C DIR`), to compare before/after in alternation.

    .venv/bin/python bench/experiments/step_time.py --weight-format int4
    .venv/bin/python bench/experiments/step_time.py --weight-format int4 --stub-kernels
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _use_tree(tree: str) -> None:
    """Import verispec from `tree`: drop the editable install's finder, put `tree` first."""
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()]
    sys.path.insert(0, os.path.abspath(tree))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weight-format", default="int4",
                    help="dense | int8 | int4 | int4a8 | auto | none (a tree that predates weight formats)")
    ap.add_argument("--stub-kernels", action="store_true")
    ap.add_argument("--tree", default=None)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    if args.tree:
        _use_tree(args.tree)
    else:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

    import torch

    from verispec.config import CacheConfig, EngineConfig, SpecConfig
    from verispec.engine.engine import LLMEngine, SpecOverride
    from verispec.sampling import SamplingParams

    torch.set_num_threads(1)
    fmt = {} if args.weight_format == "none" else {"weight_format": args.weight_format}
    engine = LLMEngine.from_config(EngineConfig(**fmt, cache=CacheConfig(num_kv_tokens=4096),
                                                spec=SpecConfig(method="ngram", adaptive=False, num_spec_tokens=4)))
    if args.stub_kernels:
        _stub_int4_kernels()
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content":
                                            "Write a long story about a cat who learns to fly. Repeat 'the cat flies' often."}])
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    def median_step_ms(spec: SpecOverride) -> float:
        rid = f"r{time.perf_counter_ns()}"
        engine.add_request(rid, prompt, params, spec)
        for _ in range(4):  # prefill and the first steps
            engine.step()
        times = []
        for _ in range(args.steps):
            t0 = time.thread_time()
            engine.step()
            times.append(time.thread_time() - t0)
        engine.abort_request(rid)
        return statistics.median(times) * 1e3

    plain = min(median_step_ms(SpecOverride(method="none")) for _ in range(2))
    verify = min(median_step_ms(SpecOverride(method="ngram", num_tokens=4, adaptive=False)) for _ in range(2))
    print(f"weight format {args.weight_format}{' (kernels stubbed)' if args.stub_kernels else ''}: "
          f"plain step {plain:.2f} ms, k=4 verify step {verify:.2f} ms (CPU time, 1 thread, median)")
    return 0


def _stub_int4_kernels() -> None:
    from verispec.model import quant

    real, cache = quant.Int4Linear.forward, {}

    def cached(self, x):
        key = (id(self), x.shape[0])
        if key not in cache:
            cache[key] = real(self, x)
        return cache[key]

    quant.Int4Linear.forward = cached


if __name__ == "__main__":
    sys.exit(main())
