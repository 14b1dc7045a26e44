"""Memory-bandwidth roofline of batch-1 decoding, next to verispec's measured tokens/s.

At batch 1 a decode step reads every weight once (plus the row's KV), so

    roofline tokens/s = memory bandwidth / bytes read per step

and a speculative step that commits n tokens per weight read raises the ceiling n-fold.
This script measures the bandwidth (a large streaming sum and copy, the same threads),
counts the bytes one decode step of the model reads in the chosen weight format, and runs
verispec on real chat prompts (plain, and n-gram speculation with adaptive k), alternating
the two per prompt so machine noise hits both alike.

    .venv/bin/python bench/roofline.py --weight-format int4 --threads 2 --prompts 12

Writes bench/results/roofline-<model>-<format>-t<threads>.json (resolved configs, machine,
load average before and after, every per-request number).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python bench/roofline.py` from a checkout
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from verispec.bench.datasets import load_datasets, select_prompts  # noqa: E402
from verispec.bench.provenance import git_info, machine_info, software_versions  # noqa: E402
from verispec.config import CacheConfig, EngineConfig, SpecConfig  # noqa: E402
from verispec.engine.engine import LLMEngine, SpecOverride  # noqa: E402
from verispec.model.llama import LlamaModel  # noqa: E402
from verispec.model.memory import huge_page_buffer, huge_page_bytes  # noqa: E402
from verispec.model.quant import Bf16Linear, Int4Linear, Int8Linear, Q8Linear, RefinedHead  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402

RESULTS = REPO / "bench" / "results"


# --- the machine ---------------------------------------------------------------------------------

def memory_bandwidth(threads: int, mib: int = 512, reps: int = 7, huge_pages: bool = False) -> dict:
    """Streaming read (sum) and copy bandwidth in GB/s, median (and best) of `reps`; the
    buffers in huge pages if asked (as the engine's weights are)."""
    torch.set_num_threads(threads)
    n = mib * 2 ** 20 // 4
    if huge_pages:
        a, b = (huge_page_buffer(4 * n).view(torch.float32) for _ in range(2))
        a.fill_(1.0)
    else:
        a, b = torch.ones(n), torch.empty(n)
    out = {}
    for name, fn, nbytes in (("read", lambda: a.sum(), 4 * n), ("copy", lambda: b.copy_(a), 8 * n)):
        times = _seconds(fn, reps)
        out[f"{name}_gbps"] = nbytes / statistics.median(times) / 1e9
        out[f"{name}_best_gbps"] = nbytes / min(times) / 1e9
    return out


def _seconds(fn, reps: int) -> list[float]:
    """fn's wall time over `reps` calls, after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


class ReadProbe:
    """One streaming-read buffer kept for the run: `gbps()` reads it `reps` times (median),
    cheap enough (~10-30 ms) to run next to every measured prompt."""

    def __init__(self, threads: int, mib: int, huge_pages: bool):
        self.threads, self.nbytes = threads, mib * 2 ** 20
        self.buf = (huge_page_buffer(self.nbytes).view(torch.float32) if huge_pages
                    else torch.empty(self.nbytes // 4))
        self.buf.fill_(1.0)

    def gbps(self, reps: int = 3) -> float:
        torch.set_num_threads(self.threads)
        return self.nbytes / statistics.median(_seconds(self.buf.sum, reps)) / 1e9


def load_average() -> float:
    return os.getloadavg()[0]


# --- the model -----------------------------------------------------------------------------------

def _tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _linear_bytes(module: nn.Module) -> int | None:
    """Bytes a linear layer streams per pass (its packed weights), None if not a linear."""
    if isinstance(module, nn.Linear):
        return _tensor_bytes(module.weight, module.bias)
    if isinstance(module, Int8Linear):
        return _tensor_bytes(module.qweight, module.scales, module.bias)
    if isinstance(module, Int4Linear):
        return _tensor_bytes(module.q4, module.scale, module.min, module.bias)
    if isinstance(module, Bf16Linear):
        return _tensor_bytes(module.w16, module.bias)
    if isinstance(module, Q8Linear):
        return _tensor_bytes(module.q8, module.scale)
    return None


def bytes_per_step(model: LlamaModel, context_len: int, num_tokens: int = 1) -> dict:
    """Bytes one pass of `num_tokens` new tokens reads: weights once, KV of the context.

    The float32 copy a `RefinedHead` keeps is not streamed (only its few refined rows are
    read) and counts as zero; the embedding table contributes one row per token.
    """
    linear = sum(b for b in map(_linear_bytes, model.modules()) if b is not None)
    norms = sum(_tensor_bytes(m.weight) for name, m in model.named_modules() if name.endswith("norm"))
    emb = model.embed_tokens.weight
    embedding = num_tokens * emb.shape[1] * emb.element_size()
    cfg = model.cfg
    kv = 2 * cfg.num_layers * context_len * cfg.num_kv_heads * cfg.head_dim * emb.element_size()
    head = model.lm_head
    parts = [head] if isinstance(head, nn.Linear) else list(head.parts)
    return {"linear_bytes": linear, "head_bytes_included": sum(map(_linear_bytes, parts)),
            "norm_bytes": norms, "embedding_bytes": embedding, "kv_bytes": kv,
            "total_bytes": linear + norms + embedding + kv}


# --- verispec ------------------------------------------------------------------------------------

def chat_prompts(tokenizer, num_prompts: int, seed: int, datasets: str = "spec-bench") -> list[dict]:
    """`num_prompts` real chat prompts spread over the datasets (seeded), tokenized."""
    by_name, _ = load_datasets(datasets)
    per = max(1, -(-num_prompts // len(by_name)))
    picked = select_prompts(by_name, per, warmup=2, seed=seed)
    prompts = [{"dataset": p.dataset, "prompt_id": p.prompt_id,
                "token_ids": tokenizer.encode_chat(list(p.messages))} for p in picked.measured]
    order = sorted(range(len(prompts)), key=lambda i: (i % per, i))  # round-robin over datasets
    warm = [{"dataset": "warmup", "prompt_id": p.prompt_id, "token_ids": tokenizer.encode_chat(list(p.messages))}
            for p in picked.warmup]
    return [prompts[i] for i in order][:num_prompts], warm


def run_request(engine: LLMEngine, token_ids: list[int], max_tokens: int, spec: SpecOverride) -> dict:
    """One request alone (batch 1), greedy; times its first token and its decode phase."""
    rid = f"req-{time.perf_counter_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, token_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), spec)
    first = out = None
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid:
                out = o
                if first is None and o.token_ids:
                    first = time.perf_counter()
        steps += 1
    end = time.perf_counter()
    n = len(out.token_ids)
    decode_s = end - first
    return {"num_prompt_tokens": len(token_ids), "num_output_tokens": n, "ttft_s": first - t0,
            "decode_s": decode_s, "decode_tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
            "e2e_tokens_per_s": n / (end - t0), "steps": steps,
            "acceptance_rate": out.spec.acceptance_rate, "output_token_ids": list(out.token_ids)}


MODES = {"plain": SpecOverride(method="none"),
         "ngram-adaptive": SpecOverride(method="ngram", adaptive=True)}


def measure(engine: LLMEngine, prompts: list[dict], warmup: list[dict], max_tokens: int,
            probe: ReadProbe | None = None) -> dict:
    """Plain and speculative per prompt, alternating (the order flips every prompt); with a
    probe, the bandwidth read just before each prompt is stored in both its records."""
    for w in warmup:
        for spec in MODES.values():
            run_request(engine, w["token_ids"], 32, spec)
    records = {m: [] for m in MODES}
    for i, p in enumerate(prompts):
        bandwidth = probe.gbps() if probe is not None else None
        order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
        for mode in order:
            r = run_request(engine, p["token_ids"], max_tokens, MODES[mode])
            records[mode].append({"dataset": p["dataset"], "prompt_id": p["prompt_id"],
                                  "probe_read_gbps": bandwidth, **r})
    return records


def paired_fractions(records: list[dict], step_bytes: int) -> list[float]:
    """Each prompt's decode tokens/s over the roofline of the bandwidth read just before it."""
    return [r["decode_tokens_per_s"] * step_bytes / (r["probe_read_gbps"] * 1e9) for r in records
            if r["decode_tokens_per_s"] and r.get("probe_read_gbps")]


def summarize(records: list[dict]) -> dict:
    tps = [r["decode_tokens_per_s"] for r in records if r["decode_tokens_per_s"]]
    tokens = sum(r["num_output_tokens"] - 1 for r in records)
    return {"median_decode_tokens_per_s": statistics.median(tps),
            "pooled_decode_tokens_per_s": tokens / sum(r["decode_s"] for r in records),
            "tokens_per_step": tokens / sum(r["steps"] - 1 for r in records),
            "mean_context_len": statistics.mean(r["num_prompt_tokens"] + r["num_output_tokens"] / 2 for r in records)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weight-format", default="int4", choices=["dense", "int8", "int4", "int4a8", "auto"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-load", type=float, default=1.3, help="wait until the 1-min load average is below this")
    ap.add_argument("--wait-s", type=float, default=600, help="give up waiting for a quiet machine after this")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    config = EngineConfig(model=args.model, dtype=args.dtype, weight_format=args.weight_format,
                          spec=SpecConfig(method="ngram", adaptive=True),
                          cache=CacheConfig(num_kv_tokens=8192))
    engine = LLMEngine.from_config(config)
    model = engine.target.model
    prompts, warm = chat_prompts(engine.tokenizer, args.prompts, args.seed)

    waited = wait_for_quiet(args.max_load, args.wait_s)
    load_before = load_average()
    # Two buffer sizes: 512 MiB streams from DRAM; a buffer the size of one step's weights may
    # stay in a large L3 (this machine's is 260 MiB), which is what decoding re-reads each step.
    step_mib = max(16, int(bytes_per_step(model, 256)["total_bytes"] / 2 ** 20))
    # When the weights are in huge pages, the probes read such buffers too (faster there);
    # the roofline takes the highest reading of all.
    def probe() -> dict:
        out = {"dram": memory_bandwidth(args.threads), "step_sized": memory_bandwidth(args.threads, step_mib)}
        if engine.config.huge_pages:
            out.update(dram_huge_pages=memory_bandwidth(args.threads, huge_pages=True),
                       step_sized_huge_pages=memory_bandwidth(args.threads, step_mib, huge_pages=True))
        return out

    bandwidth = probe()
    # The fastest kind read before the run, probed again next to every prompt: the machine's
    # bandwidth moves by tens of percent over minutes here, so each prompt is also compared
    # with the bandwidth of its own moment (paired), not only with the run's best reading.
    paired_kind = max(bandwidth, key=lambda kind: bandwidth[kind]["read_gbps"])
    paired_probe = ReadProbe(args.threads, step_mib if paired_kind.startswith("step_sized") else 512,
                             paired_kind.endswith("huge_pages"))
    records = measure(engine, prompts, warm, args.max_tokens, paired_probe)
    del paired_probe
    bandwidth_after = probe()
    load_after = load_average()

    summary = {m: summarize(r) for m, r in records.items()}
    ctx = int(summary["plain"]["mean_context_len"])
    step = bytes_per_step(model, ctx)
    per_kind = {kind: statistics.mean([bandwidth[kind]["read_gbps"], bandwidth_after[kind]["read_gbps"]]) * 1e9
                for kind in bandwidth}
    bw = max(per_kind.values())  # the higher ceiling: never flatter our fraction of it
    roof = bw / step["total_bytes"]
    plain = summary["plain"]["pooled_decode_tokens_per_s"]
    spec = summary["ngram-adaptive"]["pooled_decode_tokens_per_s"]
    paired = paired_fractions(records["plain"], step["total_bytes"])
    result = {
        "script": "bench/roofline.py", "argv": sys.argv[1:], "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": engine.config.to_dict(), "resolved_weight_format": model.weight_format,
        "weights_huge_page_backed_bytes": huge_page_bytes(model.embed_tokens.weight),
        "threads": args.threads, "machine": machine_info(), "software": software_versions(), "git": git_info(),
        "load_average": {"before": load_before, "after": load_after, "waited_s": waited},
        "bandwidth": {"before": bandwidth, "after": bandwidth_after, "step_sized_mib": step_mib,
                      "used_gbps": bw / 1e9, "read_gbps_by_kind": {k: v / 1e9 for k, v in per_kind.items()}},
        "bytes_per_step": step, "context_len_for_kv": ctx,
        "roofline_tokens_per_s": roof,
        "plain": summary["plain"], "speculative": summary["ngram-adaptive"],
        "plain_fraction_of_roofline": plain / roof,
        "paired": {"kind": paired_kind, "plain_fractions": paired,
                   "median_plain_fraction": statistics.median(paired) if paired else None},
        "speculative_ceiling_tokens_per_s": roof * summary["ngram-adaptive"]["tokens_per_step"],
        "records": records,
    }
    out = args.out or RESULTS / f"roofline-{args.model}-{model.weight_format}-t{args.threads}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"model {args.model}  weight format {model.weight_format}  threads {args.threads}  "
          f"load {load_before:.2f} -> {load_after:.2f}")
    print(f"bandwidth (streaming read, {args.threads} threads): " +
          ", ".join(f"{kind.replace('step_sized', f'{step_mib} MiB buffer').replace('dram', 'DRAM').replace('_', ' ')}"
                    f" {v / 1e9:.1f} GB/s" for kind, v in per_kind.items()) + f" -> roofline uses {bw / 1e9:.1f} GB/s")
    print(f"bytes per decode step: {step['total_bytes'] / 1e6:.1f} MB  (linear layers {step['linear_bytes'] / 1e6:.1f}, "
          f"of which LM head {step['head_bytes_included'] / 1e6:.1f}; KV at {ctx} tokens {step['kv_bytes'] / 1e6:.1f})")
    print(f"roofline: {roof:.1f} tokens/s  (weights in huge pages: {'on' if engine.config.huge_pages else 'off'}, "
          f"{(result['weights_huge_page_backed_bytes'] or 0) / 2 ** 20:.0f} MiB of their mapping backed by them)")
    print(f"plain:        {plain:7.1f} tokens/s  = {plain / roof:.0%} of the roofline")
    if paired:
        print(f"paired:       each prompt's plain decoding against the {paired_kind.replace('_', ' ')} read just "
              f"before it: median {statistics.median(paired):.0%} (range {min(paired):.0%}-{max(paired):.0%})")
    print(f"speculative:  {spec:7.1f} tokens/s  ({summary['ngram-adaptive']['tokens_per_step']:.2f} tokens/step; "
          f"ceiling {result['speculative_ceiling_tokens_per_s']:.1f})")
    print(f"wrote {out}")
    return 0


def wait_for_quiet(max_load: float, wait_s: float) -> float:
    """Sleep until the 1-minute load average is below `max_load` (or `wait_s` passed)."""
    t0 = time.time()
    while load_average() >= max_load and time.time() - t0 < wait_s:
        time.sleep(10)
    return time.time() - t0


if __name__ == "__main__":
    sys.exit(main())
