"""Tensor parallelism on the CPU: does speculation pay more when every step carries collectives?

Two layouts of the same cores: one process with --threads-total threads, and --tp ranks
with threads-total / tp threads each (verispec.distributed, gloo). Under each, the same
prompts run one request at a time, greedy, plain and speculative; per layout and mode:
decode tokens/s, engine steps, seconds per step, and under TP the step's split into
collectives (rank 0's, ForwardStats; waiting for the slower rank counts) and the rest
(compute, sampling, drafting, bookkeeping). The ratio speculative / plain under each layout answers the
question: a verify step carries the same collectives as a plain one (one all-reduce per
o_proj and down_proj, one gather of the logits) for up to k + 1 tokens.

Greedy outputs of the two layouts are compared token for token (float32 would make them
identical; in bfloat16 the ranks' partial sums round differently, so a few may differ).

    .venv/bin/python bench/tensor_parallel.py                     # Qwen2.5-Coder-1.5B + 0.5B draft
    .venv/bin/python bench/tensor_parallel.py --smoke-model DIR --raw-prompts --quick --allow-noisy
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from verispec.config import SpecConfig  # noqa: E402
from verispec.engine.engine import LLMEngine, SpecOverride  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402

MODES = ("plain", "speculative")


def run_one(engine: LLMEngine, rid: str, prompt: tuple[int, ...], params: SamplingParams, spec) -> dict:
    """One request alone: tokens, decode seconds (after the first token), steps, and rank 0's
    forward / collective seconds over the decode (0 for one process)."""
    engine.add_request(rid, list(prompt), params, spec)
    out, first, steps, at_first = None, None, 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if first is None and o.token_ids:
                first, at_first = time.perf_counter(), _collective_seconds(engine)
            out = o if o.finished else out
        steps += first is not None
    end = _collective_seconds(engine)
    return {"tokens": out.token_ids, "decode_tokens": len(out.token_ids) - 1,
            "decode_s": time.perf_counter() - first, "steps": steps - 1,
            "collective_s": end - at_first,
            "drafted": out.spec.num_draft_tokens, "accepted": out.spec.num_accepted_tokens}


def _collective_seconds(engine: LLMEngine) -> float:
    """Rank 0's seconds in collectives so far (0 in one process)."""
    stats = getattr(engine.target, "stats", None)
    return stats().collective_seconds if stats is not None else 0.0


def summarise(runs: list[dict]) -> dict:
    total = {k: sum(r[k] for r in runs) for k in ("decode_tokens", "decode_s", "steps", "collective_s",
                                                  "drafted", "accepted")}
    steps = max(total["steps"], 1)
    return {"decode_tokens_per_s": total["decode_tokens"] / total["decode_s"],
            "steps": total["steps"], "ms_per_step": 1e3 * total["decode_s"] / steps,
            "collective_ms_per_step": 1e3 * total["collective_s"] / steps,
            "non_collective_ms_per_step": 1e3 * (total["decode_s"] - total["collective_s"]) / steps,
            "tokens_per_step": total["decode_tokens"] / steps,
            "acceptance_rate": total["accepted"] / total["drafted"] if total["drafted"] else None}


def run_layout(config, items, args, spec_method: str) -> tuple[dict, dict, dict]:
    """(per-mode summaries, resolved EngineConfig, per-mode token lists) of one layout."""
    engine = LLMEngine.from_config(config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
        overrides = {"plain": SpecOverride(method="none"),
                     "speculative": SpecOverride(method=spec_method, num_tokens=args.k, adaptive=args.adaptive)}
        run_one(engine, "warm-up", items[0].token_ids, replace(params, max_tokens=8), overrides["speculative"])
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for i, item in enumerate(items):
            for mode in MODES if i % 2 == 0 else MODES[::-1]:  # alternate the order: drift hits both
                runs[mode].append(run_one(engine, f"{mode}-{i}", item.token_ids, params, overrides[mode]))
        summary = {m: summarise(r) for m, r in runs.items()}
        summary["speculative_over_plain"] = (summary["speculative"]["decode_tokens_per_s"]
                                             / summary["plain"]["decode_tokens_per_s"])
        return summary, engine.config.to_dict(), {m: [r["tokens"] for r in runs[m]] for m in MODES}
    finally:
        engine.shutdown()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct",
                   help="draft model for the speculative mode; 'none': n-gram prompt lookup")
    p.add_argument("--smoke-model", default=None, help="check the script on this (tiny) model, n-gram")
    p.add_argument("--raw-prompts", action="store_true", help="encode prompts without the chat template")
    p.add_argument("--datasets", default="humaneval,rewrite-code")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--k", type=int, default=4, help="draft tokens (k_max when adaptive)")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--tp", type=int, default=2, help="ranks of the tensor-parallel layout")
    p.add_argument("--threads-total", type=int, default=2, help="threads of the one-process layout; "
                   "the TP layout gives each rank threads-total / tp")
    common.add_common_args(p, "1")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_tokens = 2, 16
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    header = common.start_run(args)
    model = args.smoke_model or args.model
    draft = None if args.smoke_model or args.draft_model == "none" else args.draft_model
    method = "draft" if draft else "ngram"
    base = replace(common.base_config(args, draft), model=model,
                   spec=SpecConfig(method=method, num_spec_tokens=args.k, adaptive=args.adaptive))
    layouts = {"tp1": replace(base, threads=args.threads_total),
               f"tp{args.tp}": replace(base, tensor_parallel_size=args.tp,
                                       threads=max(1, args.threads_total // args.tp))}
    measured, _, sources = common.pick_prompts(args.datasets.split(","), args.num_prompts, 0,
                                               seed=args.seed, split=args.split)
    items = _items(model, measured, args.raw_prompts)
    results, configs, tokens = {}, {}, {}
    for name, config in layouts.items():  # one at a time: a process holds one tensor-parallel group
        results[name], configs[name], tokens[name] = run_layout(config, items, args, method)
    identical = {m: sum(a == b for a, b in zip(*(tokens[n][m] for n in layouts))) for m in MODES}
    common.write_result("tensor-parallel", args, header, t0, {
        "configs": configs, "sources": sources, "max_tokens": args.max_tokens, "prompts": len(measured),
        "layouts": results, "identical_greedy_outputs": {m: f"{identical[m]}/{len(measured)}" for m in MODES}},
        common.RESULTS_DIR / f"tensor-parallel-tp{args.tp}{'-quick' if args.quick else ''}.json")
    columns = ("decode_tokens_per_s", "ms_per_step", "non_collective_ms_per_step", "collective_ms_per_step",
               "tokens_per_step")
    print(common.markdown_table(
        ["layout", "mode", "tok/s", "ms/step", "other ms", "collective ms", "tok/step", "spec/plain"],
        [[n, m, *(r[m][c] for c in columns), r["speculative_over_plain"] if m != "plain" else None]
         for n, r in results.items() for m in MODES]))


def _items(model: str, prompts, raw: bool) -> list:
    """The prompts' token ids under the model's tokenizer (chat template unless `raw`: the
    first turn's text, at most 64 tokens)."""
    from verispec.model.loader import load_config_and_tokenizer, resolve_model
    tokenizer = load_config_and_tokenizer(resolve_model(model))[1]
    if not raw:
        return common.encode(tokenizer, prompts)
    return [common.WorkItem(f"{p.dataset}:{p.prompt_id}", p.dataset,
                            tuple(tokenizer.encode(p.messages[0]["content"]))[:64]) for p in prompts]


if __name__ == "__main__":
    main()
