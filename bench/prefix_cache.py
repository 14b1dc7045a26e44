"""Prefix-cache hit rate and turn-2 time to first token on two-turn chats (issue 4).

Each MT-bench question is one conversation: turn 1 is sent; when it finishes, turn 2 is
sent with the model's own turn-1 answer (its text, as a chat client would send it) in the
history, rendered with the chat template. C conversations are in flight at once.

Two engines over the same weights run the same conversations, alternating block by block:
  cache-on    the default engine config (prefix cache on)
  cache-off   the same with CacheConfig.prefix_cache = False

The hit rate comes from the engine's KV manager counters, engine.kv.hit_tokens /
engine.kv.query_tokens. To split it by turn, each engine's kv.open_sequence is wrapped to
record every lookup per request; the per-request sums are checked against the counters.
`shared_prefix` is the longest common prefix of the turn-2 prompt with turn 1's prompt +
answer ids: the most any cache could reuse (the engine caches whole 16-token blocks of
computed positions, and the answer re-tokenized inside the template may differ from the
generated ids).

    .venv/bin/python bench/prefix_cache.py --quick
    .venv/bin/python bench/prefix_cache.py
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from verispec.bench.datasets import BenchPrompt  # noqa: E402
from verispec.config import EngineConfig  # noqa: E402
from verispec.engine.engine import LLMEngine  # noqa: E402
from verispec.sampling import SamplingParams  # noqa: E402


@dataclass
class TurnResult:
    conversation: str
    turn: int
    prompt_tokens: int
    hit_tokens: int         # summed over this request's lookups (one unless re-admitted)
    lookups: int
    shared_prefix: int      # turn 2 only: common prefix with turn 1's prompt + answer ids
    ttft_s: float
    latency_s: float
    token_ids: list[int]


def record_lookups(engine: LLMEngine) -> dict[str, list[tuple[int, int]]]:
    """Wrap this engine's kv.open_sequence to log (hit tokens, prompt tokens) per request."""
    log: dict[str, list[tuple[int, int]]] = {}
    original = engine.kv.open_sequence

    def open_sequence(seq_id, prompt_ids):
        hit = original(seq_id, prompt_ids)
        log.setdefault(seq_id, []).append((hit, len(prompt_ids)))
        return hit

    engine.kv.open_sequence = open_sequence
    return log


def run_conversations(engine: LLMEngine, lookups: dict, convs: list[BenchPrompt], concurrency: int,
                      params: SamplingParams, tag: str) -> list[TurnResult]:
    """Closed loop over conversations: C in flight; turn 2 is sent when turn 1 finishes."""
    queue, live, results = list(convs), {}, []
    first: dict[str, float] = {}
    turn1: dict[str, tuple[list[int], list[int]]] = {}  # conversation -> (prompt ids, answer ids)
    while queue or live:
        while queue and len(live) < concurrency:
            conv = queue.pop(0)
            _send(engine, live, conv, 1, list(conv.messages), tag, params)
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
            if not out.finished:
                continue
            if out.error or out.finish_reason == "abort":
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            conv, turn, messages, ids, t_add = live.pop(out.request_id)
            hits = lookups[out.request_id]
            shared = 0
            if turn == 2:
                prompt1, answer1 = turn1[conv.prompt_id]
                shared = _common_prefix(ids, prompt1 + answer1)
            results.append(TurnResult(conv.prompt_id, turn, len(ids), sum(h for h, _ in hits), len(hits),
                                      shared, first[out.request_id] - t_add, now - t_add, list(out.token_ids)))
            if turn == 1:
                turn1[conv.prompt_id] = (ids, list(out.token_ids))
                history = messages + [{"role": "assistant", "content": out.text},
                                      {"role": "user", "content": conv.followups[0]}]
                _send(engine, live, conv, 2, history, tag, params)
    return results


