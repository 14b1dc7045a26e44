"""The body's linear layers by pass width: verispec's int4 kernel against PyTorch's bf16 linear.

(Where the int4 kernel has its AMX path, `kernels.int4_amx`, the same kernel with the tiles
off runs beside them: its AVX-512 path, the speed-up at each width.)

A verify pass over B rows with D drafts runs every linear on B + D tokens. verispec's int4
kernel (`kernels.int4_linear`) streams 4-bit weights and multiplies on AVX-512 (or AVX2)
vectors, so it is memory-bound at one token and compute-bound from a few on; PyTorch's bf16
linear (oneDNN) runs on AMX tiles on a CPU that has them (Intel Sapphire Rapids and later),
where wide passes cost little more than narrow ones. This measures both on the model's own
int4 layers (the bf16 weights are the int4 weights dequantized, so both compute the same
layer up to rounding), one shape at a time, contenders alternated, the best of `--reps`
timings of `--calls` calls each, and sums each width over the body (every layer x its
count). The bf16 contender is a yardstick of what tile hardware does at that width, not a
verispec path: it does not compute the int4 kernel's numbers bit for bit.

    .venv/bin/python bench/experiments/linear_widths.py --threads 2

Writes bench/results/linear-widths-<model>.json (machine, CPU flags, every timing).
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for common
import common  # noqa: E402
from verispec.config import EngineConfig  # noqa: E402
from verispec.model.quant import Int4Linear, unpack_int4  # noqa: E402

WIDTHS = "1,2,4,8,12,16,20,24,32,48,64"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--widths", type=common.parse_int_list, default=common.parse_int_list(WIDTHS),
                   help=f"tokens a pass (default {WIDTHS})")
    p.add_argument("--reps", type=int, default=7, help="timings per (shape, width, contender); the best is kept")
    p.add_argument("--calls", type=int, default=20, help="calls a timing")
    common.add_common_args(p, "1")
    args = p.parse_args(argv)
    if args.quick:
        args.widths, args.reps, args.calls = [1, 16], 2, 3
    if args.reps < 1 or args.calls < 1:
        p.error("--reps and --calls must be at least 1")
    return args


def cpu_flags() -> list[str]:
    """The CPU's AVX-512 and AMX feature flags (Linux), for the record."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("amx", "avx512")))


def time_call(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def body_sums(rows: list[dict], widths: list[int]) -> list[dict]:
    """Per width, each contender's time over the whole body: every shape's timing times the
    number of layers of that shape (int4_avx512_ms None where the kernel has no AMX path)."""
    body = []
    for width in widths:
        of = [r for r in rows if r["width"] == width]
        int4, bf16 = (sum(r[key] * r["count"] for r in of) for key in ("int4_s", "torch_bf16_s"))
        avx512 = None if any(r.get("int4_avx512_s") is None for r in of) else \
            sum(r["int4_avx512_s"] * r["count"] for r in of)
        body.append({"width": width, "int4_ms": int4 * 1e3, "torch_bf16_ms": bf16 * 1e3,
                     "int4_over_torch_bf16": int4 / bf16,
                     "int4_avx512_ms": None if avx512 is None else avx512 * 1e3})
    return body


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    header = common.start_run(args)
    models = common.load_models(EngineConfig(model=args.model, weight_format="int4"))
    layers = [m for m in models.target.modules() if isinstance(m, Int4Linear)]
    if not layers:
        raise SystemExit(f"{args.model}: no int4 linear layers (weight format int4 did not apply)")
    counts = Counter((m.out_features, m.in_features) for m in layers)
    shapes = {}
    for m in layers:
        shapes.setdefault((m.out_features, m.in_features), m)
    ops = layers[0].kernels
    amx = bool(ops is not None and getattr(ops, "int4_amx", False))

    def timed(name: str, fn, calls: int) -> float:
        """`fn`'s seconds a call; the kernel's tiles off for "int4-avx512" only (set once
        around the timing, not inside it)."""
        if not amx:
            return time_call(fn, calls)
        ops.set_int4_amx(name != "int4-avx512")
        try:
            return time_call(fn, calls)
        finally:
            ops.set_int4_amx(True)

    rows = []
    for (n, k), layer in shapes.items():
        dense = unpack_int4(layer.q4, layer.scale, layer.min, n).dequantize().to(torch.bfloat16)
        for width in args.widths:
            x = torch.randn(width, k, dtype=torch.bfloat16)
            contenders = {"int4": lambda: layer(x), "torch-bf16": lambda: F.linear(x, dense)}
            if amx:  # the same kernel with its AMX tiles off: its AVX-512 path at every width
                contenders["int4-avx512"] = contenders["int4"]
            for name, fn in contenders.items():
                timed(name, fn, 1)  # first calls: packing, oneDNN's primitive cache
            best = dict.fromkeys(contenders, float("inf"))
            for rep in range(args.reps):
                names = list(contenders) if rep % 2 == 0 else list(reversed(contenders))
                for name in names:
                    best[name] = min(best[name], timed(name, contenders[name], args.calls))
            rows.append({"out_features": n, "in_features": k, "count": counts[(n, k)], "width": width,
                         "int4_s": best["int4"], "torch_bf16_s": best["torch-bf16"],
                         "int4_avx512_s": best.get("int4-avx512")})
            print(f"[linear] {n}x{k} x{counts[(n, k)]} width {width:3d}: int4 {best['int4'] * 1e6:8.1f} us, "
                  f"torch bf16 {best['torch-bf16'] * 1e6:8.1f} us"
                  + (f", int4 without AMX {best['int4-avx512'] * 1e6:8.1f} us" if amx else ""), file=sys.stderr)
    body = body_sums(rows, args.widths)
    table = common.markdown_table(
        ["tokens a pass", "int4 kernel ms (body)", "torch bf16 ms (body)", "int4 / torch bf16",
         "int4 ms a token", "int4 without AMX ms (body)"],
        [[b["width"], f"{b['int4_ms']:.2f}", f"{b['torch_bf16_ms']:.2f}", f"{b['int4_over_torch_bf16']:.2f}",
          f"{b['int4_ms'] / b['width']:.3f}", b["int4_avx512_ms"]] for b in body])
    print(table)
    header = common.finish_run(header, t0)
    payload = {"benchmark": "linear-widths", "schema": "verispec.bench.linear-widths/v2", **header,
               "settings": {"model": args.model, "widths": args.widths, "reps": args.reps, "calls": args.calls,
                            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                            "cpu_flags": cpu_flags(), "layers": len(layers)},
               "body": body, "layers": rows, "table_markdown": table}
    common.write_json(args.out or common.RESULTS_DIR / f"linear-widths-{args.model}.json", payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