def _send(engine, live, conv, turn, messages, tag, params) -> None:
    ids = engine.tokenizer.encode_chat(messages)
    rid = f"{tag}/{conv.prompt_id}/t{turn}"
    engine.add_request(rid, ids, params)
    live[rid] = (conv, turn, messages, ids, time.perf_counter())


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-prompts", type=int, default=8, help="measured conversations per concurrency")
    p.add_argument("--max-tokens", type=int, default=128, help="max tokens of each turn's answer")
    p.add_argument("--blocks", type=int, default=2, help="alternation blocks per concurrency")
    p.add_argument("--num-warmup", type=int, default=2, help="warm-up conversations per engine")
    common.add_common_args(p, "1")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_tokens, args.num_warmup = min(args.num_prompts, 4), min(args.max_tokens, 24), 1
    if args.num_prompts < args.blocks:
        p.error(f"--num-prompts {args.num_prompts} must be >= --blocks {args.blocks}")
    return args


def run_concurrency(models, configs: dict[str, EngineConfig], c: int, args) -> dict:
    measured, warm, sources = common.pick_prompts(["mtbench"], args.num_prompts, args.num_warmup,
                                                  seed=args.seed + c, split=args.split)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    warm_params = replace(params, max_tokens=min(16, args.max_tokens))
    engines = {name: common.make_engine(models, cfg) for name, cfg in configs.items()}
    logs = {name: record_lookups(eng) for name, eng in engines.items()}
    for name, eng in engines.items():
        run_conversations(eng, logs[name], warm, c, warm_params, f"warmup-{name}-c{c}")
    size = -(-len(measured) // args.blocks)
    blocks = [measured[i: i + size] for i in range(0, len(measured), size)]
    turns: dict[str, list[TurnResult]] = {n: [] for n in engines}
    counters: dict[str, list[int]] = {n: [0, 0] for n in engines}
    others = {n: 0.0 for n in engines}  # most of the cores other processes took in a block
    names = list(engines)
    for b, block in enumerate(blocks):
        for name in names[b % 2:] + names[: b % 2]:
            eng = engines[name]
            h0, q0 = eng.kv.hit_tokens, eng.kv.query_tokens
            cpu0 = common.cpu_sample()
            res = run_conversations(eng, logs[name], block, c, params, f"{name}-c{c}-b{b}")
            others[name] = max(others[name], common.others_cpu_share(cpu0, common.cpu_sample()) or 0.0)
            counters[name][0] += eng.kv.hit_tokens - h0
            counters[name][1] += eng.kv.query_tokens - q0
            turns[name].extend(res)
            t2 = [r for r in res if r.turn == 2]
            print(f"[prefix] C={c} block {b} {name:9s} turn-2 hits {sum(r.hit_tokens for r in t2)}/"
                  f"{sum(r.prompt_tokens for r in t2)} mean TTFT2 {statistics.mean(r.ttft_s for r in t2):.3f} s "
                  f"load={common.load_average():.2f} others={others[name]:.2f}", file=sys.stderr, flush=True)
    del engines
    return _summarise(turns, counters, others, c, measured, warm, sources)


def _summarise(turns, counters, others, c, measured, warm, sources) -> dict:
    out = {"concurrency": c, "conversation_ids": [p.prompt_id for p in measured],
           "warmup_conversation_ids": [p.prompt_id for p in warm], "datasets": sources, "engines": {}}
    for name, res in turns.items():
        hit, query = counters[name]
        if hit != sum(r.hit_tokens for r in res) or query != sum(r.prompt_tokens * r.lookups for r in res):
            raise RuntimeError(f"{name}: per-request lookups do not add up to the kv counters")
        per_turn = {}
        for turn in (1, 2):
            rs = [r for r in res if r.turn == turn]
            ttft = [r.ttft_s for r in rs]
            per_turn[f"turn{turn}"] = {
                "requests": len(rs), "prompt_tokens": sum(r.prompt_tokens for r in rs),
                "hit_tokens": sum(r.hit_tokens for r in rs),
                "hit_rate": sum(r.hit_tokens for r in rs) / sum(r.prompt_tokens * r.lookups for r in rs),
                "shared_prefix_tokens": sum(r.shared_prefix for r in rs) if turn == 2 else None,
                "mean_ttft_s": statistics.mean(ttft), "median_ttft_s": statistics.median(ttft),
                "ttft_s": ttft, "readmissions": sum(r.lookups - 1 for r in rs)}
        out["engines"][name] = {"kv_hit_tokens": hit, "kv_query_tokens": query,
                                "max_others_cpu_share": others[name],
                                "kv_hit_rate": hit / query if query else None, **per_turn,
                                "answers": {f"{r.conversation}/t{r.turn}": r.token_ids for r in res}}
    on, off = out["engines"]["cache-on"], out["engines"]["cache-off"]
    out["turn2_ttft_saving_s"] = {"mean": off["turn2"]["mean_ttft_s"] - on["turn2"]["mean_ttft_s"],
                                  "median": off["turn2"]["median_ttft_s"] - on["turn2"]["median_ttft_s"],
                                  "ratio_off_over_on_mean": off["turn2"]["mean_ttft_s"] / on["turn2"]["mean_ttft_s"]}
    out["identical_answers"] = {t: sum(on["answers"][k] == off["answers"][k] for k in on["answers"] if k.endswith(t))
                                for t in ("t1", "t2")}
    return out


def table(results: list[dict]) -> str:
    rows = []
    for res in results:
        for name, e in res["engines"].items():
            t1, t2 = e["turn1"], e["turn2"]
            rows.append([res["concurrency"], name, f"{e['kv_hit_tokens']}/{e['kv_query_tokens']}",
                         e["kv_hit_rate"], t1["hit_rate"], t2["hit_rate"],
                         f"{t2['hit_tokens']}/{t2['shared_prefix_tokens']}",
                         t1["mean_ttft_s"], t2["mean_ttft_s"], t2["median_ttft_s"], e["max_others_cpu_share"]])
    return common.markdown_table(["C", "engine", "kv hit/query tokens", "hit rate", "turn-1 hit rate",
                                  "turn-2 hit rate", "turn-2 hits/shared prefix", "turn-1 TTFT s (mean)",
                                  "turn-2 TTFT s (mean)", "turn-2 TTFT s (median)", "others' CPU (max)"], rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    header = common.start_run(args)
    base = common.base_config(args)
    models = common.load_models(base)
    configs = {"cache-on": base, "cache-off": replace(base, cache=replace(base.cache, prefix_cache=False))}
    results = [run_concurrency(models, configs, c, args) for c in args.concurrency]
    text = table(results)
    print(text)
    for res in results:
        s = res["turn2_ttft_saving_s"]
        print(f"C={res['concurrency']}: turn-2 TTFT saving mean {s['mean']:.3f} s, median {s['median']:.3f} s "
              f"(off/on = {s['ratio_off_over_on_mean']:.2f}x); identical answers on vs off: "
              f"{res['identical_answers']}")
    header = common.finish_run(header, t0)
    payload = {"benchmark": "prefix_cache", "schema": "verispec.bench.engine-prefix-cache/v1", **header,
               "settings": {"model": args.model, "dtype": args.dtype, "temperature": 0.0,
                            "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                            "num_prompts": args.num_prompts, "blocks": args.blocks,
                            "num_warmup": args.num_warmup, "quick": args.quick, "split": args.split,
                            "model_load_s": models.load_seconds},
               "engine_configs": {name: common.resolved(models, cfg).to_dict() for name, cfg in configs.items()},
               "results": results, "table_markdown": text}
    name = "prefix_cache_quick" if args.quick else "prefix_cache"
    common.write_json(args.out or common.RESULTS_DIR / f"{name}.json", payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
